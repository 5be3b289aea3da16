//! What a limit is ([`Acquire`]), the crate's own ([`Limit`]), and how a limit is asked for a
//! permit, in a service's `poll_ready` or in an `async` block.
//!
//! NeMo Gym's module enters "`limit`, which is any async context manager such as an
//! `asyncio.Semaphore`". Here a limit is anything that hands out a permit and takes it back when
//! the permit drops: tokio's [`Semaphore`], this crate's [`Limit`], a weighted semaphore, a pool
//! whose checkout is the permit, a semaphore kept in a store that every replica of a fleet
//! reaches (with the `redis` feature, this crate's `redis::RedisLimit`).

mod front;
mod local;
mod poll;
#[cfg(feature = "redis")]
pub mod redis;
mod resize;

use std::error::Error;
use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore, SemaphorePermit, TryAcquireError};

pub use local::{Limit, LimitBuilder, LimitPermit, LimitTooLarge};
pub(crate) use poll::{in_place, Asking, Waiting};

use crate::metrics::Capacity;
use crate::Rejection;

/// A limit: admits operations one permit at a time, and takes the place back when the permit
/// drops.
///
/// # Contract
///
/// - **The permit drops exactly once**, when the operation ends (the layer holds it until the
///   response future, or the response body, is done; [`resources_operation`] until the work
///   returns). Dropping it gives the place back; it must not panic.
/// - **Cancellation-safe.** The future of [`acquire`](Acquire::acquire) may be dropped at any
///   `.await`: the caller went away. Dropping it must leave the limit as if it had never asked
///   (no place taken, none leaked).
/// - **Fairness is the limit's.** The layer asks in the order its callers poll; who gets the next
///   place is up to the implementation (tokio's [`Semaphore`] and [`Limit`] serve first come,
///   first served).
/// - **Never hang on a failure; a failure is answered.** A limit that turns an operation away
///   returns [`AcquireError::rejected`]. A limit that cannot admit it (closed, shut down, its
///   store unreachable past a timeout of its own) returns [`AcquireError::closed`] or
///   [`AcquireError::failed`]: the operation is turned away with
///   [`Rejection::Unavailable`]. Either way the layer answers it as its
///   [`protocol`](crate::protocol) says (HTTP `503`, gRPC `UNAVAILABLE` for `unavailable`,
///   [`RejectAsError`](crate::protocol::RejectAsError)'s error), [`resources_operation`]
///   returns [`Rejected`](crate::Rejected), and it is counted in
///   `gym.resources.operation.rejected` by reason. Only a layer whose protocol cannot answer
///   ([`Plain`](crate::protocol::Plain), tower's drop-in) has no answer to give: it ends the
///   caller of a failed limit with a panic that names the limit's type and the cause, as
///   tower's limit does for a closed semaphore, and it refuses up front a limit that says it
///   [may reject](Acquire::may_reject). A limit that may fail in the normal course of things
///   (one across a network) says so there.
///
/// # Implementing it
///
/// ```
/// use std::future::Future;
/// use std::sync::Arc;
/// use tokio::sync::{OwnedSemaphorePermit, Semaphore};
/// use tower_resources_operation::{limit::AcquireError, Acquire};
///
/// /// A limit where a large job takes several places.
/// #[derive(Clone)]
/// struct Weighted {
///     places: Arc<Semaphore>,
///     weight: u32,
/// }
///
/// impl Acquire for Weighted {
///     type Permit = OwnedSemaphorePermit;
///
///     fn acquire(&self) -> impl Future<Output = Result<Self::Permit, AcquireError>> + Send {
///         let places = Arc::clone(&self.places);
///         let weight = self.weight;
///         async move {
///             places
///                 .acquire_many_owned(weight)
///                 .await
///                 .map_err(|_| AcquireError::closed())
///         }
///     }
/// }
/// ```
///
/// [`resources_operation`]: crate::resources_operation
pub trait Acquire {
    /// What the work holds while it runs; dropping it gives the place back.
    type Permit;

    /// Waits for a permit.
    fn acquire(&self) -> impl Future<Output = Result<Self::Permit, AcquireError>> + Send;

