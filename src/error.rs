//! The crate's two errors: [`Rejected`], an operation turned away without a permit, from the
//! limit that says it to the caller that gets it; and [`ConfigError`], a value the crate cannot
//! take (a capacity, a limit's name, an attribute from a config file).

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

/// A value the crate cannot take: a limit's capacity (0, or above tokio's
/// `Semaphore::MAX_PERMITS`), a limit's name that cannot be a metric attribute, or an
/// attribute value that is not one of NeMo Gym's. Its message names the value (at most 64 bytes
/// of it) and what is allowed.
///
/// ```
/// use tower_resources_operation::{ConfigError, Limit, Operation};
///
/// let unknown: ConfigError = "grade".parse::<Operation>().unwrap_err();
/// assert_eq!(unknown.setting(), "operation");
/// assert_eq!(unknown.to_string(), r#"unknown operation "grade"; expected one of: verify, tool, judge, other"#);
///
/// let empty = Limit::try_new(0).unwrap_err();
/// assert_eq!(empty.setting(), "capacity");
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigError {
    kind: ConfigKind,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum ConfigKind {
    /// A capacity a limit cannot have.
    Capacity(usize),
    /// A name that cannot be a metric attribute (cut to 64 bytes).
    Name(String),
    /// An attribute value that is not one of `valid` (cut to 64 bytes).
    Attribute {
        attribute: &'static str,
        valid: &'static [&'static str],
        input: String,
    },
}

/// The most of a refused value that a message repeats.
const MAX_ECHOED: usize = 64;

/// `input`, cut to at most [`MAX_ECHOED`] bytes on a character boundary.
fn echoed(input: &str) -> String {
    let mut end = input.len().min(MAX_ECHOED);
    while !input.is_char_boundary(end) {
        end -= 1;
    }
    input[..end].to_owned()
}

impl ConfigError {
    pub(crate) fn capacity(capacity: usize) -> Self {
        Self {
            kind: ConfigKind::Capacity(capacity),
        }
    }

    pub(crate) fn name(name: &str) -> Self {
        Self {
            kind: ConfigKind::Name(echoed(name)),
        }
    }

    pub(crate) fn attribute(
        attribute: &'static str,
        valid: &'static [&'static str],
        input: &str,
    ) -> Self {
        Self {
            kind: ConfigKind::Attribute {
                attribute,
                valid,
                input: echoed(input),
            },
        }
    }

    /// What was refused: `"capacity"`, `"name"` (a limit's), or the attribute (`"operation"`,
    /// `"executor"`, `"outcome"`, `"rejection"`).
    pub fn setting(&self) -> &'static str {
        match &self.kind {
            ConfigKind::Capacity(_) => "capacity",
            ConfigKind::Name(_) => "name",
            ConfigKind::Attribute { attribute, .. } => attribute,
        }
    }

    /// The values the setting may take, where there is a list of them (an attribute's); empty
    /// otherwise.
    pub fn valid_values(&self) -> &'static [&'static str] {
        match &self.kind {
            ConfigKind::Attribute { valid, .. } => valid,
            _ => &[],
        }
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.kind {
            ConfigKind::Capacity(0) => f.write_str(
                "tower-resources-operation: a limit of 0 operations would admit nothing, ever; \
                 give it 1 or more (set_capacity(0) pauses a limit that serves)",
            ),
            ConfigKind::Capacity(capacity) => write!(
                f,
                "tower-resources-operation: a limit of {capacity} operations is above tokio's \
                 Semaphore::MAX_PERMITS ({})",
                tokio::sync::Semaphore::MAX_PERMITS
            ),
            ConfigKind::Name(name) => write!(
                f,
                "tower-resources-operation: a limit's name becomes a metric attribute, so it \
                 must be 1 to 64 characters among A-Z a-z 0-9 _ . : / -, starting with a \
                 letter; got {name:?}"
            ),
            ConfigKind::Attribute {
                attribute,
                valid,
                input,
            } => write!(
                f,
                "unknown {attribute} {input:?}; expected one of: {}",
                valid.join(", ")
            ),
        }
    }
}

impl Error for ConfigError {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_value_is_echoed_cut_on_a_char_boundary() {
        let long = "é".repeat(100);
        let error = ConfigError::attribute("executor", &["inline"], &long);
        let ConfigKind::Attribute { input, .. } = &error.kind else {
            panic!("an attribute's error")
        };
        assert!(input.len() <= MAX_ECHOED);
        assert!(error.to_string().ends_with("expected one of: inline"));
        assert_eq!(
            ConfigError::name(&long).to_string().matches('é').count(),
            32
        );
    }
}
