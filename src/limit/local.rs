//! [`Limit`]: the crate's own limit, which knows its capacity and its queue.

use std::cell::Cell;
use std::fmt;
use std::sync::atomic::{AtomicU32, Ordering::Relaxed};
use std::sync::{Arc, Weak};

use tokio::sync::{Semaphore, TryAcquireError};

use super::acquire::{Acquire, LimitId};
use super::feedback::{Control, Ended, MakeControl, Resize};
use super::front::{Front, Joined};
use super::report::{check_name, Capacity, Reading};
use super::resize::Resizable;
use crate::attributes::Rejection;
use crate::error::ConfigError;
use crate::rejected::Rejected;

/// A limit of operations at once, shared by every clone, that knows its capacity, can bound its
/// queue, and can be resized while it serves.
///
/// It counts its waiters and reports its capacity as `gym.resources.operation.limit`. While
/// nobody waits, a place is taken and given back with one atomic operation each, without the
/// lock that tokio's [`Semaphore`] takes on every release; waiters queue in a `Semaphore`, and
/// are served first come, first served.
///
/// A limit [named](LimitBuilder::name) in code also reports instruments of its own, under its
/// name: how many operations it admits at once, holds and keeps waiting, whichever routes and
/// operations share it (see [the metrics](crate#metrics)). An [adaptive](LimitBuilder::adaptive)
/// limit sets its own capacity from the run times and outcomes of its operations.
///
/// ```
/// use tower_resources_operation::Limit;
///
/// // Two verifiers at once; at most eight callers wait, the ninth is turned away at once.
/// let limit = Limit::builder(2).max_queued(8).name("verifiers").build();
/// assert_eq!((limit.capacity(), limit.available(), limit.queued()), (2, 2, 0));
/// assert_eq!(limit.name(), Some("verifiers"));
///
/// // More verifiers came up: the waiters get the new places at once.
/// limit.set_capacity(4).unwrap();
/// assert_eq!(limit.available(), 4);
/// ```
#[derive(Clone)]
pub struct Limit {
    state: Arc<State>,
}

/// In this order, so that what every operation reads (whether it is heard, the front of the
/// places) shares a cache line.
#[repr(C)]
struct State {
    /// An adaptive limit's controller, which hears each operation's end.
    control: Option<Arc<dyn Control>>,
    /// Which operations its controller hears: one in `sampling + 1`, a power of two.
    sampling: AtomicU32,
    /// Its places, free, held or owed; and its waiters, counted.
    places: Resizable<Front<Semaphore>>,
    /// Waiters beyond this are turned away; `usize::MAX` for no bound. Set when the limit is
    /// made, so that no layer sees a limit start to reject after it was checked.
    max_queued: usize,
    /// What the metrics read, and the limit's identity there.
    gauge: Capacity,
}

impl Limit {
    /// A limit of `max` operations at once; callers wait for it as long as it takes.
    ///
    /// # Panics
    ///
    /// If `max` is 0 or above tokio's [`Semaphore::MAX_PERMITS`]; [`try_new`](Self::try_new)
    /// returns that as an error instead.
    #[track_caller]
    pub fn new(max: usize) -> Self {
        Self::with_max_queued(max, usize::MAX)
    }

    /// A limit of `max` operations at once, or an error if `max` is 0 or above tokio's
    /// [`Semaphore::MAX_PERMITS`].
    pub fn try_new(max: usize) -> Result<Self, ConfigError> {
        check_built(max)?;
        Ok(Self::make(max, usize::MAX, None, None))
    }

    /// A limit of `max` operations at once, of which at most `max_queued` wait, across every
    /// layer and call that shares it: one more is turned away at once, with
    /// [`Rejection::QueueFull`]. `0` turns away every operation that finds no free place.
    ///
    /// A layer answers such a rejection (`503`, RESOURCE_EXHAUSTED, or an error of your own);
    /// a layer that cannot answer one refuses, when it makes its service, a limit with a bound.
    ///
    /// # Panics
    ///
    /// If `max` is 0 or above tokio's [`Semaphore::MAX_PERMITS`].
    #[track_caller]
    pub fn with_max_queued(max: usize, max_queued: usize) -> Self {
        Self::builder(max).max_queued(max_queued).build()
    }

