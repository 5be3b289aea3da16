//! [`RedisLimit`]: one limit for a whole fleet of replicas, kept in Redis (feature `redis`).
//!
//! Resources servers run as many replicas, and what they protect is often shared by all of them:
//! a judge endpoint with a concurrency quota, a sandbox cluster, a licence server, a GPU pool. A
//! [`Limit`](crate::Limit) of N on each of 8 replicas is a fleet limit of 8N, wrong as soon as a
//! replica dies or one is added. A [`RedisLimit`] of N is N for the whole fleet: every process
//! that names it shares it, through the Redis they all reach.
//!
//! # Setup
//!
//! ```no_run
//! use std::time::Duration;
//! use tower_resources_operation::limit::redis::RedisLimit;
//! use tower_resources_operation::{Executor, Operation, ResourcesOperationLayer};
//!
//! # async fn serve() -> Result<(), Box<dyn std::error::Error>> {
//! // Eight judge calls at once across every replica that names "judges".
//! let judges = RedisLimit::builder("judges", 8)
//!     .lease_ttl(Duration::from_secs(10))
//!     .call_timeout(Duration::from_millis(500))
//!     .max_queued(256)
//!     .build("redis://redis.internal:6379/")?;
//! judges.ready().await?; // optional: fail at startup if Redis cannot be reached
//!
//! // An HTTP layer answers a turned-away operation with 503.
//! let layer = ResourcesOperationLayer::new_for_http(judges.clone())
//!     .operation(Operation::Judge)
//!     .executor(Executor::Inline)
//!     .queue_timeout(Duration::from_secs(30));
//! # drop(layer);
//! // More judges came up: the whole fleet admits 12 from now on, waiters at once.
//! judges.set_capacity(12).await?;
//! # Ok(())
//! # }
//! ```
//!
//! The capacity given to the builder is the fleet's only until the fleet has one: the first
//! process to reach Redis stores it, and from then on every process reads the stored one, which
//! [`set_capacity`](RedisLimit::set_capacity) changes for all. Build one `RedisLimit` per name
//! in a process and clone it: two built with one name each report the capacity under that name,
//! and the named instruments add them up.
//!
//! # How it works
//!
//! - **Leases.** A held place is a lease: an id in a sorted set, scored by when it expires on
//!   the server's clock. One task per limit and process extends all the process's leases and
//!   tickets in one call, every third of the lease TTL. A process killed with `kill -9` stops
//!   extending them: its places come back within the TTL.
//! - **A fair queue across the fleet.** An operation that finds no free place takes a ticket:
//!   an id in a second sorted set, scored by order of arrival (with its own expiry in a third,
//!   so a dead process's tickets leave the queue within the TTL). A place that frees up goes to
//!   the first ticket, whichever process holds it: first come, first served over the fleet.
//! - **Wake-ups without polling.** The script that frees a place hands it to the first waiter
//!   there and then, and publishes the waiter's id on the limit's channel. Each process
//!   subscribes once (on the connection it sends its commands on, in RESP3), and wakes the
//!   waiter, which holds its lease without another round trip. A wake-up lost (the connection
//!   dropped, a message missed) is covered by the refresh task, which also tells each waiter
//!   what became of its ticket, at least every [`fallback_poll`](RedisLimitBuilder::fallback_poll)
//!   while anything waits.
//! - **Cancellation.** A caller that goes away (its request dropped, its queue timeout passed)
//!   gives its ticket back, or its lease if the place was handed to it meanwhile, in the next
//!   call the refresh task makes (releases go out at once, batched). If that call cannot be
//!   made, the ticket or lease expires within the TTL.
//! - **Atomic steps, server time.** Every step that must be atomic is one Lua script, loaded
//!   once and called by its SHA; every expiry is computed from `redis.call('TIME')`, never from
//!   a replica's clock. An uncontended operation costs two round trips: one to take its lease,
//!   one to give it back; the refresh is one call per process every third of the TTL, whatever
//!   the number of leases.
//!
//! # Choosing the lease TTL
//!
//! The TTL is how long the fleet waits for a process that died before it hands its places to
//! others, so shorter is better, down to what pauses allow: a lease is extended every TTL/3,
//! so a process that stops for longer than about two thirds of the TTL (a long GC-like pause, a
//! frozen VM, Redis unreachable) loses its leases. The default, 10 s, gives back a dead
//! replica's places within 10 s and tolerates pauses of about 6 s. Keep it at least three times
//! the [call timeout](RedisLimitBuilder::call_timeout) (the builder checks), give every replica
//! the same TTL (a place handed to a waiter gets the TTL of the process that frees it), and
//! remember that the refresh costs one call per process per TTL/3.
//!
//! # Failures, and how each is answered
//!
//! Never a panic, never a hang. Every call to Redis has a timeout
//! ([`call_timeout`](RedisLimitBuilder::call_timeout), default 500 ms).
//!
//! | what happens | what the caller gets |
//! |---|---|
//! | Redis unreachable or slow (taking a place, or while waiting for one) | failing closed (the default): turned away as [`Rejection::Unavailable`]: HTTP `503`, gRPC `UNAVAILABLE`, `Err(Rejected)`, counted in `gym.resources.operation.rejected{rejection="unavailable"}`. Failing open ([`fail_open`](RedisLimitBuilder::fail_open)): admitted without the fleet limit, counted in `gym.resources.limit.failed_open` |
//! | the fleet queue is full ([`max_queued`](RedisLimitBuilder::max_queued)) | turned away at once as [`Rejection::QueueFull`], as a [`Limit`](crate::Limit)'s full queue |
//! | waited longer than a queue timeout ([`Acquire::queue_timeout`], a layer's `queue_timeout`) | turned away as [`Rejection::QueueTimeout`]; its ticket goes back |
//! | a lease lost while its operation runs (Redis restarted, a long pause) | the operation runs on; the loss is counted in `gym.resources.limit.leases_lost`; the lease is taken back if its place is still free and nobody waits, and never otherwise, so no place is knowingly given twice |
//! | Redis restarted in the middle of a load | callers get the configured answer within the call timeout while it is down; the connection comes back by itself, the capacity is stored again from the builder's, and each process's books (`queued`, `active`) stay balanced. Without persistence, operations admitted before the restart and after it may together exceed the capacity until the earlier ones end |
//! | a release that cannot reach Redis | retried with the next refresh for up to a TTL; the lease expires within the TTL anyway |
//! | a process killed (`kill -9`) | its leases and tickets expire within the TTL, and their places go to the next waiters |
//!
//! Failing closed by default is a choice: Envoy's global rate limit fails open unless told
//! otherwise, but a limit that protects a shared resource (a quota, a GPU pool) should not be
//! lifted without a word when its store goes away. A failing-closed limit says it
//! [may reject](Acquire::may_reject), so a layer that cannot answer a rejection
//! ([`Plain`](crate::protocol::Plain)) refuses it when it makes its service; failing open
//! without a queue bound it never rejects, and such a layer takes it.
//!
//! # What the metrics mean across a fleet
//!
//! Each replica reports its own operations: `queue_duration_ms` (its operations' wait for the
//! fleet's places, including the round trip to Redis), `duration_ms`, `queued` and `active`
//! (its waiters and its lease holders), `rejected` and `abandoned`. The `limit` gauge, and
//! `gym.resources.limit.capacity`, are the *fleet's* capacity, as last read from Redis (each
//! call returns it; a change is published to every replica). So:
//!
//! - `sum(gym_resources_operation_active) without (instance)` against
//!   `max(gym_resources_operation_limit) without (instance)` is the fleet's saturation;
//! - the fleet's queue time is the histogram summed over instances;
//! - `gym.resources.limit.failed_open` and `gym.resources.limit.leases_lost`, per replica and
//!   per limit name, say when the fleet ran without its limit, or lost track of a place.
//!
//! The Grafana dashboard (`dashboards/grafana/resources-operations.json`) has a row for the
//! fleet view: active summed over instances against the fleet limit, and the fleet's queue
//! time.
//!
//! # Why the `redis` crate
//!
//! `redis` 0.32 (redis-rs) builds on this crate's MSRV, 1.85 (its 1.x needs 1.88, `fred` 10
//! needs about the same), brings only what a limit needs with its `tokio-comp`,
//! `connection-manager` and `script` features, and its `ConnectionManager` reconnects by itself
//! and, over RESP3, carries the subscription on the same connection as the commands and
//! re-subscribes after a reconnect. `fred` has its own pool and reconnect policies, more than
//! one connection per limit needs, at a larger build.

