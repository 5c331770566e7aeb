--[[ active_mark.lua: record that tenants have something for the background jobs to do.

Purpose
  A gateway worker remembers the tenants it reserved, settled or released for and flushes them
  here about once a second, one call per shard of the index (quotas/active.py). The drain, the
  sweep and the alert detectors then visit only the tenants of the index (plus a slow full walk
  as a backstop). The score is this server's clock, so it compares with active_forget.lua's
  cutoff on the same clock whatever the callers' clocks say.

KEYS (one hash tag: the shard's `{a<shard>}`)
  KEYS[1]  shard    tg:active:{a<shard>}   zset tenant tag -> ms last marked

ARGV
  ARGV[1..n]  tenant tags (at least one)

Return
  { now_ms }  the score given. A member's score only ever rises (a late flush of an older mark
  never lowers it). No TTL: members leave through active_forget.lua only.
]]

if #KEYS ~= 1 or #ARGV < 1 then
  return redis.error_reply('active_mark: expected KEYS = shard and ARGV = tenant, ...')
end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
for i = 1, #ARGV do
  local old = redis.call('ZSCORE', KEYS[1], ARGV[i])
  if not old or tonumber(old) < now_ms then
    redis.call('ZADD', KEYS[1], now_ms, ARGV[i])
  end
end
return { now_ms }
