promote()
local replicas = alive(args.member)
local ticked = tonumber(redis.call('HGET', KEYS[8], 'ticked') or '-1')
local adaptive = 0
if ticked >= 0 and now - ticked < ttl then adaptive = 1 end
return reply{capacity = cap, active = redis.call('ZCARD', holders), unheard = unheard(),
  queued = redis.call('ZCARD', queue), replicas = replicas,
  adaptive = adaptive}
