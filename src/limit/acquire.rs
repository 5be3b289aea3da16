//! [`Acquire`]: what a limit is, the contract every limit keeps, and the limits it is
//! implemented for (tokio's semaphore, and any limit behind a reference or an `Arc`).

use std::future::Future;
use std::sync::Arc;

use tokio::sync::{OwnedSemaphorePermit, Semaphore, SemaphorePermit, TryAcquireError};

use super::feedback::Ended;
use super::report::Capacity;
#[cfg(doc)]
use crate::attributes::Rejection;
use crate::rejected::Rejected;

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
/// - **Never hang on a failure; a failure is answered.** A limit that turns an operation away
///   returns [`Rejected::new`] with its reason. A limit that cannot admit it (closed, shut down,
///   its store unreachable past a timeout of its own) returns [`Rejected::closed`] or
///   [`Rejected::failed`]: the operation is turned away with
///   [`Rejection::Unavailable`]. Either way the layer answers it as its
///   [`protocol`](crate::protocol) says (HTTP `503`, gRPC `UNAVAILABLE` for `unavailable`,
///   [`RejectAsError`](crate::protocol::RejectAsError)'s error), [`resources_operation`]
///   returns [`Rejected`](crate::Rejected), and it is counted in
///   `gym.resources.operation.rejected` by reason. Only a layer whose protocol cannot answer
///   (the generic layer's, `()`: tower's drop-in) has no answer to give: it ends the
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
/// use tower_resources_operation::{Acquire, Rejected};
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
///     fn acquire(&self) -> impl Future<Output = Result<Self::Permit, Rejected>> + Send {
///         let places = Arc::clone(&self.places);
///         let weight = self.weight;
///         async move {
///             places
///                 .acquire_many_owned(weight)
///                 .await
///                 .map_err(|_| Rejected::closed())
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
    fn acquire(&self) -> impl Future<Output = Result<Self::Permit, Rejected>> + Send;

    /// Waits for a permit, on a limit given away: a service keeps this future across its
    /// `poll_ready` calls, so it must own what it borrows. Defaults to
    /// [`acquire`](Acquire::acquire) on the limit moved into the future; a limit whose handle is
    /// a reference count can move that count into the permit instead of taking another.
    fn acquire_owned(self) -> impl Future<Output = Result<Self::Permit, Rejected>> + Send
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
    fn try_acquire(&self) -> Option<Result<Self::Permit, Rejected>> {
        None
    }

    /// The capacity this limit reports as `gym.resources.operation.limit`, if it knows it.
    ///
    /// Defaults to `None`: the series reports no limit (the layer's
    /// [`capacity`](crate::ResourcesOperationLayer::capacity) can give one). Return clones of one
    /// [`Capacity`], made with the limit: each distinct `Capacity` counts as another limit. A
    /// limit of your own reports like the crate's through [`Capacity::of_limit`].
    fn capacity(&self) -> Option<Capacity> {
        None
    }

    /// Whether this limit may turn an operation away: with [`Rejected::new`], or with
    /// a failure it expects in the normal course of things (a store across a network that
    /// may be out of reach), answered as [`Rejection::Unavailable`].
    ///
    /// A layer that cannot answer a rejection refuses, when it makes its service, a limit that
    /// says it may reject. Defaults to `false`: a limit that fails only when it is closed on
    /// purpose (tokio's [`Semaphore`], [`Limit`](crate::Limit)) need not say so.
    fn may_reject(&self) -> bool {
        false
    }

    /// Whether this limit hears how each of its operations ends, through
    /// [`ended`](Acquire::ended): an operation is timed for its limit only then (with metrics
    /// off, it reads no clock otherwise). Asked once per layer, when it is made, so the answer
    /// must not change over the limit's life. Defaults to `false`.
    fn hears_ends(&self) -> bool {
        false
    }

    /// Whether this limit wants to hear the end of the operation just admitted with `permit`:
    /// asked once, as it is admitted, by every form of operation whose limit
    /// [hears ends](Acquire::hears_ends). A limit that measures a sample of a busy limit's
    /// operations says no to the rest: those are then neither timed nor told to
    /// [`ended`](Acquire::ended) (with metrics off, they read no clock). Defaults to `true`.
    #[inline]
    fn hears_end(permit: &Self::Permit) -> bool {
        let _ = permit;
        true
    }

    /// Hears how an admitted operation that holds `permit` ended, before the permit goes back:
    /// every form of operation calls it once, whatever the metrics, for a limit that
    /// [hears ends](Acquire::hears_ends) and [its end](Acquire::hears_end). An adaptive limit
    /// feeds its controller here. It must not panic (a panic is caught, and costs only what it
    /// would have done). Defaults to nothing.
    #[inline]
    fn ended(permit: &Self::Permit, ended: &Ended) {
        let _ = (permit, ended);
    }

    /// Which limit this is: the same for every clone of it, so that a request that reaches a
    /// limit whose place it already holds (one limit applied twice on its path: on a route and
    /// on the Router, or a handler that calls
    /// [`resources_operation`](crate::resources_operation) on the limit its layer
    /// holds) is admitted on the place it holds, instead of waiting for a second place, which
    /// halves the limit, or deadlocks once every place is held by a request that waits for
    /// another. Return the same as [`id_of`](Acquire::id_of) says of its permits.
    ///
    /// Defaults to `None`, not known: such a request then waits for a second place, as with
    /// tower's limits. [`Limit`](crate::Limit), `Arc<Semaphore>` and the companion's fleet limit
    /// say.
    fn id(&self) -> Option<LimitId> {
        None
    }

    /// Which limit `permit` holds a place of: the [`id`](Acquire::id) of the limit that handed
    /// it out. Defaults to `None`.
    #[inline]
    fn id_of(permit: &Self::Permit) -> Option<LimitId> {
        let _ = permit;
        None
    }
}

