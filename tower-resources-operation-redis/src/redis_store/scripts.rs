//! The Lua scripts of the fleet limit: every step that must be atomic, each loaded once and
//! called by its SHA (`EVALSHA`, with `SCRIPT LOAD` on `NOSCRIPT`: what `redis::Script` does).
//! Each script's arguments and reply are laid out by [`codec`](super::codec): a script reads
//! `args.<name>` and answers `reply{<name> = ...}`.
//!
//! Every script gets the same keys and common arguments, and starts the same way ([`PRELUDE`]):
//! it reads the server's clock (`TIME`: never a replica's), drops the leases and tickets whose
//! members stopped refreshing them, drops the claims that expired untaken (and with them every
//! ticket of their members, which are gone), reads the capacity (setting the caller's default
//! if the fleet has none yet), and can then hand the free places to the first waiters
//! (`promote`), publishing their ids so that their members take them up at once.
//!
//! `KEYS[1]` the capacity (a string), `KEYS[2]` the holders (a sorted set of lease and claim
//! ids by the server time they expire), `KEYS[3]` the queue (a sorted set of ticket ids by
//! order of arrival), `KEYS[4]` the tickets' expiry (a sorted set of the same ids by the server
//! time their ticket expires), `KEYS[5]` the arrival counter, `KEYS[6]` the claims (a sorted set
//! of the ids of places handed over and not yet taken up, by when the claim expires), `KEYS[7]`
//! the members (a sorted set of member tokens by when they stop being counted alive: a lease
//! TTL after they were last heard), `KEYS[8..10]` an adaptive limit's state, window and leader's
//! lease. Every key of a limit shares one hash slot (`{prefix:name}`), so a Redis Cluster serves
//! it. An id is `member:count`: a script can tell every ticket of a member from its token.

use std::sync::LazyLock;

use redis::Script;

use super::codec::{lua_arguments, lua_reply, Field};

/// What every script starts with.
const PRELUDE: &str = r#"
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
"#;

/// Asks for a place for `id`, with `max_queued` the bound on the queue (`-1` for none).
/// `status` 1: it holds a lease (taken now, or the place handed over while it waited, taken
/// up); 0: it waits in the queue (its ticket refreshed); 2: turned away (the queue is full).
pub(super) const TAKE_ARGS: &[Field] = &[Field::Text("id"), Field::Number("max_queued")];
pub(super) const TAKE_REPLY: &[Field] = &[
    Field::Number("status"),
    Field::Number("capacity"),
    Field::Number("replicas"),
];
const TAKE: &str = r#"
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
"#;

/// Gives back the leases, claims and tickets `ids` (a permit dropped, a wait given up); their
/// places go to the first waiters.
pub(super) const RELEASE_ARGS: &[Field] = &[Field::Texts("ids")];
pub(super) const RELEASE_REPLY: &[Field] = &[Field::Number("capacity")];
const RELEASE: &str = r#"
for _, id in ipairs(args.ids) do
  redis.call('ZREM', holders, id)
  redis.call('ZREM', claims, id)
  redis.call('ZREM', queue, id)
  redis.call('ZREM', waiting, id)
end
promote()
return reply{capacity = cap}
"#;

/// Counts `member` alive, and says what became of each of its ids, one status each: `held`
/// (leases its permits hold), `unheard` (places it admitted on its share while Redis was out of
/// reach) and `waiting` (its waiters'). 1: holds a lease (extended; a claim taken up; a place of
/// the share made a lease, whatever the capacity: it runs); 2: waits in the queue (extended);
/// 3: a lost lease taken back (its place was free and nobody waited); 0: gone. With the
/// fleet's places held, and those held by members not heard from.
pub(super) const REFRESH_ARGS: &[Field] = &[
    Field::Text("member"),
    Field::Texts("held"),
    Field::Texts("unheard"),
    Field::Texts("waiting"),
];
pub(super) const REFRESH_REPLY: &[Field] = &[
    Field::Number("capacity"),
    Field::Number("replicas"),
    Field::Number("fleet_held"),
    Field::Number("fleet_unheard"),
    Field::Numbers("held"),
    Field::Numbers("unheard"),
    Field::Numbers("waiting"),
];
const REFRESH: &str = r#"
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
"#;

/// Sets the fleet's `capacity`, hands the new places to the first waiters at once, and tells
/// every member.
pub(super) const SET_CAPACITY_ARGS: &[Field] = &[Field::Number("capacity")];
pub(super) const SET_CAPACITY_REPLY: &[Field] = &[Field::Number("capacity")];
const SET_CAPACITY: &str = r#"
cap = args.capacity
redis.call('SET', cap_key, tostring(cap))
promote()
redis.call(publish, channel, 'c ' .. tostring(cap))
return reply{capacity = cap}
"#;

