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

/// The scripts, made (and hashed) once per process.
pub(crate) struct Scripts {
    pub(crate) acquire: Script,
    pub(crate) release: Script,
    pub(crate) refresh: Script,
    pub(crate) set_capacity: Script,
    pub(crate) state: Script,
}

pub(crate) static SCRIPTS: LazyLock<Scripts> = LazyLock::new(|| {
    let script = |body: &str| Script::new(&format!("{PRELUDE}{body}"));
    Scripts {
        acquire: script(ACQUIRE),
        release: script(RELEASE),
        refresh: script(REFRESH),
        set_capacity: script(SET_CAPACITY),
        state: script(STATE),
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
