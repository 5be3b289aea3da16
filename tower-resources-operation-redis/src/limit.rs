//! [`RedisLimit`], the handle: how an operation takes a place of the fleet ([`Acquire`]), what
//! it holds meanwhile ([`RedisPermit`]), and what a process can read or change of the fleet.

use std::borrow::Cow;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use opentelemetry::metrics::Meter;
use tokio::sync::mpsc::UnboundedSender;
use tower_resources_operation::limit::{Acquire, AcquireError, Capacity, Ended};
use tower_resources_operation::Rejection;

use crate::builder::RedisLimitBuilder;
use crate::core::Core;
use crate::error::Error;
use crate::scripts::Asked;
use crate::waiters::{lock, Waiter};

/// A limit of operations at once shared by every process that names it, kept in Redis: see
/// [the crate](crate).
///
/// Clones share it. It implements [`Acquire`], so it goes wherever a `Limit` of
/// `tower-resources-operation` goes: a layer, a per-request layer's named limits,
/// `resources_operation`.
///
/// Made by [`RedisLimit::builder`]; its background work runs on the tokio runtime
/// [`build`](RedisLimitBuilder::build) was called on, or wherever the caller of
/// [`build_pair`](RedisLimitBuilder::build_pair) runs it.
#[derive(Clone)]
pub struct RedisLimit {
    shared: Arc<Shared>,
}

/// What the handles, waiters and permits share.
pub(crate) struct Shared {
    pub(crate) core: Arc<Core>,
    /// Leases and tickets to give back, for the background task.
    releases: UnboundedSender<String>,
    /// What the metrics read, and the limit's identity there.
    gauge: Capacity,
}

impl Shared {
    pub(crate) fn new(core: Arc<Core>, releases: UnboundedSender<String>, gauge: Capacity) -> Self {
        Self {
            core,
            releases,
            gauge,
        }
    }

    /// Gives the lease or ticket `id` back, by the background task, at once.
    pub(crate) fn release(&self, id: String) {
        // If the task is gone, the lease or ticket expires within the TTL.
        let _ = self.releases.send(id);
    }

    /// The answer to an operation that could not reach Redis: turned away, or admitted without
    /// the fleet limit.
    fn failed(self: &Arc<Self>, error: Error) -> Result<RedisPermit, AcquireError> {
        if self.core.fail_open {
            self.core.failed_open.fetch_add(1, Ordering::Relaxed);
            Ok(RedisPermit::new(Arc::clone(self), None))
        } else {
            Err(AcquireError::failed(error))
        }
    }

    /// Takes a place of the fleet, waiting for one in its queue if it has to.
    ///
    /// Boxed, so that a caller's future holds a pointer to it, not the whole wait inline (see
    /// `Core::call`).
    fn acquire(
        self: Arc<Self>,
    ) -> Pin<Box<dyn Future<Output = Result<RedisPermit, AcquireError>> + Send>> {
        Box::pin(self.wait_for_place())
    }

    async fn wait_for_place(self: Arc<Self>) -> Result<RedisPermit, AcquireError> {
        let mut waiter = Waiter::new(&self);
        loop {
            let asked_before = waiter.asked;
            waiter.asked = true;
            match self.core.ask(&waiter.id).await {
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
                    if let Some(control) = &self.core.adaptive {
                        control.rejected();
                    }
                    return Err(AcquireError::rejected(Rejection::QueueFull));
                }
                Err(error) => {
                    if error.is_short_circuited() {
                        // Not asked this time: only an earlier ask may have left a ticket.
                        waiter.asked = asked_before;
                    }
                    return self.failed(error);
                }
            }
        }
    }
}

impl RedisLimit {
    /// A limit named `name` (shared by every process that names it), of `capacity` operations
    /// at once across the fleet if the fleet has no capacity yet: see [`RedisLimitBuilder`].
    ///
    /// The name is also the limit's attribute in the metrics: 1 to 64 characters among
    /// `A-Z a-z 0-9 _ . : / -`, starting with a letter. It may be a `&'static str` or a
    /// `String` read from configuration: it is checked once, here, and a `String` is kept for
    /// the life of the process, once per distinct name (a process names a few fleet limits, not
    /// one per request).
    ///
    /// ```
    /// use tower_resources_operation_redis::RedisLimit;
    ///
    /// let from_config = String::from("judges");
    /// let builder = RedisLimit::builder(from_config, 8);
    /// # drop(builder);
    /// ```
    ///
    /// # Panics
    ///
    /// If `name` cannot name a limit ([`check_name`](tower_resources_operation::limit::check_name)
    /// says why), as `LimitBuilder::name` of `tower-resources-operation` does, or if `capacity`
    /// is 0, as `Limit::new(0)` does.
    #[track_caller]
    pub fn builder(name: impl Into<Cow<'static, str>>, capacity: usize) -> RedisLimitBuilder {
        RedisLimitBuilder::new(name.into(), capacity)
    }

    pub(crate) fn from_shared(shared: Arc<Shared>) -> Self {
        Self { shared }
    }