/// The fleet's state: its capacity, places held (of which by members not heard from), tickets
/// waiting, members alive, and whether an adaptive limit ticked within a lease TTL.
pub(super) const STATE_ARGS: &[Field] = &[];
pub(super) const STATE_REPLY: &[Field] = &[
    Field::Number("capacity"),
    Field::Number("active"),
    Field::Number("unheard"),
    Field::Number("queued"),
    Field::Number("replicas"),
    Field::Number("adaptive"),
];
const STATE: &str = r#"
promote()
local ticked = tonumber(redis.call('HGET', KEYS[8], 'ticked') or '-1')
local adaptive = 0
if ticked >= 0 and now - ticked < ttl then adaptive = 1 end
return reply{capacity = cap, active = redis.call('ZCARD', holders), unheard = unheard(),
  queued = redis.call('ZCARD', queue), replicas = redis.call('ZCARD', processes),
  adaptive = adaptive}
"#;

/// An adaptive limit's tick, every member's, every [`adaptive_tick`]: adds the member's counts
/// into the fleet's window, samples the fleet's places held, keeps (or takes) the leader's
/// lease, and, for the leader, takes and resets the window once it is due.
///
/// `KEYS[8]` the adaptive state (a hash: `epoch`, the window's number; `opened`, when it opened
/// on the server's clock; `decreased`, the first window after the last decrease, and
/// `decreased_at`; `decreases`, how many (each opened a window: the windows taken are `epoch`
/// less them, less 1); `rtt_us`, `baseline_us`, `estimate_us`, and `baselines`, each series';
/// `ticked`, when a member last ticked), `KEYS[9]` the window (a hash of counts), `KEYS[10]` the
/// leader's lease (a string: the leader's id, with a TTL).
///
/// The arguments: the member's `candidate` id for the leader's lease and the lease's
/// `leader_ttl` (ms); `seen`, the window its counts were taken in; of its own operations
/// (admitted in that window) the `ended`; of every end, `congested` (news), `stale` and
/// `rejected`; the `shortest` and `longest` window (ms) and the `tolerance`; each `series` (its
/// prefix `<operation>/<executor>/`, then of every end `e` ended, `o` ended `ok`, `v` their run
/// times summed (µs), and of its own operations `t` ended `ok`, `s` their run times summed (µs),
/// `q` their squares (µs² / 1024), `m` the shortest (`-1` for none)); `starting`, 1 if the
/// member has no algorithm yet (it would start one if it led); `judged`, the window of the last
/// decrease the member judged its congestion against (0 for none): if the fleet's last decrease
/// is later, that congestion is added as stale. A member's counts taken in an earlier window
/// add only what any window counts (the core's `Window::into_next`).
///
/// The reply: whether the window was `taken`, the `capacity`, `epoch`, whether this member
/// `leads`, the window's `age` (ms), and what the fleet knows (`decreased`, `rtt_us`,
/// `baseline_us`, `estimate_us`, and `baselines`, what the last decision stored, only for a
/// leader that has no algorithm yet: a hand-over's); then, if the window was taken, its hash.
///
/// [`adaptive_tick`]: crate::RedisLimitBuilder::adaptive_tick
pub(super) const TICK_ARGS: &[Field] = &[
    Field::Text("candidate"),
    Field::Number("leader_ttl"),
    Field::Number("seen"),
    Field::Number("ended"),
    Field::Number("congested"),
    Field::Number("stale"),
    Field::Number("rejected"),
    Field::Number("shortest"),
    Field::Number("longest"),
    Field::Number("tolerance"),
    Field::Records(
        "series",
        &[
            Field::Text("prefix"),
            Field::Number("e"),
            Field::Number("o"),
            Field::Number("v"),
            Field::Number("t"),
            Field::Number("s"),
            Field::Number("q"),
            Field::Number("m"),
        ],
    ),
    Field::Number("starting"),
    Field::Number("judged"),
];
pub(super) const TICK_REPLY: &[Field] = &[
    Field::Number("taken"),
    Field::Number("capacity"),
    Field::Number("epoch"),
    Field::Number("leads"),
    Field::Number("age"),
    Field::Number("decreased"),
    Field::Number("rtt_us"),
    Field::Number("baseline_us"),
    Field::Number("estimate_us"),
    Field::Text("baselines"),
    Field::Pairs("window"),
];
const TICK: &str = r#"
local state, window, leader_key = KEYS[8], KEYS[9], KEYS[10]
local id, leader_ttl, seen = args.candidate, args.leader_ttl, args.seen
local floor_ms, interval_ms, tolerance = args.shortest, args.longest, args.tolerance
local epoch = tonumber(redis.call('HGET', state, 'epoch'))
if not epoch then
  epoch = 1
  redis.call('HSET', state, 'epoch', epoch, 'opened', now)
