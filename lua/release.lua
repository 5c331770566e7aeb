--[[ release.lua: end a hold without charging anything (the upstream produced nothing), and
append its usage event, in one atomic step.

Purpose
  Remove a hold's amount from `pending` in every counter it was made in, free its concurrency
  slot, close the hold and append one usage event with outcome "released". Idempotent: the
  amount comes from the hold record, never from the caller; a hold already settled, released or
  corrected is left alone, so a retried release cannot free another request's hold. Two late
  cases, as in lua/settle.lua:
    - the hold was SWEPT and charged (`charged`, `charged_money`): the upstream produced
      nothing after all, so the charge is taken back from `used` of the counters that still
      exist, the hold becomes "corrected" and one "corrected" event (actual 0) is appended. Once.
    - there is NO record (Redis lost it): nothing to give back; the event is appended with
      orphan=1 (the ledger gets its row) and a tombstone makes a retry a no-op.

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
  ARGV[4]  fallback        JSON object, read only when the record is gone: {"units": [...],
                           "amount": tokens held, "created": ms, "meta": reserve's meta}
  ARGV[5]  wake channel    optional: then the LAST key is the tenant's waiters key, and when it
                           exists the freed capacity is announced (see lua/settle.lua)

Return table
  { outcome, released, held }
  "released":  released = tokens removed from `pending`, held = the hold's tokens
  "corrected": the hold had been swept; released = the tokens taken back from `used`,
               held = the hold's tokens (>= 1: this call made the correction)
  "settled" | "released" | "corrected" with 0, 0: it had already ended (no-op, no event)
  "keys_mismatch": KEYS differ from the hold's (no-op)

Usage event fields: request_id, outcome ("released" | "corrected"), held, actual (0), money (0),
created, ended, meta, event; "corrected" adds swept and swept_money; a lost record orphan=1.
The stream is never trimmed here. Expired counters are skipped, never recreated. Allotment
chains (units 2 and 3, lua/lib/tiers.lua) give back the hold (the sweep's charge, if swept).
]]

--#include tiers

if #KEYS < 4 or (#ARGV ~= 4 and #ARGV ~= 5) or (#ARGV == 5 and #KEYS < 5) then
  return redis.error_reply('release: expected KEYS = hold, index, stream, counters..., [gauge], [waiters] and 4 ARGV (5 with the waiters key)')
end
local nkeys = #ARGV == 5 and #KEYS - 1 or #KEYS
local function wake()
  if #ARGV == 5 and redis.call('EXISTS', KEYS[#KEYS]) == 1 then
    redis.call('PUBLISH', ARGV[5], cjson.encode({ w = KEYS[#KEYS] }))
  end
end
local tombstone_ttl = tonumber(ARGV[2])
if not tombstone_ttl or tombstone_ttl < 1 then
  return redis.error_reply('release: tombstone_ttl must be >= 1')
end

local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local hold = redis.call('HMGET', KEYS[1], 'state', 'amount', 'keys', 'gauge', 'created', 'meta',
  'units', 'money', 'charged', 'charged_money')
local state = hold[1]

if state == false then
  local known = cjson.decode(ARGV[4])
  if nkeys > #known.units + 3 then
    redis.call('ZREM', KEYS[nkeys], ARGV[1])
    wake()
  end
  redis.call('HSET', KEYS[1], 'state', 'released', 'orphan', 1)
  redis.call('EXPIRE', KEYS[1], tombstone_ttl)
  redis.call('XADD', KEYS[3], '*',
    'request_id', ARGV[1], 'outcome', 'released', 'held', known.amount, 'actual', 0,
    'money', 0, 'created', known.created, 'ended', now_ms, 'meta', known.meta,
    'event', ARGV[3], 'orphan', 1)
  return { 'released', 0, tonumber(known.amount) }
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
  tiers_move(keys, units, 0 - swept)
  for i = 1, #keys do
    local back = units[i] == 1 and swept_money or swept
    if (units[i] or 0) < 2 and back > 0 and redis.call('EXISTS', KEYS[i + 3]) == 1 then
      redis.call('HINCRBY', KEYS[i + 3], 'used', 0 - back)
    end
  end
  redis.call('HSET', KEYS[1], 'state', 'corrected', 'actual', 0)
  redis.call('EXPIRE', KEYS[1], tombstone_ttl)
  redis.call('XADD', KEYS[3], '*',
    'request_id', ARGV[1], 'outcome', 'corrected', 'held', amount, 'actual', 0, 'money', 0,
    'swept', swept, 'swept_money', swept_money,
    'created', hold[5], 'ended', now_ms, 'meta', hold[6] or '', 'event', ARGV[3])
  if swept > 0 then wake() end
  return { 'corrected', swept, amount }
end

tiers_move(keys, units, 0 - amount)
for i = 1, #keys do
  if (units[i] or 0) < 2 and redis.call('EXISTS', KEYS[i + 3]) == 1 then
    -- 0 - x, not -x: Lua's -0 is sent as "-0", which HINCRBY refuses
    redis.call('HINCRBY', KEYS[i + 3], 'pending', 0 - (units[i] == 1 and money or amount))
  end
end
if gauge ~= '' then
  redis.call('ZREM', gauge, ARGV[1])
end

redis.call('HSET', KEYS[1], 'state', 'released')
redis.call('EXPIRE', KEYS[1], tombstone_ttl)
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('XADD', KEYS[3], '*',
  'request_id', ARGV[1], 'outcome', 'released', 'held', amount, 'actual', 0, 'money', 0,
  'created', hold[5], 'ended', now_ms, 'meta', hold[6] or '', 'event', ARGV[3])
wake()
return { 'released', amount, amount }
