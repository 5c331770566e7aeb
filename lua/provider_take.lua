--[[ provider_take.lua: take one request and its tokens from an upstream provider key's capacity.

Purpose
  Supply side (DESIGN.md section 3, step 6): a provider key may carry an RPM and a TPM capacity
  (what the upstream account allows). Before a call is sent with that key, one request and the
  call's held tokens are taken from two token buckets that refill continuously over a minute.
  Both or neither: if either bucket lacks room nothing is taken, and the gateway tries the next
  key. Only keys with a capacity cost this extra round trip.

KEYS
  KEYS[1]  tg:{p<provider_key_id>}:cap   hash {requests, tokens, ts}   (its own hash tag: provider
           keys are shared by tenants, so this never runs in a tenant's slot)
  and, with the queue (see "Queue" below):
  KEYS[2]  tg:{p<id>}:waiters            zset waiter id -> expiry ms (deadline, or a head's lease)
  KEYS[3]  tg:{p<id>}:wq                 zset waiter id -> order (-priority * 2^32 + arrival)
  KEYS[4]  tg:{p<id>}:waiters:seq        arrival counter; never deleted by a leave (a dropped head
                                         comes back with its order until its deadline): its TTL
                                         is raised to each new waiter's deadline

ARGV
  ARGV[1]  rpm_capacity   requests per minute, -1 = not limited
  ARGV[2]  tpm_capacity   tokens per minute, -1 = not limited
  ARGV[3]  tokens         tokens this call holds (its worst case), integer >= 0
  with the queue keys, six more:
  ARGV[4]  waiter id      "" for a caller that does not wait (its plan rejects): gate only
  ARGV[5]  order          the waiter's place, "" before it has one
  ARGV[6]  priority       the caller's plan queue priority, |priority| < 2^20
  ARGV[7]  deadline_ms    Redis clock: the waiter gives up then
  ARGV[8]  lease_ms       a head must come back within this, or it is taken for dead
  ARGV[9]  channel        pub/sub channel of wakes

Return table (integers only)
  taken:    { 1, requests_left, tokens_left }   (-1 for an unlimited bucket)
  refused:  { 0, retry_after_ms, which }        which = 1 requests, 2 tokens, 3 callers wait
                                                (gate only: the capacity is theirs first)
  queued:   { -6, head, retry_after_ms, order } (a waiter) it waits in the key's queue

Queue
  Callers of every tenant waiting for this key's capacity, ordered by their plan's priority,
  then arrival. A caller (waiting or not) with a live waiter ahead of it takes nothing: a new
  call never overtakes a waiter. A waiter refused queues (keeping its order); a waiter that takes
  capacity leaves and wakes the next head ({"w": waiters key, "ids": [head]}), which also comes
  back by itself after retry_after_ms (the buckets refill with time, nothing else frees them).
  Entries past their expiry are dropped by whoever finds them ahead of itself.
  No call is hopeless here: a bucket always has one request in time, and a call bigger than the
  whole TPM capacity passes on a full bucket (it takes the whole bucket), so no waiter can
  block the queue for good.

TTL: refreshed to 60 s on each take; an expired hash is two full buckets, which is exactly
their state after a minute without calls.
]]

if not ((#KEYS == 1 and #ARGV == 3) or (#KEYS == 4 and #ARGV == 9)) then
  return redis.error_reply('provider_take: expected 1 key and ARGV = rpm_capacity, tpm_capacity, tokens (4 keys and 9 ARGV with the queue)')
end
local rpm, tpm, tokens = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
if not rpm or not tpm or not tokens or tokens < 0 or rpm == 0 or tpm == 0 or rpm < -1 or tpm < -1 then
  return redis.error_reply('provider_take: capacities must be >= 1 or -1, tokens >= 0')
end

local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local f = redis.call('HMGET', KEYS[1], 'requests', 'tokens', 'ts')
local elapsed = math.max(0, now_ms - (tonumber(f[3]) or now_ms))

local function refill(stored, capacity)
  if capacity < 0 then return -1 end
  return math.min(capacity, (tonumber(stored) or capacity) + elapsed * capacity / 60000)
end

local requests_left = refill(f[1], rpm)
local tokens_left = refill(f[2], tpm)
-- A call bigger than the whole TPM capacity could never pass: let it through on a full bucket.
local need = math.min(tokens, tpm > 0 and tpm or tokens)
local retry, which = 0, 0
if rpm > 0 and requests_left < 1 then
  retry, which = math.ceil((1 - requests_left) * 60000 / rpm), 1
elseif tpm > 0 and tokens_left < need then
  retry, which = math.ceil((need - tokens_left) * 60000 / tpm), 2
end

local Q = nil
if #KEYS == 4 then
  local priority = tonumber(ARGV[6])
  Q = { waiters = KEYS[2], queue = KEYS[3], seq = KEYS[4], id = ARGV[4],
        order = ARGV[5] ~= '' and tonumber(ARGV[5]) or nil, priority = priority,
        deadline = tonumber(ARGV[7]), lease = tonumber(ARGV[8]), channel = ARGV[9], wake = {} }
  if not priority or math.abs(priority) >= 1048576 or not Q.deadline or not Q.lease
    or Q.lease < 1 or (ARGV[5] ~= '' and not Q.order) then
    return redis.error_reply('provider_take: queue values: |priority| < 2^20, deadline, lease >= 1, order "" or a number')
  end
end

local function publish_wakes()
  if Q and #Q.wake > 0 then
    redis.call('PUBLISH', Q.channel, cjson.encode({ w = Q.waiters, ids = Q.wake }))
  end
end

-- The first live waiter ahead of `before`, dropping dead entries met on the way; a new head
-- found behind them (or any head, with `promote`: the one before it left) gets its lease and
-- is woken.
local function live_ahead(before, promote)
  local dropped = false
  for _ = 1, 64 do
    local first = redis.call('ZRANGE', Q.queue, 0, 0, 'WITHSCORES')
    if #first == 0 or tonumber(first[2]) >= before then
      if dropped and #first > 0 then
        local exp = tonumber(redis.call('ZSCORE', Q.waiters, first[1]))
        if exp then redis.call('ZADD', Q.waiters, math.min(exp, now_ms + Q.lease), first[1]) end
        Q.wake[#Q.wake + 1] = first[1]
      end
      return nil
    end
    local exp = tonumber(redis.call('ZSCORE', Q.waiters, first[1]))
    if exp ~= nil and exp >= now_ms then
      if dropped or promote then
        redis.call('ZADD', Q.waiters, math.min(exp, now_ms + Q.lease), first[1])
        Q.wake[#Q.wake + 1] = first[1]
      end
      return first[1]
    end
    redis.call('ZREM', Q.queue, first[1])
    redis.call('ZREM', Q.waiters, first[1])
    dropped = true
  end
  return '?'
end

local function wait_here(retry_after)
  if Q.order == nil then
    Q.order = -Q.priority * 4294967296 + redis.call('INCR', Q.seq)
    local keep = Q.deadline - now_ms
    if keep > 0 and redis.call('PTTL', Q.seq) < keep then redis.call('PEXPIRE', Q.seq, keep) end
  end
  redis.call('ZADD', Q.queue, Q.order, Q.id)
  local head = live_ahead(Q.order) == nil
  redis.call('ZADD', Q.waiters, head and math.min(Q.deadline, now_ms + Q.lease) or Q.deadline, Q.id)
  publish_wakes()
  return { -6, head and 1 or 0, retry_after, Q.order }
end

if Q then
  local mine = Q.order or (-Q.priority * 4294967296 + 4294967295)
  if live_ahead(mine) ~= nil then
    if Q.id == '' then
      publish_wakes()
      return { 0, math.max(retry, 1), 3 }
    end
    return wait_here(retry)
  end
end

if which ~= 0 then
  if Q and Q.id ~= '' then return wait_here(retry) end
  publish_wakes()
  return { 0, retry, which }
end

if rpm > 0 then requests_left = requests_left - 1 end
if tpm > 0 then tokens_left = tokens_left - need end
redis.call('HSET', KEYS[1], 'requests', tostring(requests_left), 'tokens', tostring(tokens_left), 'ts', now_ms)
redis.call('PEXPIRE', KEYS[1], 60000)
if Q and Q.id ~= '' then
  -- Taken: out of the queue, and the next head is told to look at once.
  local first = redis.call('ZRANGE', Q.queue, 0, 0)
  if redis.call('ZREM', Q.queue, Q.id) == 1 and first[1] == Q.id then live_ahead(math.huge, true) end
  redis.call('ZREM', Q.waiters, Q.id)
end
publish_wakes()
return { 1, math.floor(requests_left), math.floor(tokens_left) }
