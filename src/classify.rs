//! Deciding the [`Outcome`] of a finished operation from what the inner service returned.
//!
//! The layer asks its classifier once, when the inner future completes. A drop before that is
//! `cancelled` and a panic is `crashed` whatever the classifier says, and an outcome chosen with
//! [`set_outcome`](crate::set_outcome) wins over all of them.

use std::any::Any;
use std::error::Error;

use crate::Outcome;

mod http;

pub use http::{GrpcClassifier, HttpClassifier};

/// Maps the result of the inner service to an [`Outcome`].
///
/// Implemented by [`DefaultClassifier`] and by every `Fn(Result<&Res, &Err>) -> Outcome`, so a
/// closure works wherever a classifier is:
///
/// ```
/// use tower_resources_operation::{Outcome, ResourcesOperationLayer};
///
/// // A service whose responses carry their own verdict.
/// let layer = ResourcesOperationLayer::new(4).classifier(
///     |result: Result<&Result<u32, String>, &std::convert::Infallible>| match result {
///         Ok(Ok(_)) => Outcome::Ok,
///         Ok(Err(_)) => Outcome::Error,
///         Err(never) => match *never {},
///     },
/// );
/// # drop(layer);
/// ```
///
/// A classifier runs on the request path: it should be cheap and must not panic (if it does, the
/// response still goes out and the operation is recorded as `error`).
pub trait ClassifyOutcome<Res, Err> {
    /// The outcome of an operation whose inner future returned `result`.
    fn classify(&self, result: Result<&Res, &Err>) -> Outcome;
}

impl<F, Res, Err> ClassifyOutcome<Res, Err> for F
where
    F: Fn(Result<&Res, &Err>) -> Outcome,
{
    fn classify(&self, result: Result<&Res, &Err>) -> Outcome {
        self(result)
    }
}

/// `Ok` is [`Outcome::Ok`]; `Err` is [`Outcome::Timeout`] when the error is a timeout (see
/// [`error_outcome`]) and [`Outcome::Error`] otherwise.
///
/// It looks into the error through `Any`, so it works for any error type: a boxed error such as
/// tower's `BoxError` (and its source chain), `std::io::Error`, tower's and tokio's `Elapsed`
/// themselves, and `Infallible`. An error type of your own is `error` unless it *is* one of
/// those; classify it with a closure that calls [`error_outcome`] to look into its chain.
///
/// `Any` needs the error type to be `'static`. rustc cannot always prove that inside an async
/// block (rust-lang/rust#110338): a layered service whose error is a `BoxError`, driven with
/// `oneshot` inside `tokio::spawn(async move { .. })`, fails to compile with "higher-ranked
/// lifetime error" (tower's own `Timeout` fails there too). Box the service
/// (`tower::util::BoxCloneService`), spawn the `oneshot` future itself rather than an async block
/// around it, or use [`ResultClassifier`], which has no bounds. axum and tonic handlers, whose
/// errors are `Infallible`, are not affected.
#[derive(Clone, Copy, Debug, Default)]
pub struct DefaultClassifier;

/// `Ok` is [`Outcome::Ok`], `Err` is [`Outcome::Error`]: the [`DefaultClassifier`] without the
/// timeout rule, and without its `'static` bound on the error type, so it compiles wherever
/// tower's `ConcurrencyLimit` does.
#[derive(Clone, Copy, Debug, Default)]
pub struct ResultClassifier;

impl<Res, Err> ClassifyOutcome<Res, Err> for ResultClassifier {
    fn classify(&self, result: Result<&Res, &Err>) -> Outcome {
        match result {
            Ok(_) => Outcome::Ok,
            Err(_) => Outcome::Error,
        }
    }
}

impl<Res, Err: 'static> ClassifyOutcome<Res, Err> for DefaultClassifier {
    fn classify(&self, result: Result<&Res, &Err>) -> Outcome {
        match result {
            Ok(_) => Outcome::Ok,
            Err(error) => any_error_outcome(error),
        }
    }
}

/// Longest source chain [`error_outcome`] follows, in case a chain loops.
const MAX_SOURCE_DEPTH: usize = 32;

