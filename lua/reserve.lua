--[[ reserve.lua: admit a request against every limit it is subject to, and hold its worst-case
token cost in every quota counter it touches; or, on any refusal, write nothing at all.

Checked in one atomic step, in this order (the first refusal is reported):
  1. concurrency: the API key's open requests < cap (a sorted set of request ids that heals
     itself: members older than stale_ms are dropped, so a crashed process cannot leak a slot)
  2. request rate: one token from each token bucket (requests per second / per minute)
  3. token quota: for EVERY counter, used + pending + amount <= limit + credit
     (day and month windows for tenant, project, key and model; a minute window for TPM),
     and for every money counter (monthly spend budget, micro-dollars) the call's worst-case cost

KEYS (all of one tenant, sharing its hash tag `{t<id>}`, so this runs on one cluster slot)
  KEYS[1]            hold record   tg:{t<id>}:hold:<request_id>   hash, see "hold record"
  KEYS[2]            hold index    tg:{t<id>}:holds               zset request_id -> created ms
  KEYS[3..N+2]       counters      tg:{t<id>}:q:<scope>:<window>  hash {limit used pending credit over}
  KEYS[N+3..N+R+2]   rate buckets  tg:{t<id>}:rate:<scope>:<period> hash {tokens ts}
  KEYS[N+R+3]        gauge         tg:{t<id>}:conc:<scope>        zset; present iff cap >= 0
  KEYS[N+R+G+3]      epoch         tg:{t<id>}:epoch               string; present iff check_epoch
  then, under the queue policy only (see "Queue" below; E = the keys above):
  KEYS[E+1]          waiters       tg:{t<id>}:waiters             zset waiter id -> expiry ms
  KEYS[E+2]          membership    tg:{t<id>}:waiters:in          hash waiter id -> its queue key
  KEYS[E+3]          arrivals      tg:{t<id>}:waiters:seq         string counter (see TTLs)
  KEYS[E+4..E+N+3]   counter queues  tg:{t<id>}:wq:q:<scope>[:usd]:<kind>, one per counter
  KEYS[..+R]         bucket queues   tg:{t<id>}:wq:rate:<scope>:<period>ms, one per bucket
  KEYS[..+1]         gauge queue     tg:{t<id>}:wq:conc:<scope>; present iff cap >= 0

ARGV
  ARGV[1]  request_id     the index member; the caller guarantees it matches KEYS[1]
  ARGV[2]  amount         tokens wanted, integer >= 1
  ARGV[3]  min_amount     smallest acceptable hold, 1..amount. If min_amount <= headroom < amount,
                          the headroom is held instead (the caller caps the upstream's output to
                          fit). min_amount = amount disables shrinking.
  ARGV[4]  dry_run        1: check and report, write nothing; 0: hold
  ARGV[5]  N              number of counters, >= 1
  ARGV[6]  R              number of rate buckets, >= 0
  ARGV[7]  cap            concurrency cap of the gauge; -1: no gauge key is passed
  ARGV[8]  stale_ms       gauge members older than this are dead requests and are dropped
  ARGV[9]  meta           opaque string stored in the hold and copied into its usage event
  ARGV[10] money          the call's worst-case cost in micro-dollars, integer >= 0, held in the
                          money counters (never shrunk: it stays an upper bound of the bill)
  ARGV[11] input          estimated input (prompt) tokens, integer >= 0, stored in the hold: the
                          sweep charges it for a call that reached the upstream
  ARGV[12] price_in       micro-dollars per million input tokens, integer >= 0 } the price the
  ARGV[13] price_out      micro-dollars per million output tokens, integer >= 0} ledger uses, so
                          the sweep prices what it charges exactly like the ledger
  ARGV[14] check_epoch    1: refuse with code -5 when the epoch key is missing (Redis lost the
                          tenant's data: its counters would read 0); 0: no epoch key is passed
  then for counter i, five values:  limit (-1 unlimited, 0 refuse all), window_start ms
                                    (inclusive), window_end ms (exclusive), expire_at unix s,
                                    unit (0: tokens, held `granted`; 1: micro-dollars, held `money`;
                                    2: an allotment tier, limit = its allotment; 3 + 8j: the
                                    shared pool ending a chain of tiers, limit = the pool's size
                                    >= 0, j = the index of the tenant counter of its window whose
                                    used + pending seeds a new pool (0: none); see "Allotments")
  then for bucket j, two values:    capacity (requests), period_ms (refills capacity per period)
  then, under the queue policy only (their presence is the flag: 6 + N more values):
    order        the waiter's place, "" before it has one (then -priority * 2^32 + arrival)
    priority     the plan's queue priority, |priority| < 2^20 (higher is served first)
    deadline_ms  Redis clock: the caller gives up then; its entry is dead after it
    lease_ms     a queue's head must come back within this, or it is dead
    max_waiters  the tenant's bound; a new waiter beyond it is refused (code -7)
    channel      the pub/sub channel of wakes
    queueable_1..queueable_N   1: a refusal by counter i may wait; 0: refused at once

Clock
  The Redis server's TIME is the only clock. The caller computes windows from its estimate of
  Redis time; if TIME is outside any passed window the script refuses with code -1 and the
  server time, the caller corrects its estimate and retries. Buckets and the gauge use TIME too.

Return table (integers only)
  admitted:          { 1, granted, now_ms, rem_1..rem_N, bucket_1..bucket_R }
                     (granted is in tokens; money counters hold `money` in full)
  refused, quota:    { 0, i, now_ms, rem_1..rem_N, bucket_1..bucket_R }  i = first refusing counter
                     (queue policy: or the first counter the call can never fit, whatever else
                     refused it; see "Queue")
  window mismatch:   { -1, i, now_ms }
  duplicate id:      { -2, 0, now_ms }                  a hold (or its tombstone) has this id
  epoch missing:     { -5, 0, now_ms }                  counters must be rebuilt first
  refused, rate:     { -3, j, now_ms, retry_after_ms }  j = first empty bucket
  refused, gauge:    { -4, open, now_ms }               open = requests in flight for the key
  queued:            { -6, head, now_ms, retry_after_ms, order, kind, index, waiters }
                     (queue policy only) the caller waits in the queue of resource `kind`
                     (1 counter, 2 bucket, 3 gauge) number `index`; head = 1 when no live waiter
                     is ahead of it there; retry_after_ms > 0 when a bucket refills then
  queue full:        { -7, waiters, now_ms }            (queue policy) nothing written
  rem_i = limit + credit - used - pending after this call (-1: unlimited counter);
  bucket_j = whole requests left in bucket j after this call.
  In a dry run, figures are as if the hold had been made; nothing is written.

Allotments (units 2 and 3; lua/lib/tiers.lua)
  A chain is a run of allotment tiers (a key's, a project's) ending with the tenant's shared pool
  tg:{t<id>}:pool:<window>; tiers are tg:{t<id>}:al:<scope>:<window> hashes {taken, allot}. The
  call's granted tokens are taken from the first tier up to its allotment, the rest from the
  next, the rest of that from the pool. A chain's room (the unused allotments plus the pool's
  limit + credit - taken) is checked like a token counter's headroom and reported at the pool's
  index (rem_i of a tier is -1); the pool refuses when the room is short.

