//! [`RedisLimit`], the handle: how an operation takes a place of the fleet ([`Acquire`]), what
//! it holds meanwhile ([`RedisPermit`]), and what a process can read or change of the fleet.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use opentelemetry::metrics::Meter;
use tower_resources_operation::limit::{Capacity, Ended, LimitId};
use tower_resources_operation::{Acquire, Rejected};

use crate::error::Error;
use crate::fleet::member::Handle;
use crate::fleet::place::{Kind, Place};
use crate::fleet::share::Unreachable;
use crate::fleet::waiter::acquire;
use crate::redis_store::RedisStore;

/// A limit of operations at once shared by every process that names it, kept in Redis: see
/// [the crate](crate).
///
/// Clones share it. It implements [`Acquire`], so it goes wherever a `Limit` of
/// `tower-resources-operation` goes: a layer, a per-request layer's named limits,
/// `resources_operation`.
///
/// Made by [`RedisLimit::builder`]; its background work runs on the tokio runtime
/// [`build`](crate::RedisLimitBuilder::build) was called on, or wherever the caller of
/// [`build_pair`](crate::RedisLimitBuilder::build_pair) runs it.
#[derive(Clone)]
pub struct RedisLimit {
    handle: Arc<Handle<RedisStore>>,
}

impl RedisLimit {
    pub(crate) fn from_handle(handle: Arc<Handle<RedisStore>>) -> Self {
        Self { handle }
    }

    /// Takes a place of the fleet, waiting for one in its queue if it has to.
    ///
    /// Boxed, so that a caller's future holds a pointer to it, not the whole wait inline (every
    /// future that holds the `redis` crate's is boxed at some level: see the transport).
    fn wait_for_place(
        handle: Arc<Handle<RedisStore>>,
    ) -> Pin<Box<dyn Future<Output = Result<RedisPermit, Rejected>> + Send>> {
        Box::pin(async move { acquire(handle).await.map(|place| RedisPermit { place }) })
    }

    /// The limit's name: its Redis keys, and its attribute in the metrics.
    pub fn name(&self) -> &str {
        &self.handle.member.settings.name
    }

    /// The Redis the limit was given, as its messages say it (without a password).
    pub fn address(&self) -> &str {
        crate::fleet::store::Store::address(&self.handle.member.store)
    }

    /// The fleet's capacity, as last read from Redis (the builder's until then).
    pub fn capacity(&self) -> usize {
        self.handle.member.capacity.load(Ordering::Relaxed)
    }

    /// This process's share of the fleet's capacity, as last read: the capacity over the
    /// replicas alive (rounded down, and at least 1), or `None` before it reached Redis. What
    /// it admits at once while Redis is out of reach (see [`Unreachable::Share`]).
    pub fn share(&self) -> Option<usize> {
        self.handle.member.share()
    }

    /// The processes alive in the fleet (each one that named the limit and reached Redis
    /// within a lease TTL), as last read; 0 before this process reached Redis.
    pub fn replicas(&self) -> usize {
        self.handle.member.share.replicas().unwrap_or(0)
    }

    /// Whether it runs on this process's share now: Redis is out of reach, and the limit
    /// answers as [`Unreachable::Share`].
    pub fn is_on_share(&self) -> bool {
        self.handle.member.running_on_share().is_some()
    }

    /// Places this process holds now (leases, and places of its share).
    pub fn active(&self) -> usize {
        self.handle.member.counts.active.load(Ordering::Relaxed)
    }

    /// Operations of this process waiting in the fleet's queue (or for a place of its share)
    /// now.
    pub fn queued(&self) -> usize {
        self.handle.member.counts.queued.load(Ordering::Relaxed)
    }

    /// Operations this process admitted without the fleet limit, failing open, so far.
    pub fn failed_open(&self) -> u64 {
        self.handle
            .member
            .counts
            .failed_open
            .load(Ordering::Relaxed)
    }

    /// Leases of this process found lost while their operations ran, so far.
    pub fn leases_lost(&self) -> u64 {
        self.handle
            .member
            .counts
            .leases_lost
            .load(Ordering::Relaxed)
    }

    /// The bound on the fleet's queue, if there is one.
    pub fn queue_bound(&self) -> Option<usize> {
        self.handle.member.settings.max_queued
    }

