--[[ queue_leave.lua: take a waiter out of the waiting queue (it timed out, or its client left),
and wake the next head if it was the head.

Purpose
  A queue-policy caller that stops waiting without being admitted removes its entry, so nobody
  waits behind it (lua/reserve.lua takes admitted waiters out itself). Idempotent: a waiter
  already gone (dropped as dead by another caller, or never queued) changes nothing. Works for a
  tenant's queues and a provider key's queue alike (the membership key is optional).

KEYS (one hash tag: the tenant's `{t<id>}` or the provider key's `{p<id>}`)
  KEYS[1]  waiters      ...:waiters        zset waiter id -> expiry ms
  KEYS[2]  queue        ...:wq[:<resource>] zset waiter id -> order: the queue the caller was
                        told it waits in (its last reserve reply)
  KEYS[3]  membership   ...:waiters:in     hash waiter id -> queue key; tenant queues only (a
                        provider key has one queue and no membership hash: 2 keys)
  (The arrival counter is not touched: it is never reset by a leave, see lua/reserve.lua TTLs.)

ARGV
  ARGV[1]  waiter id
  ARGV[2]  lease_ms     the next head must come back within this (its expiry is lowered to it)
  ARGV[3]  channel      pub/sub channel of wakes: {"w": waiters key, "ids": [next head]}

Return
  { removed (1 | 0), woken (1 | 0) }
  Dead entries (past their expiry) found behind a leaving head are dropped on the way to the
  next live one (at most 64 per call), so the wake never goes to a waiter that is gone.
]]

if (#KEYS ~= 2 and #KEYS ~= 3) or #ARGV ~= 3 then
  return redis.error_reply('queue_leave: expected KEYS = waiters, queue, [membership] and ARGV = id, lease_ms, channel')
end
local id, lease = ARGV[1], tonumber(ARGV[2])
if not lease or lease < 1 then
  return redis.error_reply('queue_leave: lease_ms must be >= 1')
end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local function drop(member)
  redis.call('ZREM', KEYS[2], member)
  redis.call('ZREM', KEYS[1], member)
  if #KEYS == 3 then redis.call('HDEL', KEYS[3], member) end
end

local first = redis.call('ZRANGE', KEYS[2], 0, 0)
local removed = redis.call('ZREM', KEYS[2], id)
drop(id)

local woken = 0
if removed == 1 and first[1] == id then
  -- It was the head: the next live one is told at once, and given its lease. Dead entries
  -- before it (no expiry, or past it: their process is gone) are dropped on the way.
  for _ = 1, 64 do
    local nxt = redis.call('ZRANGE', KEYS[2], 0, 0)
    if #nxt == 0 then break end
    local exp = tonumber(redis.call('ZSCORE', KEYS[1], nxt[1]))
    if exp ~= nil and exp >= now_ms then
      redis.call('ZADD', KEYS[1], math.min(exp, now_ms + lease), nxt[1])
      redis.call('PUBLISH', ARGV[3], cjson.encode({ w = KEYS[1], ids = { nxt[1] } }))
      woken = 1
      break
    end
    drop(nxt[1])
  end
end
return { removed, woken }
