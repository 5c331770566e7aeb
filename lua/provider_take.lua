--[[ provider_take.lua: take one request and its tokens from an upstream provider key's capacity.

Purpose
  Supply side (DESIGN.md section 3, step 6): a provider key may carry an RPM and a TPM capacity
  (what the upstream account allows). Before a call is sent with that key, one request and the
  call's held tokens are taken from two token buckets that refill continuously over a minute.
  Both or neither: if either bucket lacks room nothing is taken, and the gateway tries the next
  key. Only keys with a capacity cost this extra round trip.

KEYS
  KEYS[1]  tg:{p<provider_key_id>}:cap   hash {requests, tokens, ts}   (its own hash tag: provider
           keys are shared by tenants, so this never runs in a tenant's slot)

ARGV
  ARGV[1]  rpm_capacity   requests per minute, -1 = not limited
  ARGV[2]  tpm_capacity   tokens per minute, -1 = not limited
  ARGV[3]  tokens         tokens this call holds (its worst case), integer >= 0

Return table (integers only)
  taken:    { 1, requests_left, tokens_left }   (-1 for an unlimited bucket)
  refused:  { 0, retry_after_ms, which }        which = 1 requests, 2 tokens

TTL: refreshed to 60 s on each take; an expired hash is two full buckets, which is exactly
their state after a minute without calls.
]]

if #KEYS ~= 1 or #ARGV ~= 3 then
  return redis.error_reply('provider_take: expected 1 key and ARGV = rpm_capacity, tpm_capacity, tokens')
end
local rpm, tpm, tokens = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
if not rpm or not tpm or not tokens or tokens < 0 or rpm == 0 or tpm == 0 or rpm < -1 or tpm < -1 then
  return redis.error_reply('provider_take: capacities must be >= 1 or -1, tokens >= 0')
end

local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local f = redis.call('HMGET', KEYS[1], 'requests', 'tokens', 'ts')
local elapsed = math.max(0, now_ms - (tonumber(f[3]) or now_ms))

local function refill(stored, capacity)
  if capacity < 0 then return -1 end
  return math.min(capacity, (tonumber(stored) or capacity) + elapsed * capacity / 60000)
end

local requests_left = refill(f[1], rpm)
local tokens_left = refill(f[2], tpm)
if rpm > 0 and requests_left < 1 then
  return { 0, math.ceil((1 - requests_left) * 60000 / rpm), 1 }
end
-- A call bigger than the whole TPM capacity could never pass: let it through on a full bucket.
local need = math.min(tokens, tpm > 0 and tpm or tokens)
if tpm > 0 and tokens_left < need then
  return { 0, math.ceil((need - tokens_left) * 60000 / tpm), 2 }
end

if rpm > 0 then requests_left = requests_left - 1 end
if tpm > 0 then tokens_left = tokens_left - need end
redis.call('HSET', KEYS[1], 'requests', tostring(requests_left), 'tokens', tostring(tokens_left), 'ts', now_ms)
redis.call('PEXPIRE', KEYS[1], 60000)
return { 1, math.floor(requests_left), math.floor(tokens_left) }