    /// What it answers while Redis is out of reach.
    pub fn when_unreachable(&self) -> Unreachable {
        self.handle.member.settings.unreachable
    }

    /// Whether the last call reached Redis. While it did not, callers are answered at once (as
    /// [`when_unreachable`](Self::when_unreachable) says), and Redis is asked again in the
    /// background every [fallback poll](crate::RedisLimitBuilder::fallback_poll).
    pub fn is_reachable(&self) -> bool {
        !self.handle.member.health.is_down()
    }

    /// Connects to Redis and subscribes to the limit's channel if that is not done yet, or else
    /// checks that it answers; then reads the fleet's state: its capacity (a capacity this
    /// process was built with that is not the fleet's is said now, once, and the fleet's kept),
    /// its replicas (so this process knows its share from now on), and whether a controller
    /// sets the capacity (a replica built otherwise is warned about, once). Calls connect by
    /// themselves, so this is optional: call it at startup to fail early.
    ///
    /// Always asks Redis, even while it is down (as [`set_capacity`](Self::set_capacity) and
    /// [`fleet`](Self::fleet) do); its answer ends an outage.
    pub async fn ready(&self) -> Result<(), Error> {
        self.handle.member.connect().await
    }

    /// Sets the capacity of the whole fleet. Raising it hands the new places to the fleet's
    /// waiters at once; lowering it revokes nobody: places above the new capacity are taken
    /// out as their operations end. Every process is told.
    pub async fn set_capacity(&self, capacity: usize) -> Result<(), Error> {
        self.handle.member.set_capacity(capacity).await.map(drop)
    }

    /// Whether the fleet's capacity is set by a controller
    /// ([`RedisLimitBuilder::adaptive`](crate::RedisLimitBuilder::adaptive); see
    /// [the crate](crate#an-adaptive-fleet-limit)).
    pub fn is_adaptive(&self) -> bool {
        self.handle.member.control.is_some()
    }

    /// Whether this process decides the fleet's capacity now: an adaptive limit's leader, as
    /// of its last tick. At most one process of the fleet does at a time; `false` for a limit
    /// that is not adaptive.
    pub fn is_leader(&self) -> bool {
        self.handle
            .member
            .control
            .as_ref()
            .is_some_and(|c| c.leads())
    }

    /// Windows of the fleet this process decided, as its leader, so far.
    pub fn decisions(&self) -> u64 {
        self.handle
            .member
            .control
            .as_ref()
            .map_or(0, |c| c.decisions())
    }

    /// What the fleet's controller measured, as this process last heard: the run time its
    /// algorithm takes as normal (its baseline) and its recent estimate, the figures every
    /// replica reports as `gym.resources.limit.adaptive.{baseline,estimate}_ms`. `(None, None)`
    /// for a limit that is not adaptive, or before the algorithm has them.
    pub fn measured(&self) -> (Option<Duration>, Option<Duration>) {
        self.handle
            .member
            .control
            .as_ref()
            .map(|c| c.measured())
            .unwrap_or_default()
    }

    /// The bounds an adaptive limit's controller keeps the capacity within.
    pub fn adaptive_bounds(&self) -> Option<std::ops::RangeInclusive<usize>> {
        self.handle.member.control.as_ref().map(|c| c.bounds())
    }

    /// The fleet's capacity, places held (and of those, by members not heard from), tickets
    /// waiting and replicas alive, read from Redis now.
    pub async fn fleet(&self) -> Result<Fleet, Error> {
        let state = self.handle.member.state().await?;
        Ok(Fleet {
            capacity: state.capacity,
            active: state.active,
            unheard: state.unheard,
            queued: state.queued,
            replicas: state.replicas,
        })
    }

    /// Reports this limit's own instruments, `gym.resources.limit.failed_open`,
    /// `gym.resources.limit.leases_lost` and `gym.resources.limit.unheard` (see
    /// [`metrics`](crate::metrics)), through `meter`,
    /// for as long as the limit lives. The same as
    /// [`RedisLimitBuilder::meter`](crate::RedisLimitBuilder::meter).
    ///
    /// Register each limit once per meter provider: one limit per name in a process, cloned
    /// where it is needed. Two limits of one name registered on one provider observe the same
    /// series, and OpenTelemetry keeps the last observation.
    pub fn register_metrics(&self, meter: &Meter) {
        crate::metrics::register(meter, &self.handle);
    }
}

