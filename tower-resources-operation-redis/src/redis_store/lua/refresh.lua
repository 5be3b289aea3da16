promote()
local replicas = alive(args.member)
local out = {capacity = cap, replicas = replicas, held = {}, unheard = {}, waiting = {}}
for i, id in ipairs(args.held) do
  local status = 0
  if redis.call('ZSCORE', holders, id) then
    lease(id)
    status = 1
  elseif redis.call('ZSCORE', queue, id) then
    redis.call('ZADD', waiting, now + ttl, id)
    status = 2
  elseif redis.call('ZCARD', queue) == 0 and redis.call('ZCARD', holders) < cap then
    lease(id)
    status = 3
  end
  out.held[i] = status
end
for i, id in ipairs(args.unheard) do
  lease(id)
  redis.call('ZREM', queue, id)
  redis.call('ZREM', waiting, id)
  out.unheard[i] = 1
end
for i, id in ipairs(args.waiting) do
  local status = 0
  if redis.call('ZSCORE', holders, id) then
    lease(id)
    status = 1
  elseif redis.call('ZSCORE', queue, id) then
    redis.call('ZADD', waiting, now + ttl, id)
    status = 2
  end
  out.waiting[i] = status
end
out.fleet_held = redis.call('ZCARD', holders)
out.fleet_unheard = unheard()
return reply(out)
