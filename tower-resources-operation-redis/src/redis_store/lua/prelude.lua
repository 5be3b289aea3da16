local cap_key, holders, queue, waiting, arrivals = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local claims, processes = KEYS[6], KEYS[7]
local channel, ttl, default_cap = args.channel, args.ttl, args.default_cap
local claim_ms, publish = args.claim_ms, args.publish
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local function token(id) return string.match(id, '^[^:]*') end
local function drop_tickets(ids)
  for i = 1, #ids, 500 do
    local batch = {unpack(ids, i, math.min(i + 499, #ids))}
    redis.call('ZREM', queue, unpack(batch))
    redis.call('ZREM', waiting, unpack(batch))
  end
end
redis.call('ZREMRANGEBYSCORE', holders, '-inf', now)
redis.call('ZREMRANGEBYSCORE', processes, '-inf', now)
local untaken = redis.call('ZRANGEBYSCORE', claims, '-inf', now)
if #untaken > 0 then
  -- A place handed over and not taken up: its process is gone, and its tickets with it.
  redis.call('ZREMRANGEBYSCORE', claims, '-inf', now)
  local gone = {}
  for _, id in ipairs(untaken) do
    gone[token(id)] = true
    redis.call('ZREM', holders, id)
  end
  local tickets, dead = redis.call('ZRANGE', queue, 0, -1), {}
  for _, id in ipairs(tickets) do
    if gone[token(id)] then dead[#dead + 1] = id end
  end
  if #dead > 0 then drop_tickets(dead) end
  for process in pairs(gone) do redis.call('ZREM', processes, process) end
end
local expired = redis.call('ZRANGEBYSCORE', waiting, '-inf', now)
if #expired > 0 then drop_tickets(expired) end
local cap = tonumber(redis.call('GET', cap_key))
if not cap then
  cap = tonumber(default_cap)
  redis.call('SET', cap_key, default_cap)
end
local function promote()
  local free = cap - redis.call('ZCARD', holders)
  if free <= 0 then return end
  local first = redis.call('ZRANGE', queue, 0, free - 1)
  if #first == 0 then return end
  for _, id in ipairs(first) do
    redis.call('ZADD', holders, now + claim_ms, id)
    redis.call('ZADD', claims, now + claim_ms, id)
    redis.call('ZREM', waiting, id)
  end
  redis.call('ZREMRANGEBYRANK', queue, 0, #first - 1)
  local window = redis.call('HGET', KEYS[8], 'epoch') or '0'
  redis.call(publish, channel, 'g ' .. window .. ' ' .. table.concat(first, ' '))
end
local function alive(process)
  redis.call('ZADD', processes, now + ttl, process)
  return redis.call('ZCARD', processes)
end
local function lease(id)
  redis.call('ZADD', holders, now + ttl, id)
  redis.call('ZREM', claims, id)
end
-- Places held by members not heard from within half a lease TTL (each refreshes every third of
-- it): a member that died holding them, until its leases lapse.
local function unheard()
  local quiet = redis.call('ZRANGEBYSCORE', processes, '-inf', now + ttl / 2)
  if #quiet == 0 then return 0 end
  local members, count = {}, 0
  for _, member in ipairs(quiet) do members[member] = true end
  for _, id in ipairs(redis.call('ZRANGE', holders, 0, -1)) do
    if members[token(id)] then count = count + 1 end
  end
  return count
end
