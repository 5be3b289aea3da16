//! [`Acquire`]: what a limit is, for the layer and for [`resources_operation`](crate::resources_operation).
//!
//! NeMo Gym's module enters "`limit`, which is any async context manager such as an
//! `asyncio.Semaphore`". Here a limit is anything that hands out a permit and takes it back when
//! the permit drops: tokio's [`Semaphore`], this crate's [`Limit`](crate::Limit), a weighted
//! semaphore, a pool whose checkout is the permit, a rate limiter, a semaphore kept in a store
//! that every replica of a fleet reaches.

use std::error::Error;
use std::fmt;
use std::future::Future;
use std::sync::Arc;

use tokio::sync::{OwnedSemaphorePermit, Semaphore, SemaphorePermit, TryAcquireError};

use crate::Rejection;

mod capacity;
mod poll;

pub use capacity::Capacity;
pub use poll::PollAcquire;

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
///   place is up to the implementation (tokio's [`Semaphore`] and [`Limit`](crate::Limit) serve
///   first come, first served).
/// - **Never hang on a failure.** A limit that cannot admit any more (closed, shut down, its store
///   unreachable past a timeout of its own) returns [`AcquireError::closed`] or
///   [`AcquireError::failed`], and that ends the caller with a panic that names the limit's type,
///   as tower's limit does for a closed semaphore. A limit that bounds its queue turns an
///   operation away with [`AcquireError::rejected`], which the layer answers as a rejection.
///
/// # Implementing it
///
/// ```
/// use std::future::Future;
/// use std::sync::Arc;
/// use tokio::sync::{OwnedSemaphorePermit, Semaphore};
/// use tower_resources_operation::{Acquire, AcquireError};
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

    /// Waits for a permit, on a limit given away: the poll-based form ([`PollAcquire`]) keeps
    /// this future across polls, so it must own what it borrows. Defaults to
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
    /// clock read. Defaults to `None`: every operation goes through `acquire`, and in the layer
    /// the first one of each service that waits allocates its future once.
    fn try_acquire(&self) -> Option<Result<Self::Permit, AcquireError>> {
        None
    }

    /// The capacity this limit reports as `gym.resources.operation.limit`, if it knows it.
    ///
    /// Defaults to `None`: the series reports no limit (the layer's
    /// [`capacity`](crate::ResourcesOperationLayer::capacity) can give one). Return clones of one
    /// [`Capacity`], made with the limit: each distinct `Capacity` counts as another limit.
    fn capacity(&self) -> Option<&Capacity> {
        None
    }

    /// Whether this limit may turn an operation away with [`AcquireError::rejected`].
    ///
    /// A layer that cannot answer a rejection refuses, when it makes its service, a limit that
    /// says it may reject. Defaults to `false`.
    fn may_reject(&self) -> bool {
        false
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

    /// Why the operation was turned away, if it was (rather than the limit failing).
    pub fn rejection(&self) -> Option<Rejection> {
        match self.kind {
            ErrorKind::Rejected(rejection) => Some(rejection),
            _ => None,
        }
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

/// Ends a caller whose limit failed: the panic names the limit's type and why.
#[cold]
#[inline(never)]
#[track_caller]
pub(crate) fn limit_failed<L: ?Sized>(error: &AcquireError) -> ! {
    panic!(
        "tower-resources-operation: the limit ({}) cannot admit any operation: {error}. \
         A semaphore given as a limit must stay open while services use it.",
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

            fn capacity(&self) -> Option<&Capacity> {
                (**self).capacity()
            }

            fn may_reject(&self) -> bool {
                (**self).may_reject()
            }
        }
    )*};
}

forward_acquire!(&A, Arc<A>);