mod scripts;

use std::collections::hash_map::RandomState;
use std::collections::{HashMap, HashSet};
use std::fmt;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::time::Duration;

use ::redis::aio::{ConnectionManager, ConnectionManagerConfig};
use ::redis::{
    Client, ErrorKind, FromRedisValue, IntoConnectionInfo, ProtocolVersion, PushInfo, PushKind,
    RedisError, RedisResult, Script, ScriptInvocation,
};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};
use tokio::sync::{Notify, OnceCell};
use tokio::time::Instant;

use self::scripts::{Asked, HOLDS, SCRIPTS, TAKEN_BACK, WAITS};
use super::local::check_name;
use super::{Acquire, AcquireError};
use crate::metrics::{Capacity, Reading};
use crate::Rejection;

/// A limit of operations at once shared by every process that names it, kept in Redis: see
/// [the module](self).
///
/// Clones share it. It implements [`Acquire`], so it goes wherever a [`Limit`](crate::Limit)
/// goes: a layer, a per-request layer's named limits, [`resources_operation`](crate::resources_operation).
///
/// Its first call starts two tasks of its own (the refresh and release task, and the listener
/// on its channel) on the tokio runtime it runs on: use it on one runtime, the one that lives
/// as long as the process serves.
#[derive(Clone)]
pub struct RedisLimit {
    shared: Arc<Shared>,
}

