--[[ sweep.lua: release a bounded batch of a tenant's stale holds (older than a cutoff).

Purpose
  A gateway process that dies mid-request never settles nor releases its hold. The sweep ends
  such holds, one batch per call, measuring age on the Redis clock, frees their concurrency
  slots and appends one usage event (outcome "swept") per hold. Safe on several workers at once:
  a hold is swept only while still open, so each ends exactly once.

KEYS (one tenant, one hash tag)
  KEYS[1]            hold index     tg:{t<id>}:holds
  KEYS[2]            usage stream   tg:{t<id>}:usage
  KEYS[3..H+2]       hold records   tg:{t<id>}:hold:<request_id>, one per ARGV request id
  KEYS[H+3..]        every counter and gauge key named in those holds (any order)

ARGV
  ARGV[1]            stale_ms       a hold is stale when created <= now_ms - stale_ms
  ARGV[2]            H              number of holds in this batch (bounded by the caller)
  ARGV[3]            tombstone_ttl  seconds to keep a swept hold record
  ARGV[4]            stream_maxlen  approximate cap of the usage stream
  ARGV[5..H+4]       request ids, in the order of KEYS[3..H+2]

Return table
  { swept, dropped, fresh, now_ms, id_1, amount_1, id_2, amount_2, ... }
  swept    holds released by this call; their ids and amounts follow
  dropped  index entries whose hold had already ended or vanished (removed from the index)
  fresh    holds not yet stale, or whose keys were not all passed (left untouched)
]]

if #KEYS < 2 or #ARGV < 4 then
  return redis.error_reply('sweep: expected KEYS = index, stream, holds..., keys... and ARGV = stale_ms, H, tombstone_ttl, maxlen, ids...')
end
local stale_ms = tonumber(ARGV[1])
local h = tonumber(ARGV[2])
local tombstone_ttl = tonumber(ARGV[3])
local maxlen = tonumber(ARGV[4])
if not stale_ms or stale_ms < 0 or not h or h < 0 or #ARGV ~= 4 + h or #KEYS < 2 + h
  or not tombstone_ttl or tombstone_ttl < 1 or not maxlen or maxlen < 1 then
  return redis.error_reply('sweep: bad arguments (stale_ms >= 0, H ids and H hold keys, tombstone_ttl and maxlen >= 1)')
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
  local request_id = ARGV[i + 4]
  local hold = redis.call('HMGET', hold_key, 'state', 'created', 'amount', 'keys', 'gauge', 'meta',
    'units', 'money')
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
      for j = 1, #keys do
        if redis.call('EXISTS', keys[j]) == 1 then
          redis.call('HINCRBY', keys[j], 'pending', 0 - (units[j] == 1 and money or amount))
        end
      end
      if gauge ~= '' then
        redis.call('ZREM', gauge, request_id)
      end
      redis.call('HSET', hold_key, 'state', 'swept')
      redis.call('EXPIRE', hold_key, tombstone_ttl)
      redis.call('ZREM', KEYS[1], request_id)
      redis.call('XADD', KEYS[2], 'MAXLEN', '~', maxlen, '*',
        'request_id', request_id, 'outcome', 'swept', 'held', amount, 'actual', 0,
        'created', hold[2], 'ended', now_ms, 'meta', hold[6] or '', 'event', '')
      swept = swept + 1
      ended[#ended + 1] = request_id
      ended[#ended + 1] = amount
    end
  end
end

local out = { swept, dropped, fresh, now_ms }
for i = 1, #ended do out[#out + 1] = ended[i] end
return out