    /// A limit of `max` operations at once, with a bound on its queue or a name: see
    /// [`LimitBuilder`].
    pub fn builder(max: usize) -> LimitBuilder {
        LimitBuilder {
            max,
            max_queued: usize::MAX,
            name: None,
            adaptive: None,
        }
    }

    fn make(
        max: usize,
        max_queued: usize,
        name: Option<&str>,
        adaptive: Option<&dyn MakeControl>,
    ) -> Self {
        let max = adaptive.map_or(max, |adaptive| {
            let bounds = adaptive.bounds();
            max.clamp(*bounds.start(), *bounds.end())
        });
        let state = Arc::new_cyclic(|state: &Weak<State>| {
            let control = adaptive.map(|adaptive| {
                let limit: Weak<dyn Resize> = state.clone();
                adaptive.make(limit, max)
            });
            let state = state.clone();
            let read = move || state.upgrade().map(|state| state.read());
            State {
                places: Resizable::new(Front::new(max, Semaphore::new(0)), max),
                max_queued,
                gauge: Capacity::of_checked(name, read),
                control,
                sampling: AtomicU32::new(0),
            }
        });
        Self { state }
    }

    /// Its name, if it was given one.
    pub fn name(&self) -> Option<&str> {
        self.state.gauge.name()
    }

    /// How many operations this limit admits at once.
    pub fn capacity(&self) -> usize {
        self.state.places.capacity()
    }

    /// How many more operations it would admit now without waiting.
    pub fn available(&self) -> usize {
        self.state.places.places().available()
    }

    /// How many operations wait for it now.
    pub fn queued(&self) -> usize {
        self.state.places.places().waiting()
    }

    /// The bound on the queue, if there is one ([`with_max_queued`](Self::with_max_queued)).
    pub fn queue_bound(&self) -> Option<usize> {
        match self.state.max_queued {
            usize::MAX => None,
            bound => Some(bound),
        }
    }

    /// Whether a controller sets its capacity (see [`LimitBuilder::adaptive`]).
    pub fn is_adaptive(&self) -> bool {
        self.state.control.is_some()
    }

    /// Changes the capacity while the limit serves.
    ///
    /// Raising it admits waiters at once. Lowering it never revokes a running operation: the
    /// places above the new capacity are taken out as running operations finish, so for a while
    /// more may run than the new capacity (the metrics then show `active` above `limit`). No
    /// place is lost or made up, whatever runs meanwhile. An adaptive limit's controller goes
    /// on from the capacity set here, at its next window.
    pub fn set_capacity(&self, capacity: usize) -> Result<(), ConfigError> {
        check(capacity)?;
        self.state.places.set_capacity(capacity);
        Ok(())
    }

    /// Closes the limit: waiters and later callers are turned away with
    /// [`Rejection::Unavailable`] (HTTP `503`, gRPC `UNAVAILABLE`, `Err(Rejected)` from
    /// [`resources_operation`](crate::resources_operation)); running operations finish
    /// normally. Under a layer whose protocol cannot answer
    /// (the generic layer's, `()`) they end with a panic that says the limit is closed,
    /// as tower's limit does.
    pub fn close(&self) {
        self.state.places.places().close();
    }
}

impl State {
    /// What the metrics report of the limit now.
    fn read(&self) -> Reading {
        let free = self.places.places().available();
        let (baseline, estimate) = self
            .control
            .as_ref()
            .map(|control| control.measured())
            .unwrap_or_default();
        Reading::new(
            self.places.capacity(),
            self.places.held(free),
            self.places.places().waiting(),
        )
        .with_run_times(baseline, estimate)
    }
}

impl State {
    /// The queue is full: the operation is turned away, and the controller hears of it.
    #[cold]
    fn queue_full(&self) -> Rejected {
        if let Some(control) = &self.control {
            control.rejected();
        }
        Rejected::new(Rejection::QueueFull)
    }
}

impl Resize for State {
    fn capacity(&self) -> usize {
        self.places.capacity()
    }

    fn resize(&self, capacity: usize) {
        self.places.set_capacity(capacity);
    }