/// What the handles and permits share.
struct Shared {
    core: Arc<Core>,
    /// Releases and nudges for the process's task.
    commands: UnboundedSender<Command>,
    /// The receivers of the process's tasks, until the first call starts them.
    pending: Mutex<Option<(UnboundedReceiver<Command>, UnboundedReceiver<PushInfo>)>>,
    started: AtomicBool,
    /// What the metrics read, and the limit's identity there.
    gauge: Capacity,
}

/// What the process's tasks share with the handles: the connection, the settings, and the
/// process's own leases and waiters.
struct Core {
    name: &'static str,
    keys: Keys,
    client: Client,
    /// The connection, made at the first call that succeeds in making it.
    connection: OnceCell<ConnectionManager>,
    /// Where the connection sends what is published on the channel.
    pushes: UnboundedSender<PushInfo>,
    capacity_default: usize,
    max_queued: Option<usize>,
    fail_open: bool,
    lease_ttl: Duration,
    call_timeout: Duration,
    fallback_poll: Duration,
    local: Mutex<Local>,
    /// The fleet's capacity, as last read.
    capacity: AtomicUsize,
    /// This process's leases held by permits, and its waiters with a ticket.
    active: AtomicUsize,
    queued: AtomicUsize,
    failed_open: AtomicU64,
    leases_lost: AtomicU64,
    /// Whether the last call reached Redis (a change is worth a log line).
    reachable: AtomicBool,
}

/// The Redis names of one limit.
#[derive(Debug)]
struct Keys {
    capacity: String,
    holders: String,
    queue: String,
    waiting: String,
    arrivals: String,
    channel: String,
}

/// This process's ids: the leases its permits hold, and its waiters.
#[derive(Default)]
struct Local {
    held: HashSet<String>,
    waiting: HashMap<String, Arc<Slot>>,
}

/// Where a waiter hears what became of its ticket.
#[derive(Default)]
struct Slot {
    news: AtomicU8,
    notify: Notify,
    /// Whether it has a ticket in the fleet's queue (and so is refreshed, and counted).
    queued: AtomicBool,
}

const NO_NEWS: u8 = 0;
/// Ask again: a wake-up may have been lost, or the ticket is gone.
const POLL: u8 = 1;
/// The place was handed over: the lease is held.
const GRANTED: u8 = 2;

impl Slot {
    fn tell(&self, news: u8) {
        self.news.fetch_max(news, Ordering::AcqRel);
        self.notify.notify_one();
    }
}

/// What a permit or a waiter asks of the process's task.
enum Command {
    /// Give this lease or ticket back.
    Release(String),
    /// A waiter joined the queue: refresh at least every fallback poll from now.
    Nudge,
}

impl RedisLimit {
    /// A limit named `name` (shared by every process that names it), of `capacity` operations
    /// at once across the fleet if the fleet has no capacity yet: see [`RedisLimitBuilder`].
    ///
    /// The name is also the limit's attribute in the metrics, so it is written in code: 1 to
    /// 64 characters among `A-Z a-z 0-9 _ . : / -`, starting with a letter (the builder panics
    /// otherwise, as [`LimitBuilder::name`](crate::limit::LimitBuilder::name) does).
    #[track_caller]
    pub fn builder(name: &'static str, capacity: usize) -> RedisLimitBuilder {
        if let Err(error) = check_name(name) {
            panic!("{error}");
        }
        RedisLimitBuilder {
            name,
            capacity,
            lease_ttl: Duration::from_secs(10),
            call_timeout: Duration::from_millis(500),
            fallback_poll: Duration::from_secs(1),
            max_queued: None,
            fail_open: false,
            key_prefix: "tro".to_owned(),
        }
    }

    /// Its name.
    pub fn name(&self) -> &'static str {
        self.shared.core.name
    }

    /// The fleet's capacity, as last read from Redis (the builder's until then).
    pub fn capacity(&self) -> usize {
        self.shared.core.capacity.load(Ordering::Relaxed)
    }

    /// Places this process holds now.
    pub fn active(&self) -> usize {
        self.shared.core.active.load(Ordering::Relaxed)
    }

    /// Operations of this process waiting in the fleet's queue now.
    pub fn queued(&self) -> usize {
        self.shared.core.queued.load(Ordering::Relaxed)
    }

    /// Operations this process admitted without the fleet limit, failing open, so far.
    pub fn failed_open(&self) -> u64 {
        self.shared.core.failed_open.load(Ordering::Relaxed)
    }

    /// Leases of this process found lost while their operations ran, so far.
    pub fn leases_lost(&self) -> u64 {
        self.shared.core.leases_lost.load(Ordering::Relaxed)
    }

    /// The bound on the fleet's queue, if there is one.
    pub fn queue_bound(&self) -> Option<usize> {
        self.shared.core.max_queued
    }

    /// Connects to Redis and subscribes to the limit's channel, if that is not done yet: to
    /// find out at startup whether Redis can be reached. Calls connect by themselves, so this
    /// is optional.
    pub async fn ready(&self) -> RedisResult<()> {
        self.shared.start();
        let core = &self.shared.core;
        core.timed(core.connection()).await.map(drop)
    }

    /// Sets the capacity of the whole fleet. Raising it hands the new places to the fleet's
    /// waiters at once; lowering it revokes nobody: places above the new capacity are taken
    /// out as their operations end. Every process is told.
    pub async fn set_capacity(&self, capacity: usize) -> RedisResult<()> {
        self.shared.start();
        let core = &self.shared.core;
        let mut invocation = core.invocation(&SCRIPTS.set_capacity);
        invocation.arg(capacity);
        let capacity: usize = core.call(&invocation).await?;
        core.capacity.store(capacity, Ordering::Relaxed);
        Ok(())
    }

    /// The fleet's capacity, leases held and tickets waiting, read from Redis now.
    pub async fn fleet(&self) -> RedisResult<Fleet> {
        self.shared.start();
        let core = &self.shared.core;
        let invocation = core.invocation(&SCRIPTS.state);
        let (capacity, active, queued): (usize, usize, usize) = core.call(&invocation).await?;
        core.capacity.store(capacity, Ordering::Relaxed);
        Ok(Fleet {
            capacity,
            active,
            queued,
        })
    }
}

