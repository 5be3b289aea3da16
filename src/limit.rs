//! [`Limit`]: the crate's own limit, which knows its capacity and its queue.

use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::{Semaphore, TryAcquireError};

use crate::{Acquire, AcquireError, Capacity, Rejection};

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
/// let limit = Limit::new(2).max_queued(8);
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
    semaphore: Semaphore,
    /// Operations waiting now. Next to the semaphore, whose line a wait touches anyway.
    queued: AtomicUsize,
    /// Waiters beyond this are turned away; `usize::MAX` for no bound.
    max_queued: AtomicUsize,
    capacity: AtomicUsize,
    /// Places to take out of circulation as they come back, after the capacity was lowered
    /// below what was running.
    debt: AtomicUsize,
    /// Serialises resizes.
    resize: Mutex<()>,
    gauge: Capacity,
}

impl Limit {
    /// A limit of `max` operations at once.
    ///
    /// # Panics
    ///
    /// If `max` is above tokio's [`Semaphore::MAX_PERMITS`]; [`try_new`](Self::try_new) returns
    /// that as an error instead.
    #[track_caller]
    pub fn new(max: usize) -> Self {
        match Self::try_new(max) {
            Ok(limit) => limit,
            Err(error) => panic!("{error}"),
        }
    }

    /// A limit of `max` operations at once, or an error if `max` is above tokio's
    /// [`Semaphore::MAX_PERMITS`].
    pub fn try_new(max: usize) -> Result<Self, LimitTooLarge> {
        check(max)?;
        let state = Arc::new_cyclic(|state: &std::sync::Weak<State>| {
            let state = state.clone();
            State {
                semaphore: Semaphore::new(max),
                queued: AtomicUsize::new(0),
                max_queued: AtomicUsize::new(usize::MAX),
                capacity: AtomicUsize::new(max),
                debt: AtomicUsize::new(0),
                resize: Mutex::new(()),
                gauge: Capacity::while_alive(move || {
                    state
                        .upgrade()
                        .map(|state| state.capacity.load(Ordering::Relaxed))
                }),
            }
        });
        Ok(Self { state })
    }

    /// Lets at most `max_queued` operations wait for this limit, across every layer and call
    /// that shares it; one more is turned away at once, with [`Rejection::QueueFull`]. `0` turns
    /// away every operation that finds no free place.
    ///
    /// A layer answers such a rejection only if it is [`bounded`](crate::ResourcesOperationLayer::bounded);
    /// a layer that is not refuses, when it makes its service, a limit with a bound.
    pub fn max_queued(self, max_queued: usize) -> Self {
        self.state.max_queued.store(max_queued, Ordering::Relaxed);
        self
    }

    /// How many operations this limit admits at once.
    pub fn capacity(&self) -> usize {
        self.state.capacity.load(Ordering::Relaxed)
    }

    /// How many more operations it would admit now without waiting.
    pub fn available(&self) -> usize {
        self.state.semaphore.available_permits()
    }

    /// How many operations wait for it now.
    pub fn queued(&self) -> usize {
        self.state.queued.load(Ordering::Relaxed)
    }

    /// The bound on the queue, if there is one ([`max_queued`](Self::max_queued)).
    pub fn queue_bound(&self) -> Option<usize> {
        match self.state.max_queued.load(Ordering::Relaxed) {
            usize::MAX => None,
            bound => Some(bound),
        }
    }

    /// Changes the capacity while the limit serves.
    ///
    /// Raising it admits waiters at once. Lowering it never revokes a running operation: the
    /// places above the new capacity are taken out as running operations finish, so for a while
    /// more may run than the new capacity (the metrics then show `active` above `limit`).
    pub fn set_capacity(&self, capacity: usize) -> Result<(), LimitTooLarge> {
        check(capacity)?;
        let state = &*self.state;
        let _resizing = state
            .resize
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let old = state.capacity.swap(capacity, Ordering::Relaxed);
        if capacity > old {
            let more = capacity - old;
            let settled = state.settle_debt(more);
            if more > settled {
                state.semaphore.add_permits(more - settled);
            }
        } else if capacity < old {
            let fewer = old - capacity;
            let forgotten = state.semaphore.forget_permits(fewer);
            state.debt.fetch_add(fewer - forgotten, Ordering::AcqRel);
            // A place that came back between the two steps above is free again: take it now.
            let swept = state
                .semaphore
                .forget_permits(state.debt.load(Ordering::Acquire));
            state.settle_debt(swept);
        }
        Ok(())
    }

