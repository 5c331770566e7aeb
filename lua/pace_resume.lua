--[[ pace_resume.lua: lift a burn-rate breaker's trip early (a person's "Resume", quotas/pace.py).

Undoes what lua/pace_trip.lua closed: the counters of periods still to come lose their credit,
and the current period's counter gets credit = used + pending, so the scope has a whole period's
share again from now (it trips again if the runaway goes on). The record keeps the trip, marked
resumed (its until becomes now), so the alert of the trip still fires exactly once.

KEYS (all of one tenant, sharing its hash tag `{t<id>}`)
  KEYS[1]        trips hash   tg:{t<id>}:pace:trips
  KEYS[2..N+1]   the record's counter keys, in its order (the caller read them from the record)

ARGV
  ARGV[1]  scope     the trips hash field
  ARGV[2]  tripped   the trip's tripped ms, as read: a newer trip of the scope is not lifted
  ARGV[3]  by        who lifted it (stored in the record)

Return: { 1, now_ms }   lifted
        { 0, now_ms }   no such active trip (ended, already lifted, or a newer one)
        { -1, now_ms }  KEYS do not match the record's counters (nothing written)
]]

local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local raw = redis.call('HGET', KEYS[1], ARGV[1])
if not raw then return { 0, now_ms } end
local rec = cjson.decode(raw)
if rec['tripped'] ~= ARGV[2] or rec['resumed'] or tonumber(rec['until']) <= now_ms then
  return { 0, now_ms }
end
if #rec['keys'] ~= #KEYS - 1 then return { -1, now_ms } end
for i, key in ipairs(rec['keys']) do
  if KEYS[i + 1] ~= key then return { -1, now_ms } end
end

for i, key in ipairs(rec['keys']) do
  local start_ms, end_ms = tonumber(rec['starts'][i]), tonumber(rec['ends'][i])
  if now_ms < end_ms and redis.call('EXISTS', key) == 1 then
    if now_ms >= start_ms then
      local f = redis.call('HMGET', key, 'used', 'pending')
      redis.call('HSET', key, 'credit', (tonumber(f[1]) or 0) + (tonumber(f[2]) or 0))
    else
      redis.call('HDEL', key, 'credit')
    end
  end
end

rec['resumed'] = string.format('%.0f', now_ms)
rec['until'] = rec['resumed']
rec['by'] = ARGV[3]
redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(rec))
return { 1, now_ms }
