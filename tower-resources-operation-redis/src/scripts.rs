//! The Lua scripts of the fleet limit: every step that must be atomic, each loaded once and
//! called by its SHA (`EVALSHA`, with `SCRIPT LOAD` on `NOSCRIPT`: what `redis::Script` does).
//!
//! Every script gets the same keys and first arguments, and starts the same way ([`PRELUDE`]):
//! it reads the server's clock (`TIME`: never a replica's), drops the leases and tickets whose
//! processes stopped refreshing them, reads the capacity (setting the caller's default if the
//! fleet has none yet), and can then hand the free places to the first waiters (`promote`),
//! publishing their ids so that their processes know at once.
//!
//! - `KEYS[1]` the capacity (a string), `KEYS[2]` the holders (a sorted set of lease ids by the
//!   server time their lease expires), `KEYS[3]` the queue (a sorted set of ticket ids by order
//!   of arrival), `KEYS[4]` the tickets' expiry (a sorted set of the same ids by the server time
//!   their ticket expires), `KEYS[5]` the arrival counter.
//!   An adaptive limit's two scripts ([`FLEET_TICK`], [`FLEET_DECIDE`]) get three more keys.
//! - `ARGV[1]` the channel, `ARGV[2]` the lease time to live in ms, `ARGV[3]` the capacity to set
//!   if there is none; each script's own arguments follow.

use std::sync::LazyLock;

use redis::Script;

