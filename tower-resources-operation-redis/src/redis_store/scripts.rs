//! The Lua scripts of the fleet limit: every step that must be atomic, each loaded once and
//! called by its SHA (`EVALSHA`, with `SCRIPT LOAD` on `NOSCRIPT`: what `redis::Script` does).
//!
//! Every script gets the same keys and first arguments, and starts the same way ([`PRELUDE`]):
//! it reads the server's clock (`TIME`: never a replica's), drops the leases and tickets whose
//! processes stopped refreshing them, drops the claims that expired untaken (and with them every
//! ticket of their processes, which are gone), reads the capacity (setting the caller's default
//! if the fleet has none yet), and can then hand the free places to the first waiters
//! (`promote`), publishing their ids so that their processes take them up at once.
//!
//! - `KEYS[1]` the capacity (a string), `KEYS[2]` the holders (a sorted set of lease and claim
//!   ids by the server time they expire), `KEYS[3]` the queue (a sorted set of ticket ids by
//!   order of arrival), `KEYS[4]` the tickets' expiry (a sorted set of the same ids by the
//!   server time their ticket expires), `KEYS[5]` the arrival counter, `KEYS[6]` the claims (a
//!   sorted set of the ids of places handed over and not yet taken up, by when the claim
//!   expires), `KEYS[7]` the processes (a sorted set of process tokens by when they stop being
//!   counted alive), `KEYS[8..10]` an adaptive limit's state, window and leader's lease.
//!   Every key of a limit shares one hash slot (`{prefix:name}`), so a Redis Cluster serves it.
//! - `ARGV[1]` the channel, `ARGV[2]` the lease time to live in ms, `ARGV[3]` the capacity to set
//!   if there is none, `ARGV[4]` the claim timeout in ms, `ARGV[5]` the command to publish with
//!   (`PUBLISH`, or `SPUBLISH` on a cluster); each script's own arguments follow, from
//!   `ARGV[6]`.
//!
//! An id is `process:count`: the script can tell every ticket of a process from its token.

use std::sync::LazyLock;

use redis::Script;

/// What every script starts with.
const PRELUDE: &str = r#"
local cap_key, holders, queue, waiting, arrivals = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local claims, processes = KEYS[6], KEYS[7]
local channel, ttl, default_cap = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local claim_ms, publish = tonumber(ARGV[4]), ARGV[5]
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
"#;

/// `ARGV[6]` the caller's id, `ARGV[7]` the bound on the queue (`-1` for none). Returns
/// `{status, capacity, replicas}`: status 1 holds a lease (taken now, or the place handed over
/// while it waited, taken up), 0 waits in the queue (its ticket refreshed), 2 was turned away
/// (the queue is full).
const ACQUIRE: &str = r#"
promote()
local id, max_queued = ARGV[6], tonumber(ARGV[7])
local replicas = alive(token(id))
if redis.call('ZSCORE', holders, id) then
  lease(id)
  return {1, cap, replicas}
end
if redis.call('ZSCORE', queue, id) then
  redis.call('ZADD', waiting, now + ttl, id)
  return {0, cap, replicas}
end
local queued = redis.call('ZCARD', queue)
if queued == 0 and redis.call('ZCARD', holders) < cap then
  lease(id)
  return {1, cap, replicas}
end
if max_queued >= 0 and queued >= max_queued then
  return {2, cap, replicas}
end
redis.call('ZADD', queue, redis.call('INCR', arrivals), id)
redis.call('ZADD', waiting, now + ttl, id)
return {0, cap, replicas}
"#;

/// `ARGV[6..]` ids whose lease, claim or ticket goes back (a permit dropped, a wait given up);
/// their places go to the first waiters. Returns the capacity.
const RELEASE: &str = r#"
for i = 6, #ARGV do
  redis.call('ZREM', holders, ARGV[i])
  redis.call('ZREM', claims, ARGV[i])
  redis.call('ZREM', queue, ARGV[i])
  redis.call('ZREM', waiting, ARGV[i])
end
promote()
return cap
"#;

