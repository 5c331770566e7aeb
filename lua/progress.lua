--[[ progress.lua: record how far an open hold's call got, so the sweep can charge what is known
if the gateway process dies before it settles.

Purpose
  A hold starts in phase "reserved" (lua/reserve.lua). The gateway marks it "forwarded" once a
  non-streamed call has been in flight a while (the upstream may be producing up to the cap) and
  "streaming" with a checkpoint of the output tokens delivered to the client so far (at most one
  write per interval per stream). The sweep (lua/sweep.lua) charges: reserved 0; forwarded the
  whole hold; streaming the input plus the last checkpoint. A hold that has already ended is
  left alone: a checkpoint can never reopen, recreate or alter a closed hold.

KEYS
  KEYS[1]  hold record   tg:{t<id>}:hold:<request_id>

ARGV
  ARGV[1]  phase     "forwarded" | "streaming"
  ARGV[2]  progress  output tokens delivered so far, integer >= 0 (only ever raised)
  ARGV[3]  upstream  the provider key id the call went to, or "" (stored as `pk`, so a swept
                     hold's usage can be reconciled against that key's bill)

Return table
  { state, phase, progress }
  state "open": recorded; phase and progress as stored now (the phase never goes back:
  reserved < forwarded < streaming, and progress never decreases)
  otherwise the hold's state ("settled" | "released" | "swept" | "corrected", or "unknown" when
  there is no record) with "" and 0: nothing was written

TTL: untouched (the hold keeps the expiry reserve gave it).
]]

if #KEYS ~= 1 or #ARGV ~= 3 then
  return redis.error_reply('progress: expected KEYS = hold and ARGV = phase, progress, upstream')
end
local rank = { reserved = 0, forwarded = 1, streaming = 2 }
local wanted = ARGV[1]
local progress = tonumber(ARGV[2])
if (wanted ~= 'forwarded' and wanted ~= 'streaming') or not progress or progress < 0 then
  return redis.error_reply('progress: phase must be forwarded or streaming, progress >= 0')
end

local hold = redis.call('HMGET', KEYS[1], 'state', 'phase', 'progress')
if hold[1] == false then
  return { 'unknown', '', 0 }
end
if hold[1] ~= 'open' then
  return { hold[1], '', 0 }
end

local phase = hold[2] or 'reserved'
if (rank[wanted] or 0) > (rank[phase] or 0) then
  phase = wanted
end
local stored = tonumber(hold[3]) or 0
if progress > stored then
  stored = progress
end
redis.call('HSET', KEYS[1], 'phase', phase, 'progress', stored)
if ARGV[3] ~= '' then
  redis.call('HSET', KEYS[1], 'pk', ARGV[3])
end
return { 'open', phase, stored }
