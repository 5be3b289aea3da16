local state, leader_key = KEYS[8], KEYS[10]
local id, epoch, next_cap = args.leader, args.window, args.capacity
if redis.call('GET', leader_key) ~= id or redis.call('HGET', state, 'epoch') ~= epoch then
  return reply{capacity = -1}
end
if next_cap < cap then
  -- A window of its own from the decrease: what was admitted since the last window opened
  -- ran at the capacity it lowers. What that window counted so far is the next one's as an
  -- earlier window's counts are (`Window::into_next`), its failures stale.
  epoch = tostring(tonumber(epoch) + 1)
  redis.call('HSET', state, 'epoch', epoch, 'decreased', epoch, 'decreased_at', now)
  redis.call('HINCRBY', state, 'decreases', 1)
  local window = KEYS[9]
  local counted = redis.call('HGETALL', window)
  for i = 1, #counted, 2 do
    local name, value = counted[i], counted[i + 1]
    if name == 'congested' then
      redis.call('HINCRBY', window, 'stale', value)
      redis.call('HDEL', window, name)
    elseif name == 'ended' or string.match(name, '/[tsqm]$') then
      redis.call('HDEL', window, name)
    end
  end
end
if next_cap ~= cap then
  cap = next_cap
  redis.call('SET', cap_key, tostring(cap))
  promote()
  redis.call(publish, channel, 'c ' .. tostring(cap))
end
redis.call('HSET', state, 'rtt_us', args.rtt_us, 'baseline_us', args.baseline_us,
  'estimate_us', args.estimate_us, 'baselines', args.handover)
local decreased = redis.call('HGET', state, 'decreased') or '0'
redis.call(publish, channel, table.concat({'a', epoch, decreased, tostring(args.rtt_us),
  tostring(args.baseline_us), tostring(args.estimate_us)}, ' '))
return reply{capacity = cap}
