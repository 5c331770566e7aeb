--[[ settle.lua: end an open hold with the tokens the call actually used.

Purpose
  Move a hold from `pending` to `used` in every counter it was made in (the windows of the
  reserve, even when a new window has begun since), and close the hold. Idempotent: the amount
  comes from the hold record, never from the caller, and a hold that is no longer open is left
  alone, so a retried, late or duplicate settle can never touch another request's hold.

KEYS (one tenant, one hash tag)
  KEYS[1]      hold record    tg:{t<id>}:hold:<request_id>
  KEYS[2]      hold index     tg:{t<id>}:holds
  KEYS[3..]    counters       exactly the hold record's `keys`, in the same order

ARGV
  ARGV[1]  request_id      the index member
  ARGV[2]  actual          tokens the call really used, integer >= 0 (may exceed the hold)
  ARGV[3]  tombstone_ttl   seconds to keep the closed hold record, so a duplicate reserve with
                           this id is refused and a late settle reports the first outcome

Return table
  { outcome, held, charged }
  outcome "settled": held = tokens that were pending, charged = actual added to `used`
  outcome "released" | "swept" | "settled" with held = charged = 0 when the hold had already
          ended that way (no-op); "unknown" when no hold record exists (never made or long gone);
          "keys_mismatch" when KEYS[3..] differ from the hold's counters (caller bug, nothing done)

Counters that have already expired (a settle long after the window) are skipped rather than
recreated without a TTL. Tokens used above the hold are added to the counter's `over` field, so
estimate misses are visible per window.
]]

if #KEYS < 3 or #ARGV ~= 3 then
  return redis.error_reply('settle: expected KEYS = hold, index, counters... and ARGV = request_id, actual, tombstone_ttl')
end
local actual = tonumber(ARGV[2])
local tombstone_ttl = tonumber(ARGV[3])
if not actual or actual < 0 or not tombstone_ttl or tombstone_ttl < 1 then
  return redis.error_reply('settle: actual must be >= 0 and tombstone_ttl >= 1')
end

local hold = redis.call('HMGET', KEYS[1], 'state', 'amount', 'keys')
if hold[1] == false then
  return { 'unknown', 0, 0 }
end
if hold[1] ~= 'open' then
  return { hold[1], 0, 0 }
end

local keys = cjson.decode(hold[3])
if #keys ~= #KEYS - 2 then
  return { 'keys_mismatch', 0, 0 }
end
for i = 1, #keys do
  if keys[i] ~= KEYS[i + 2] then return { 'keys_mismatch', 0, 0 } end
end

local amount = tonumber(hold[2])
for i = 3, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 1 then
    redis.call('HINCRBY', KEYS[i], 'pending', -amount)
    redis.call('HINCRBY', KEYS[i], 'used', actual)
    if actual > amount then
      redis.call('HINCRBY', KEYS[i], 'over', actual - amount)
    end
  end
end

redis.call('HSET', KEYS[1], 'state', 'settled', 'actual', actual)
redis.call('EXPIRE', KEYS[1], tombstone_ttl)
redis.call('ZREM', KEYS[2], ARGV[1])
return { 'settled', amount, actual }