/// [`Outcome::Timeout`] if `error`, or an error in its source chain, is tower's or tokio's
/// `Elapsed` or an `std::io::Error` of kind `TimedOut`; [`Outcome::Error`] otherwise.
///
/// ```
/// use tower_resources_operation::{error_outcome, Outcome};
///
/// let elapsed = tower::timeout::error::Elapsed::new();
/// let wrapped = std::io::Error::other(elapsed);
/// assert_eq!(error_outcome(&wrapped), Outcome::Timeout);
/// assert_eq!(error_outcome(&std::fmt::Error), Outcome::Error);
/// ```
pub fn error_outcome(error: &(dyn Error + 'static)) -> Outcome {
    let mut next = Some(error);
    for _ in 0..MAX_SOURCE_DEPTH {
        let Some(error) = next else { break };
        if is_timeout(error) {
            return Outcome::Timeout;
        }
        next = match error.downcast_ref::<std::io::Error>() {
            // An `io::Error`'s `source` skips the error it wraps; step into that error itself.
            Some(io) => match io.get_ref() {
                Some(inner) => Some(inner as &(dyn Error + 'static)),
                None => None,
            },
            None => error.source(),
        };
    }
    Outcome::Error
}

fn is_timeout(error: &(dyn Error + 'static)) -> bool {
    error.is::<tower::timeout::error::Elapsed>()
        || error.is::<tokio::time::error::Elapsed>()
        || error
            .downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::TimedOut)
}

/// The outcome of an error of any type: looks through `Any` for the error types whose chain
/// can be read.
pub(crate) fn any_error_outcome<E: 'static>(error: &E) -> Outcome {
    let any: &dyn Any = error;
    let error: &(dyn Error + 'static) =
        if let Some(boxed) = any.downcast_ref::<Box<dyn Error + Send + Sync>>() {
            &**boxed
        } else if let Some(boxed) = any.downcast_ref::<Box<dyn Error + Send>>() {
            &**boxed
        } else if let Some(boxed) = any.downcast_ref::<Box<dyn Error>>() {
            &**boxed
        } else if let Some(io) = any.downcast_ref::<std::io::Error>() {
            io
        } else if let Some(elapsed) = any.downcast_ref::<tower::timeout::error::Elapsed>() {
            elapsed
        } else if let Some(elapsed) = any.downcast_ref::<tokio::time::error::Elapsed>() {
            elapsed
        } else {
            return Outcome::Error;
        };
    error_outcome(error)
}

/// How [`resources_operation`](crate::resources_operation) reads the outcome of a future's output.
///
/// `Result` is `ok` or, for `Err`, what [`DefaultClassifier`] says of the error; `()` is `ok`.
/// Implement it for an output type of your own; it should not panic (if it does, the output
/// still goes to the caller and the operation is recorded as `error`).
pub trait OperationOutput {
    /// The outcome of an operation whose work returned `self`.
    fn outcome(&self) -> Outcome;
}

impl<T, E: 'static> OperationOutput for Result<T, E> {
    fn outcome(&self) -> Outcome {
        match self {
            Ok(_) => Outcome::Ok,
            Err(error) => any_error_outcome(error),
        }
    }
}

impl OperationOutput for () {
    fn outcome(&self) -> Outcome {
        Outcome::Ok
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type BoxError = Box<dyn Error + Send + Sync>;

    fn classify<E: 'static>(error: E) -> Outcome {
        ClassifyOutcome::<(), E>::classify(&DefaultClassifier, Err(&error))
    }

    #[test]
    fn ok_is_ok() {
        assert_eq!(
            ClassifyOutcome::<u8, BoxError>::classify(&DefaultClassifier, Ok(&1)),
            Outcome::Ok
        );
    }

    #[test]
    fn tower_and_tokio_elapsed_are_timeouts_directly_boxed_or_in_the_chain() {
        assert_eq!(
            classify(tower::timeout::error::Elapsed::new()),
            Outcome::Timeout
        );
        let boxed: BoxError = Box::new(tower::timeout::error::Elapsed::new());
        assert_eq!(classify(boxed), Outcome::Timeout);
        let chained: BoxError =
            Box::new(std::io::Error::other(tower::timeout::error::Elapsed::new()));
        assert_eq!(classify(chained), Outcome::Timeout);
        let timed_out = std::io::Error::from(std::io::ErrorKind::TimedOut);
        assert_eq!(classify(timed_out), Outcome::Timeout);
    }

    #[test]
    fn other_errors_are_errors() {
        let boxed: BoxError = "boom".into();
        assert_eq!(classify(boxed), Outcome::Error);
        assert_eq!(classify("a &str error"), Outcome::Error);
        assert_eq!(classify(std::io::Error::other("boom")), Outcome::Error);
    }
}