    fn hear_one_in(&self, one_in: u32) -> u32 {
        let one_in = 1 << (31 - one_in.max(1).leading_zeros());
        self.sampling.store(one_in - 1, Relaxed);
        one_in
    }
}

/// Whether to hear the operation being admitted, given a sampling `mask` (one in `mask + 1`):
/// from a golden-ratio (Weyl) sequence of the thread's own, heard where it falls in the first
/// `1 / (mask + 1)` of its circle. One add and one multiply, nothing shared, and the ops heard
/// are spread as evenly as such a sequence spreads (no period for a workload to fall in step
/// with); an xorshift would put six dependent steps on the path of every admission, sampled or
/// not.
#[inline]
fn heard(mask: u32) -> bool {
    thread_local! {
        static STEP: Cell<u32> = const { Cell::new(0) };
    }
    if mask == 0 {
        return true;
    }
    STEP.try_with(|step| {
        let x = step.get().wrapping_add(0x9E37_79B9);
        step.set(x);
        (u64::from(x) * (u64::from(mask) + 1)) >> 32 == 0
    })
    .unwrap_or(true)
}

/// Makes a [`Limit`] with a bound on its queue, a name, or a controller: the things that are
/// fixed once the limit is shared.
///
/// ```
/// use tower_resources_operation::Limit;
///
/// let judges = Limit::builder(8).name("judges").build();
/// let verifiers = Limit::builder(2).max_queued(16).name("verifiers").build();
/// assert_eq!((judges.queue_bound(), verifiers.queue_bound()), (None, Some(16)));
/// ```
#[derive(Clone, Debug)]
#[must_use = "a builder makes nothing until `build`"]
pub struct LimitBuilder {
    max: usize,
    max_queued: usize,
    name: Option<String>,
    adaptive: Option<Arc<dyn MakeControl>>,
}

impl LimitBuilder {
    /// At most `max_queued` operations wait, across every layer and call that shares the limit:
    /// one more is turned away at once, with [`Rejection::QueueFull`] (see
    /// [`Limit::with_max_queued`]).
    pub fn max_queued(mut self, max_queued: usize) -> Self {
        self.max_queued = max_queued;
        self
    }

    /// Names the limit: it then reports `gym.resources.limit.capacity`, `.active` and `.queued`
    /// with `nemo.gym.resources.limit` = `name`, so that one dashboard row or alert covers every
    /// route and operation that shares it. Limits that share a name add up.
    ///
    /// A name is checked when the limit is built, so the attribute stays bounded: 1 to 64
    /// characters among `A-Z a-z 0-9 _ . : / -`, starting with a letter. It may come from a
    /// config file: [`try_build`](Self::try_build) then returns a name that is not such a name
    /// as an error, and [`build`](Self::build) panics naming it.
    ///
    /// ```
    /// use tower_resources_operation::Limit;
    ///
    /// let from_config = String::from("judges");
    /// let judges = Limit::builder(8).name(from_config).build();
    /// assert_eq!(judges.name(), Some("judges"));
    ///
    /// let refused = Limit::builder(8).name("my judges").try_build();
    /// assert!(refused.unwrap_err().to_string().contains("\"my judges\""));
    /// ```
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// Lets `controller` set the capacity: [`adaptive`](Self::adaptive)'s seam, which stands
    /// beside the controllers in [`adaptive`](crate::adaptive) so that a limit knows none of them.
    pub(crate) fn controlled(mut self, controller: impl MakeControl + 'static) -> Self {
        self.adaptive = Some(Arc::new(controller));
        self
    }

    /// The limit.
    ///
    /// # Panics
    ///
    /// If its capacity is 0, or it or an adaptive limit's highest is above tokio's
    /// [`Semaphore::MAX_PERMITS`], or its [name](Self::name) cannot be a metric attribute;
    /// [`try_build`](Self::try_build) returns that as an error instead.
    #[track_caller]
    pub fn build(self) -> Limit {
        match self.try_build() {
            Ok(limit) => limit,
            Err(error) => panic!("{error}"),
        }
    }

