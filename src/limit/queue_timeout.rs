//! [`QueueTimeout`]: a limit whose operations wait at most a time for their permit.

use std::time::Duration;

use super::feedback::Ended;
use super::report::Capacity;
use super::{Acquire, AcquireError, LimitId};
use crate::attributes::Rejection;

/// A limit whose operations wait at most a time for their permit: see
/// [`Acquire::queue_timeout`].
#[derive(Clone, Debug)]
pub struct QueueTimeout<A> {
    limit: A,
    timeout: Duration,
}

impl<A> QueueTimeout<A> {
    pub(super) fn new(limit: A, timeout: Duration) -> Self {
        Self { limit, timeout }
    }

    /// The limit inside.
    pub fn get_ref(&self) -> &A {
        &self.limit
    }

    /// How long an operation may wait.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }
}

/// `Elapsed` as the rejection it is.
pub(super) fn timed_out<P>(
    waited: Result<Result<P, AcquireError>, tokio::time::error::Elapsed>,
) -> Result<P, AcquireError> {
    waited.unwrap_or_else(|_| Err(AcquireError::rejected(Rejection::QueueTimeout)))
}

impl<A: Acquire + Sync> Acquire for QueueTimeout<A> {
    type Permit = A::Permit;

    async fn acquire(&self) -> Result<Self::Permit, AcquireError> {
        timed_out(tokio::time::timeout(self.timeout, self.limit.acquire()).await)
    }

    #[inline]
    fn try_acquire(&self) -> Option<Result<Self::Permit, AcquireError>> {
        self.limit.try_acquire()
    }

    fn capacity(&self) -> Option<Capacity> {
        self.limit.capacity()
    }

    fn may_reject(&self) -> bool {
        true
    }

    fn hears_ends(&self) -> bool {
        self.limit.hears_ends()
    }

    fn id(&self) -> Option<LimitId> {
        self.limit.id()
    }

    #[inline]
    fn id_of(permit: &Self::Permit) -> Option<LimitId> {
        A::id_of(permit)
    }

    #[inline]
    fn hears_end(permit: &Self::Permit) -> bool {
        A::hears_end(permit)
    }

    #[inline]
    fn ended(permit: &Self::Permit, ended: &Ended) {
        A::ended(permit, ended)
    }
}