    /// Closes the limit: waiters and later callers fail, with a panic that says the limit is
    /// closed; running operations finish normally.
    pub fn close(&self) {
        self.state.semaphore.close();
    }

    #[inline]
    fn permit(&self) -> LimitPermit {
        LimitPermit {
            state: Arc::clone(&self.state),
        }
    }
}

impl Limit {
    /// Waits in the queue for a place, counted in `queued`, or is turned away when the queue is
    /// full. The place taken is the caller's to wrap in a permit.
    async fn wait(&self) -> Result<(), AcquireError> {
        let state = &*self.state;
        let ahead = state.queued.fetch_add(1, Ordering::Relaxed);
        let _waiting = Queued(state);
        if ahead >= state.max_queued.load(Ordering::Relaxed) {
            return Err(AcquireError::rejected(Rejection::QueueFull));
        }
        match state.semaphore.acquire().await {
            Ok(place) => {
                place.forget();
                Ok(())
            }
            Err(_) => Err(AcquireError::closed()),
        }
    }
}

fn check(max: usize) -> Result<(), LimitTooLarge> {
    if max > Semaphore::MAX_PERMITS {
        Err(LimitTooLarge { max })
    } else {
        Ok(())
    }
}

impl State {
    /// Pays up to `at_most` places of debt; returns how many.
    fn settle_debt(&self, at_most: usize) -> usize {
        let mut paid = 0;
        let _ = self
            .debt
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |debt| {
                paid = debt.min(at_most);
                Some(debt - paid)
            });
        paid
    }

    /// A place comes back: to the semaphore, or to pay the debt of a lowered capacity.
    #[inline]
    fn release(&self) {
        if self.debt.load(Ordering::Relaxed) != 0 && self.settle_debt(1) == 1 {
            return;
        }
        self.semaphore.add_permits(1);
    }
}

impl Acquire for Limit {
    type Permit = LimitPermit;

    async fn acquire(&self) -> Result<Self::Permit, AcquireError> {
        // A free place is taken at once, whatever the bound on the queue.
        if let Some(now) = self.try_acquire() {
            return now;
        }
        self.wait().await?;
        Ok(self.permit())
    }

    /// The wait of [`acquire`](Acquire::acquire), on a `Limit` given away: its reference to
    /// the shared state becomes the permit's, rather than the permit taking one more.
    async fn acquire_owned(self) -> Result<Self::Permit, AcquireError> {
        if let Some(now) = self.try_acquire() {
            return now;
        }
        self.wait().await?;
        Ok(LimitPermit { state: self.state })
    }

    /// A free place now; `None` if the operation would wait; a rejection at once if it would
    /// wait in a queue that is already full (so that turning it away costs no wait).
    #[inline]
    fn try_acquire(&self) -> Option<Result<Self::Permit, AcquireError>> {
        let state = &*self.state;
        match state.semaphore.try_acquire() {
            Ok(permit) => {
                permit.forget();
                Some(Ok(self.permit()))
            }
            Err(TryAcquireError::NoPermits) => {
                let full = state.queued.load(Ordering::Relaxed)
                    >= state.max_queued.load(Ordering::Relaxed);
                full.then(|| Err(AcquireError::rejected(Rejection::QueueFull)))
            }
            Err(TryAcquireError::Closed) => Some(Err(AcquireError::closed())),
        }
    }

    fn capacity(&self) -> Option<&Capacity> {
        Some(&self.state.gauge)
    }

    fn may_reject(&self) -> bool {
        self.queue_bound().is_some()
    }
}

/// Counts one waiter of a [`Limit`] while it lives.
struct Queued<'a>(&'a State);

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        self.0.queued.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A place in a [`Limit`], given back when dropped.
pub struct LimitPermit {
    state: Arc<State>,
}

impl Drop for LimitPermit {
    #[inline]
    fn drop(&mut self) {
        self.state.release();
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