end
redis.call('HSET', state, 'ticked', now)
local own = seen == epoch
if own then redis.call('HINCRBY', window, 'ended', args.ended) end
local news, stale = args.congested, args.stale
if args.judged < tonumber(redis.call('HGET', state, 'decreased') or '0') - 1 then
  -- Judged before the member heard of the last decrease: admitted before it.
  news, stale = 0, stale + news
end
redis.call('HINCRBY', window, 'congested', news)
redis.call('HINCRBY', window, 'stale', stale)
redis.call('HINCRBY', window, 'rejected', args.rejected)
for _, series in ipairs(args.series) do
  local prefix = series.prefix
  redis.call('HINCRBY', window, prefix .. 'e', series.e)
  redis.call('HINCRBY', window, prefix .. 'o', series.o)
  redis.call('HINCRBY', window, prefix .. 'v', series.v)
  if own then
    redis.call('HINCRBY', window, prefix .. 't', series.t)
    redis.call('HINCRBY', window, prefix .. 's', series.s)
    redis.call('HINCRBY', window, prefix .. 'q', series.q)
    if series.m >= 0 then
      local old = tonumber(redis.call('HGET', window, prefix .. 'm'))
      if not old or series.m < old then redis.call('HSET', window, prefix .. 'm', series.m) end
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
local baselines = ''
if leads == 1 and args.starting == 1 then
  baselines = redis.call('HGET', state, 'baselines') or ''
end
return reply{taken = taken, capacity = cap, epoch = epoch, leads = leads, age = age,
  decreased = known[1], rtt_us = known[2], baseline_us = known[3], estimate_us = known[4],
  baselines = baselines, window = fields}
"#;

/// The leader's decision on the window it took: the `leader`'s id, the `window` that opened as
/// it took it (the decision is dropped unless both are still current: a leader that lost its
/// lease meanwhile decides nothing), the new `capacity`, the round trip, baseline and estimate
/// in µs (`-1` for none), and the algorithm's `handover` (what a new leader starts from). Sets
/// the capacity as `SET_CAPACITY` does, and tells every member: `a <epoch> <decreased> <rtt>
/// <baseline> <estimate>`. A decrease opens a window of its own (`epoch` one more than
/// `window`, and `decreased` it). Replies the capacity, or `-1` if the decision was dropped.
pub(super) const DECIDE_ARGS: &[Field] = &[
    Field::Text("leader"),
    Field::Text("window"),
    Field::Number("capacity"),
    Field::Number("rtt_us"),
    Field::Number("baseline_us"),
    Field::Number("estimate_us"),
    Field::Text("handover"),
];
pub(super) const DECIDE_REPLY: &[Field] = &[Field::Number("capacity")];
const DECIDE: &str = r#"
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
"#;

/// The scripts, made (and hashed) once per process.
pub(crate) struct Scripts {
    pub(crate) take: Script,
    pub(crate) release: Script,
    pub(crate) refresh: Script,
    pub(crate) set_capacity: Script,
    pub(crate) state: Script,
    pub(crate) tick: Script,
    pub(crate) decide: Script,
}

pub(crate) static SCRIPTS: LazyLock<Scripts> = LazyLock::new(|| {
    let script = |arguments: &[Field], reply: &[Field], body: &str| {
        Script::new(&format!(
            "{}{}{PRELUDE}{body}",
            lua_arguments(arguments),
            lua_reply(reply)
        ))
    };
    Scripts {
        take: script(TAKE_ARGS, TAKE_REPLY, TAKE),
        release: script(RELEASE_ARGS, RELEASE_REPLY, RELEASE),
        refresh: script(REFRESH_ARGS, REFRESH_REPLY, REFRESH),
        set_capacity: script(SET_CAPACITY_ARGS, SET_CAPACITY_REPLY, SET_CAPACITY),
        state: script(STATE_ARGS, STATE_REPLY, STATE),
        tick: script(TICK_ARGS, TICK_REPLY, TICK),
        decide: script(DECIDE_ARGS, DECIDE_REPLY, DECIDE),
    }
});
