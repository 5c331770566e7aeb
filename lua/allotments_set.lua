--[[ allotments_set.lua: give a tenant's allotment tiers of one window their allotments now,
moving what each scope took above a lowered (or removed) allotment into the next tier and the
shared pool at once, in one atomic step (lua/lib/tiers.lua describes the tiers).

Purpose
  Reserve updates a tier's allotment only when a call goes through that tier. An allotment that
  is lowered, removed or freed by a revoked key would meanwhile stay lent: the pool grows for
  everybody at once while what the scope took above its new allotment is not yet in the pool.
  The services run this after every change of allotments (quotas/allotments.py
  apply_allotments): every tier of the window gets its allotment, children before parents, and
  the change in what each passes on, spill_new(x') - spill_old(x), goes to its parent.
  Idempotent: run again, nothing moves.

KEYS (one tenant, one hash tag)
  KEYS[1]          the window's pool      tg:{t<id>}:pool:<window>
  KEYS[2..M+1]     its tiers              tg:{t<id>}:al:<scope>:<window>, keys before projects

ARGV
  ARGV[1]  M          number of tiers, >= 0
  ARGV[2]  drop_pool  1: the tenant has no allotment left in the window: after the moves the pool
                      is deleted (a later first allotment seeds a new pool from the tenant
                      counter, lua/reserve.lua)
  then for tier i, two values: allotment (>= 0; 0 for a scope that no longer has one),
                               parent (0: the pool, else the index j > i of its project's tier)

Return table
  { moved }   tokens added to (negative: taken from) the pool's `taken`

A missing tier (nothing taken in the window) is not created; what its children pass on goes
through it to its parent. Nothing is created, so no TTL is set here.
]]

local m = tonumber(ARGV[1])
if not m or m < 0 or #KEYS ~= m + 1 or #ARGV ~= 2 + 2 * m then
  return redis.error_reply('allotments_set: expected KEYS = pool, M tiers; ARGV = M, drop_pool, 2M values')
end

local exists, xs, olds, news, parents, add = {}, {}, {}, {}, {}, {}
for i = 1, m do
  local f = redis.call('HMGET', KEYS[i + 1], 'taken', 'allot')
  exists[i] = f[1] ~= false
  xs[i] = tonumber(f[1]) or 0
  news[i] = tonumber(ARGV[1 + 2 * i])
  olds[i] = tonumber(f[2]) or news[i]
  parents[i] = tonumber(ARGV[2 + 2 * i])
  if not news[i] or news[i] < 0 or not parents[i] or (parents[i] ~= 0 and parents[i] <= i) or parents[i] > m then
    return redis.error_reply('allotments_set: allotment >= 0 and parent 0 or a later tier')
  end
  add[i] = 0
end

local moved = 0
for i = 1, m do
  local d = add[i]
  if exists[i] then
    local x_new = math.max(0, xs[i] + add[i])
    d = math.max(0, x_new - news[i]) - math.max(0, xs[i] - olds[i])
    if x_new ~= xs[i] then redis.call('HSET', KEYS[i + 1], 'taken', x_new) end
    if news[i] ~= olds[i] then redis.call('HSET', KEYS[i + 1], 'allot', news[i]) end
  end
  if parents[i] == 0 then moved = moved + d else add[parents[i]] = add[parents[i]] + d end
end

if redis.call('EXISTS', KEYS[1]) == 1 then
  if ARGV[2] == '1' then
    redis.call('DEL', KEYS[1])
  elseif moved ~= 0 then
    local x = tonumber(redis.call('HGET', KEYS[1], 'taken')) or 0
    redis.call('HSET', KEYS[1], 'taken', math.max(0, x + moved))
  end
end
return { moved }
