--[[ settle.lua: end a hold with the tokens the call actually used, and append its usage event
for the ledger, in one atomic step.

Purpose
  Move a hold from `pending` to `used` in every counter it was made in (the windows of the
  reserve, even when a new window has begun since), free its concurrency slot, close the hold and
  append exactly one usage event. Idempotent: the amount comes from the hold record, never from
  the caller, and a hold that has already ended is left alone, so a retried, late or duplicate
  settle can never touch another request's hold nor double-bill. Two late cases are not no-ops:
    - the hold was SWEPT (its gateway looked dead): the sweep charged what it knew
      (`charged` tokens, `charged_money`); this settle adds the difference (actual - charged,
      which may be negative) to `used` of the hold's counters that still exist, marks the hold
      "corrected" and appends one "corrected" event, so counters and ledger converge to the
      real usage. Once: a second late settle finds "corrected" and does nothing.
    - there is NO record at all (Redis lost it: restart, failover, flush): the call still
      reached the upstream, so its usage is charged to the counters that exist (rebuilt ones)
      and its event appended with orphan=1; a tombstone makes a retry a no-op.

KEYS (one tenant, one hash tag)
  KEYS[1]      hold record    tg:{t<id>}:hold:<request_id>
  KEYS[2]      hold index     tg:{t<id>}:holds
  KEYS[3]      usage stream   tg:{t<id>}:usage
  KEYS[4..]    counters       exactly the hold record's `keys`, in the same order,
               then the hold's gauge key if it has one (tg:{t<id>}:conc:<scope>)

ARGV
  ARGV[1]  request_id      the index and gauge member
  ARGV[2]  actual          tokens the call really used, integer >= 0 (may exceed the hold)
  ARGV[3]  tombstone_ttl   seconds to keep the closed hold record (duplicate ids refused meanwhile)
  ARGV[4]  event           opaque string (the caller's JSON: model, tokens in/out, latency, ...)
  ARGV[5]  actual_money    what the call really cost, micro-dollars >= 0, added to `used` of the
                           hold's money counters (their `pending` drops by the hold's `money`)
  ARGV[6]  fallback        JSON object, what the caller knows of the hold, read only when the
                           record is gone: {"units": [0 tokens | 1 micro-dollars, per counter
                           key], "amount": tokens held, "created": ms, "meta": reserve's meta}
  ARGV[7]  wake channel    optional: then the LAST key is the tenant's waiters key
                           (tg:{t<id>}:waiters), and when it exists (callers wait in the queue)
                           the freed capacity is announced: PUBLISH channel {"w": waiters key}.
                           One EXISTS when nobody waits; the gateway always passes it.

Return table
  { outcome, held, charged }
  "settled":   held = tokens that were pending, charged = actual added to `used`
  "corrected": the hold had been swept; held = its tokens, charged = actual - swept charge
  "released" | "settled" | "corrected" with 0, 0: the hold had already ended (no-op)
  "keys_mismatch": KEYS differ from the hold's (caller bug, no-op)

Usage event (stream entry fields)
  request_id, outcome ("settled" | "corrected"), held, actual, money, created (hold creation
  ms), ended (ms), meta (from reserve), event (ARGV[4]), and for "corrected": swept, swept_money
  (what the sweep had charged); for a lost record: orphan=1. All on the Redis clock. The stream
  is never trimmed here: only the ledger drain deletes events, after committing them.

Counters that have already expired (a settle long after the window) are skipped rather than
recreated without a TTL. Tokens used above the hold are added to the counter's `over` field.
Allotment chains (units 2 and 3, lua/lib/tiers.lua) move by the change in the call's tokens
(actual - held; actual - swept charge after a sweep; actual for a lost record), which gives
back to the pool first when the call used less than it held.
]]

--#include tiers

if #KEYS < 4 or (#ARGV ~= 6 and #ARGV ~= 7) or (#ARGV == 7 and #KEYS < 5) then
  return redis.error_reply('settle: expected KEYS = hold, index, stream, counters..., [gauge], [waiters] and 6 ARGV (7 with the waiters key)')
end
-- Without the optional waiters key, nkeys = #KEYS: the layout callers used before the queue.
local nkeys = #ARGV == 7 and #KEYS - 1 or #KEYS
local function wake()
  if #ARGV == 7 and redis.call('EXISTS', KEYS[#KEYS]) == 1 then
    redis.call('PUBLISH', ARGV[7], cjson.encode({ w = KEYS[#KEYS] }))
  end
end
local actual = tonumber(ARGV[2])
local tombstone_ttl = tonumber(ARGV[3])
local actual_money = tonumber(ARGV[5])
if not actual or actual < 0 or not tombstone_ttl or tombstone_ttl < 1
  or not actual_money or actual_money < 0 then
  return redis.error_reply('settle: actual and actual_money must be >= 0, tombstone_ttl >= 1')
end

local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local hold = redis.call('HMGET', KEYS[1], 'state', 'amount', 'keys', 'gauge', 'created', 'meta',
  'units', 'money', 'charged', 'charged_money')
local state = hold[1]

if state == false then
  -- The record is gone with Redis' data: charge what exists, record the event, keep a tombstone.
  local known = cjson.decode(ARGV[6])
  local units = known.units
  local lost_keys = {}
  for i = 1, #units do
    local key = KEYS[i + 3]
    lost_keys[i] = key
    if units[i] < 2 and redis.call('EXISTS', key) == 1 then
      redis.call('HINCRBY', key, 'used', units[i] == 1 and actual_money or actual)
    end
  end
  tiers_move(lost_keys, units, actual)
  if nkeys > #units + 3 then redis.call('ZREM', KEYS[nkeys], ARGV[1]) end
  redis.call('HSET', KEYS[1], 'state', 'settled', 'actual', actual, 'orphan', 1)
  redis.call('EXPIRE', KEYS[1], tombstone_ttl)
  redis.call('XADD', KEYS[3], '*',
    'request_id', ARGV[1], 'outcome', 'settled', 'held', known.amount, 'actual', actual,
    'money', actual_money, 'created', known.created, 'ended', now_ms, 'meta', known.meta,
    'event', ARGV[4], 'orphan', 1)
  wake()
  return { 'settled', 0, actual }
end
if state ~= 'open' and state ~= 'swept' then
  return { state, 0, 0 }
end

local keys = cjson.decode(hold[3])
local gauge = hold[4] or ''
local expected = #keys + 3 + (gauge ~= '' and 1 or 0)
if nkeys ~= expected or (gauge ~= '' and KEYS[expected] ~= gauge) then
  return { 'keys_mismatch', 0, 0 }
end
for i = 1, #keys do
  if keys[i] ~= KEYS[i + 3] then return { 'keys_mismatch', 0, 0 } end
end

local amount = tonumber(hold[2])
local units = hold[7] and cjson.decode(hold[7]) or {}
local money = tonumber(hold[8]) or 0

if state == 'swept' then
  local swept, swept_money = tonumber(hold[9]) or 0, tonumber(hold[10]) or 0
  tiers_move(keys, units, actual - swept)
  for i = 1, #keys do
    local key = KEYS[i + 3]
    if (units[i] or 0) < 2 and redis.call('EXISTS', key) == 1 then
      local delta, held, used = actual - swept, amount, actual
      if units[i] == 1 then delta, held, used = actual_money - swept_money, money, actual_money end
      if delta ~= 0 then redis.call('HINCRBY', key, 'used', delta) end
      if used > held then redis.call('HINCRBY', key, 'over', used - held) end
    end
  end
  redis.call('HSET', KEYS[1], 'state', 'corrected', 'actual', actual)
  redis.call('EXPIRE', KEYS[1], tombstone_ttl)
  redis.call('XADD', KEYS[3], '*',
    'request_id', ARGV[1], 'outcome', 'corrected', 'held', amount, 'actual', actual,
    'money', actual_money, 'swept', swept, 'swept_money', swept_money,
    'created', hold[5], 'ended', now_ms, 'meta', hold[6] or '', 'event', ARGV[4])
  if actual < swept then wake() end
  return { 'corrected', amount, actual - swept }
end

tiers_move(keys, units, actual - amount)
for i = 1, #keys do
  local key = KEYS[i + 3]
  if (units[i] or 0) < 2 and redis.call('EXISTS', key) == 1 then
    local held, used = amount, actual
    if units[i] == 1 then held, used = money, actual_money end
    redis.call('HINCRBY', key, 'pending', 0 - held)  -- not -held: Lua's -0 is "-0" to HINCRBY
    redis.call('HINCRBY', key, 'used', used)
    if used > held then
      redis.call('HINCRBY', key, 'over', used - held)
    end
  end
end
if gauge ~= '' then
  redis.call('ZREM', gauge, ARGV[1])
end

redis.call('HSET', KEYS[1], 'state', 'settled', 'actual', actual)
redis.call('EXPIRE', KEYS[1], tombstone_ttl)
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('XADD', KEYS[3], '*',
  'request_id', ARGV[1], 'outcome', 'settled', 'held', amount, 'actual', actual,
  'money', actual_money,
  'created', hold[5], 'ended', now_ms, 'meta', hold[6] or '', 'event', ARGV[4])
wake()
return { 'settled', amount, actual }