Hold record (hash KEYS[1])
  amount, money, created (now_ms), keys (JSON array of the counter keys), units (JSON array,
  0 tokens / 1 money, per key), gauge (the gauge key or ""), meta, input, pin, pout,
  phase "reserved" (later "forwarded" | "streaming", lua/progress.lua), progress (output tokens
  delivered at the last checkpoint, 0), state "open" (later "settled" | "released" | "swept" |
  "corrected", then a short-lived tombstone).
  It expires with the latest counter (never before the counters it will decrement); each hold is
  its own key, so no expiry can drop other requests' holds at once.

Queue (only when the queue values are passed: other calls run none of this)
  Every refusing resource (a counter with a limit, a bucket, the gauge) has a queue in the
  tenant's slot, ordered by priority, then arrival. Before any check, the caller is compared with
  the queues of every resource it touches: if a live waiter is ahead of it in any of them, it is
  queued behind (new arrivals never overtake). Otherwise the checks run as always; a refusal by a
  queueable resource queues the caller there (keeping its order when it moves between queues), a
  refusal by a counter marked not queueable answers at once (and takes it out of its queue), an
  admission takes it out of its queue. A call that can never fit is never queued: when it would
  be (by the gate or any refusal), a counter with limit + credit below min_amount (below money,
  for a money counter) refuses it at once with the quota reply, and it leaves its queue; so does
  a concurrency cap of 0 (the gauge reply). (A bucket always holds its one request in time.)
  A waiter leaving the head of a queue that still has waiters wakes the next head
  (PUBLISH {"w": waiters key, "ids": [head]}) and gives it a lease:
  a head must call again within lease_ms, else it is taken for dead. Entries past their expiry
  (the deadline, or the head's lease) are dropped by whoever finds them ahead of itself, and,
  when the tenant is at its bound, by a newcomer (up to 128 per call, with their queue entry and
  membership, in whichever queue they are).

TTLs: counters expire at their expire_at, set once at creation and never refreshed (a new window
is a new key). A bucket's TTL is refreshed to one period on each write: an expired bucket is a
full bucket, which is exactly its state after a period without requests. The gauge expires
stale_ms after its last admission. The index has no TTL; Redis deletes it when empty. Queue
keys (waiters, membership, queues) have no TTL either and go when empty; the arrival counter is
never deleted by a leave (a dropped head comes back with its order until its deadline, and later
arrivals must stay behind it): its TTL is raised to each new waiter's deadline.
]]

