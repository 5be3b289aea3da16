for _, id in ipairs(args.ids) do
  redis.call('ZREM', holders, id)
  redis.call('ZREM', claims, id)
  redis.call('ZREM', queue, id)
  redis.call('ZREM', waiting, id)
end
promote()
return reply{capacity = cap}
