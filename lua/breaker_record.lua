--[[ breaker_record.lua: count call outcomes against an upstream provider key's circuit breakers,
and open, close or re-open them.

Purpose
  Issue 12, part 2 (gateway/circuit.py). Each provider key has a breaker of its own (transport
  failures: connect errors, resets, timeouts) and one per model it served (5xx answers). Both
  live in the key's slot. A gateway worker counts successes in process and flushes them here in
  batches (about once a second per key and model); it records a failure at once, with the
  successes it had not flushed yet. Client errors (4xx) are counted by neither.

  closed     calls and errors are counted in a fixed window of window_ms (the first record after
             it ends starts a new one); when calls >= min_calls and
             errors * 100 >= error_percent * calls, the breaker opens until now + cooldown_ms.
  open       records of calls (which started before it opened) are ignored; after the cool-down
             lua/breaker_probe.lua turns it half-open and hands out probe slots.
  half_open  only probe results count: a failed probe re-opens it for another cool-down; the
             `probes`-th successful probe closes it (a new, empty window); a probe record with
             no success and no failure hands its slot back (taken - 1) and counts for nothing.

KEYS
  KEYS[1]  tg:{p<id>}:brk            the key's breaker (transport failures)
  KEYS[2]  tg:{p<id>}:brk:m:<model>  the (key, model) breaker (5xx answers)
  KEYS[3]  tg:{p<id>}:brk:models     set of the models with a breaker hash (admin, /metrics)
  Breaker hash: {state, win, calls, errors, until, since, taken, ok, opened, half_opened, closed}
  (opened / half_opened / closed: transitions so far, for /metrics).

ARGV
  ARGV[1]   model         the model's name (added to KEYS[3])
  ARGV[2]   key_ok        successes for the key's breaker, integer >= 0
  ARGV[3]   key_failed    failures for the key's breaker, integer >= 0
  ARGV[4]   key_probe     1: these are the result of a probe holding one of its slots, else 0;
                          with key_ok = key_failed = 0: no result, the slot is handed back
  ARGV[5]   model_ok      ARGV[6] model_failed   ARGV[7] model_probe: the same for KEYS[2]
  ARGV[8]   window_ms     ARGV[9] min_calls      ARGV[10] error_percent (1-100)
  ARGV[11]  cooldown_ms   ARGV[12] probes (successful probes that close a half-open breaker)

Return table
  { now_ms, <key breaker>, <model breaker> }, each breaker as 5 items:
  transition ("" | "opened" | "closed"), state ("closed" | "open" | "half_open"),
  until_ms (open: when it may half-open; else 0), calls, errors (of the current window, or of
  the window that opened it)

TTL: each hash and the set live one day after their last record, or twice the cool-down plus
the window if that is longer (an idle closed breaker with an expired window is no breaker).
]]

if #KEYS ~= 3 or #ARGV ~= 12 then
  return redis.error_reply('breaker_record: expected 3 keys and 12 arguments')
end
local n = {}
for i = 2, 12 do
  n[i] = tonumber(ARGV[i])
  if not n[i] or n[i] < 0 or n[i] ~= math.floor(n[i]) then
    return redis.error_reply('breaker_record: ARGV[' .. i .. '] must be an integer >= 0')
  end
end
local window_ms, min_calls, error_percent, cooldown_ms, probes = n[8], n[9], n[10], n[11], n[12]
if window_ms < 1 or min_calls < 1 or error_percent < 1 or error_percent > 100
    or cooldown_ms < 1 or probes < 1 then
  return redis.error_reply('breaker_record: window, min_calls, cooldown and probes must be >= 1, error_percent 1-100')
end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = math.max(86400000, 2 * cooldown_ms + window_ms)

local function open(key, calls, errors)
  redis.call('HSET', key, 'state', 'open', 'until', now + cooldown_ms, 'since', now,
             'calls', calls, 'errors', errors, 'taken', 0, 'ok', 0)
  redis.call('HINCRBY', key, 'opened', 1)
end

local function record(key, ok, failed, probe)
  local f = redis.call('HMGET', key, 'state', 'win', 'calls', 'errors', 'until')
  local state = f[1] or 'closed'
  local calls, errors = tonumber(f[3]) or 0, tonumber(f[4]) or 0
  local transition = ''
  if probe == 1 then
    if state == 'half_open' then
      if failed > 0 then
        open(key, 1, 1)
        calls, errors, transition = 1, 1, 'opened'
      elseif ok == 0 then
        -- No result (the call never reached this breaker's test, or was given up): the slot
        -- is handed back at once rather than a lease later.
        if (tonumber(redis.call('HGET', key, 'taken')) or 0) > 0 then
          redis.call('HINCRBY', key, 'taken', -1)
        end
      elseif redis.call('HINCRBY', key, 'ok', 1) >= probes then
        redis.call('HSET', key, 'state', 'closed', 'win', now, 'calls', 0, 'errors', 0,
                   'until', 0, 'since', now, 'taken', 0, 'ok', 0)
        redis.call('HINCRBY', key, 'closed', 1)
        calls, errors, transition = 0, 0, 'closed'
      end
    end
  elseif state == 'closed' and ok + failed > 0 then
    local win = tonumber(f[2])
    if not win or now - win >= window_ms then
      win, calls, errors = now, 0, 0
    end
    calls, errors = calls + ok + failed, errors + failed
    if calls >= min_calls and errors * 100 >= error_percent * calls then
      open(key, calls, errors)
      transition = 'opened'
    else
      redis.call('HSET', key, 'state', 'closed', 'win', win, 'calls', calls, 'errors', errors)
    end
  end
  if redis.call('EXISTS', key) == 1 then
    redis.call('PEXPIRE', key, ttl)
  end
  local now_state = redis.call('HMGET', key, 'state', 'until')
  local until_ms = 0
  if now_state[1] == 'open' then until_ms = tonumber(now_state[2]) or 0 end
  return { transition, now_state[1] or 'closed', until_ms, calls, errors }
end

local key_part = record(KEYS[1], n[2], n[3], n[4])
local model_part = record(KEYS[2], n[5], n[6], n[7])
if redis.call('EXISTS', KEYS[2]) == 1 then
  redis.call('SADD', KEYS[3], ARGV[1])
  redis.call('PEXPIRE', KEYS[3], ttl)
end
local reply = { now }
for _, part in ipairs({ key_part, model_part }) do
  for _, item in ipairs(part) do reply[#reply + 1] = item end
end
return reply