/// The state of a fleet limit across every process: [`RedisLimit::fleet`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Fleet {
    /// Operations the fleet admits at once.
    pub capacity: usize,
    /// Leases held now, by every process (above `capacity` for a while after it was lowered).
    pub active: usize,
    /// Tickets waiting now, from every process.
    pub queued: usize,
}

/// Makes a [`RedisLimit`]: its lease TTL, call timeout, queue bound, and what it does when
/// Redis cannot be reached.
///
/// ```
/// use std::time::Duration;
/// use tower_resources_operation::limit::redis::RedisLimit;
///
/// let sandboxes = RedisLimit::builder("sandboxes", 32)
///     .lease_ttl(Duration::from_secs(15))
///     .max_queued(100)
///     .fail_open()
///     .build("redis://127.0.0.1:6379/")
///     .unwrap(); // connects at the first call, not here
/// assert_eq!((sandboxes.name(), sandboxes.capacity()), ("sandboxes", 32));
/// ```
#[derive(Clone, Debug)]
#[must_use = "a builder makes nothing until `build`"]
pub struct RedisLimitBuilder {
    name: &'static str,
    capacity: usize,
    lease_ttl: Duration,
    call_timeout: Duration,
    fallback_poll: Duration,
    max_queued: Option<usize>,
    fail_open: bool,
    key_prefix: String,
}

impl RedisLimitBuilder {
    /// How long a held place outlives a process that stops extending it (see
    /// [choosing the TTL](self#choosing-the-lease-ttl)). Defaults to 10 s; at least three
    /// times the call timeout.
    pub fn lease_ttl(mut self, ttl: Duration) -> Self {
        self.lease_ttl = ttl;
        self
    }

    /// How long any one call to Redis may take, connecting included, before the limit gives
    /// the configured answer. Defaults to 500 ms.
    pub fn call_timeout(mut self, timeout: Duration) -> Self {
        self.call_timeout = timeout;
        self
    }

    /// How often, at most, a waiter learns what became of its ticket while no wake-up reaches
    /// it (the fallback for a lost wake-up; one call per process, whatever the number of
    /// waiters). Defaults to 1 s; never less often than every third of the TTL.
    pub fn fallback_poll(mut self, every: Duration) -> Self {
        self.fallback_poll = every;
        self
    }

    /// At most `max_queued` operations wait, across the whole fleet: one more is turned away
    /// at once with [`Rejection::QueueFull`]. `0` turns away every operation that finds no free
    /// place. Defaults to no bound.
    pub fn max_queued(mut self, max_queued: usize) -> Self {
        self.max_queued = Some(max_queued);
        self
    }

    /// When Redis cannot be reached, admits the operation without the fleet limit, and counts
    /// it in `gym.resources.limit.failed_open`, instead of turning it away as `unavailable`
    /// (the default).
    pub fn fail_open(mut self) -> Self {
        self.fail_open = true;
        self
    }

    /// When Redis cannot be reached, turns the operation away with [`Rejection::Unavailable`].
    /// The default.
    pub fn fail_closed(mut self) -> Self {
        self.fail_open = false;
        self
    }

