--[[ rebuild.lua: after Redis lost a tenant's data, restore the current windows' counters from
the ledger's figures and set the tenant's epoch marker, in one atomic step.

Purpose
  The reserve script refuses while the epoch marker is missing (lua/reserve.lua, code -5), so
  no call is admitted on an empty counter. The rebuild passes, for every counter of the current
  windows that the ledger (plus the undrained usage events) has figures for, the `used` it must
  have; the script never lowers a counter that exists (calls may have settled into it since the
  loss): used = max(existing used, figure). Missing counters are created with their window's
  expiry. Then the epoch is set and admission resumes. Holds that were open when the data was
  lost are gone; their settles are recorded as orphans (lua/settle.lua).

KEYS (one tenant, one hash tag)
  KEYS[1]        epoch marker   tg:{t<id>}:epoch
  KEYS[2..N+1]   counters       tg:{t<id>}:q:<scope>:<window>

ARGV
  ARGV[1]  N        number of counters, >= 0
  ARGV[2]  epoch    the marker's value (opaque: when and by whom it was rebuilt)
  then for counter i, four values:  used (integer >= 0, tokens or micro-dollars; for an
                                    allotment tier or the pool: its `taken`),
                                    limit (-1 unlimited, stored for readers; a tier's allotment),
                                    expire_at (unix s, the counter's expiry),
                                    unit (0 tokens, 1 micro-dollars, 2 allotment tier, 3 pool:
                                    lua/lib/tiers.lua; tiers keep `taken` and `allot`)

Return table
  { raised, now_ms }   raised = counters whose `used` this call set or raised

TTLs: counters get their window's expire_at when created here (never refreshed); the epoch
has no TTL.
]]

local n = tonumber(ARGV[1])
if not n or n < 0 or #KEYS ~= n + 1 or #ARGV ~= 2 + 4 * n then
  return redis.error_reply('rebuild: expected KEYS = epoch, N counters; ARGV = N, epoch, 4N values')
end

local raised = 0
for i = 1, n do
  local key = KEYS[i + 1]
  local base = 2 + 4 * (i - 1)
  local used, limit, expire_at, unit = tonumber(ARGV[base + 1]), tonumber(ARGV[base + 2]),
    tonumber(ARGV[base + 3]), tonumber(ARGV[base + 4])
  if not used or used < 0 or not limit or not expire_at or not unit then
    return redis.error_reply('rebuild: used >= 0, limit, expire_at and unit must be integers')
  end
  local field = unit >= 2 and 'taken' or 'used'
  if redis.call('EXISTS', key) == 0 then
    if unit == 2 then
      redis.call('HSET', key, 'taken', used, 'allot', limit)
    elseif unit == 3 then
      redis.call('HSET', key, 'taken', used, 'limit', limit)
    else
      redis.call('HSET', key, 'used', used, 'pending', 0, 'limit', limit)
    end
    redis.call('EXPIREAT', key, expire_at)
    raised = raised + 1
  elseif (tonumber(redis.call('HGET', key, field)) or 0) < used then
    redis.call('HSET', key, field, used)
    raised = raised + 1
  end
end
redis.call('SET', KEYS[1], ARGV[2])

local t = redis.call('TIME')
return { raised, tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) }