    /// The limit's name: its Redis keys, and its attribute in the metrics.
    pub fn name(&self) -> &'static str {
        self.shared.core.name
    }

    /// The Redis the limit was given, as its messages say it (without a password).
    pub fn address(&self) -> &str {
        self.shared.core.transport.address()
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

    /// Whether the last call reached Redis. While it did not, callers are answered at once
    /// (turned away, or admitted without the fleet limit), and Redis is asked again in the
    /// background every [fallback poll](RedisLimitBuilder::fallback_poll).
    pub fn is_reachable(&self) -> bool {
        !self.shared.core.health.is_down()
    }

    /// Connects to Redis and subscribes to the limit's channel if that is not done yet, or else
    /// sends it a `PING`: to find out (at startup, say) whether Redis answers now. Calls
    /// connect by themselves, so this is optional.
    ///
    /// Always asks Redis, even while it is down (as [`set_capacity`](Self::set_capacity) and
    /// [`fleet`](Self::fleet) do); its answer ends an outage.
    pub async fn ready(&self) -> Result<(), Error> {
        self.shared.core.connect().await
    }

    /// Sets the capacity of the whole fleet. Raising it hands the new places to the fleet's
    /// waiters at once; lowering it revokes nobody: places above the new capacity are taken
    /// out as their operations end. Every process is told.
    pub async fn set_capacity(&self, capacity: usize) -> Result<(), Error> {
        self.shared.core.set_capacity(capacity).await.map(drop)
    }

    /// Whether the fleet's capacity is set by a controller
    /// ([`RedisLimitBuilder::adaptive`]; see [the crate](crate#an-adaptive-fleet-limit)).
    pub fn is_adaptive(&self) -> bool {
        self.shared.core.adaptive.is_some()
    }

    /// Whether this process decides the fleet's capacity now: an adaptive limit's leader, as
    /// of its last tick. At most one process of the fleet does at a time; `false` for a limit
    /// that is not adaptive.
    pub fn is_leader(&self) -> bool {
        self.shared
            .core
            .adaptive
            .as_ref()
            .is_some_and(|c| c.leads())
    }

    /// Windows of the fleet this process decided, as its leader, so far.
    pub fn decisions(&self) -> u64 {
        self.shared
            .core
            .adaptive
            .as_ref()
            .map_or(0, |c| c.decisions())
    }

    /// What the fleet's controller measured, as this process last heard: the run time its
    /// algorithm takes as normal (its baseline) and its recent estimate, the figures every
    /// replica reports as `gym.resources.limit.adaptive.{baseline,estimate}_ms`. `(None, None)`
    /// for a limit that is not adaptive, or before the algorithm has them.
    pub fn measured(&self) -> (Option<Duration>, Option<Duration>) {
        self.shared
            .core
            .adaptive
            .as_ref()
            .map(|c| c.measured())
            .unwrap_or_default()
    }

    /// The bounds an adaptive limit's controller keeps the capacity within.
    pub fn adaptive_bounds(&self) -> Option<std::ops::RangeInclusive<usize>> {
        self.shared.core.adaptive.as_ref().map(|c| c.bounds())
    }

    /// The fleet's capacity, leases held and tickets waiting, read from Redis now.
    pub async fn fleet(&self) -> Result<Fleet, Error> {
        self.shared.core.state().await
    }

    /// Reports this limit's own instruments, `gym.resources.limit.failed_open` and
    /// `gym.resources.limit.leases_lost` (see [`metrics`](crate::metrics)), through `meter`,
    /// for as long as the limit lives. The same as [`RedisLimitBuilder::meter`].
    ///
    /// Register each limit once per meter provider: one limit per name in a process, cloned
    /// where it is needed. Two limits of one name registered on one provider observe the same
    /// series, and OpenTelemetry keeps the last observation.
    pub fn register_metrics(&self, meter: &Meter) {
        crate::metrics::register(meter, &self.shared);
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

/// A place of a [`RedisLimit`]: a lease the process extends while the permit lives, given
/// back when it drops. A permit admitted while Redis could not be reached, by a limit that
/// fails open, holds no lease.
pub struct RedisPermit {
    shared: Arc<Shared>,
    lease: Option<String>,
    /// The fleet's window it was admitted in, as this process knew it (adaptive limits).
    epoch: u64,
}

impl RedisPermit {
    pub(crate) fn new(shared: Arc<Shared>, lease: Option<String>) -> Self {
        let epoch = shared.core.adaptive.as_ref().map_or(0, |c| c.epoch());
        Self {
            shared,
            lease,
            epoch,
        }
    }

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
            self.shared.release(id);
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

    fn acquire(&self) -> impl Future<Output = Result<Self::Permit, AcquireError>> + Send {
        Arc::clone(&self.shared).acquire()
    }

    fn acquire_owned(self) -> impl Future<Output = Result<Self::Permit, AcquireError>> + Send {
        self.shared.acquire()
    }

    fn capacity(&self) -> Option<Capacity> {
        Some(self.shared.gauge.clone())
    }

    /// `true` when it fails closed (Redis unreachable turns operations away) or bounds its
    /// queue.
    fn may_reject(&self) -> bool {
        !self.shared.core.fail_open || self.shared.core.max_queued.is_some()
    }

    /// `true` for an adaptive limit: its controller counts each end.
    fn hears_ends(&self) -> bool {
        self.shared.core.adaptive.is_some()
    }

    /// Adds the end to this process's counts for the fleet's window: a few relaxed atomics,
    /// no call to Redis. An operation admitted without the fleet limit (failing open) is not
    /// counted.
    #[inline]
    fn ended(permit: &RedisPermit, ended: &Ended) {
        if let (Some(control), Some(_)) = (&permit.shared.core.adaptive, &permit.lease) {
            control.ended(permit.epoch, ended);
        }
    }
}

impl fmt::Debug for RedisLimit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let core = &self.shared.core;
        f.debug_struct("RedisLimit")
            .field("name", &core.name)
            .field("address", &self.address())
            .field("capacity", &self.capacity())
            .field("active", &self.active())
            .field("queued", &self.queued())
            .field("queue_bound", &core.max_queued)
            .field("lease_ttl", &core.lease_ttl)
            .field("call_timeout", &core.call_timeout)
            .field("fail_open", &core.fail_open)
            .field("adaptive", &core.adaptive)
            .field("reachable", &self.is_reachable())
            .field("keys", &core.keys)
            .finish()
    }
}