    /// Waits for a permit, on a limit given away: a service keeps this future across its
    /// `poll_ready` calls, so it must own what it borrows. Defaults to
    /// [`acquire`](Acquire::acquire) on the limit moved into the future; a limit whose handle is
    /// a reference count can move that count into the permit instead of taking another.
    fn acquire_owned(self) -> impl Future<Output = Result<Self::Permit, AcquireError>> + Send
    where
        Self: Sized + Send + Sync,
    {
        async move { self.acquire().await }
    }

    /// A permit now if one is free, `None` if the operation would have to wait.
    ///
    /// Tried before [`acquire`](Acquire::acquire), so that a free place costs no future and no
    /// clock read. Defaults to `None`: every operation goes through `acquire`, and a service
    /// allocates each wait's future (as tokio-util's `PollSemaphore` does).
    fn try_acquire(&self) -> Option<Result<Self::Permit, AcquireError>> {
        None
    }

    /// The capacity this limit reports as `gym.resources.operation.limit`, if it knows it.
    ///
    /// Defaults to `None`: the series reports no limit (the layer's
    /// [`capacity`](crate::ResourcesOperationLayer::capacity) can give one). Return clones of one
    /// [`Capacity`], made with the limit: each distinct `Capacity` counts as another limit.
    fn capacity(&self) -> Option<Capacity> {
        None
    }

    /// Whether this limit may turn an operation away: with [`AcquireError::rejected`], or with
    /// a failure it expects in the normal course of things (a store across a network that
    /// may be out of reach), answered as [`Rejection::Unavailable`].
    ///
    /// A layer that cannot answer a rejection refuses, when it makes its service, a limit that
    /// says it may reject. Defaults to `false`: a limit that fails only when it is closed on
    /// purpose (tokio's [`Semaphore`], [`Limit`]) need not say so.
    fn may_reject(&self) -> bool {
        false
    }

    /// This limit, turning away with [`Rejection::QueueTimeout`] an operation that has waited
    /// `timeout` for its permit.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_resources_operation::{Acquire, Limit};
    ///
    /// // Two at once; none waits more than half a second.
    /// let judges = Limit::new(2).queue_timeout(Duration::from_millis(500));
    /// assert!(judges.may_reject());
    /// ```
    fn queue_timeout(self, timeout: Duration) -> QueueTimeout<Self>
    where
        Self: Sized,
    {
        QueueTimeout {
            limit: self,
            timeout,
        }
    }
}

/// Something a limit can be made from: a number (a new [`Limit`] of that many operations at
/// once) or any [`Acquire`] (itself).
pub trait IntoLimit {
    /// The limit.
    type Limit: Acquire;

    /// Makes the limit.
    ///
    /// # Panics
    ///
    /// A number above tokio's [`Semaphore::MAX_PERMITS`] panics: use [`Limit::try_new`] for an
    /// error instead.
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

/// A limit whose operations wait at most a time for their permit: see
/// [`Acquire::queue_timeout`].
#[derive(Clone, Debug)]
pub struct QueueTimeout<A> {
    limit: A,
    timeout: Duration,
}

impl<A> QueueTimeout<A> {
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
fn timed_out<P>(
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
}

/// Why a limit admitted no operation: it turned it away, or it cannot admit any more.
pub struct AcquireError {
    kind: ErrorKind,
}

enum ErrorKind {
    Rejected(Rejection),
    Closed,
    Failed(Box<dyn Error + Send + Sync>),
}

impl AcquireError {
    /// The limit turned the operation away, for `rejection`; the layer answers it as a rejection
    /// and counts it in `gym.resources.operation.rejected`.
    pub fn rejected(rejection: Rejection) -> Self {
        Self {
            kind: ErrorKind::Rejected(rejection),
        }
    }

    /// The limit is closed and will never admit again (tokio's `AcquireError`).
    pub fn closed() -> Self {
        Self {
            kind: ErrorKind::Closed,
        }
    }

    /// The limit could not admit the operation because of `source` (a pool shut down, a store
    /// that cannot be reached).
    pub fn failed(source: impl Into<Box<dyn Error + Send + Sync>>) -> Self {
        Self {
            kind: ErrorKind::Failed(source.into()),
        }
    }

    /// Why the operation was turned away, as a layer answers and counts it: the limit's
    /// [`Rejection`], or [`Rejection::Unavailable`] for a limit that is closed or failed.
    pub fn rejection(&self) -> Rejection {
        match self.kind {
            ErrorKind::Rejected(rejection) => rejection,
            ErrorKind::Closed | ErrorKind::Failed(_) => Rejection::Unavailable,
        }
    }

