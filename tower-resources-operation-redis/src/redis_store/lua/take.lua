promote()
local id, max_queued = args.id, args.max_queued
local replicas = alive(token(id))
if redis.call('ZSCORE', holders, id) then
  lease(id)
  return reply{status = 1, capacity = cap, replicas = replicas}
end
if redis.call('ZSCORE', queue, id) then
  redis.call('ZADD', waiting, now + ttl, id)
  return reply{status = 0, capacity = cap, replicas = replicas}
end
local queued = redis.call('ZCARD', queue)
if queued == 0 and redis.call('ZCARD', holders) < cap then
  lease(id)
  return reply{status = 1, capacity = cap, replicas = replicas}
end
if max_queued >= 0 and queued >= max_queued then
  return reply{status = 2, capacity = cap, replicas = replicas}
end
redis.call('ZADD', queue, redis.call('INCR', arrivals), id)
redis.call('ZADD', waiting, now + ttl, id)
return reply{status = 0, capacity = cap, replicas = replicas}
