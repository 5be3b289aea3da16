//! [`Error`]: why a fleet limit could not be built, or a call to its store failed. It names the
//! limit, the address (without its password) and the cause; the store client's own error, when
//! there is one, is only its [`source`](std::error::Error::source). Nothing here knows Redis:
//! the store makes its errors through [`Error::new`].

use std::error::Error as StdError;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

/// Why a fleet limit could not be built, or a call of it to Redis failed.
///
/// Cheap to clone. Its message names the limit, the Redis address (never its password) and
/// the cause; [`kind`](Error::kind) says what went wrong, for a program to act on.
///
/// ```
/// use tower_resources_operation_redis::{ErrorKind, RedisLimit};
///
/// let error = RedisLimit::builder("judges", 8)
///     .build("http://:secret@redis.internal:6379/")
///     .unwrap_err();
/// assert_eq!(error.kind(), ErrorKind::InvalidAddress);
/// assert_eq!(error.limit(), "judges");
/// assert!(error.to_string().contains("redis.internal:6379"));
/// assert!(!error.to_string().contains("secret"));
/// ```
#[derive(Clone)]
pub struct Error {
    inner: Arc<Inner>,
}

struct Inner {
    kind: ErrorKind,
    limit: Arc<str>,
    /// The address, as said in messages: without its password.
    address: String,
    /// What went wrong, in words, the cause included.
    message: String,
    /// Answered without asking Redis: it failed a moment ago.
    short_circuited: bool,
    source: Option<Box<dyn StdError + Send + Sync>>,
}

/// What kind of [`Error`] it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The address is not a Redis URL the limit can use (`redis://host:port/db`, or
    /// `redis+unix:///path`).
    InvalidAddress,
    /// [`build`](crate::RedisLimitBuilder::build) was called outside a tokio runtime, where
    /// it has nowhere to spawn the limit's background task. Call it within one, or use
    /// [`build_pair`](crate::RedisLimitBuilder::build_pair) and run the task yourself.
    NoRuntime,
    /// Redis did not answer within the [call timeout](crate::RedisLimitBuilder::call_timeout)
    /// (frozen, overloaded, or a network that drops packets).
    Timeout,
    /// Redis could not be reached: the connection was refused, dropped or could not be made,
    /// or the server is not ready (loading its data, a replica without its master).
    Unreachable,
    /// Redis answered with an error (authentication, a script error, a key of another type
    /// under the limit's names), or with what the limit's scripts never answer.
    Redis,
}

impl Error {
    /// What kind of error it is.
    pub fn kind(&self) -> ErrorKind {
        self.inner.kind
    }

    /// The name of the limit it is about.
    pub fn limit(&self) -> &str {
        &self.inner.limit
    }

    /// The Redis address the limit was given, without its password.
    pub fn address(&self) -> &str {
        &self.inner.address
    }

    /// Whether the limit answered without asking Redis, because Redis failed a moment ago
    /// (it is asked again in the background; until it answers, every caller is answered at
    /// once). The failure that started it is the [`source`](StdError::source).
    pub fn is_short_circuited(&self) -> bool {
        self.inner.short_circuited
    }

    /// Whether Redis could not be reached or did not answer in time ([`ErrorKind::Timeout`],
    /// [`ErrorKind::Unreachable`]): what the limit's fail-open or fail-closed rule answers.
    pub fn is_unavailable(&self) -> bool {
        matches!(self.kind(), ErrorKind::Timeout | ErrorKind::Unreachable)
    }

    /// An error of `kind` about the limit `limit` on the store at `address` (as messages say
    /// it), described by `message`, caused by `source`.
    pub(crate) fn new(
        kind: ErrorKind,
        limit: &Arc<str>,
        address: &str,
        message: String,
        source: Option<Box<dyn StdError + Send + Sync>>,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                kind,
                limit: Arc::clone(limit),
                address: address.to_owned(),
                message,
                short_circuited: false,
                source,
            }),
        }
    }

    /// Redis answered what the limit's scripts never answer: `what`.
    pub(crate) fn unexpected(limit: &Arc<str>, address: &str, what: &str) -> Self {
        Self::new(
            ErrorKind::Redis,
            limit,
            address,
            format!("Redis answered what the limit's scripts never answer: {what}"),
            None,
        )
    }

    /// `build` outside a tokio runtime.
    pub(crate) fn no_runtime(
        limit: &Arc<str>,
        address: &str,
        cause: tokio::runtime::TryCurrentError,
    ) -> Self {
        Self::new(
            ErrorKind::NoRuntime,
            limit,
            address,
            format!(
                "`build` must be called within a tokio runtime, on which it spawns the limit's \
                 background task ({cause}); call it within one, or use `build_pair` and run \
                 the task yourself"
            ),
            Some(Box::new(cause)),
        )
    }

    /// No answer within `timeout`.
    pub(crate) fn timeout(limit: &Arc<str>, address: &str, timeout: Duration) -> Self {
        Self::new(
            ErrorKind::Timeout,
            limit,
            address,
            format!("Redis did not answer within the call timeout ({timeout:?})"),
            None,
        )
    }

    /// The answer given without asking Redis, after `self`.
    pub(crate) fn short_circuited(&self) -> Self {
        Self {
            inner: Arc::new(Inner {
                kind: self.kind(),
                limit: Arc::clone(&self.inner.limit),
                address: self.inner.address.clone(),
                message: format!(
                    "not asked: Redis failed a moment ago ({}), and the limit answers at once \
                     until it is reached again (retried in the background)",
                    self.inner.message
                ),
                short_circuited: true,
                source: Some(Box::new(self.clone())),
            }),
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "tower-resources-operation-redis: the fleet limit {:?} on Redis at {}: {}",
            self.inner.limit, self.inner.address, self.inner.message
        )
    }
}

impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Error")
            .field("kind", &self.inner.kind)
            .field("limit", &self.inner.limit)
            .field("address", &self.inner.address)
            .field("message", &self.inner.message)
            .field("short_circuited", &self.inner.short_circuited)
            .finish()
    }
}

impl StdError for Error {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        self.inner
            .source
            .as_deref()
            .map(|source| source as &(dyn StdError + 'static))
    }
}
