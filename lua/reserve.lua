--[[ reserve.lua: hold a request's worst-case token cost in every scope it touches, or in none.

Purpose
  Before a call goes upstream, admit it only if, for EVERY counter passed,
  used + pending + amount <= limit + credit, and then add the amount to `pending` of every
  counter and record the hold. All or nothing: on any refusal nothing is written.

KEYS (all of one tenant, sharing its hash tag `{t<id>}`, so this runs on one cluster slot)
  KEYS[1]      hold record     tg:{t<id>}:hold:<request_id>   hash, see "hold record" below
  KEYS[2]      hold index      tg:{t<id>}:holds                zset member=request_id score=created ms
  KEYS[3..N+2] counters        tg:{t<id>}:q:<scope>:<window>   hash {limit, used, pending, credit, over}

ARGV
  ARGV[1]  request_id    the index member; the caller guarantees it matches KEYS[1]
  ARGV[2]  amount        tokens wanted, integer >= 1
  ARGV[3]  min_amount    smallest acceptable hold, 1..amount. When min_amount < amount and the
                         tightest headroom h satisfies min_amount <= h < amount, h is held instead
                         (the caller then caps the upstream's output to fit). min_amount = amount
                         disables shrinking.
  ARGV[4]  dry_run       1: check and report, write nothing; 0: hold
  then for counter i (i = 1..N), four values at ARGV[4 + 4*(i-1) + 1 ..]:
    limit           tokens in the window; -1 = unlimited (tracked, never refuses); 0 = refuse all
    window_start    window start, ms since epoch on the Redis clock (inclusive)
    window_end      window end, ms (exclusive)
    expire_at       unix seconds at which the counter expires (window end + grace), set once

Clock
  The Redis server's TIME is the only clock. The caller computes the windows from its own estimate
  of Redis time; if TIME falls outside any passed window the script refuses with code -1 and the
  server time, and the caller resynchronises and retries. So a gateway host with a skewed clock
  can never charge the wrong day.

Return table (integers only)
  admitted:         { 1, granted, now_ms, remaining_1, ..., remaining_N }
  refused by quota: { 0, i, now_ms, remaining_1, ..., remaining_N }   i = first counter refusing
  window mismatch:  { -1, i, now_ms }                                 i = first stale window
  duplicate id:     { -2, 0, now_ms }                                 a hold with this id exists
  remaining_j = limit + credit - used - pending after this call (what is left for others);
  -1 for an unlimited counter. In a dry run, as if the hold had been made.

Hold record (hash, KEYS[1])
  amount   tokens held in every counter
  created  now_ms at reserve (the sweep compares it with the Redis clock)
  keys     JSON array of the counter keys, in order: settle/release/sweep must present the same
           keys, so a hold always ends in the window where it was made
  state    "open"; later "settled" | "released" | "swept" (then kept briefly as a tombstone)
  It expires at the latest counter expire_at: never before the counters it would decrement, and
  each hold has its own key, so an expiry can never drop other requests' holds.

Counters expire at their expire_at, set once when created, never refreshed: a new window is a new
key, and a busy tenant's counter still goes away. The index zset carries no TTL: it is only an
index, emptied by settle/release/sweep, and Redis deletes it when empty.
]]

local n = #KEYS - 2
if n < 1 or #ARGV ~= 4 + 4 * n then
  return redis.error_reply('reserve: expected KEYS = hold, index, counters... and 4 + 4*N ARGV')
end

local request_id = ARGV[1]
local amount = tonumber(ARGV[2])
local min_amount = tonumber(ARGV[3])
local dry_run = ARGV[4] == '1'
if not amount or amount < 1 or not min_amount or min_amount < 1 or min_amount > amount then
  return redis.error_reply('reserve: amount must be >= 1 and 1 <= min_amount <= amount')
end

local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local limits, expire_ats = {}, {}
for i = 1, n do
  local base = 4 + 4 * (i - 1)
  limits[i] = tonumber(ARGV[base + 1])
  local window_start = tonumber(ARGV[base + 2])
  local window_end = tonumber(ARGV[base + 3])
  expire_ats[i] = tonumber(ARGV[base + 4])
  if now_ms < window_start or now_ms >= window_end then
    return { -1, i, now_ms }
  end
end

if redis.call('EXISTS', KEYS[1]) == 1 then
  return { -2, 0, now_ms }
end

-- headroom of each limited counter; nil for unlimited ones
local headroom, exists, stored_limit = {}, {}, {}
local tightest = nil
for i = 1, n do
  local f = redis.call('HMGET', KEYS[i + 2], 'used', 'pending', 'credit', 'limit')
  exists[i] = f[1] ~= false
  stored_limit[i] = tonumber(f[4])
  if limits[i] >= 0 then
    local h = limits[i] + (tonumber(f[3]) or 0) - (tonumber(f[1]) or 0) - (tonumber(f[2]) or 0)
    headroom[i] = h
    if tightest == nil or h < tightest then tightest = h end
  end
end

local granted = amount
if tightest ~= nil and tightest < amount then
  if tightest >= min_amount then
    granted = tightest
  else
    local refused = 0
    for i = 1, n do
      if headroom[i] ~= nil and headroom[i] < min_amount then refused = i; break end
    end
    local out = { 0, refused, now_ms }
    for i = 1, n do
      if headroom[i] == nil then out[#out + 1] = -1 else out[#out + 1] = headroom[i] end
    end
    return out
  end
end

local out = { 1, granted, now_ms }
for i = 1, n do
  if headroom[i] == nil then out[#out + 1] = -1 else out[#out + 1] = headroom[i] - granted end
end
if dry_run then
  return out
end

local hold_expire_at = 0
for i = 1, n do
  local key = KEYS[i + 2]
  -- stored for readers (dashboards); the check above always uses the limit passed in ARGV
  if stored_limit[i] ~= limits[i] then redis.call('HSET', key, 'limit', limits[i]) end
  redis.call('HINCRBY', key, 'pending', granted)
  if not exists[i] then
    redis.call('HSET', key, 'used', 0)
    redis.call('EXPIREAT', key, expire_ats[i])
  end
  if expire_ats[i] > hold_expire_at then hold_expire_at = expire_ats[i] end
end

local counter_keys = {}
for i = 1, n do counter_keys[i] = KEYS[i + 2] end
redis.call('HSET', KEYS[1], 'amount', granted, 'created', now_ms,
  'keys', cjson.encode(counter_keys), 'state', 'open')
redis.call('EXPIREAT', KEYS[1], hold_expire_at)
redis.call('ZADD', KEYS[2], now_ms, request_id)

return out