    /// Whether the limit failed or is closed ([`closed`](Self::closed),
    /// [`failed`](Self::failed)), rather than turning the operation away by a rule of its own.
    pub fn is_failure(&self) -> bool {
        !matches!(self.kind, ErrorKind::Rejected(_))
    }
}

impl fmt::Debug for AcquireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.kind {
            ErrorKind::Rejected(rejection) => f.debug_tuple("Rejected").field(rejection).finish(),
            ErrorKind::Closed => f.write_str("Closed"),
            ErrorKind::Failed(source) => f.debug_tuple("Failed").field(source).finish(),
        }
    }
}

impl fmt::Display for AcquireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.kind {
            ErrorKind::Rejected(Rejection::QueueFull) => f.write_str("the limit's queue is full"),
            ErrorKind::Rejected(Rejection::QueueTimeout) => {
                f.write_str("the operation waited too long for the limit")
            }
            ErrorKind::Rejected(Rejection::Unavailable) => {
                f.write_str("the limit cannot admit operations now")
            }
            ErrorKind::Closed => f.write_str("the limit is closed"),
            ErrorKind::Failed(source) => write!(f, "the limit failed: {source}"),
        }
    }
}

impl Error for AcquireError {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        match &self.kind {
            ErrorKind::Failed(source) => Some(&**source),
            _ => None,
        }
    }
}

/// Ends a caller whose limit failed under a layer that cannot answer: the panic names the
/// limit's type and why.
#[cold]
#[inline(never)]
#[track_caller]
pub(crate) fn limit_failed<L: ?Sized>(error: &AcquireError) -> ! {
    panic!(
        "tower-resources-operation: the limit ({}) cannot admit any operation: {error}. \
         A semaphore given as a limit must stay open while services use it, or the layer must \
         answer `unavailable`: give it a protocol that answers, such as .protocol(RejectAsError) \
         for a BoxError service, or use new_for_http / new_for_grpc.",
        std::any::type_name::<L>()
    )
}

impl<'a> Acquire for &'a Semaphore {
    type Permit = SemaphorePermit<'a>;

    fn acquire(&self) -> impl Future<Output = Result<Self::Permit, AcquireError>> + Send {
        let semaphore: &'a Semaphore = self;
        async move {
            semaphore
                .acquire()
                .await
                .map_err(|_| AcquireError::closed())
        }
    }

    #[inline]
    fn try_acquire(&self) -> Option<Result<Self::Permit, AcquireError>> {
        match Semaphore::try_acquire(self) {
            Ok(permit) => Some(Ok(permit)),
            Err(TryAcquireError::NoPermits) => None,
            Err(TryAcquireError::Closed) => Some(Err(AcquireError::closed())),
        }
    }
}

impl Acquire for Arc<Semaphore> {
    type Permit = OwnedSemaphorePermit;

    fn acquire(&self) -> impl Future<Output = Result<Self::Permit, AcquireError>> + Send {
        Acquire::acquire_owned(Arc::clone(self))
    }

    async fn acquire_owned(self) -> Result<Self::Permit, AcquireError> {
        Semaphore::acquire_owned(self)
            .await
            .map_err(|_| AcquireError::closed())
    }

    #[inline]
    fn try_acquire(&self) -> Option<Result<Self::Permit, AcquireError>> {
        match Arc::clone(self).try_acquire_owned() {
            Ok(permit) => Some(Ok(permit)),
            Err(TryAcquireError::NoPermits) => None,
            Err(TryAcquireError::Closed) => Some(Err(AcquireError::closed())),
        }
    }
}

/// A limit reached through a reference, or shared through an `Arc`, is that limit.
macro_rules! forward_acquire {
    ($($handle:ty),*) => {$(
        impl<A: Acquire + ?Sized> Acquire for $handle {
            type Permit = A::Permit;

            fn acquire(&self) -> impl Future<Output = Result<Self::Permit, AcquireError>> + Send {
                (**self).acquire()
            }

            #[inline]
            fn try_acquire(&self) -> Option<Result<Self::Permit, AcquireError>> {
                (**self).try_acquire()
            }

            fn capacity(&self) -> Option<Capacity> {
                (**self).capacity()
            }

            fn may_reject(&self) -> bool {
                (**self).may_reject()
            }
        }
    )*};
}

forward_acquire!(&A, Arc<A>);
