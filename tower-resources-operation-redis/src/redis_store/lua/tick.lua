local state, window, leader_key = KEYS[8], KEYS[9], KEYS[10]
local id, leader_ttl, seen = args.candidate, args.leader_ttl, args.seen
local floor_ms, interval_ms, tolerance = args.shortest, args.longest, args.tolerance
local epoch = tonumber(redis.call('HGET', state, 'epoch'))
if not epoch then
  epoch = 1
  redis.call('HSET', state, 'epoch', epoch, 'opened', now)
end
redis.call('HSET', state, 'ticked', now)
local own = seen == epoch
if own then redis.call('HINCRBY', window, 'ended', args.ended) end
local news, stale = args.congested, args.stale
if args.judged < tonumber(redis.call('HGET', state, 'decreased') or '0') - 1 then
  -- Judged before the member heard of the last decrease: admitted before it.
  news, stale = 0, stale + news
end
redis.call('HINCRBY', window, 'congested', news)
redis.call('HINCRBY', window, 'stale', stale)
redis.call('HINCRBY', window, 'rejected', args.rejected)
for _, series in ipairs(args.series) do
  local prefix = series.prefix
  redis.call('HINCRBY', window, prefix .. 'e', series.e)
  redis.call('HINCRBY', window, prefix .. 'o', series.o)
  redis.call('HINCRBY', window, prefix .. 'v', series.v)
  if own then
    redis.call('HINCRBY', window, prefix .. 't', series.t)
    redis.call('HINCRBY', window, prefix .. 's', series.s)
    redis.call('HINCRBY', window, prefix .. 'q', series.q)
    if series.m >= 0 then
      local old = tonumber(redis.call('HGET', window, prefix .. 'm'))
      if not old or series.m < old then redis.call('HSET', window, prefix .. 'm', series.m) end
    end
  end
end
local active = redis.call('ZCARD', holders)
redis.call('HINCRBY', window, 'samples', 1)
redis.call('HINCRBY', window, 'active_sum', active)
if active > tonumber(redis.call('HGET', window, 'peak') or '0') then
  redis.call('HSET', window, 'peak', active)
end
local leads = 0
local current = redis.call('GET', leader_key)
if current == id then
  redis.call('PEXPIRE', leader_key, leader_ttl)
  leads = 1
elseif not current then
  redis.call('SET', leader_key, id, 'PX', leader_ttl)
  leads = 1
end
local function field(name) return tonumber(redis.call('HGET', window, name) or '0') end
local ended, congested = field('ended'), field('congested')
local age = now - tonumber(redis.call('HGET', state, 'opened') or now)
local rtt_ms = tonumber(redis.call('HGET', state, 'rtt_us') or '0') / 1000
local due = congested > math.floor(tolerance * cap)
  or (age >= floor_ms and ended >= cap)
  or (rtt_ms > 0 and age >= math.max(floor_ms, 2 * rtt_ms) and ended * 2 >= cap)
  or (age >= interval_ms and ended >= 1 and (ended * 2 >= cap or age >= interval_ms * 1.5))
local taken = 0
local fields = {}
if due and leads == 1 then
  taken = 1
  fields = redis.call('HGETALL', window)
  redis.call('DEL', window)
  epoch = epoch + 1
  redis.call('HSET', state, 'epoch', epoch, 'opened', now)
elseif due and redis.call('HSETNX', window, 'announced', 1) == 1 then
  -- For the leader, at once: a sign of congestion costs one failure, not a tick of them.
  redis.call(publish, channel, 'd')
end
local known = redis.call('HMGET', state, 'decreased', 'rtt_us', 'baseline_us', 'estimate_us')
local baselines = ''
if leads == 1 and args.starting == 1 then
  baselines = redis.call('HGET', state, 'baselines') or ''
end
return reply{taken = taken, capacity = cap, epoch = epoch, leads = leads, age = age,
  decreased = known[1], rtt_us = known[2], baseline_us = known[3], estimate_us = known[4],
  baselines = baselines, window = fields}
