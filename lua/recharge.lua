--[[ recharge.lua: add tokens (credit) to one scope's counter for the current window.

Purpose
  An operator tops a tenant (or project, key, model scope) up for today or this month without
  changing its plan: reserve admits while used + pending + amount <= limit + credit. Credit
  belongs to one window and goes away with it.

KEYS
  KEYS[1]  counter   tg:{t<id>}:q:<scope>:<window>
  KEYS[2]  optional: the tenant's shared pool of the same window, tg:{t<id>}:pool:<window>
           (a tenant with allotments, lua/lib/tiers.lua): it gets the same credit, so the
           top-up can be lent to every scope rather than sit behind the allotments

ARGV
  ARGV[1]  tokens        integer >= 1 to add to `credit`
  ARGV[2]  limit         the scope's current limit (-1 unlimited), stored for display like reserve
  ARGV[3]  window_start  ms, Redis clock, inclusive
  ARGV[4]  window_end    ms, exclusive
  ARGV[5]  expire_at     unix seconds; set only when this call creates the counter

Return table
  { 1, credit, remaining, now_ms }  remaining = limit + credit - used - pending (-1 unlimited)
  { -1, 0, 0, now_ms }              the Redis clock is outside the window: resync and retry
]]

if (#KEYS ~= 1 and #KEYS ~= 2) or #ARGV ~= 5 then
  return redis.error_reply('recharge: expected 1 key (2 with the pool) and ARGV = tokens, limit, window_start, window_end, expire_at')
end
local tokens = tonumber(ARGV[1])
local limit = tonumber(ARGV[2])
if not tokens or tokens < 1 or not limit or limit < -1 then
  return redis.error_reply('recharge: tokens must be >= 1 and limit >= -1')
end

local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if now_ms < tonumber(ARGV[3]) or now_ms >= tonumber(ARGV[4]) then
  return { -1, 0, 0, now_ms }
end

local key = KEYS[1]
if redis.call('EXISTS', key) == 0 then
  redis.call('HSET', key, 'used', 0, 'pending', 0)
  redis.call('EXPIREAT', key, tonumber(ARGV[5]))
end
redis.call('HSET', key, 'limit', limit)
local credit = redis.call('HINCRBY', key, 'credit', tokens)
if #KEYS == 2 then
  if redis.call('EXISTS', KEYS[2]) == 0 then
    -- a new pool starts from what the tenant took in the window (lua/lib/tiers.lua)
    local u = redis.call('HMGET', key, 'used', 'pending')
    redis.call('HSET', KEYS[2], 'taken', (tonumber(u[1]) or 0) + (tonumber(u[2]) or 0))
    redis.call('EXPIREAT', KEYS[2], tonumber(ARGV[5]))
  end
  redis.call('HINCRBY', KEYS[2], 'credit', tokens)
end
if limit < 0 then
  return { 1, credit, -1, now_ms }
end
local f = redis.call('HMGET', key, 'used', 'pending')
return { 1, credit, limit + credit - tonumber(f[1]) - tonumber(f[2]), now_ms }