    /// Prefixes the limit's Redis keys and channel with `prefix` (`{prefix:name}:...`, one hash
    /// slot). Defaults to `tro`.
    pub fn key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.key_prefix = prefix.into();
        self
    }

    /// The limit, on the Redis at `server` (a `redis://` URL, or anything the `redis` crate
    /// takes as connection info). It connects at its first call, not here, so a process can
    /// start while Redis is away; see [`RedisLimit::ready`].
    ///
    /// An error if `server` is not valid connection info, or the TTL is shorter than three call
    /// timeouts or than 30 ms.
    pub fn build(self, server: impl IntoConnectionInfo) -> RedisResult<RedisLimit> {
        if self.lease_ttl < self.call_timeout * 3 || self.lease_ttl < Duration::from_millis(30) {
            return Err(RedisError::from((
                ErrorKind::InvalidClientConfig,
                "tower-resources-operation: a fleet limit's lease TTL must be at least three call \
                 timeouts, and at least 30 ms",
            )));
        }
        let mut info = server.into_connection_info()?;
        // The subscription shares the commands' connection, which RESP3 allows.
        info.redis.protocol = ProtocolVersion::RESP3;
        let client = Client::open(info)?;
        let (pushes, pushed) = unbounded_channel();
        let (commands, commanded) = unbounded_channel();
        let slot = format!("{{{}:{}}}", self.key_prefix, self.name);
        let core = Arc::new(Core {
            name: self.name,
            keys: Keys {
                capacity: format!("{slot}:capacity"),
                holders: format!("{slot}:holders"),
                queue: format!("{slot}:queue"),
                waiting: format!("{slot}:waiting"),
                arrivals: format!("{slot}:arrivals"),
                channel: format!("{slot}:wake"),
            },
            client,
            connection: OnceCell::new(),
            pushes,
            capacity_default: self.capacity,
            max_queued: self.max_queued,
            fail_open: self.fail_open,
            lease_ttl: self.lease_ttl,
            call_timeout: self.call_timeout,
            fallback_poll: self.fallback_poll.min(self.lease_ttl / 3),
            local: Mutex::default(),
            capacity: AtomicUsize::new(self.capacity),
            active: AtomicUsize::new(0),
            queued: AtomicUsize::new(0),
            failed_open: AtomicU64::new(0),
            leases_lost: AtomicU64::new(0),
            reachable: AtomicBool::new(true),
        });
        let shared = Arc::new_cyclic(|shared: &Weak<Shared>| {
            let shared = shared.clone();
            let gauge = Capacity::of_limit(
                Some(self.name),
                move || shared.upgrade().map(|shared| shared.core.reading()),
                None,
            );
            Shared {
                core,
                commands,
                pending: Mutex::new(Some((commanded, pushed))),
                started: AtomicBool::new(false),
                gauge,
            }
        });
        Ok(RedisLimit { shared })
    }
}

impl Shared {
    /// Starts the process's tasks for this limit, once, on the runtime of the first call.
    fn start(&self) {
        if self.started.load(Ordering::Acquire) {
            return;
        }
        let Some((commands, pushes)) = lock(&self.pending).take() else {
            return;
        };
        self.started.store(true, Ordering::Release);
        tokio::spawn(keep(Arc::clone(&self.core), commands));
        tokio::spawn(listen(Arc::downgrade(&self.core), pushes));
    }

    /// The answer to an operation that could not reach Redis: turned away, or admitted without
    /// the fleet limit.
    fn failed(self: &Arc<Self>, error: RedisError) -> Result<RedisPermit, AcquireError> {
        if self.core.fail_open {
            self.core.failed_open.fetch_add(1, Ordering::Relaxed);
            Ok(RedisPermit {
                shared: Arc::clone(self),
                lease: None,
            })
        } else {
            Err(AcquireError::failed(error))
        }
    }

    /// Takes a place of the fleet, waiting for one in its queue if it has to.
    async fn acquire(self: Arc<Self>) -> Result<RedisPermit, AcquireError> {
        self.start();
        let mut waiter = Waiter::new(&self);
        loop {
            waiter.asked = true;
            let asked = self.core.ask(&waiter.id).await;
            match asked {
                Ok(Asked::Granted) => return Ok(waiter.admitted()),
                Ok(Asked::Waiting) => {
                    waiter.queue();
                    if waiter.wait().await {
                        return Ok(waiter.admitted());
                    }
                }
                Ok(Asked::Full) => {
                    // No ticket and no lease of this id is left in Redis.
                    waiter.asked = false;
                    return Err(AcquireError::rejected(Rejection::QueueFull));
                }
                Err(error) => return self.failed(error),
            }
        }
    }
}

/// One operation waiting for its place: registered so that wake-ups reach it, and, if it goes
/// away before it is admitted, its ticket (or the lease handed to it) goes back.
struct Waiter {
    shared: Arc<Shared>,
    id: String,
    slot: Arc<Slot>,
    /// Whether Redis may hold a ticket or a lease of this id.
    asked: bool,
    admitted: bool,
}

impl Waiter {
    fn new(shared: &Arc<Shared>) -> Self {
        let id = next_id();
        let slot = Arc::new(Slot::default());
        lock(&shared.core.local)
            .waiting
            .insert(id.clone(), Arc::clone(&slot));
        Self {
            shared: Arc::clone(shared),
            id,
            slot,
            asked: false,
            admitted: false,
        }
    }

    /// It has a ticket in the fleet's queue: counted, and refreshed by the process's task.
    fn queue(&mut self) {
        if !self.slot.queued.swap(true, Ordering::Relaxed) {
            let core = &self.shared.core;
            if core.queued.fetch_add(1, Ordering::Relaxed) == 0 {
                let _ = self.shared.commands.send(Command::Nudge);
            }
        }
    }

    /// Waits for news of its ticket: `true` if the place was handed to it, `false` to ask again
    /// (a wake-up may have been lost, the ticket may be gone, Redis may be unreachable). Asks
    /// again after a TTL without news, in case the process's task is gone.
    async fn wait(&self) -> bool {
        loop {
            let heard =
                tokio::time::timeout(self.shared.core.lease_ttl, self.slot.notify.notified()).await;
            match self.slot.news.swap(NO_NEWS, Ordering::AcqRel) {
                GRANTED => return true,
                POLL => return false,
                _ if heard.is_err() => return false,
                _ => {}
            }
        }
    }