/// `ARGV[6]` the process's token, `ARGV[7]` how many of the ids that follow are leases it holds,
/// `ARGV[8]` how many after those are places it admitted on its share while Redis was out of
/// reach; the rest are its waiters'. Counts the process alive, and returns `{capacity,
/// replicas, status...}`, one status per id: 1 holds a lease (extended; a claim taken up; a
/// place of the share made a lease, whatever the capacity: it runs), 2 waits in the queue
/// (extended), 3 a lost lease taken back (its place was free and nobody waited), 0 gone.
const REFRESH: &str = r#"
promote()
local leases, shared = tonumber(ARGV[7]), tonumber(ARGV[8])
local out = {cap, alive(ARGV[6])}
for i = 9, #ARGV do
  local id = ARGV[i]
  local status = 0
  if i >= 9 + leases and i < 9 + leases + shared then
    lease(id)
    redis.call('ZREM', queue, id)
    redis.call('ZREM', waiting, id)
    status = 1
  elseif redis.call('ZSCORE', holders, id) then
    lease(id)
    status = 1
  elseif redis.call('ZSCORE', queue, id) then
    redis.call('ZADD', waiting, now + ttl, id)
    status = 2
  elseif i < 9 + leases and redis.call('ZCARD', queue) == 0
      and redis.call('ZCARD', holders) < cap then
    lease(id)
    status = 3
  end
  out[#out + 1] = status
end
return out
"#;

/// `ARGV[6]` the new capacity: set for the whole fleet, waiters handed the new places at once,
/// and every process told. Returns the capacity.
const SET_CAPACITY: &str = r#"
cap = tonumber(ARGV[6])
redis.call('SET', cap_key, ARGV[6])
promote()
redis.call(publish, channel, 'c ' .. ARGV[6])
return cap
"#;

/// Returns `{capacity, leases and claims held, tickets waiting, replicas, adaptive}` across the
/// fleet: `adaptive` is 1 if an adaptive limit ticked within a lease TTL.
const STATE: &str = r#"
promote()
local ticked = tonumber(redis.call('HGET', KEYS[8], 'ticked') or '-1')
local adaptive = 0
if ticked >= 0 and now - ticked < ttl then adaptive = 1 end
return {cap, redis.call('ZCARD', holders), redis.call('ZCARD', queue),
  redis.call('ZCARD', processes), adaptive}
"#;

/// An adaptive limit's tick, every replica's, every [`adaptive_tick`]: adds the replica's counts
/// into the fleet's window, samples the fleet's places held, keeps (or takes) the leader's
/// lease, and, for the leader, takes and resets the window once it is due.
///
/// `KEYS[8]` the adaptive state (a hash: `epoch`, the window's number; `opened`, when it opened
/// on the server's clock; `decreased`, the first window after the last decrease, and
/// `decreased_at`; `decreases`, how many (each opened a window: the windows taken are `epoch`
/// less them, less 1); `rtt_us`, `baseline_us`, `estimate_us`, and `baselines`, each series'; `ticked`, when a replica last
/// ticked), `KEYS[9]` the window (a hash of counts), `KEYS[10]` the leader's lease
/// (a string: the leader's id, with a TTL).
///
/// `ARGV[6]` the replica's id, `ARGV[7]` the leader's lease in ms, `ARGV[8]` the window the
/// replica's counts were taken in; `ARGV[9]` its own operations (admitted in that window) that
/// ended; `ARGV[10..12]` of every end: congested (news), stale, rejected; `ARGV[13]` the
/// shortest window (ms), `ARGV[14]` the longest (ms), `ARGV[15]` the tolerance; `ARGV[16]` how
/// many series follow, each as 8 arguments: its prefix (`<operation>/<executor>/`), then of
/// every end `e` ended, `o` ended `ok`, `v` their run times summed (µs), and of its own
/// operations `t` ended `ok`, `s` their run times summed (µs), `q` their squares (µs² / 1024),
/// `m` the shortest (`-1` for none). A replica's counts taken in an earlier window add only
/// what any window counts (the core's `Counts::into_next_window`). The argument after the
/// series is `1` if the replica has no algorithm yet (it would start one if it led); the one
/// after it, the window of the last decrease the replica judged its congestion against (0 for
/// none): if the fleet's last decrease is later, that congestion is added as stale.
///
/// Returns strings: `{taken, capacity, epoch, leads, age_ms, decreased, rtt_us, baseline_us,
/// estimate_us, baselines}` (`baselines`, what the last decision stored, only for a leader
/// that has no algorithm yet: a hand-over's), then, if the window was taken (`taken` = 1), the
/// window's hash as field, value pairs.
///
/// [`adaptive_tick`]: crate::RedisLimitBuilder::adaptive_tick
const FLEET_TICK: &str = r#"
local state, window, leader_key = KEYS[8], KEYS[9], KEYS[10]
local id, leader_ttl, seen = ARGV[6], tonumber(ARGV[7]), tonumber(ARGV[8])
local floor_ms, interval_ms, tolerance = tonumber(ARGV[13]), tonumber(ARGV[14]), tonumber(ARGV[15])
local epoch = tonumber(redis.call('HGET', state, 'epoch'))
if not epoch then
  epoch = 1
  redis.call('HSET', state, 'epoch', epoch, 'opened', now)
end
redis.call('HSET', state, 'ticked', now)
local own = seen == epoch
if own then redis.call('HINCRBY', window, 'ended', ARGV[9]) end
local series = tonumber(ARGV[16])
local news, stale = tonumber(ARGV[10]), tonumber(ARGV[11])
if tonumber(ARGV[18 + series * 8]) < tonumber(redis.call('HGET', state, 'decreased') or '0') - 1 then
  -- Judged before the replica heard of the last decrease: admitted before it.
  news, stale = 0, stale + news
end
redis.call('HINCRBY', window, 'congested', news)
redis.call('HINCRBY', window, 'stale', stale)
redis.call('HINCRBY', window, 'rejected', ARGV[12])
for i = 0, series - 1 do
  local at = 17 + i * 8
  local prefix = ARGV[at]
  redis.call('HINCRBY', window, prefix .. 'e', ARGV[at + 1])
  redis.call('HINCRBY', window, prefix .. 'o', ARGV[at + 2])
  redis.call('HINCRBY', window, prefix .. 'v', ARGV[at + 3])
  if own then
    redis.call('HINCRBY', window, prefix .. 't', ARGV[at + 4])
    redis.call('HINCRBY', window, prefix .. 's', ARGV[at + 5])
    redis.call('HINCRBY', window, prefix .. 'q', ARGV[at + 6])
    local min_us = tonumber(ARGV[at + 7])
    if min_us >= 0 then
      local old = tonumber(redis.call('HGET', window, prefix .. 'm'))
      if not old or min_us < old then redis.call('HSET', window, prefix .. 'm', min_us) end
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
local out = {tostring(taken), tostring(cap), tostring(epoch), tostring(leads), tostring(age)}
for _, value in ipairs(known) do out[#out + 1] = value or '' end
local baselines = ''
if leads == 1 and ARGV[17 + series * 8] == '1' then
  baselines = redis.call('HGET', state, 'baselines') or ''
end
out[#out + 1] = baselines
for _, value in ipairs(fields) do out[#out + 1] = value or '' end
return out
"#;

/// The leader's decision on the window it took: `ARGV[6]` the leader's id, `ARGV[7]` the window
/// that opened as it took it (the decision is dropped unless both are still current: a leader
/// that lost its lease meanwhile decides nothing), `ARGV[8]` the new capacity, `ARGV[9..11]`
/// the round trip, baseline and estimate in µs (`-1` for none), `ARGV[12]` the algorithm's
/// baselines, series by series (what a new leader starts from; see
/// `redis_store::encode_baselines`). Sets the capacity as `SET_CAPACITY` does, and tells every
/// process: `a <epoch> <decreased> <rtt> <baseline> <estimate>`. A decrease opens a window of
/// its own (`epoch` one more than `ARGV[7]`, and `decreased` it). Returns the capacity, or `-1`
/// if the decision was dropped.
const FLEET_DECIDE: &str = r#"
local state, leader_key = KEYS[8], KEYS[10]
local id, epoch, next_cap = ARGV[6], ARGV[7], tonumber(ARGV[8])
if redis.call('GET', leader_key) ~= id or redis.call('HGET', state, 'epoch') ~= epoch then
  return -1
end
if next_cap < cap then
  -- A window of its own from the decrease: what was admitted since the last window opened
  -- ran at the capacity it lowers. What that window counted so far is the next one's as an
  -- earlier window's counts are (`Counts::into_next_window`), its failures stale.
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
  redis.call('SET', cap_key, ARGV[8])
  promote()
  redis.call(publish, channel, 'c ' .. ARGV[8])
end
redis.call('HSET', state, 'rtt_us', ARGV[9], 'baseline_us', ARGV[10], 'estimate_us', ARGV[11],
  'baselines', ARGV[12])
local decreased = redis.call('HGET', state, 'decreased') or '0'
redis.call(publish, channel, table.concat({'a', epoch, decreased, ARGV[9], ARGV[10], ARGV[11]}, ' '))
return cap
"#;

/// The scripts, made (and hashed) once per process.
pub(crate) struct Scripts {
    pub(crate) acquire: Script,
    pub(crate) release: Script,
    pub(crate) refresh: Script,
    pub(crate) set_capacity: Script,
    pub(crate) state: Script,
    pub(crate) fleet_tick: Script,
    pub(crate) fleet_decide: Script,
}

pub(crate) static SCRIPTS: LazyLock<Scripts> = LazyLock::new(|| {
    let script = |body: &str| Script::new(&format!("{PRELUDE}{body}"));
    Scripts {
        acquire: script(ACQUIRE),
        release: script(RELEASE),
        refresh: script(REFRESH),
        set_capacity: script(SET_CAPACITY),
        state: script(STATE),
        fleet_tick: script(FLEET_TICK),
        fleet_decide: script(FLEET_DECIDE),
    }
});
