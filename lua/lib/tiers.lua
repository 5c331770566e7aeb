--[[ lib/tiers.lua: allotment chains, included (not run alone) by reserve, settle, release and
sweep (quotas/scripts.py pastes it where a script says `--#include tiers`).

A chain is a run of counters in a hold's key list: allotment tiers (unit 2) ending with the
tenant's shared pool (unit 3). A call of key k in project p takes from k's allotment first, then
from p's (its part not allotted to its keys), then from the pool; a chain lists only the tiers
the call has. Each tier hash keeps `taken` (every token the scope has taken in the window, held
or used) and `allot` (its allotment); the pool keeps `taken`, `limit` and `credit`. A tier passes
on only what it takes above its allotment: spill(x) = max(0, x - allot). So a tier's `taken`
moving from x to x' changes the next tier's by spill'(x') - spill(x), and the pool's `taken`
always equals the tokens the scopes borrowed. Ending a hold (actual below the hold) gives back to
the pool first, then the project, then the key: exactly where the last tokens were taken from.
When an allotment changes (the reserve passes the new one), the same formula moves what the
scope borrowed: spill_new(x') - spill_old(x).
]]

-- A pool that does not exist yet starts from seed_taken[i] (the reserve passes the tenant
-- counter's used + pending of the same window): what the tenant took in the window before its
-- first allotment is the pool's, so an allotment made mid-window is not lent out twice.

-- The room a chain starting at counter `first` offers: the allotments' unused parts plus what
-- the pool has left (given each tier's new allotment `allots[i]`), and the pool's index.
local function tiers_room(keys, units, allots, pool_limits, first, seed_taken)
  local carry, room, i = 0, 0, first
  while true do
    local key = keys[i]
    if units[i] == 2 then
      local f = redis.call('HMGET', key, 'taken', 'allot')
      local x = tonumber(f[1]) or 0
      local new = allots[i]
      local old = tonumber(f[2]) or new
      local x2 = x + carry
      room = room + math.max(0, new - x2)
      carry = math.max(0, x2 - new) - math.max(0, x - old)
    else  -- 3: the pool ends the chain
      local f = redis.call('HMGET', key, 'taken', 'credit')
      local x = tonumber(f[1])
      if x == nil then x = (seed_taken and seed_taken[i]) or 0 end
      x = x + carry
      return room + math.max(0, pool_limits[i] + (tonumber(f[2]) or 0) - x), i
    end
    i = i + 1
  end
end

-- Move `delta` tokens (negative: give back) into every chain of `keys`; allots[i] (optional)
-- is tier i's allotment now. expire_ats (optional) creates missing tiers with that expiry;
-- without it a missing tier (its window expired) is left alone.
local function tiers_move(keys, units, delta, allots, expire_ats, seed_taken)
  local carry = nil
  for i = 1, #keys do
    local u = units[i]
    if u == 2 or u == 3 then
      if carry == nil then carry = delta end
      local key = keys[i]
      local exists = redis.call('EXISTS', key) == 1
      if exists or expire_ats then
        local f = redis.call('HMGET', key, 'taken', 'allot')
        local x = tonumber(f[1])
        if x == nil then x = (not exists and seed_taken and seed_taken[i]) or 0 end
        local x2 = math.max(0, x + carry)
        if x2 ~= x or not exists then redis.call('HSET', key, 'taken', x2) end
        if not exists then redis.call('EXPIREAT', key, expire_ats[i]) end
        if u == 2 then
          local old = tonumber(f[2])
          local new = (allots and allots[i]) or old or 0
          if old == nil then old = new end
          if old ~= new or not exists then redis.call('HSET', key, 'allot', new) end
          carry = math.max(0, x2 - new) - math.max(0, x - old)
        else
          carry = nil
        end
      elseif u == 3 then
        carry = nil
      end
    end
  end
end
