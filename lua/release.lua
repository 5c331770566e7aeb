--[[ release.lua: end an open hold without charging anything (the upstream produced nothing).

Purpose
  Remove a hold's amount from `pending` in every counter it was made in and close the hold.
  Idempotent: the amount comes from the hold record, never from the caller; a hold already
  settled, released or swept is left alone, so a retried release cannot free another hold.

KEYS (one tenant, one hash tag)
  KEYS[1]      hold record    tg:{t<id>}:hold:<request_id>
  KEYS[2]      hold index     tg:{t<id>}:holds
  KEYS[3..]    counters       exactly the hold record's `keys`, in the same order

ARGV
  ARGV[1]  request_id      the index member
  ARGV[2]  tombstone_ttl   seconds to keep the closed hold record

Return table
  { outcome, released }
  outcome "released": released = tokens removed from `pending`
  outcome "settled" | "swept" | "released" with released = 0: it had already ended (no-op);
          "unknown": no hold record; "keys_mismatch": KEYS[3..] differ from the hold's (no-op)

Expired counters are skipped, never recreated.
]]

if #KEYS < 3 or #ARGV ~= 2 then
  return redis.error_reply('release: expected KEYS = hold, index, counters... and ARGV = request_id, tombstone_ttl')
end
local tombstone_ttl = tonumber(ARGV[2])
if not tombstone_ttl or tombstone_ttl < 1 then
  return redis.error_reply('release: tombstone_ttl must be >= 1')
end

local hold = redis.call('HMGET', KEYS[1], 'state', 'amount', 'keys')
if hold[1] == false then
  return { 'unknown', 0 }
end
if hold[1] ~= 'open' then
  return { hold[1], 0 }
end

local keys = cjson.decode(hold[3])
if #keys ~= #KEYS - 2 then
  return { 'keys_mismatch', 0 }
end
for i = 1, #keys do
  if keys[i] ~= KEYS[i + 2] then return { 'keys_mismatch', 0 } end
end

local amount = tonumber(hold[2])
for i = 3, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 1 then
    redis.call('HINCRBY', KEYS[i], 'pending', -amount)
  end
end

redis.call('HSET', KEYS[1], 'state', 'released')
redis.call('EXPIRE', KEYS[1], tombstone_ttl)
redis.call('ZREM', KEYS[2], ARGV[1])
return { 'released', amount }