    /// The place is its: the lease becomes a permit's.
    fn admitted(mut self) -> RedisPermit {
        self.admitted = true;
        let core = &self.shared.core;
        let id = std::mem::take(&mut self.id);
        {
            let mut local = lock(&core.local);
            local.waiting.remove(&id);
            local.held.insert(id.clone());
        }
        if self.slot.queued.load(Ordering::Relaxed) {
            core.queued.fetch_sub(1, Ordering::Relaxed);
        }
        core.active.fetch_add(1, Ordering::Relaxed);
        RedisPermit {
            shared: Arc::clone(&self.shared),
            lease: Some(id),
        }
    }
}

impl Drop for Waiter {
    fn drop(&mut self) {
        if self.admitted {
            return;
        }
        let core = &self.shared.core;
        lock(&core.local).waiting.remove(&self.id);
        if self.slot.queued.load(Ordering::Relaxed) {
            core.queued.fetch_sub(1, Ordering::Relaxed);
        }
        if self.asked {
            let id = std::mem::take(&mut self.id);
            let _ = self.shared.commands.send(Command::Release(id));
        }
    }
}

/// A place of a [`RedisLimit`]: a lease the process extends while the permit lives, given
/// back when it drops. A permit admitted while Redis could not be reached, by a limit that
/// fails open, holds no lease.
pub struct RedisPermit {
    shared: Arc<Shared>,
    lease: Option<String>,
}

impl RedisPermit {
    /// Whether it was admitted without the fleet limit, because Redis could not be reached
    /// and the limit fails open.
    pub fn failed_open(&self) -> bool {
        self.lease.is_none()
    }
}

impl Drop for RedisPermit {
    fn drop(&mut self) {
        if let Some(id) = self.lease.take() {
            let core = &self.shared.core;
            lock(&core.local).held.remove(&id);
            core.active.fetch_sub(1, Ordering::Relaxed);
            // Sent at once, by the process's task; if it cannot be, the lease expires.
            let _ = self.shared.commands.send(Command::Release(id));
        }
    }
}

impl fmt::Debug for RedisPermit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisPermit")
            .field("limit", &self.shared.core.name)
            .field("lease", &self.lease)
            .finish()
    }
}

impl Acquire for RedisLimit {
    type Permit = RedisPermit;

    async fn acquire(&self) -> Result<Self::Permit, AcquireError> {
        Arc::clone(&self.shared).acquire().await
    }

    async fn acquire_owned(self) -> Result<Self::Permit, AcquireError> {
        self.shared.acquire().await
    }

    fn capacity(&self) -> Option<Capacity> {
        Some(self.shared.gauge.clone())
    }

    /// `true` when it fails closed (Redis unreachable turns operations away) or bounds its
    /// queue.
    fn may_reject(&self) -> bool {
        !self.shared.core.fail_open || self.shared.core.max_queued.is_some()
    }
}

impl fmt::Debug for RedisLimit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let core = &self.shared.core;
        f.debug_struct("RedisLimit")
            .field("name", &core.name)
            .field("capacity", &self.capacity())
            .field("active", &self.active())
            .field("queued", &self.queued())
            .field("queue_bound", &core.max_queued)
            .field("lease_ttl", &core.lease_ttl)
            .field("call_timeout", &core.call_timeout)
            .field("fail_open", &core.fail_open)
            .field("keys", &core.keys)
            .finish()
    }
}

impl Core {
    /// What the metrics report of this limit in this process.
    fn reading(&self) -> Reading {
        Reading {
            capacity: self.capacity.load(Ordering::Relaxed),
            active: self.active.load(Ordering::Relaxed),
            queued: self.queued.load(Ordering::Relaxed),
            failed_open: Some(self.failed_open.load(Ordering::Relaxed)),
            leases_lost: Some(self.leases_lost.load(Ordering::Relaxed)),
            ..Reading::default()
        }
    }

