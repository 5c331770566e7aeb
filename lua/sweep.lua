--[[ sweep.lua: end a bounded batch of a tenant's stale holds (older than a cutoff), charging
what each hold knows about how far its call got.

Purpose
  A gateway process that dies mid-request never settles nor releases its hold. The sweep ends
  such holds, one batch per call, measuring age on the Redis clock, frees their concurrency
  slots and appends one usage event (outcome "swept") per hold. Safe on several workers at once:
  a hold is swept only while still open, so each ends exactly once.

  What is charged (moved from `pending` to `used`) depends on the hold's phase
  (lua/progress.lua):
    reserved   0: the call never reached the upstream
    forwarded  the whole hold: a non-streamed call that reached the upstream may have produced
               up to its cap (input = the stored estimate, output = the rest)
    streaming  the input estimate plus the last checkpoint of output tokens delivered,
               never more than the hold
  Money counters get the same tokens at the hold's prices (pin / pout, micro-dollars per
  million, rounded half up once, as the ledger does). The swept hold keeps what was charged
  (`charged`, `charged_money`), so a settle that arrives later corrects it by the difference,
  once (lua/settle.lua, lua/release.lua).

KEYS (one tenant, one hash tag)
  KEYS[1]            hold index     tg:{t<id>}:holds
  KEYS[2]            usage stream   tg:{t<id>}:usage
  KEYS[3..H+2]       hold records   tg:{t<id>}:hold:<request_id>, one per ARGV request id
  KEYS[H+3..]        every counter and gauge key named in those holds (any order)

ARGV
  ARGV[1]            stale_ms       a hold is stale when created <= now_ms - stale_ms
  ARGV[2]            H              number of holds in this batch (bounded by the caller)
  ARGV[3]            tombstone_ttl  seconds to keep a swept hold record (a late settle needs it)
  ARGV[4..H+3]       request ids, in the order of KEYS[3..H+2]
  ARGV[H+4]          wake channel, optional: then the LAST key is the tenant's waiters key, and
                     when a hold was swept and it exists, PUBLISH channel {"w": waiters key}

Return table
  { swept, dropped, fresh, now_ms, id_1, amount_1, charged_1, basis_1, id_2, ... }
  swept    holds ended by this call; their ids, held tokens, charged tokens and phase follow
  dropped  index entries whose hold had already ended or vanished (removed from the index)
  fresh    holds not yet stale, or whose keys were not all passed (left untouched)

Usage event: request_id, outcome "swept", held, actual (= tokens charged), in, out, money
(micro-dollars charged), basis (the phase), created, ended, meta, event ({"pk": provider key id}
when a checkpoint recorded the upstream, else ""). The stream is never
trimmed here: only the ledger drain deletes events, after committing them.
]]

--#include tiers

if #KEYS < 2 or #ARGV < 3 then
  return redis.error_reply('sweep: expected KEYS = index, stream, holds..., keys... and ARGV = stale_ms, H, tombstone_ttl, ids...')
end
local stale_ms = tonumber(ARGV[1])
local h = tonumber(ARGV[2])
local tombstone_ttl = tonumber(ARGV[3])
if not stale_ms or stale_ms < 0 or not h or h < 0 or (#ARGV ~= 3 + h and #ARGV ~= 4 + h)
  or #KEYS < 2 + h + (#ARGV == 4 + h and 1 or 0)
  or not tombstone_ttl or tombstone_ttl < 1 then
  return redis.error_reply('sweep: bad arguments (stale_ms >= 0, H ids and H hold keys, tombstone_ttl >= 1)')
end

local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local cutoff = now_ms - stale_ms

local passed = {}
for i = h + 3, #KEYS do passed[KEYS[i]] = true end

local swept, dropped, fresh = 0, 0, 0
local ended = {}
for i = 1, h do
  local hold_key = KEYS[i + 2]
  local request_id = ARGV[i + 3]
  local hold = redis.call('HMGET', hold_key, 'state', 'created', 'amount', 'keys', 'gauge', 'meta',
    'units', 'money', 'phase', 'progress', 'input', 'pin', 'pout', 'pk')
  if hold[1] ~= 'open' then  -- ended, or expired (false)
    redis.call('ZREM', KEYS[1], request_id)
    dropped = dropped + 1
  elseif tonumber(hold[2]) > cutoff then
    fresh = fresh + 1
  else
    local keys = cjson.decode(hold[4])
    local gauge = hold[5] or ''
    local complete = gauge == '' or passed[gauge]
    for j = 1, #keys do
      if not passed[keys[j]] then complete = false end
    end
    if not complete then
      fresh = fresh + 1
    else
      local amount = tonumber(hold[3])
      local units = hold[7] and cjson.decode(hold[7]) or {}
      local money = tonumber(hold[8]) or 0
      -- Holds made before phases existed have none: they are charged nothing, as before.
      local phase = hold[9] or 'reserved'
      local input = math.min(tonumber(hold[11]) or 0, amount)
      local charge_in, charge_out = 0, 0
      if phase == 'forwarded' then
        charge_in, charge_out = input, amount - input
      elseif phase == 'streaming' then
        charge_in = input
        charge_out = math.min(tonumber(hold[10]) or 0, amount - input)
      end
      local charged = charge_in + charge_out
      local pin, pout = tonumber(hold[12]) or 0, tonumber(hold[13]) or 0
      -- Exact in a double while the product stays below 2^53 (9e15): tokens * price per
      -- million, i.e. far beyond any real call.
      local charged_money = math.floor((charge_in * pin + charge_out * pout + 500000) / 1000000)
      tiers_move(keys, units, charged - amount)  -- allotment chains (lua/lib/tiers.lua)
      for j = 1, #keys do
        if (units[j] or 0) < 2 and redis.call('EXISTS', keys[j]) == 1 then
          local held, used = amount, charged
          if units[j] == 1 then held, used = money, charged_money end
          redis.call('HINCRBY', keys[j], 'pending', 0 - held)
          if used > 0 then redis.call('HINCRBY', keys[j], 'used', used) end
        end
      end
      if gauge ~= '' then
        redis.call('ZREM', gauge, request_id)
      end
      redis.call('HSET', hold_key, 'state', 'swept', 'charged', charged,
        'charged_money', charged_money, 'charged_in', charge_in, 'charged_out', charge_out)
      redis.call('EXPIRE', hold_key, tombstone_ttl)
      redis.call('ZREM', KEYS[1], request_id)
      redis.call('XADD', KEYS[2], '*',
        'request_id', request_id, 'outcome', 'swept', 'held', amount, 'actual', charged,
        'in', charge_in, 'out', charge_out, 'money', charged_money, 'basis', phase,
        'created', hold[2], 'ended', now_ms, 'meta', hold[6] or '',
        'event', hold[14] and cjson.encode({ pk = tonumber(hold[14]) }) or '')
      swept = swept + 1
      ended[#ended + 1] = request_id
      ended[#ended + 1] = amount
      ended[#ended + 1] = charged
      ended[#ended + 1] = phase
    end
  end
end

if swept > 0 and #ARGV == 4 + h and redis.call('EXISTS', KEYS[#KEYS]) == 1 then
  redis.call('PUBLISH', ARGV[4 + h], cjson.encode({ w = KEYS[#KEYS] }))
end

local out = { swept, dropped, fresh, now_ms }
for i = 1, #ended do out[#out + 1] = ended[i] end
return out