--#include tiers

local n, r = tonumber(ARGV[5]), tonumber(ARGV[6])
local cap = tonumber(ARGV[7])
local check_epoch = ARGV[14] == '1'
local base_argv = n and r and 14 + 5 * n + 2 * r
local base_keys = n and r and cap and 2 + n + r + (cap >= 0 and 1 or 0) + (check_epoch and 1 or 0)
if not n or n < 1 or not r or r < 0 or not cap or cap < -1
  or (#ARGV ~= base_argv and #ARGV ~= base_argv + 6 + n)
  or #KEYS ~= base_keys + (#ARGV == base_argv and 0 or 3 + n + r + (cap >= 0 and 1 or 0)) then
  return redis.error_reply('reserve: expected KEYS = hold, index, N counters, R buckets, [gauge], [epoch], [queue keys]; ARGV = 14 + 5N + 2R values [+ 6 + N queue values]')
end
local queued_mode = #ARGV ~= base_argv

local request_id = ARGV[1]
local amount = tonumber(ARGV[2])
local min_amount = tonumber(ARGV[3])
local dry_run = ARGV[4] == '1'
local stale_ms = tonumber(ARGV[8])
local money = tonumber(ARGV[10])
local input, price_in, price_out = tonumber(ARGV[11]), tonumber(ARGV[12]), tonumber(ARGV[13])
if not amount or amount < 1 or not min_amount or min_amount < 1 or min_amount > amount
  or not stale_ms or stale_ms < 1 or not money or money < 0
  or not input or input < 0 or not price_in or price_in < 0 or not price_out or price_out < 0 then
  return redis.error_reply('reserve: amount must be >= 1, 1 <= min_amount <= amount, stale_ms >= 1, money, input and prices >= 0')
end

local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local limits, expire_ats, units, ckeys, seeds = {}, {}, {}, {}, {}
for i = 1, n do
  local base = 14 + 5 * (i - 1)
  limits[i] = tonumber(ARGV[base + 1])
  expire_ats[i] = tonumber(ARGV[base + 4])
  local code = tonumber(ARGV[base + 5]) or 0
  units[i] = code % 8
  seeds[i] = math.floor(code / 8)
  ckeys[i] = KEYS[i + 2]
  if now_ms < tonumber(ARGV[base + 2]) or now_ms >= tonumber(ARGV[base + 3]) then
    return { -1, i, now_ms }
  end
end

-- A missing epoch means this slot lost its data (restart without persistence, failover,
-- flush): every counter would read 0, an overdraft nobody notices. Refuse until rebuilt.
if check_epoch and redis.call('EXISTS', KEYS[base_keys]) == 0 then
  return { -5, 0, now_ms }
end

if redis.call('EXISTS', KEYS[1]) == 1 then
  return { -2, 0, now_ms }
end

-- The queue (queue policy only) ---------------------------------------------------------------
local Q = nil
if queued_mode then
  local qa = base_argv
  local order = ARGV[qa + 1] ~= '' and tonumber(ARGV[qa + 1]) or nil
  local priority = tonumber(ARGV[qa + 2])
  Q = { waiters = KEYS[base_keys + 1], member = KEYS[base_keys + 2], seq = KEYS[base_keys + 3],
        order = order, priority = priority, deadline = tonumber(ARGV[qa + 3]),
        lease = tonumber(ARGV[qa + 4]), max = tonumber(ARGV[qa + 5]), channel = ARGV[qa + 6],
        queueable = {}, wake = {} }
  if not priority or math.abs(priority) >= 1048576 or not Q.deadline or not Q.lease
    or Q.lease < 1 or not Q.max or Q.max < 1 or dry_run or (ARGV[qa + 1] ~= '' and not order) then
    return redis.error_reply('reserve: queue values: |priority| < 2^20, deadline, lease >= 1, max_waiters >= 1, order "" or a number, and no dry run')
  end
  for i = 1, n do Q.queueable[i] = ARGV[qa + 6 + i] == '1' end
  -- the queue key of each resource: counter i, bucket j, the gauge
  Q.counter_q = function(i) return KEYS[base_keys + 3 + i] end
  Q.bucket_q = function(j) return KEYS[base_keys + 3 + n + j] end
  Q.gauge_q = KEYS[base_keys + 4 + n + r]
end

local function drop(id, qk)
  redis.call('ZREM', qk, id)
  redis.call('ZREM', Q.waiters, id)
  redis.call('HDEL', Q.member, id)
end

-- The first live waiter of queue qk ahead of `before` (any, when before is nil), dropping dead
-- entries met on the way; a new head found behind them (or any head, with `promote`: the head
-- before it just left) is given its lease and woken.
local function live_ahead(qk, before, promote)
  local dropped = false
  for _ = 1, 64 do
    local first = redis.call('ZRANGE', qk, 0, 0, 'WITHSCORES')
    if #first == 0 or (before ~= nil and tonumber(first[2]) >= before) then
      if dropped and #first > 0 then
        local exp = tonumber(redis.call('ZSCORE', Q.waiters, first[1]))
        if exp then redis.call('ZADD', Q.waiters, math.min(exp, now_ms + Q.lease), first[1]) end
        Q.wake[#Q.wake + 1] = first[1]
      end
      return nil
    end
    local id = first[1]
    local exp = tonumber(redis.call('ZSCORE', Q.waiters, id))
    if exp ~= nil and exp >= now_ms then
      if dropped or promote then
        redis.call('ZADD', Q.waiters, math.min(exp, now_ms + Q.lease), id)
        Q.wake[#Q.wake + 1] = id
      end
      return id
    end
    drop(id, qk)  -- past its deadline or its lease: the waiter is gone
    dropped = true
  end
  return '?'  -- more dead entries than one call should drop: stay behind them this time
end

-- Take this caller out of its queue (admitted, refused for good); wake the next head.
local function leave()
  local cur = redis.call('HGET', Q.member, request_id)
  if not cur then
    redis.call('ZREM', Q.waiters, request_id)
    return
  end
  local first = redis.call('ZRANGE', cur, 0, 0)
  drop(request_id, cur)
  if first[1] == request_id then live_ahead(cur, nil, true) end
end

local function publish_wakes()
  if Q and #Q.wake > 0 then
    redis.call('PUBLISH', Q.channel, cjson.encode({ w = Q.waiters, ids = Q.wake }))
  end
end

-- Bucket j's level now (refilled since its last write), its capacity and period.
local function bucket_level(j)
  local base = 14 + 5 * n + 2 * (j - 1)
  local capacity, period = tonumber(ARGV[base + 1]), tonumber(ARGV[base + 2])
  local f = redis.call('HMGET', KEYS[2 + n + j], 'tokens', 'ts')
  local tokens = tonumber(f[1]) or capacity
  local ts = tonumber(f[2]) or now_ms
  return math.min(capacity, tokens + math.max(0, now_ms - ts) * capacity / period), capacity, period
end

-- The first counter this call can never fit, 0 if none: its smallest acceptable hold (its
-- worst-case cost, for a money counter) is above limit + credit, so no amount of waiting helps
-- (a prompt beyond the daily or the TPM limit, a call dearer than the spend budget).
local function never_fits()
  for i = 1, n do
    -- (an allotment tier or a pool never decides alone: the chain's room may exceed either)
    if limits[i] >= 0 and units[i] < 2 then
      local need = units[i] == 1 and money or min_amount
      if limits[i] + (tonumber(redis.call('HGET', KEYS[i + 2], 'credit')) or 0) < need then
        return i
      end
    end
  end
  return 0
end

-- Refused for good by counter i (the quota refusal's reply, nothing held), out of its queue.
local function refused_for_good(i)
  local out = { 0, i, now_ms }
  for k = 1, n do
    if limits[k] < 0 or units[k] >= 2 then
      out[#out + 1] = -1
    else
      local f = redis.call('HMGET', KEYS[k + 2], 'used', 'pending', 'credit')
      out[#out + 1] = limits[k] + (tonumber(f[3]) or 0)
        - (tonumber(f[1]) or 0) - (tonumber(f[2]) or 0)
    end
  end
  for j = 1, r do out[#out + 1] = math.floor(bucket_level(j)) end
  if Q.any then leave() end
  publish_wakes()
  return out
end

-- The tenant is at its bound: drop (a bounded batch of) entries past their expiry, waiters of
-- dead processes possibly in queues nobody visits, with their queue entry and membership (a
-- dropped head's successor is woken). The live waiters left count.
local function live_waiters()
  local dead = redis.call('ZRANGEBYSCORE', Q.waiters, '-inf', now_ms - 1, 'LIMIT', 0, 128)
  for _, id in ipairs(dead) do
    local qk = redis.call('HGET', Q.member, id)
    if qk then
      local first = redis.call('ZRANGE', qk, 0, 0)
      drop(id, qk)
      if first[1] == id then live_ahead(qk, nil, true) end
    else
      redis.call('ZREM', Q.waiters, id)
    end
  end
  return redis.call('ZCOUNT', Q.waiters, now_ms, '+inf')
end

-- A new place: the next arrival. The counter is never reset while an order it handed out may
-- come back (a dropped head calls again with its order until its deadline): it lives at least
-- until this caller's deadline, so later arrivals always come after earlier ones.
local function arrival()
  local seq = redis.call('INCR', Q.seq)
  local keep = Q.deadline - now_ms
  if keep > 0 and redis.call('PTTL', Q.seq) < keep then redis.call('PEXPIRE', Q.seq, keep) end
  return seq
end

-- Queue the caller in qk (resource kind, index), keeping its order; the reply says whether it
-- is the head there. A call that can never fit is refused at once instead (never a head that
-- blocks its queue until its timeout).
local function wait_in(qk, kind, index, retry_after)
  local hopeless = never_fits()
  if hopeless ~= 0 then return refused_for_good(hopeless) end
  local registered = redis.call('ZSCORE', Q.waiters, request_id) ~= false
  if not registered and Q.order == nil and redis.call('ZCARD', Q.waiters) >= Q.max then
    local count = live_waiters()
    if count >= Q.max then
      publish_wakes()
      return { -7, count, now_ms }
    end
  end
  if Q.order == nil then
    Q.order = -Q.priority * 4294967296 + arrival()
  end
  local cur = redis.call('HGET', Q.member, request_id)
  if cur and cur ~= qk then
    local first = redis.call('ZRANGE', cur, 0, 0)
    redis.call('ZREM', cur, request_id)
    if first[1] == request_id then live_ahead(cur, nil, true) end
  end
  redis.call('ZADD', qk, Q.order, request_id)
  redis.call('HSET', Q.member, request_id, qk)
  local head = live_ahead(qk, Q.order) == nil
  local exp = head and math.min(Q.deadline, now_ms + Q.lease) or Q.deadline
  redis.call('ZADD', Q.waiters, exp, request_id)
  publish_wakes()
  return { -6, head and 1 or 0, now_ms, retry_after or 0, Q.order, kind, index,
           redis.call('ZCARD', Q.waiters) }
end

-- The gate: behind any live waiter ahead in the queue of a resource this call touches. While
-- nobody of the tenant waits (the usual case) one EXISTS stands for every queue, and for the
-- caller's own entry (it has none: nothing to leave when it is admitted).
if Q then Q.any = redis.call('EXISTS', Q.waiters) == 1 end
if Q and Q.any then
  local mine = Q.order
  if mine == nil then
    -- A newcomer comes after every waiter of its priority (its arrival number is not taken yet).
    mine = -Q.priority * 4294967296 + 4294967295
  end
  if cap >= 0 and live_ahead(Q.gauge_q, mine) ~= nil then return wait_in(Q.gauge_q, 3, 1) end
  for j = 1, r do
    if live_ahead(Q.bucket_q(j), mine) ~= nil then return wait_in(Q.bucket_q(j), 2, j) end
  end
  for i = 1, n do
    if limits[i] >= 0 and Q.queueable[i] and live_ahead(Q.counter_q(i), mine) ~= nil then
      return wait_in(Q.counter_q(i), 1, i)
    end
  end
end

-- 1. concurrency
local gauge = nil
if cap >= 0 then
  gauge = KEYS[2 + n + r + 1]
  redis.call('ZREMRANGEBYSCORE', gauge, '-inf', now_ms - stale_ms)
  local open = redis.call('ZCARD', gauge)
  if open >= cap then
    if Q and cap > 0 then return wait_in(Q.gauge_q, 3, 1) end
    if Q then  -- a cap of 0 never frees a slot: refused at once, out of its queue
      if Q.any then leave() end
      publish_wakes()
    end
    return { -4, open, now_ms }
  end
end

-- 2. request rate: token buckets, one request each
local bucket_left, bucket_cap, bucket_period = {}, {}, {}
for j = 1, r do
  local tokens, capacity, period = bucket_level(j)
  if tokens < 1 then
    local retry_after = math.ceil((1 - tokens) * period / capacity)
    if Q then return wait_in(Q.bucket_q(j), 2, j, retry_after) end
    return { -3, j, now_ms, retry_after }
  end
  bucket_left[j], bucket_cap[j], bucket_period[j] = tokens - 1, capacity, period
end

-- 3. token quota and money budgets
local headroom, exists, stored_limit = {}, {}, {}
local tightest = nil
local tiered = false
-- A new pool starts from its tenant counter's used + pending, read before this call holds.
local seed_taken = {}
for i = 1, n do
  if units[i] == 3 and seeds[i] > 0 then
    local f = redis.call('HMGET', KEYS[seeds[i] + 2], 'used', 'pending')
    seed_taken[i] = (tonumber(f[1]) or 0) + (tonumber(f[2]) or 0)
  end
end
for i = 1, n do
  local f = redis.call('HMGET', KEYS[i + 2], 'used', 'pending', 'credit', 'limit')
  exists[i] = f[1] ~= false
  stored_limit[i] = tonumber(f[4])
  if units[i] >= 2 then
    tiered = true
    if i == 1 or units[i - 1] < 2 or units[i - 1] == 3 then  -- a chain starts here
      local room, pool = tiers_room(ckeys, units, limits, limits, i, seed_taken)
      headroom[pool] = room
      if tightest == nil or room < tightest then tightest = room end
    end
  elseif limits[i] >= 0 then
    local h = limits[i] + (tonumber(f[3]) or 0) - (tonumber(f[1]) or 0) - (tonumber(f[2]) or 0)
    headroom[i] = h
    if units[i] == 0 and (tightest == nil or h < tightest) then tightest = h end
  end
end

local granted = amount
local refused = 0
if tightest ~= nil and tightest < amount then
  if tightest >= min_amount then
    granted = tightest
  else
    for i = 1, n do
      if units[i] ~= 1 and headroom[i] ~= nil and headroom[i] < min_amount then refused = i; break end
    end
  end
end
for i = 1, n do
  if units[i] == 1 and headroom[i] ~= nil and headroom[i] < money and (refused == 0 or i < refused) then
    refused = i
    break
  end
end
local function held(i) return units[i] == 1 and money or granted end  -- a chain's: granted

local out = { refused == 0 and 1 or 0, refused == 0 and granted or refused, now_ms }
for i = 1, n do
  if headroom[i] == nil then
    out[#out + 1] = -1
  elseif refused == 0 then
    out[#out + 1] = headroom[i] - held(i)
  else
    out[#out + 1] = headroom[i]
  end
end
for j = 1, r do
  out[#out + 1] = math.floor(refused == 0 and bucket_left[j] or bucket_left[j] + 1)
end
if refused ~= 0 and Q then
  if Q.queueable[refused] then return wait_in(Q.counter_q(refused), 1, refused) end
  -- waiting cannot help (e.g. a pace counter): refused at once, out of the queue
  if Q.any then leave() end
  publish_wakes()
end
if refused ~= 0 or dry_run then
  return out
end
if Q and Q.any then
  leave()  -- admitted: out of its queue, and the next head is told to try at once
  publish_wakes()
end

-- all checks passed: write
for j = 1, r do
  local key = KEYS[2 + n + j]
  redis.call('HSET', key, 'tokens', tostring(bucket_left[j]), 'ts', now_ms)
  redis.call('PEXPIRE', key, bucket_period[j])
end
if gauge then
  redis.call('ZADD', gauge, now_ms, request_id)
  redis.call('PEXPIRE', gauge, stale_ms)
end

local hold_expire_at = 0
for i = 1, n do
  local key = KEYS[i + 2]
  if units[i] < 2 then
    -- stored for readers (dashboards); the check above always uses the limit passed in ARGV
    if stored_limit[i] ~= limits[i] then redis.call('HSET', key, 'limit', limits[i]) end
    redis.call('HINCRBY', key, 'pending', held(i))
    if not exists[i] then
      redis.call('HSET', key, 'used', 0)
      redis.call('EXPIREAT', key, expire_ats[i])
    end
  end
  if expire_ats[i] > hold_expire_at then hold_expire_at = expire_ats[i] end
end
if tiered then
  -- tiers_move creates a missing tier or pool with its expiry, so the pool's size is written
  -- after it: written first, it would create the pool without one (a key never expiring).
  tiers_move(ckeys, units, granted, limits, expire_ats, seed_taken)
  for i = 1, n do
    if units[i] == 3 and stored_limit[i] ~= limits[i] then
      redis.call('HSET', KEYS[i + 2], 'limit', limits[i])  -- the pool's size, for readers
    end
  end
end

local counter_keys = {}
for i = 1, n do counter_keys[i] = KEYS[i + 2] end
redis.call('HSET', KEYS[1], 'amount', granted, 'money', money, 'created', now_ms,
  'keys', cjson.encode(counter_keys), 'units', cjson.encode(units),
  'gauge', gauge or '', 'meta', ARGV[9], 'input', input, 'pin', price_in, 'pout', price_out,
  'phase', 'reserved', 'progress', 0, 'state', 'open')
redis.call('EXPIREAT', KEYS[1], hold_expire_at)
redis.call('ZADD', KEYS[2], now_ms, request_id)

return out
