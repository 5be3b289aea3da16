cap = args.capacity
redis.call('SET', cap_key, tostring(cap))
promote()
redis.call(publish, channel, 'c ' .. tostring(cap))
return reply{capacity = cap}