    /// The connection, made (and subscribed) if it is not yet.
    async fn connection(&self) -> RedisResult<ConnectionManager> {
        let connection = self
            .connection
            .get_or_try_init(|| async {
                let timeout = self.call_timeout;
                let config = ConnectionManagerConfig::new()
                    .set_connection_timeout(timeout)
                    .set_response_timeout(timeout)
                    .set_number_of_retries(1)
                    .set_factor(10)
                    .set_max_delay(u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX))
                    .set_push_sender(self.pushes.clone())
                    .set_automatic_resubscription();
                let mut connection =
                    ConnectionManager::new_with_config(self.client.clone(), config).await?;
                connection.subscribe(&self.keys.channel).await?;
                Ok::<_, RedisError>(connection)
            })
            .await?;
        Ok(connection.clone())
    }

    /// `script` with the limit's keys and common arguments; the caller adds its own.
    fn invocation<'a>(&self, script: &'a Script) -> ScriptInvocation<'a> {
        let keys = &self.keys;
        let mut invocation = script.prepare_invoke();
        invocation
            .key(&keys.capacity)
            .key(&keys.holders)
            .key(&keys.queue)
            .key(&keys.waiting)
            .key(&keys.arrivals)
            .arg(&keys.channel)
            .arg(u64::try_from(self.lease_ttl.as_millis()).unwrap_or(u64::MAX))
            .arg(self.capacity_default);
        invocation
    }

    /// Runs `invocation` (by its SHA; loaded first if Redis does not know it), within the call
    /// timeout.
    async fn call<T: FromRedisValue>(&self, invocation: &ScriptInvocation<'_>) -> RedisResult<T> {
        self.timed(async {
            let mut connection = self.connection().await?;
            invocation.invoke_async(&mut connection).await
        })
        .await
    }

    /// `call`, or a timeout error after the call timeout; notes whether Redis was reached.
    async fn timed<T>(
        &self,
        call: impl std::future::Future<Output = RedisResult<T>>,
    ) -> RedisResult<T> {
        let result = match tokio::time::timeout(self.call_timeout, call).await {
            Ok(result) => result,
            Err(_) => Err(RedisError::from(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!(
                    "Redis did not answer within the fleet limit's call timeout ({:?})",
                    self.call_timeout
                ),
            ))),
        };
        self.note(result.as_ref().err());
        result
    }

    /// Says once, when Redis stops or starts answering, what the limit does meanwhile.
    fn note(&self, error: Option<&RedisError>) {
        let reachable = error.is_none();
        if self.reachable.swap(reachable, Ordering::Relaxed) == reachable {
            return;
        }
        let what = if self.fail_open {
            "admits operations without the fleet limit (fail open)"
        } else {
            "turns operations away as unavailable (fail closed)"
        };
        #[cfg(feature = "tracing")]
        match error {
            Some(error) => tracing::warn!(
                target: "tower_resources_operation",
                limit = self.name,
                "tower-resources-operation: the fleet limit {:?} cannot reach Redis ({error}); \
                 until it can, it {what}",
                self.name,
            ),
            None => tracing::info!(
                target: "tower_resources_operation",
                limit = self.name,
                "tower-resources-operation: the fleet limit {:?} reaches Redis again",
                self.name
            ),
        }
        // Without `tracing`, the loss only, on standard error.
        #[cfg(not(feature = "tracing"))]
        if let Some(error) = error {
            eprintln!(
                "WARN tower_resources_operation: the fleet limit {:?} cannot reach Redis ({error}); \
                 until it can, it {what}",
                self.name,
            );
        }
    }

    /// Asks for a place for `id`: a lease, a ticket, or the queue is full.
    async fn ask(&self, id: &str) -> RedisResult<Asked> {
        let mut invocation = self.invocation(&SCRIPTS.acquire);
        let max_queued = self
            .max_queued
            .map_or(-1, |bound| i64::try_from(bound).unwrap_or(i64::MAX));
        invocation.arg(id).arg(max_queued);
        let (status, capacity): (i64, usize) = self.call(&invocation).await?;
        self.capacity.store(capacity, Ordering::Relaxed);
        Ok(Asked::from_status(status))
    }

    /// Gives back the leases and tickets `ids`.
    async fn release(&self, ids: &[String]) -> RedisResult<()> {
        let mut invocation = self.invocation(&SCRIPTS.release);
        invocation.arg(ids);
        let capacity: usize = self.call(&invocation).await?;
        self.capacity.store(capacity, Ordering::Relaxed);
        Ok(())
    }

    /// Extends this process's leases and tickets, in one call, and acts on what became of them:
    /// a lost lease is counted (and taken back if its place was free), a waiter whose place was
    /// handed over without its wake-up reaching it is admitted, one whose ticket is gone asks
    /// again. If Redis cannot be reached, every waiter asks again, to get the configured answer.
    async fn refresh(&self) {
        let (held, waiting): (Vec<String>, Vec<(String, Arc<Slot>)>) = {
            let local = lock(&self.local);
            (
                local.held.iter().cloned().collect(),
                local
                    .waiting
                    .iter()
                    .filter(|(_, slot)| slot.queued.load(Ordering::Relaxed))
                    .map(|(id, slot)| (id.clone(), Arc::clone(slot)))
                    .collect(),
            )
        };
        if held.is_empty() && waiting.is_empty() {
            return;
        }
        let mut invocation = self.invocation(&SCRIPTS.refresh);
        invocation
            .arg(held.len())
            .arg(&held)
            .arg(waiting.iter().map(|(id, _)| id).collect::<Vec<_>>());
        let statuses: Vec<i64> = match self.call(&invocation).await {
            Ok(statuses) => statuses,
            Err(_) => {
                for (_, slot) in &waiting {
                    slot.tell(POLL);
                }
                return;
            }
        };
        let Some((&capacity, statuses)) = statuses.split_first() else {
            return;
        };
        self.capacity
            .store(usize::try_from(capacity).unwrap_or(0), Ordering::Relaxed);
        let (of_held, of_waiting) = statuses.split_at(held.len().min(statuses.len()));
        for (id, &status) in held.iter().zip(of_held) {
            match status {
                HOLDS => {}
                TAKEN_BACK => {
                    self.leases_lost.fetch_add(1, Ordering::Relaxed);
                }
                _ => {
                    // Lost, and its place may be someone else's now: no longer extended.
                    self.leases_lost.fetch_add(1, Ordering::Relaxed);
                    lock(&self.local).held.remove(id);
                }
            }
        }
        for ((_, slot), &status) in waiting.iter().zip(of_waiting) {
            match status {
                HOLDS => slot.tell(GRANTED),
                WAITS => {}
                // Gone: it joins the queue again.
                _ => slot.tell(POLL),
            }
        }
    }

    /// How long the process's task waits between refreshes: a third of the TTL, or the
    /// fallback poll while something waits or a release is to be retried.
    fn every(&self, urgent: bool) -> Duration {
        if urgent || self.queued.load(Ordering::Relaxed) > 0 {
            self.fallback_poll
        } else {
            self.lease_ttl / 3
        }
    }

    /// What was published on the limit's channel: places handed to waiters, or a new capacity.
    fn heard(&self, message: &str) {
        if let Some(ids) = message.strip_prefix("g ") {
            let local = lock(&self.local);
            for id in ids.split(' ') {
                if let Some(slot) = local.waiting.get(id) {
                    slot.tell(GRANTED);
                }
            }
        } else if let Some(capacity) = message.strip_prefix("c ") {
            if let Ok(capacity) = capacity.parse() {
                self.capacity.store(capacity, Ordering::Relaxed);
            }
        }
    }

    /// Every waiter asks again (the connection dropped or came back: wake-ups may be lost).
    fn poll_all(&self) {
        for slot in lock(&self.local).waiting.values() {
            slot.tell(POLL);
        }
    }
}