    /// The limit, or an error if its capacity is 0, if it or an adaptive limit's highest is
    /// above tokio's [`Semaphore::MAX_PERMITS`], or if its [name](Self::name) cannot be a metric
    /// attribute (see [`name`](Self::name)).
    ///
    /// ```
    /// use tower_resources_operation::Limit;
    ///
    /// let empty = Limit::builder(0).name("workers").try_build().unwrap_err();
    /// assert_eq!(empty.setting(), "capacity");
    /// let spaced = Limit::builder(2).name("my workers").try_build().unwrap_err();
    /// assert_eq!(spaced.setting(), "name");
    /// ```
    pub fn try_build(self) -> Result<Limit, ConfigError> {
        check_built(self.max)?;
        if let Some(adaptive) = &self.adaptive {
            check(*adaptive.bounds().end())?;
        }
        if let Some(name) = &self.name {
            check_name(name)?;
        }
        Ok(Limit::make(
            self.max,
            self.max_queued,
            self.name.as_deref(),
            self.adaptive.as_deref(),
        ))
    }
}

/// Whether a limit can be set to `max` operations at once while it serves (0 pauses it).
fn check(max: usize) -> Result<(), ConfigError> {
    if max > Semaphore::MAX_PERMITS {
        Err(ConfigError::capacity(max))
    } else {
        Ok(())
    }
}

/// Whether a limit can be built with `max` operations at once: 0 would admit nothing, ever.
fn check_built(max: usize) -> Result<(), ConfigError> {
    match max {
        0 => Err(ConfigError::capacity(max)),
        max => check(max),
    }
}

impl Acquire for Limit {
    type Permit = LimitPermit;

    async fn acquire(&self) -> Result<Self::Permit, Rejected> {
        Acquire::acquire_owned(self.clone()).await
    }

    /// The wait of [`acquire`](Acquire::acquire), on a `Limit` given away: a free place at
    /// once, whatever the bound on the queue; otherwise a wait in the queue, counted in
    /// `queued`, or a rejection when the queue is full. The handle becomes the permit's, rather
    /// than the permit taking one more.
    async fn acquire_owned(self) -> Result<Self::Permit, Rejected> {
        if let Some(now) = self.try_acquire() {
            return now;
        }
        let queued = match self.state.places.places().join() {
            // A place came free meanwhile.
            Joined::Took => return Ok(LimitPermit { state: self.state }),
            Joined::Waits { ahead } => Queued::counted(self.state, ahead)?,
            Joined::Closed => return Err(Rejected::closed()),
        };
        let placed = queued.state().places.places().queue().acquire().await;
        // The place leaves tokio's count: the `LimitPermit` gives it back when it drops.
        match placed.map(tokio::sync::SemaphorePermit::forget) {
            Ok(()) => Ok(queued.admitted()),
            Err(_) => Err(Rejected::closed()),
        }
    }

    /// A free place now; `None` if the operation would wait; a rejection at once if it would
    /// wait in a queue that is already full (so that turning it away costs no wait).
    #[inline(always)]
    fn try_acquire(&self) -> Option<Result<Self::Permit, Rejected>> {
        let state = &*self.state;
        match state.places.places().try_take() {
            Ok(()) => Some(Ok(LimitPermit {
                state: Arc::clone(&self.state),
            })),
            Err(TryAcquireError::NoPermits) => {
                let full = state.places.places().waiting() >= state.max_queued;
                full.then(|| Err(state.queue_full()))
            }
            Err(TryAcquireError::Closed) => Some(Err(Rejected::closed())),
        }
    }

    fn capacity(&self) -> Option<Capacity> {
        Some(self.state.gauge.clone())
    }

    fn may_reject(&self) -> bool {
        self.queue_bound().is_some()
    }

    fn hears_ends(&self) -> bool {
        self.state.control.is_some()
    }

    fn id(&self) -> Option<LimitId> {
        Some(LimitId::of(&*self.state))
    }

    #[inline]
    fn id_of(permit: &LimitPermit) -> Option<LimitId> {
        Some(LimitId::of(&*permit.state))
    }

    #[inline]
    fn hears_end(permit: &LimitPermit) -> bool {
        let state = &*permit.state;
        state.control.is_some() && heard(state.sampling.load(Relaxed))
    }

    #[inline]
    fn ended(permit: &LimitPermit, ended: &Ended) {
        let state = &*permit.state;
        if let Some(control) = &state.control {
            let in_flight = state.places.held(state.places.places().available());
            control.ended(ended, in_flight);
        }
    }
}

