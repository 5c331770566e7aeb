--[[ breaker_probe.lua: take a probe slot of an upstream breaker whose cool-down has passed.

Purpose
  Issue 12, part 2 (gateway/circuit.py, lua/breaker_record.lua). A gateway worker that knows a
  breaker open, and sees its open-until passed, asks here before sending a call with that key.
  The first such call after the cool-down turns the breaker half-open; at most `probes` calls get
  a slot (atomically: concurrent workers never get more); their results, recorded by
  breaker_record.lua with the probe flag, close or re-open it. A slot whose result never came
  (its worker died) is freed when the lease ends: `lease_ms` after the breaker half-opened,
  every slot is handed out afresh. A worker that gives a slot up (the call left, or went
  elsewhere before testing the upstream) hands it back at once: breaker_record.lua, probe flag
  with no success and no failure.

KEYS
  KEYS[1]  tg:{p<id>}:brk or tg:{p<id>}:brk:m:<model>   one breaker hash (see breaker_record.lua)

ARGV
  ARGV[1]  probes     slots per half-open period, integer >= 1
  ARGV[2]  lease_ms   how long a slot stays taken without a result, integer >= 1

Return table
  { granted, transition, state, wait_ms, now_ms }
  granted 1: this call may go (state "half_open": as a probe; "closed": as an ordinary call, the
  breaker closed meanwhile), 0: skip the key for now
  transition "half_opened" when this call turned it half-open, else ""
  wait_ms: when refused, how long until a slot may free up (the cool-down's or the lease's end)

TTL: untouched (breaker_record.lua keeps the hash alive past any cool-down).
]]

if #KEYS ~= 1 or #ARGV ~= 2 then
  return redis.error_reply('breaker_probe: expected 1 key and ARGV = probes, lease_ms')
end
local probes, lease_ms = tonumber(ARGV[1]), tonumber(ARGV[2])
if not probes or not lease_ms or probes < 1 or lease_ms < 1 then
  return redis.error_reply('breaker_probe: probes and lease_ms must be >= 1')
end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local f = redis.call('HMGET', KEYS[1], 'state', 'until', 'since', 'taken')
local state = f[1] or 'closed'

if state == 'closed' then
  return { 1, '', 'closed', 0, now }
end
if state == 'open' then
  local until_ms = tonumber(f[2]) or 0
  if now < until_ms then
    return { 0, '', 'open', until_ms - now, now }
  end
  redis.call('HSET', KEYS[1], 'state', 'half_open', 'since', now, 'taken', 1, 'ok', 0, 'until', 0)
  redis.call('HINCRBY', KEYS[1], 'half_opened', 1)
  return { 1, 'half_opened', 'half_open', 0, now }
end

-- half_open
local since, taken = tonumber(f[3]) or now, tonumber(f[4]) or 0
if now - since >= lease_ms then
  -- The slots handed out a lease ago never reported: hand them out again.
  since, taken = now, 0
  redis.call('HSET', KEYS[1], 'since', now, 'ok', 0)
end
if taken < probes then
  redis.call('HSET', KEYS[1], 'taken', taken + 1)
  return { 1, '', 'half_open', 0, now }
end
return { 0, '', 'half_open', math.max(1, since + lease_ms - now), now }