/// The process's task for one limit: sends releases at once (batched), retries those that
/// failed, and refreshes the process's leases and tickets every third of the TTL (at the
/// fallback poll while anything waits). Ends once every handle and permit is gone.
async fn keep(core: Arc<Core>, mut commands: UnboundedReceiver<Command>) {
    let mut retry: Vec<(String, Instant)> = Vec::new();
    let mut next = Instant::now() + core.every(false);
    loop {
        match tokio::time::timeout_at(next, commands.recv()).await {
            Ok(Some(first)) => {
                let mut ids = Vec::new();
                let mut nudged = false;
                let mut take = |command| match command {
                    Command::Release(id) => ids.push(id),
                    Command::Nudge => nudged = true,
                };
                take(first);
                while let Ok(command) = commands.try_recv() {
                    take(command);
                }
                if !ids.is_empty() && core.release(&ids).await.is_err() {
                    let now = Instant::now();
                    retry.extend(ids.into_iter().map(|id| (id, now)));
                }
                if nudged || !retry.is_empty() {
                    next = next.min(Instant::now() + core.every(!retry.is_empty()));
                }
            }
            Ok(None) => {
                if !retry.is_empty() {
                    let ids: Vec<String> = retry.drain(..).map(|(id, _)| id).collect();
                    let _ = core.release(&ids).await;
                }
                return;
            }
            Err(_) => {
                // A lease given back after it expired is moot.
                retry.retain(|(_, at)| at.elapsed() < core.lease_ttl);
                if !retry.is_empty() {
                    let ids: Vec<String> = retry.iter().map(|(id, _)| id.clone()).collect();
                    if core.release(&ids).await.is_ok() {
                        retry.clear();
                    }
                }
                core.refresh().await;
                next = Instant::now() + core.every(!retry.is_empty());
            }
        }
    }
}

/// The process's listener for one limit: routes what the connection hears on the limit's
/// channel, and makes every waiter ask again when the connection drops or comes back. Ends
/// when the limit is gone.
async fn listen(core: Weak<Core>, mut pushes: UnboundedReceiver<PushInfo>) {
    while let Some(push) = pushes.recv().await {
        let Some(core) = core.upgrade() else {
            return;
        };
        match push.kind {
            PushKind::Message => {
                if let Some(Ok(message)) = push.data.get(1).map(String::from_redis_value) {
                    core.heard(&message);
                }
            }
            PushKind::Disconnection | PushKind::Subscribe => core.poll_all(),
            _ => {}
        }
    }
}

/// A new id, unique across the fleet: this process's random token and a count.
fn next_id() -> String {
    static TOKEN: OnceLock<u64> = OnceLock::new();
    static COUNT: AtomicU64 = AtomicU64::new(0);
    let token = *TOKEN.get_or_init(|| {
        let mut hasher = RandomState::new().build_hasher();
        hasher.write_u32(std::process::id());
        if let Ok(since) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
            hasher.write_u128(since.as_nanos());
        }
        hasher.finish()
    });
    let count = COUNT.fetch_add(1, Ordering::Relaxed);
    format!("{token:016x}:{count}")
}

/// Locks `mutex`, whatever a panic left in it (the maps stay consistent step by step).
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}
