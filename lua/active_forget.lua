--[[ active_forget.lua: take idle tenants out of one shard of the index of active tenants.

Purpose
  The sweep job (quotas/active.py forget_idle) found these tenants with no open hold and no
  undrained usage event, and last marked long ago. It removes each one only if its score is
  still at or below the cutoff, on this server's clock: a gateway that marked the tenant since
  (active_mark.lua, same shard, same clock) raised its score above the cutoff, and the tenant
  stays. Atomic against marks, so a removal never drops a tenant marked after the check.

KEYS (one hash tag: the shard's `{a<shard>}`)
  KEYS[1]  shard    tg:active:{a<shard>}   zset tenant tag -> ms last marked

ARGV
  ARGV[1]      idle_ms   remove only members last marked at least this long ago (> 0)
  ARGV[2..n]   tenant tags (at least one); job members (`~<job>`) are refused

Return
  { removed, now_ms }  how many members this call removed, and the server's time.
]]

if #KEYS ~= 1 or #ARGV < 2 then
  return redis.error_reply('active_forget: expected KEYS = shard and ARGV = idle_ms, tenant, ...')
end
local idle = tonumber(ARGV[1])
if not idle or idle < 1 then
  return redis.error_reply('active_forget: idle_ms must be >= 1')
end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local cutoff = now_ms - idle
local removed = 0
for i = 2, #ARGV do
  if string.sub(ARGV[i], 1, 1) == '~' then
    return redis.error_reply('active_forget: ' .. ARGV[i] .. ' is a job member, not a tenant')
  end
  local score = redis.call('ZSCORE', KEYS[1], ARGV[i])
  if score and tonumber(score) <= cutoff then
    removed = removed + redis.call('ZREM', KEYS[1], ARGV[i])
  end
end
return { removed, now_ms }