/// Which limit a limit is ([`Acquire::id`]): the address of the state that every clone of it
/// shares, which no other limit alive has.
///
/// ```
/// use std::sync::Arc;
/// use tokio::sync::Semaphore;
/// use tower_resources_operation::limit::LimitId;
/// use tower_resources_operation::{Acquire, Limit};
///
/// let limit = Limit::new(2);
/// assert_eq!(limit.id(), limit.clone().id());
/// assert_ne!(limit.id(), Limit::new(2).id());
///
/// // A limit of your own: the address of what its handles share.
/// let shared = Arc::new(Semaphore::new(2));
/// assert_eq!(LimitId::of(&*shared), LimitId::of(&*shared.clone()));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LimitId(std::num::NonZeroUsize);

impl LimitId {
    /// The identity of the limit whose clones all share `shared` (the contents of their `Arc`,
    /// say): its address. Give it a value with a size (the address of a zero-sized value is
    /// no one's own).
    pub fn of<T: ?Sized>(shared: &T) -> Self {
        // A reference is never null.
        let address = (shared as *const T).cast::<()>() as usize;
        Self(std::num::NonZeroUsize::new(address).unwrap_or(std::num::NonZeroUsize::MIN))
    }
}

impl<'a> Acquire for &'a Semaphore {
    type Permit = SemaphorePermit<'a>;

    fn acquire(&self) -> impl Future<Output = Result<Self::Permit, Rejected>> + Send {
        let semaphore: &'a Semaphore = self;
        async move { semaphore.acquire().await.map_err(|_| Rejected::closed()) }
    }

    #[inline]
    fn try_acquire(&self) -> Option<Result<Self::Permit, Rejected>> {
        match Semaphore::try_acquire(self) {
            Ok(permit) => Some(Ok(permit)),
            Err(TryAcquireError::NoPermits) => None,
            Err(TryAcquireError::Closed) => Some(Err(Rejected::closed())),
        }
    }
}

impl Acquire for Arc<Semaphore> {
    type Permit = OwnedSemaphorePermit;

    fn id(&self) -> Option<LimitId> {
        Some(LimitId::of(&**self))
    }

    #[inline]
    fn id_of(permit: &OwnedSemaphorePermit) -> Option<LimitId> {
        Some(LimitId::of(&**permit.semaphore()))
    }

    fn acquire(&self) -> impl Future<Output = Result<Self::Permit, Rejected>> + Send {
        Acquire::acquire_owned(Arc::clone(self))
    }

    async fn acquire_owned(self) -> Result<Self::Permit, Rejected> {
        Semaphore::acquire_owned(self)
            .await
            .map_err(|_| Rejected::closed())
    }

    #[inline]
    fn try_acquire(&self) -> Option<Result<Self::Permit, Rejected>> {
        match Arc::clone(self).try_acquire_owned() {
            Ok(permit) => Some(Ok(permit)),
            Err(TryAcquireError::NoPermits) => None,
            Err(TryAcquireError::Closed) => Some(Err(Rejected::closed())),
        }
    }
}

/// A limit reached through a reference, or shared through an `Arc`, is that limit.
macro_rules! forward_acquire {
    ($($handle:ty),*) => {$(
        impl<A: Acquire> Acquire for $handle {
            type Permit = A::Permit;

            fn acquire(&self) -> impl Future<Output = Result<Self::Permit, Rejected>> + Send {
                (**self).acquire()
            }

            #[inline]
            fn try_acquire(&self) -> Option<Result<Self::Permit, Rejected>> {
                (**self).try_acquire()
            }

            fn capacity(&self) -> Option<Capacity> {
                (**self).capacity()
            }

            fn may_reject(&self) -> bool {
                (**self).may_reject()
            }

            fn hears_ends(&self) -> bool {
                (**self).hears_ends()
            }

            fn id(&self) -> Option<LimitId> {
                (**self).id()
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
    )*};
}

forward_acquire!(&A, Arc<A>);
