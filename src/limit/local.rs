//! [`Limit`]: the crate's own limit, which knows its capacity and its queue.

use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Weak};

use tokio::sync::{Semaphore, TryAcquireError};

use super::resize::Resizable;
use super::{Acquire, AcquireError};
use crate::metrics::Capacity;
use crate::Rejection;

/// A limit of operations at once, shared by every clone, that knows its capacity, can bound its
/// queue, and can be resized while it serves.
///
/// It is a tokio [`Semaphore`] that also counts its waiters and reports its capacity as
/// `gym.resources.operation.limit`. Waiters are served first come, first served.
///
/// ```
/// use tower_resources_operation::Limit;
///
/// // Two verifiers at once; at most eight callers wait, the ninth is turned away at once.
/// let limit = Limit::with_max_queued(2, 8);
/// assert_eq!((limit.capacity(), limit.available(), limit.queued()), (2, 2, 0));
///
/// // More verifiers came up: the waiters get the new places at once.
/// limit.set_capacity(4).unwrap();
/// assert_eq!(limit.available(), 4);
/// ```
#[derive(Clone)]
pub struct Limit {
    state: Arc<State>,
}

struct State {
    places: Resizable<Semaphore>,
    /// Operations waiting now. Next to the semaphore, whose line a wait touches anyway.
    queued: AtomicUsize,
    /// Waiters beyond this are turned away; `usize::MAX` for no bound. Set when the limit is
    /// made, so that no layer sees a limit start to reject after it was checked.
    max_queued: usize,
    gauge: Capacity,
}

impl Limit {
    /// A limit of `max` operations at once; callers wait for it as long as it takes.
    ///
    /// # Panics
    ///
    /// If `max` is above tokio's [`Semaphore::MAX_PERMITS`]; [`try_new`](Self::try_new) returns
    /// that as an error instead.
    #[track_caller]
    pub fn new(max: usize) -> Self {
        Self::with_max_queued(max, usize::MAX)
    }

    /// A limit of `max` operations at once, or an error if `max` is above tokio's
    /// [`Semaphore::MAX_PERMITS`].
    pub fn try_new(max: usize) -> Result<Self, LimitTooLarge> {
        check(max)?;
        Ok(Self::make(max, usize::MAX))
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
    /// If `max` is above tokio's [`Semaphore::MAX_PERMITS`].
    #[track_caller]
    pub fn with_max_queued(max: usize, max_queued: usize) -> Self {
        match check(max) {
            Ok(()) => Self::make(max, max_queued),
            Err(error) => panic!("{error}"),
        }
    }

    fn make(max: usize, max_queued: usize) -> Self {
        let state = Arc::new_cyclic(|state: &Weak<State>| {
            let state = state.clone();
            State {
                places: Resizable::new(Semaphore::new(max), max),
                queued: AtomicUsize::new(0),
                max_queued,
                gauge: Capacity::while_alive(move || {
                    state.upgrade().map(|state| state.places.capacity())
                }),
            }
        });
        Self { state }
    }

    /// How many operations this limit admits at once.
    pub fn capacity(&self) -> usize {
        self.state.places.capacity()
    }

    /// How many more operations it would admit now without waiting.
    pub fn available(&self) -> usize {
        self.state.places.places().available_permits()
    }

    /// How many operations wait for it now.
    pub fn queued(&self) -> usize {
        self.state.queued.load(Ordering::Relaxed)
    }

    /// The bound on the queue, if there is one ([`with_max_queued`](Self::with_max_queued)).
    pub fn queue_bound(&self) -> Option<usize> {
        match self.state.max_queued {
            usize::MAX => None,
            bound => Some(bound),
        }
    }

    /// Changes the capacity while the limit serves.
    ///
    /// Raising it admits waiters at once. Lowering it never revokes a running operation: the
    /// places above the new capacity are taken out as running operations finish, so for a while
    /// more may run than the new capacity (the metrics then show `active` above `limit`). No
    /// place is lost or made up, whatever runs meanwhile.
    pub fn set_capacity(&self, capacity: usize) -> Result<(), LimitTooLarge> {
        check(capacity)?;
        self.state.places.set_capacity(capacity);
        Ok(())
    }

    /// Closes the limit: waiters and later callers fail, with a panic that says the limit is
    /// closed; running operations finish normally.
    pub fn close(&self) {
        self.state.places.places().close();
    }
}

fn check(max: usize) -> Result<(), LimitTooLarge> {
    if max > Semaphore::MAX_PERMITS {
        Err(LimitTooLarge { max })
    } else {
        Ok(())
    }
}

impl Acquire for Limit {
    type Permit = LimitPermit;