/// One waiter of a [`Limit`], counted while it lives.
struct Queued {
    /// `None` once admitted.
    state: Option<Arc<State>>,
}

impl Queued {
    /// Counted as waiting after `ahead` others; turned away if the queue is full.
    fn counted(state: Arc<State>, ahead: usize) -> Result<Self, Rejected> {
        let queued = Self { state: Some(state) };
        if ahead >= queued.state().max_queued {
            return Err(queued.state().queue_full());
        }
        Ok(queued)
    }

    fn state(&self) -> &State {
        self.state
            .as_deref()
            .expect("a waiter is counted until admitted")
    }

    /// Leaves the queue with a place: its handle becomes the permit's.
    fn admitted(mut self) -> LimitPermit {
        let state = self.state.take().expect("a waiter is admitted once");
        state.places.places().leave();
        LimitPermit { state }
    }
}

impl Drop for Queued {
    fn drop(&mut self) {
        if let Some(state) = &self.state {
            state.places.places().leave();
        }
    }
}

/// A place in a [`Limit`], given back when dropped.
pub struct LimitPermit {
    state: Arc<State>,
}

impl Drop for LimitPermit {
    #[inline]
    fn drop(&mut self) {
        self.state.places.release();
    }
}

impl fmt::Debug for LimitPermit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LimitPermit").finish_non_exhaustive()
    }
}

impl fmt::Debug for Limit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Limit")
            .field("capacity", &self.capacity())
            .field("available", &self.available())
            .field("queued", &self.queued())
            .field("queue_bound", &self.queue_bound())
            .field("name", &self.name())
            .field("adaptive", &self.state.control)
            .finish()
    }
}

// Not under loom: a `Limit`'s places are loom's there, which run only in a model.
/// Something a limit can be made from: a number (a new [`Limit`] of that many operations at
/// once) or any [`Acquire`] (itself).
pub trait IntoLimit {
    /// The limit.
    type Limit: Acquire;

    /// Makes the limit.
    ///
    /// # Panics
    ///
    /// A number that is 0 or above tokio's [`Semaphore::MAX_PERMITS`] panics: use
    /// [`Limit::try_new`] for an error instead.
    fn into_limit(self) -> Self::Limit;
}

impl<A: Acquire> IntoLimit for A {
    type Limit = A;

    fn into_limit(self) -> A {
        self
    }
}

impl IntoLimit for usize {
    type Limit = Limit;

    #[track_caller]
    fn into_limit(self) -> Limit {
        Limit::new(self)
    }
}

#[cfg(all(test, not(tro_loom)))]
mod tests {
    use std::ops::RangeInclusive;

    use super::*;

    /// A controller that only listens.
    #[derive(Debug)]
    struct Listens;

    impl Control for Listens {
        fn ended(&self, _: &Ended, _: usize) {}
    }

    impl MakeControl for Listens {
        fn bounds(&self) -> RangeInclusive<usize> {
            1..=4
        }

        fn make(&self, _: Weak<dyn Resize>, _: usize) -> Arc<dyn Control> {
            Arc::new(Listens)
        }
    }

    fn heard_of(limit: &Limit, operations: u32) -> u32 {
        (0..operations)
            .map(|_| {
                let permit = limit.try_acquire().unwrap().unwrap();
                u32::from(Limit::hears_end(&permit))
            })
            .sum()
    }

    #[test]
    fn an_adaptive_limit_hears_the_share_its_controller_asks_for_and_a_plain_one_none() {
        let limit = Limit::builder(4).controlled(Listens).build();
        assert_eq!(heard_of(&limit, 1000), 1000, "every one, to begin with");
        // Rounded down to a power of two.
        assert_eq!(limit.state.hear_one_in(5), 4);
        let heard = heard_of(&limit, 40_000);
        assert!((9_000..=11_000).contains(&heard), "{heard} of 40000");
        assert_eq!(limit.state.hear_one_in(0), 1);
        assert_eq!(heard_of(&limit, 1000), 1000);

        let plain = Limit::new(4);
        assert_eq!(heard_of(&plain, 1000), 0, "no controller, nothing to hear");
    }
}
