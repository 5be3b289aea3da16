//! [`AcquireError`]: why a limit admitted no operation, and the end of a caller whose limit
//! failed under a layer that cannot answer.

use std::error::Error;
use std::fmt;

use crate::attributes::Rejection;

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
            ErrorKind::Rejected(Rejection::Deadline) => {
                f.write_str("the server's deadline passed while the operation waited")
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
