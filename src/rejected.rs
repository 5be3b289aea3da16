//! [`Rejected`]: an operation turned away without a permit, from the limit that says it to the
//! caller that gets it.

use std::error::Error;
use std::fmt;
use std::sync::Arc;

use crate::attributes::Rejection;

/// An operation turned away without a permit, and why: by a rule of the limit's (a full queue,
/// a queue timeout, a deadline that passed in the queue), or because the limit cannot admit it
/// (closed, or failed, with the limit's own error as its [`source`](Error::source)).
///
/// It is one error from end to end: a limit returns it from [`Acquire`](crate::Acquire), and the
/// caller gets it as it was made: the error of
/// [`resources_operation`](crate::resources_operation), and the error that
/// [`RejectAsError`](crate::protocol::RejectAsError) answers with (converted into the service's
/// error type). A fleet limit's detailed error (its address, its cause) is its `source()`, as
/// tower's `buffer::ServiceError` keeps the error of the service it buffers.
///
/// Like tower's `Overloaded`, it converts into a `BoxError` and can be found again with
/// `downcast_ref`:
///
/// ```
/// use tower_resources_operation::{Rejected, Rejection};
///
/// let error: tower::BoxError = Rejected::new(Rejection::QueueFull).into();
/// let rejected = error.downcast_ref::<Rejected>().unwrap();
/// assert_eq!(rejected.rejection(), Rejection::QueueFull);
///
/// // A limit that failed keeps why.
/// let failed = Rejected::failed(std::io::Error::other("redis at 127.0.0.1:6390: refused"));
/// assert_eq!(failed.rejection(), Rejection::Unavailable);
/// let cause = std::error::Error::source(&failed).unwrap();
/// assert!(cause.to_string().contains("127.0.0.1:6390"));
/// ```
///
/// Two are equal when they turn an operation away for the same [`Rejection`], whatever the
/// cause.
#[derive(Clone)]
pub struct Rejected {
    reason: Reason,
}

#[derive(Clone)]
enum Reason {
    /// Turned away by a rule.
    Rule(Rejection),
    /// The limit is closed and will never admit again.
    Closed,
    /// The limit could not admit, because of this error. A thin pointer, so that a service
    /// that keeps a rejection for `call` to answer stays small.
    Failed(Arc<Box<dyn Error + Send + Sync>>),
}

impl Rejected {
    /// An operation turned away for `rejection`.
    pub const fn new(rejection: Rejection) -> Self {
        Self {
            reason: Reason::Rule(rejection),
        }
    }

    /// The limit is closed and will never admit again (tokio's `AcquireError`):
    /// [`Rejection::Unavailable`].
    pub const fn closed() -> Self {
        Self {
            reason: Reason::Closed,
        }
    }

    /// The limit could not admit the operation because of `source` (a pool shut down, a store
    /// that cannot be reached): [`Rejection::Unavailable`], with `source` as this error's
    /// [`source`](Error::source).
    pub fn failed(source: impl Into<Box<dyn Error + Send + Sync>>) -> Self {
        Self {
            reason: Reason::Failed(Arc::new(source.into())),
        }
    }

    /// Why the operation was turned away, as a layer answers and counts it: the limit's
    /// [`Rejection`], or [`Rejection::Unavailable`] for a limit that is closed or failed.
    pub const fn rejection(&self) -> Rejection {
        match &self.reason {
            Reason::Rule(rejection) => *rejection,
            Reason::Closed | Reason::Failed(_) => Rejection::Unavailable,
        }
    }

    /// Whether the limit failed or is closed ([`closed`](Self::closed),
    /// [`failed`](Self::failed)), rather than turning the operation away by a rule.
    pub const fn is_failure(&self) -> bool {
        !matches!(self.reason, Reason::Rule(_))
    }

    /// What a rejection for this reason says, whatever its cause (a gRPC answer's
    /// `grpc-message`).
    pub(crate) const fn message(&self) -> &'static str {
        match self.rejection() {
            Rejection::QueueFull => "rejected: the limit's queue is full",
            Rejection::QueueTimeout => {
                "rejected: waited for the limit as long as the queue timeout lets"
            }
            Rejection::Unavailable => {
                "rejected: the limit cannot admit operations now (closed, or its store is out of reach)"
            }
            Rejection::Deadline => {
                "rejected: the server's deadline passed while it waited for the limit"
            }
        }
    }
}

impl PartialEq for Rejected {
    fn eq(&self, other: &Self) -> bool {
        self.rejection() == other.rejection()
    }
}

impl Eq for Rejected {}

impl fmt::Debug for Rejected {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut debug = f.debug_struct("Rejected");
        debug.field("rejection", &self.rejection());
        match &self.reason {
            Reason::Rule(_) => {}
            Reason::Closed => {
                debug.field("closed", &true);
            }
            Reason::Failed(source) => {
                debug.field("source", source);
            }
        }
        debug.finish()
    }
}

impl fmt::Display for Rejected {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.reason {
            Reason::Rule(_) => f.write_str(self.message()),
            Reason::Closed => f.write_str("rejected: the limit is closed"),
            // The cause is also the `source()`; said here too, as tower's `ServiceError` does,
            // for a caller that logs only this line.
            Reason::Failed(source) => write!(f, "rejected: the limit failed: {source}"),
        }
    }
}

impl Error for Rejected {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        match &self.reason {
            Reason::Failed(source) => Some(&***source),
            _ => None,
        }
    }
}

/// Ends a caller whose limit failed under a layer that cannot answer: the panic names the
/// limit's type and why.
#[cold]
#[inline(never)]
#[track_caller]
pub(crate) fn limit_failed<L: ?Sized>(error: &Rejected) -> ! {
    let said = error.to_string();
    let why = said.strip_prefix("rejected: ").unwrap_or(&said);
    panic!(
        "tower-resources-operation: the limit ({}) cannot admit any operation: {why}. \
         A semaphore given as a limit must stay open while services use it, or the layer must \
         answer `unavailable`: give it a protocol that answers, such as .protocol(RejectAsError) \
         for a BoxError service, or use new_for_http / new_for_grpc.",
        std::any::type_name::<L>()
    )
}
