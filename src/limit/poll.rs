//! How a limit is asked for a permit: now, if one is free, or by waiting for one; in a service's
//! `poll_ready` (the wait kept across calls) or in an `async` block (the wait on its stack).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio_util::sync::ReusableBoxFuture;

use super::queue_timeout::timed_out;
use super::{Acquire, AcquireError, Rejected};

/// One way of asking a limit, for [`Lifecycle::poll_admit`](crate::operation::Lifecycle::poll_admit).
pub(crate) trait Asking {
    /// What the limit hands out.
    type Permit;

    /// Whether a wait is in progress: the last poll of it was `Pending`.
    fn is_waiting(&self) -> bool;

    /// A permit now if one is free; `None` if the operation has to wait.
    fn try_now(&mut self) -> Option<Result<Self::Permit, AcquireError>>;

    /// Polls the wait for a permit, starting one if none is in progress.
    fn poll_wait(&mut self, cx: &mut Context<'_>) -> Poll<Result<Self::Permit, AcquireError>>;
}

/// A service's wait for its permit, kept across `poll_ready` calls. Each wait is one allocation
/// (as in tokio-util's `PollSemaphore`), reused by the next wait of the same service when it
/// fits; a clone starts with none.
pub(crate) struct Waiting<P> {
    /// The wait in progress (when `standing` says so), or the allocation left by the last one.
    future: Option<ReusableBoxFuture<'static, Result<P, AcquireError>>>,
    standing: Standing,
}

/// Where a service's next operation stands while it holds no permit.
#[derive(Debug)]
enum Standing {
    Idle,
    Waiting,
    /// Turned away, for `call` to answer.
    Rejected(Rejected),
    /// Its request already holds a place of the limit (an operation around it on the request's
    /// path holds one): `call` runs it on that place.
    Nested,
}

/// Where a service's next operation stands, without what it carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Stands {
    /// No wait in progress, nothing to answer: the path of a free permit.
    Idle,
    /// A wait is in progress.
    Waiting,
    /// Turned away, for `call` to answer.
    Rejected,
    /// On a place its request already holds.
    Nested,
}

impl<P> Waiting<P> {
    pub(crate) const fn new() -> Self {
        Self {
            future: None,
            standing: Standing::Idle,
        }
    }

    /// Whether nothing is in progress or to answer: one compare on the path of a free permit.
    #[inline(always)]
    pub(crate) fn is_idle(&self) -> bool {
        matches!(self.standing, Standing::Idle)
    }

    /// Whether it owns nothing: no wait's allocation, nothing in progress or to answer.
    #[inline(always)]
    pub(crate) fn is_empty(&self) -> bool {
        self.future.is_none() && self.is_idle()
    }

    /// Where the next operation stands.
    pub(crate) fn stands(&self) -> Stands {
        match self.standing {
            Standing::Idle => Stands::Idle,
            Standing::Waiting => Stands::Waiting,
            Standing::Rejected(_) => Stands::Rejected,
            Standing::Nested => Stands::Nested,
        }
    }

    /// Whether a wait is in progress.
    pub(crate) fn is_waiting(&self) -> bool {
        matches!(self.standing, Standing::Waiting)
    }

    /// Whether the request already holds a place of the limit, for `call` to run on.
    pub(crate) fn is_nested(&self) -> bool {
        matches!(self.standing, Standing::Nested)
    }

    /// The request already holds a place of the limit: `call` runs it on that place; `false`
    /// undoes it (the inner service will not be called).
    pub(crate) fn nest(&mut self, nested: bool) {
        self.standing = match nested {
            true => Standing::Nested,
            false => Standing::Idle,
        };
    }

    /// Whether the next call runs on a place its request holds: taken once, by `call`.
    pub(crate) fn take_nested(&mut self) -> bool {
        let nested = self.is_nested();
        if nested {
            self.standing = Standing::Idle;
        }
        nested
    }

    /// The limit turned the operation away: `call` answers it.
    pub(crate) fn reject(&mut self, rejected: Rejected) {
        self.standing = Standing::Rejected(rejected);
    }

