--[[ release.lua: end an open hold without charging anything (the upstream produced nothing),
and append its usage event, in one atomic step.

Purpose
  Remove a hold's amount from `pending` in every counter it was made in, free its concurrency
  slot, close the hold and append one usage event with outcome "released". Idempotent: the
  amount comes from the hold record, never from the caller; a hold already settled, released or
  swept is left alone, so a retried release cannot free another request's hold.

KEYS (one tenant, one hash tag)
  KEYS[1]      hold record    tg:{t<id>}:hold:<request_id>
  KEYS[2]      hold index     tg:{t<id>}:holds
  KEYS[3]      usage stream   tg:{t<id>}:usage
  KEYS[4..]    counters       exactly the hold record's `keys`, in the same order,
               then the hold's gauge key if it has one

ARGV
  ARGV[1]  request_id      the index and gauge member
  ARGV[2]  tombstone_ttl   seconds to keep the closed hold record
  ARGV[3]  event           opaque string (the caller's JSON: why it was released, latency, ...)
  ARGV[4]  stream_maxlen   approximate cap of the usage stream

Return table
  { outcome, released }
  "released": released = tokens removed from `pending`
  "settled" | "swept" | "released" with 0: it had already ended (no-op, no event)
  "unknown": no hold record; "keys_mismatch": KEYS differ from the hold's (no-op)

Usage event fields: request_id, outcome, held, actual (0), created, ended, meta, event.
Expired counters are skipped, never recreated.
]]

if #KEYS < 4 or #ARGV ~= 4 then
  return redis.error_reply('release: expected KEYS = hold, index, stream, counters..., [gauge] and 4 ARGV')
end
local tombstone_ttl = tonumber(ARGV[2])
local maxlen = tonumber(ARGV[4])
if not tombstone_ttl or tombstone_ttl < 1 or not maxlen or maxlen < 1 then
  return redis.error_reply('release: tombstone_ttl and stream_maxlen must be >= 1')
end

local hold = redis.call('HMGET', KEYS[1], 'state', 'amount', 'keys', 'gauge', 'created', 'meta',
  'units', 'money')
if hold[1] == false then
  return { 'unknown', 0 }
end
if hold[1] ~= 'open' then
  return { hold[1], 0 }
end

local keys = cjson.decode(hold[3])
local gauge = hold[4] or ''
local expected = #keys + 3 + (gauge ~= '' and 1 or 0)
if #KEYS ~= expected or (gauge ~= '' and KEYS[expected] ~= gauge) then
  return { 'keys_mismatch', 0 }
end
for i = 1, #keys do
  if keys[i] ~= KEYS[i + 3] then return { 'keys_mismatch', 0 } end
end

local amount = tonumber(hold[2])
local units = hold[7] and cjson.decode(hold[7]) or {}
local money = tonumber(hold[8]) or 0
for i = 1, #keys do
  if redis.call('EXISTS', KEYS[i + 3]) == 1 then
    -- 0 - x, not -x: Lua's -0 is sent as "-0", which HINCRBY refuses
    redis.call('HINCRBY', KEYS[i + 3], 'pending', 0 - (units[i] == 1 and money or amount))
  end
end
if gauge ~= '' then
  redis.call('ZREM', gauge, ARGV[1])
end

local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('HSET', KEYS[1], 'state', 'released')
redis.call('EXPIRE', KEYS[1], tombstone_ttl)
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('XADD', KEYS[3], 'MAXLEN', '~', maxlen, '*',
  'request_id', ARGV[1], 'outcome', 'released', 'held', amount, 'actual', 0,
  'created', hold[5], 'ended', now_ms, 'meta', hold[6] or '', 'event', ARGV[3])
return { 'released', amount }