/// The state of a fleet limit across every process: [`RedisLimit::fleet`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Fleet {
    /// Operations the fleet admits at once.
    pub capacity: usize,
    /// Places held now, by every process (above `capacity` for a while after it was lowered),
    /// places handed over to a waiter and not yet taken up included.
    pub active: usize,
    /// Of those, places held by members the fleet has not heard from within half a lease TTL:
    /// a member that died holding them, until their leases lapse.
    pub unheard: usize,
    /// Tickets waiting now, from every process.
    pub queued: usize,
    /// Processes alive: each one that named the limit and reached Redis within a lease TTL.
    pub replicas: usize,
}

/// A place of a [`RedisLimit`]: a lease the process extends while the permit lives, given
/// back when it drops. A permit admitted while Redis could not be reached holds a place of the
/// process's share (a lease once Redis answers again), or, for a limit that fails open,
/// nothing.
pub struct RedisPermit {
    place: Place<RedisStore>,
}

impl RedisPermit {
    /// Whether it was admitted without the fleet limit, because Redis could not be reached
    /// and the limit fails open.
    pub fn failed_open(&self) -> bool {
        !self.place.is_limited()
    }

    /// Whether it was admitted on this process's share, while Redis could not be reached.
    pub fn on_share(&self) -> bool {
        matches!(self.place.kind, Kind::Share(_))
    }
}

impl fmt::Debug for RedisPermit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisPermit")
            .field("limit", &&*self.place.handle.member.settings.name)
            .field("place", &self.place.kind)
            .finish()
    }
}

impl Acquire for RedisLimit {
    type Permit = RedisPermit;

    fn acquire(&self) -> impl Future<Output = Result<Self::Permit, Rejected>> + Send {
        Self::wait_for_place(Arc::clone(&self.handle))
    }

    fn acquire_owned(self) -> impl Future<Output = Result<Self::Permit, Rejected>> + Send {
        Self::wait_for_place(self.handle)
    }

    fn capacity(&self) -> Option<Capacity> {
        Some(self.handle.gauge.clone())
    }

    /// `true` unless it fails open without a queue bound: it may turn an operation away when
    /// Redis cannot be reached (failing closed, or on the share of a replica that never reached
    /// it), or when a queue is full.
    fn may_reject(&self) -> bool {
        self.handle.member.settings.unreachable != Unreachable::Open
            || self.handle.member.settings.max_queued.is_some()
    }

    /// The limit every clone of this handle shares (a layer applied twice on a request's path
    /// admits the request on the place it holds).
    fn id(&self) -> Option<LimitId> {
        Some(LimitId::of(&*self.handle))
    }

    #[inline]
    fn id_of(permit: &RedisPermit) -> Option<LimitId> {
        Some(LimitId::of(&*permit.place.handle))
    }

    /// `true` for an adaptive limit: its controller counts each end.
    fn hears_ends(&self) -> bool {
        self.handle.member.control.is_some()
    }

    /// Adds the end to this process's counts for the fleet's window: a few relaxed atomics,
    /// no call to Redis. An operation admitted without the fleet's lease (failing open, or on
    /// the share) is not counted: the fleet's window measures the fleet's places.
    #[inline]
    fn ended(permit: &RedisPermit, ended: &Ended) {
        let place = &permit.place;
        if let (Some(control), Kind::Lease(_)) = (&place.handle.member.control, &place.kind) {
            control.ended(place.epoch, ended);
        }
    }
}

impl fmt::Debug for RedisLimit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let member = &self.handle.member;
        f.debug_struct("RedisLimit")
            .field("name", &member.settings.name)
            .field("address", &self.address())
            .field("capacity", &self.capacity())
            .field("active", &self.active())
            .field("queued", &self.queued())
            .field("queue_bound", &member.settings.max_queued)
            .field("lease_ttl", &member.settings.lease_ttl)
            .field("call_timeout", &member.settings.call_timeout)
            .field("claim_timeout", &member.settings.claim_timeout)
            .field("when_unreachable", &member.settings.unreachable)
            .field("adaptive", &member.control)
            .field("reachable", &self.is_reachable())
            .finish()
    }
}
