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
const PRELUDE: &str = include_str!("lua/prelude.lua");

/// Asks for a place for `id`, with `max_queued` the bound on the queue (`-1` for none).
/// `status` 1: it holds a lease (taken now, or the place handed over while it waited, taken
/// up); 0: it waits in the queue (its ticket refreshed); 2: turned away (the queue is full).
pub(super) const TAKE_ARGS: &[Field] = &[Field::Text("id"), Field::Number("max_queued")];
pub(super) const TAKE_REPLY: &[Field] = &[
    Field::Number("status"),
    Field::Number("capacity"),
    Field::Number("replicas"),
];
const TAKE: &str = include_str!("lua/take.lua");

/// Gives back the leases, claims and tickets `ids` (a permit dropped, a wait given up); their
/// places go to the first waiters.
pub(super) const RELEASE_ARGS: &[Field] = &[Field::Texts("ids")];
pub(super) const RELEASE_REPLY: &[Field] = &[Field::Number("capacity")];
const RELEASE: &str = include_str!("lua/release.lua");

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
const REFRESH: &str = include_str!("lua/refresh.lua");

/// Sets the fleet's `capacity`, hands the new places to the first waiters at once, and tells
/// every member.
pub(super) const SET_CAPACITY_ARGS: &[Field] = &[Field::Number("capacity")];
pub(super) const SET_CAPACITY_REPLY: &[Field] = &[Field::Number("capacity")];
const SET_CAPACITY: &str = include_str!("lua/set_capacity.lua");

/// The fleet's state: its capacity, places held (of which by members not heard from), tickets
/// waiting, members alive (the asking `member` counted alive), and whether an adaptive limit
/// ticked within a lease TTL.
pub(super) const STATE_ARGS: &[Field] = &[Field::Text("member")];
pub(super) const STATE_REPLY: &[Field] = &[
    Field::Number("capacity"),
    Field::Number("active"),
    Field::Number("unheard"),
    Field::Number("queued"),
    Field::Number("replicas"),
    Field::Number("adaptive"),
];
const STATE: &str = include_str!("lua/state.lua");

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
const TICK: &str = include_str!("lua/tick.lua");

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
const DECIDE: &str = include_str!("lua/decide.lua");

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
