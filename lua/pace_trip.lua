--[[ pace_trip.lua: trip the burn-rate breaker of one scope (quotas/pace.py), once.

Called only after reserve refused a call on a pace counter (reason spend_rate_exceeded). Records
the trip in the tenant's trips hash and closes the scope until `until_ms`: every pace counter of
the scope in every period that overlaps the cool-down gets a credit of `credit` (a huge negative
number), so reserve's check `used + pending + amount <= limit + credit` refuses every call that
touches the scope, whatever its size, until those periods end. The period after them has no
credit: the breaker half-opens by itself, admitting one period's share again.

Idempotent: while a trip of the scope is active (now < its until, not resumed), nothing is
written and the active trip is returned with code 0. Of many refusals racing, exactly one gets 1.
A refusal made while a trip still lasted (its until is at or after the refusal's time: the trip
is active, or it ended or was resumed after, or in the same millisecond as, the refusal) trips
nothing either: that refusal came
from the trip's own closing credit, and must not undo a resume that overtook it.

KEYS (all of one tenant, sharing its hash tag `{t<id>}`)
  KEYS[1]          trips hash   tg:{t<id>}:pace:trips   field <scope> -> JSON trip record
  KEYS[2..N+1]     counters     tg:{t<id>}:q:<scope>[:usd]:<pace window>, the scope's pace
                                counters of each period from the refused one to the one
                                containing until_ms - 1

ARGV
  ARGV[1]  scope      the trips hash field (e.g. "project:12")
  ARGV[2]  until_ms   when the cool-down ends (a period's end), Redis clock ms
  ARGV[3]  keep_s     the trips hash lives at least this long after until_ms (alerts read it)
  ARGV[4]  credit     negative integer written as each counter's credit
  ARGV[5]  info       opaque string stored in the record (JSON: label, rule; quotas/pace.py)
  ARGV[6]  N          number of counters, >= 1
  ARGV[7]  refused_ms the Redis time of the reserve refusal asking for this trip
  then for counter i, three values: window_start ms, window_end ms, expire_at unix s (set on a
                                    counter this script creates)

Trip record (JSON, numbers as strings: cjson would round 13-digit times)
  {tripped, until, info, keys: [...], starts: [...], ends: [...]} and, once lifted early by
  lua/pace_resume.lua, {resumed, by} with until set to the resume time.

Return: { 1, tripped_ms, until_ms } this call tripped the breaker
        { 0, tripped_ms, until_ms } a trip was already active (its values)
]]

local n = tonumber(ARGV[6])
local refused_ms = tonumber(ARGV[7])
local until_ms, keep_s, credit = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
if not n or n < 1 or #KEYS ~= n + 1 or #ARGV ~= 7 + 3 * n
  or not refused_ms or not until_ms or not keep_s or keep_s < 0 or not credit or credit >= 0 then
  return redis.error_reply('pace_trip: expected KEYS = trips, N counters; ARGV = 7 + 3N values, credit < 0')
end

local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function ms(x) return string.format('%.0f', x) end

local scope = ARGV[1]
local raw = redis.call('HGET', KEYS[1], scope)
if raw then
  local rec = cjson.decode(raw)
  local lasted = tonumber(rec['until'])
  if lasted > now_ms or lasted >= refused_ms then
    return { 0, tonumber(rec['tripped']), tonumber(rec['until']) }
  end
end

local counter_keys, starts, ends = {}, {}, {}
for i = 1, n do
  local key = KEYS[i + 1]
  local base = 7 + 3 * (i - 1)
  local existed = redis.call('EXISTS', key) == 1
  redis.call('HSET', key, 'credit', ARGV[4])
  if not existed then
    redis.call('EXPIREAT', key, tonumber(ARGV[base + 3]))
  end
  counter_keys[i], starts[i], ends[i] = key, ARGV[base + 1], ARGV[base + 2]
end

local record = cjson.encode({ tripped = ms(now_ms), ['until'] = ms(until_ms), info = ARGV[5],
  keys = counter_keys, starts = starts, ends = ends })
redis.call('HSET', KEYS[1], scope, record)
-- The hash keeps the latest trip of each scope: it lives until the last of them is kept.
local expire_at = math.floor(until_ms / 1000) + keep_s
local ttl = redis.call('TTL', KEYS[1])
if ttl < 0 or tonumber(t[1]) + ttl < expire_at then
  redis.call('EXPIREAT', KEYS[1], expire_at)
end
return { 1, now_ms, until_ms }
