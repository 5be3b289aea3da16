//! [`PollAcquire`]: the poll-based form of [`Acquire`], for `poll_ready`.

use std::fmt;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::ReusableBoxFuture;

use super::{Acquire, AcquireError};
use crate::Rejection;

/// Polls a limit for a permit, as tokio-util's `PollSemaphore` polls a semaphore: what a
/// service needs to take its permit in `poll_ready`, as tower's limit does.
///
/// It first tries [`Acquire::try_acquire`]; only an operation that has to wait makes an
/// [`Acquire::acquire`] future, kept in one allocation that later waits of the same
/// `PollAcquire` reuse. A clone shares the limit and starts with no wait of its own. Dropping a
/// `PollAcquire` that waits gives up its place.
pub struct PollAcquire<L: Acquire> {
    limit: L,
    /// The wait in progress (when `waiting`), or the allocation left by the last one.
    future: Option<ReusableBoxFuture<'static, Result<L::Permit, AcquireError>>>,
    waiting: bool,
}

impl<L> PollAcquire<L>
where
    L: Acquire + Clone + Send + Sync + 'static,
    L::Permit: Send + 'static,
{
    /// Polls `limit`.
    pub fn new(limit: L) -> Self {
        Self {
            limit,
            future: None,
            waiting: false,
        }
    }

    /// Polls for a permit.
    ///
    /// - `Poll::Pending` if none is free; the task is woken when one may be (only the waker of
    ///   the most recent call is kept);
    /// - `Poll::Ready(Ok(permit))` once it has one;
    /// - `Poll::Ready(Err(error))` if the limit turned the operation away or failed.
    pub fn poll_acquire(&mut self, cx: &mut Context<'_>) -> Poll<Result<L::Permit, AcquireError>> {
        self.poll_acquire_within(cx, None)
    }

    /// [`poll_acquire`](Self::poll_acquire), giving up with [`Rejection::QueueTimeout`] once the
    /// wait that this call starts has lasted `timeout`.
    #[inline]
    pub(crate) fn poll_acquire_within(
        &mut self,
        cx: &mut Context<'_>,
        timeout: Option<Duration>,
    ) -> Poll<Result<L::Permit, AcquireError>> {
        if !self.waiting {
            if let Some(now) = self.limit.try_acquire() {
                return Poll::Ready(now);
            }
        }
        self.poll_wait(cx, timeout)
    }

    /// The wait itself, out of line: a free permit never comes here.
    #[inline(never)]
    fn poll_wait(
        &mut self,
        cx: &mut Context<'_>,
        timeout: Option<Duration>,
    ) -> Poll<Result<L::Permit, AcquireError>> {
        if !self.waiting {
            self.start_waiting(timeout);
        }
        let future = self
            .future
            .as_mut()
            .expect("a waiting PollAcquire has a future");
        let acquired = ready!(future.poll(cx));
        self.waiting = false;
        Poll::Ready(acquired)
    }

    fn start_waiting(&mut self, timeout: Option<Duration>) {
        let limit = self.limit.clone();
        // Two futures, so that a wait with no timeout carries no timer.
        match timeout {
            None => self.arm(limit.acquire_owned()),
            Some(timeout) => {
                let deadline = Instant::now() + timeout;
                self.arm(async move {
                    tokio::time::timeout_at(deadline, limit.acquire_owned())
                        .await
                        .unwrap_or_else(|_| Err(AcquireError::rejected(Rejection::QueueTimeout)))
                })
            }
        }
        self.waiting = true;
    }

    /// Makes `wait` the wait in progress, in the allocation of the last one if it fits.
    fn arm<F>(&mut self, wait: F)
    where
        F: std::future::Future<Output = Result<L::Permit, AcquireError>> + Send + 'static,
    {
        match &mut self.future {
            Some(future) => future.set(wait),
            None => self.future = Some(ReusableBoxFuture::new(wait)),
        }
    }
}

impl<L: Acquire> PollAcquire<L> {
    /// Whether a wait is in progress: the last poll returned `Pending`.
    pub fn is_waiting(&self) -> bool {
        self.waiting
    }

    /// The limit.
    pub fn get_ref(&self) -> &L {
        &self.limit
    }
}

impl<L: Acquire + Clone> Clone for PollAcquire<L> {
    /// Shares the limit; the clone starts with no wait of its own.
    fn clone(&self) -> Self {
        Self {
            limit: self.limit.clone(),
            future: None,
            waiting: false,
        }
    }
}

impl<L: Acquire> fmt::Debug for PollAcquire<L> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PollAcquire")
            .field("limit", &std::any::type_name::<L>())
            .field("waiting", &self.waiting)
            .finish()
    }
}