    /// Starts the wait `next`, in the allocation of the last one if it fits.
    fn start(&mut self, next: impl Future<Output = Result<P, AcquireError>> + Send + 'static) {
        match &mut self.future {
            Some(future) => future.set(next),
            None => self.future = Some(ReusableBoxFuture::new(next)),
        }
        self.standing = Standing::Waiting;
    }

    /// The rejection to answer, which `call` takes once.
    pub(crate) fn take_rejection(&mut self) -> Option<Rejected> {
        match std::mem::replace(&mut self.standing, Standing::Idle) {
            Standing::Rejected(rejected) => Some(rejected),
            other => {
                self.standing = other;
                None
            }
        }
    }

    /// Asks `limit` through this wait, turning the operation away once it has waited
    /// `timeout`, if there is one. `busy`: the limit was asked for a free place a moment ago,
    /// and had none; the wait starts without asking again.
    #[inline]
    pub(crate) fn asking<'a, L>(
        &'a mut self,
        limit: &'a L,
        timeout: &'a Option<Duration>,
        busy: bool,
    ) -> impl Asking<Permit = P> + 'a
    where
        L: Acquire<Permit = P> + Clone + Send + Sync + 'static,
        P: Send + 'static,
    {
        Service {
            limit,
            wait: self,
            timeout,
            busy,
        }
    }
}

struct Service<'a, L: Acquire> {
    limit: &'a L,
    wait: &'a mut Waiting<L::Permit>,
    timeout: &'a Option<Duration>,
    busy: bool,
}

impl<L> Asking for Service<'_, L>
where
    L: Acquire + Clone + Send + Sync + 'static,
    L::Permit: Send + 'static,
{
    type Permit = L::Permit;

    #[inline]
    fn is_waiting(&self) -> bool {
        self.wait.is_waiting()
    }

    #[inline(always)]
    fn try_now(&mut self) -> Option<Result<L::Permit, AcquireError>> {
        match self.busy {
            true => None,
            false => self.limit.try_acquire(),
        }
    }

    fn poll_wait(&mut self, cx: &mut Context<'_>) -> Poll<Result<L::Permit, AcquireError>> {
        let wait = &mut *self.wait;
        if !wait.is_waiting() {
            let next = self.limit.clone().acquire_owned();
            match *self.timeout {
                None => wait.start(next),
                Some(timeout) => {
                    wait.start(async move { timed_out(tokio::time::timeout(timeout, next).await) })
                }
            }
        }
        let Some(future) = &mut wait.future else {
            unreachable!("a wait was started above")
        };
        let acquired = std::task::ready!(future.poll(cx));
        wait.standing = Standing::Idle;
        Poll::Ready(acquired)
    }
}

/// Asks `limit`, waiting on `wait` (its [`acquire`](Acquire::acquire) future, made up front and
/// polled only if the operation has to wait).
pub(crate) fn in_place<'a, L, F>(
    limit: &'a L,
    wait: Pin<&'a mut F>,
) -> impl Asking<Permit = L::Permit> + 'a
where
    L: Acquire,
    F: Future<Output = Result<L::Permit, AcquireError>>,
{
    InPlace {
        limit,
        wait,
        waiting: false,
    }
}

struct InPlace<'a, L, F> {
    limit: &'a L,
    wait: Pin<&'a mut F>,
    waiting: bool,
}

impl<L, F> Asking for InPlace<'_, L, F>
where
    L: Acquire,
    F: Future<Output = Result<L::Permit, AcquireError>>,
{
    type Permit = L::Permit;

    fn is_waiting(&self) -> bool {
        self.waiting
    }

    fn try_now(&mut self) -> Option<Result<L::Permit, AcquireError>> {
        self.limit.try_acquire()
    }

    fn poll_wait(&mut self, cx: &mut Context<'_>) -> Poll<Result<L::Permit, AcquireError>> {
        let polled = self.wait.as_mut().poll(cx);
        self.waiting = polled.is_pending();
        polled
    }
}