/// What every script starts with.
const PRELUDE: &str = r#"
local cap_key, holders, queue, waiting, arrivals = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local channel, ttl, default_cap = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', holders, '-inf', now)
local expired = redis.call('ZRANGEBYSCORE', waiting, '-inf', now)
if #expired > 0 then
  for i = 1, #expired, 500 do
    redis.call('ZREM', queue, unpack(expired, i, math.min(i + 499, #expired)))
  end
  redis.call('ZREMRANGEBYSCORE', waiting, '-inf', now)
end
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
    redis.call('ZADD', holders, now + ttl, id)
    redis.call('ZREM', waiting, id)
  end
  redis.call('ZREMRANGEBYRANK', queue, 0, #first - 1)
  redis.call('PUBLISH', channel, 'g ' .. table.concat(first, ' '))
end
"#;

/// `ARGV[4]` the caller's id, `ARGV[5]` the bound on the queue (`-1` for none). Returns
/// `{status, capacity}`: status 1 holds a lease (taken now, or handed over while it waited),
/// 0 waits in the queue (its ticket refreshed), 2 was turned away (the queue is full).
const ACQUIRE: &str = r#"
promote()
local id, max_queued = ARGV[4], tonumber(ARGV[5])
if redis.call('ZSCORE', holders, id) then
  redis.call('ZADD', holders, now + ttl, id)
  return {1, cap}
end
if redis.call('ZSCORE', queue, id) then
  redis.call('ZADD', waiting, now + ttl, id)
  return {0, cap}
end
local queued = redis.call('ZCARD', queue)
if queued == 0 and redis.call('ZCARD', holders) < cap then
  redis.call('ZADD', holders, now + ttl, id)
  return {1, cap}
end
if max_queued >= 0 and queued >= max_queued then
  return {2, cap}
end
redis.call('ZADD', queue, redis.call('INCR', arrivals), id)
redis.call('ZADD', waiting, now + ttl, id)
return {0, cap}
"#;

/// `ARGV[4..]` ids whose lease or ticket goes back (a permit dropped, a wait given up); their
/// places go to the first waiters. Returns the capacity.
const RELEASE: &str = r#"
for i = 4, #ARGV do
  redis.call('ZREM', holders, ARGV[i])
  redis.call('ZREM', queue, ARGV[i])
  redis.call('ZREM', waiting, ARGV[i])
end
promote()
return cap
"#;

/// `ARGV[4]` how many of the ids that follow are leases the process holds; the rest are its
/// tickets. Extends each, and returns `{capacity, status...}`, one status per id: 1 holds a
/// lease, 2 waits in the queue, 3 a lost lease taken back (its place was free and nobody
/// waited), 0 gone.
const REFRESH: &str = r#"
promote()
local leases = tonumber(ARGV[4])
local out = {cap}
for i = 5, #ARGV do
  local id = ARGV[i]
  local status = 0
  if redis.call('ZSCORE', holders, id) then
    redis.call('ZADD', holders, now + ttl, id)
    status = 1
  elseif redis.call('ZSCORE', queue, id) then
    redis.call('ZADD', waiting, now + ttl, id)
    status = 2
  elseif i < 5 + leases and redis.call('ZCARD', queue) == 0
      and redis.call('ZCARD', holders) < cap then
    redis.call('ZADD', holders, now + ttl, id)
    status = 3
  end
  out[#out + 1] = status
end
return out
"#;

/// `ARGV[4]` the new capacity: set for the whole fleet, waiters admitted into the new places at
/// once, and every process told. Returns the capacity.
const SET_CAPACITY: &str = r#"
cap = tonumber(ARGV[4])
redis.call('SET', cap_key, ARGV[4])
promote()
redis.call('PUBLISH', channel, 'c ' .. ARGV[4])
return cap
"#;

/// Returns `{capacity, leases held, tickets waiting}` across the fleet.
const STATE: &str = r#"
promote()
return {cap, redis.call('ZCARD', holders), redis.call('ZCARD', queue)}
"#;

/// An adaptive limit's tick, every replica's, every [`adaptive_tick`]: adds the replica's counts
/// into the fleet's window, samples the fleet's leases held, keeps (or takes) the leader's
/// lease, and, for the leader, takes and resets the window once it is due.
///
/// `KEYS[6]` the adaptive state (a hash: `epoch`, the window's number; `opened`, when it opened
/// on the server's clock; `decreased`, the first window after the last decrease, and
/// `decreased_at`; `rtt_us`, `baseline_us`, `estimate_us`), `KEYS[7]` the window (a hash of
/// counts), `KEYS[8]` the leader's lease (a string: the leader's id, with a TTL).
///
/// `ARGV[4]` the replica's id, `ARGV[5]` the leader's lease in ms, `ARGV[6]` the window the
/// replica's counts were taken in; `ARGV[7..11]` of the operations admitted in it: ended,
/// ended `ok`, the sum of their run times (µs), of their squares (µs² / 1024), the shortest
/// (`-1` for none); `ARGV[12..14]` of every end: congested (news), stale, rejected;
/// `ARGV[15]` the shortest window (ms), `ARGV[16]` the longest (ms), `ARGV[17]` the tolerance.
///
/// Returns strings: `{taken, capacity, epoch, leads, age_ms, decreased, rtt_us, baseline_us,
/// estimate_us}`, then, if the window was taken (`taken` = 1), its `ended, timed, sum_us,
/// squares, min_us, congested, stale, rejected, samples, active_sum, peak` (`''` for none).
///
/// [`adaptive_tick`]: crate::RedisLimitBuilder::adaptive_tick
const FLEET_TICK: &str = r#"
local state, window, leader_key = KEYS[6], KEYS[7], KEYS[8]
local id, leader_ttl, seen = ARGV[4], tonumber(ARGV[5]), tonumber(ARGV[6])
local floor_ms, interval_ms, tolerance = tonumber(ARGV[15]), tonumber(ARGV[16]), tonumber(ARGV[17])
local epoch = tonumber(redis.call('HGET', state, 'epoch'))
if not epoch then
  epoch = 1
  redis.call('HSET', state, 'epoch', epoch, 'opened', now)
end
if seen == epoch then
  redis.call('HINCRBY', window, 'ended', ARGV[7])
  redis.call('HINCRBY', window, 'timed', ARGV[8])
  redis.call('HINCRBY', window, 'sum_us', ARGV[9])
  redis.call('HINCRBY', window, 'squares', ARGV[10])
  local min_us = tonumber(ARGV[11])
  if min_us >= 0 then
    local old = tonumber(redis.call('HGET', window, 'min_us'))
    if not old or min_us < old then redis.call('HSET', window, 'min_us', min_us) end
  end
end
redis.call('HINCRBY', window, 'congested', ARGV[12])
redis.call('HINCRBY', window, 'stale', ARGV[13])
redis.call('HINCRBY', window, 'rejected', ARGV[14])
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
  or (age >= interval_ms and ended >= 1)
local taken = 0
local fields = {}
if due and leads == 1 then
  taken = 1
  fields = redis.call('HMGET', window, 'ended', 'timed', 'sum_us', 'squares', 'min_us',
    'congested', 'stale', 'rejected', 'samples', 'active_sum', 'peak')
  redis.call('DEL', window)
  epoch = epoch + 1
  redis.call('HSET', state, 'epoch', epoch, 'opened', now)
elseif due and redis.call('HSETNX', window, 'announced', 1) == 1 then
  -- For the leader, at once: a sign of congestion costs one failure, not a tick of them.
  redis.call('PUBLISH', channel, 'd')
end
local known = redis.call('HMGET', state, 'decreased', 'rtt_us', 'baseline_us', 'estimate_us')
local out = {tostring(taken), tostring(cap), tostring(epoch), tostring(leads), tostring(age)}
for _, value in ipairs(known) do out[#out + 1] = value or '' end
for _, value in ipairs(fields) do out[#out + 1] = value or '' end
return out
"#;

/// The leader's decision on the window it took: `ARGV[4]` the leader's id, `ARGV[5]` the window
/// that opened as it took it (the decision is dropped unless both are still current: a leader
/// that lost its lease meanwhile decides nothing), `ARGV[6]` the new capacity, `ARGV[7..9]` the
/// round trip, baseline and estimate in µs (`-1` for none). Sets the capacity as
/// `SET_CAPACITY` does, and tells every process: `a <epoch> <decreased> <rtt> <baseline>
/// <estimate>`. Returns the capacity, or `-1` if the decision was dropped.
const FLEET_DECIDE: &str = r#"
local state, leader_key = KEYS[6], KEYS[8]
local id, epoch, next_cap = ARGV[4], ARGV[5], tonumber(ARGV[6])
if redis.call('GET', leader_key) ~= id or redis.call('HGET', state, 'epoch') ~= epoch then
  return -1
end
if next_cap < cap then
  redis.call('HSET', state, 'decreased', epoch, 'decreased_at', now)
end
if next_cap ~= cap then
  cap = next_cap
  redis.call('SET', cap_key, ARGV[6])
  promote()
  redis.call('PUBLISH', channel, 'c ' .. ARGV[6])
end
redis.call('HSET', state, 'rtt_us', ARGV[7], 'baseline_us', ARGV[8], 'estimate_us', ARGV[9])
local decreased = redis.call('HGET', state, 'decreased') or '0'
redis.call('PUBLISH', channel, table.concat({'a', epoch, decreased, ARGV[7], ARGV[8], ARGV[9]}, ' '))
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

/// What an `ACQUIRE` said.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Asked {
    /// The caller holds a lease.
    Granted,
    /// The caller waits in the queue.
    Waiting,
    /// The queue is full.
    Full,
}

impl Asked {
    pub(crate) fn from_status(status: i64) -> Self {
        match status {
            1 => Asked::Granted,
            2 => Asked::Full,
            _ => Asked::Waiting,
        }
    }
}

/// What a `REFRESH` said of one id: it holds a lease (anything else unknown is gone: 0).
pub(crate) const HOLDS: i64 = 1;
/// It waits in the queue.
pub(crate) const WAITS: i64 = 2;
/// Its lease was lost, and taken back.
pub(crate) const TAKEN_BACK: i64 = 3;