    async fn acquire(&self) -> Result<Self::Permit, AcquireError> {
        Acquire::acquire_owned(self.clone()).await
    }

    /// The wait of [`acquire`](Acquire::acquire), on a `Limit` given away: a free place at
    /// once, whatever the bound on the queue; otherwise a wait in the queue, counted in
    /// `queued`, or a rejection when the queue is full. The handle becomes the permit's, rather
    /// than the permit taking one more.
    async fn acquire_owned(self) -> Result<Self::Permit, AcquireError> {
        if let Some(now) = self.try_acquire() {
            return now;
        }
        let queued = Queued::join(self.state)?;
        let placed = queued.state().places.places().acquire().await;
        match placed.map(std::mem::forget) {
            Ok(()) => Ok(queued.admitted()),
            Err(_) => Err(AcquireError::closed()),
        }
    }

    /// A free place now; `None` if the operation would wait; a rejection at once if it would
    /// wait in a queue that is already full (so that turning it away costs no wait).
    #[inline]
    fn try_acquire(&self) -> Option<Result<Self::Permit, AcquireError>> {
        let state = &*self.state;
        match state.places.places().try_acquire() {
            Ok(place) => {
                // The place is the permit's now (`mem::forget`, not tokio's `forget`: the same,
                // without a call).
                std::mem::forget(place);
                Some(Ok(LimitPermit {
                    state: Arc::clone(&self.state),
                }))
            }
            Err(TryAcquireError::NoPermits) => {
                let full = state.queued.load(Ordering::Relaxed) >= state.max_queued;
                full.then(|| Err(AcquireError::rejected(Rejection::QueueFull)))
            }
            Err(TryAcquireError::Closed) => Some(Err(AcquireError::closed())),
        }
    }

    fn capacity(&self) -> Option<Capacity> {
        Some(self.state.gauge.clone())
    }

    fn may_reject(&self) -> bool {
        self.queue_bound().is_some()
    }
}

/// One waiter of a [`Limit`], counted while it lives.
struct Queued {
    /// `None` once admitted.
    state: Option<Arc<State>>,
}

impl Queued {
    /// Joins the queue, or is turned away if it is full.
    fn join(state: Arc<State>) -> Result<Self, AcquireError> {
        let ahead = state.queued.fetch_add(1, Ordering::Relaxed);
        let queued = Self { state: Some(state) };
        if ahead >= queued.state().max_queued {
            return Err(AcquireError::rejected(Rejection::QueueFull));
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
        state.queued.fetch_sub(1, Ordering::Relaxed);
        LimitPermit { state }
    }
}

impl Drop for Queued {
    fn drop(&mut self) {
        if let Some(state) = &self.state {
            state.queued.fetch_sub(1, Ordering::Relaxed);
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
            .finish()
    }
}

/// A limit above tokio's [`Semaphore::MAX_PERMITS`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LimitTooLarge {
    max: usize,
}

impl fmt::Display for LimitTooLarge {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "tower-resources-operation: a limit of {} operations is above tokio's \
             Semaphore::MAX_PERMITS ({})",
            self.max,
            Semaphore::MAX_PERMITS
        )
    }
}

impl std::error::Error for LimitTooLarge {}
