//! Deciding the [`Outcome`] of an operation from what its work returned.
//!
//! - [`ClassifyOutcome`] reads a service's result, once, when the inner future completes; in
//!   the body-end form it reads the response head, and the trailers at the end of the stream.
//!   [`DefaultClassifier`], [`TimeoutClassifier`] and [`HttpClassifier`] are the crate's;
//!   closures are classifiers too.
//! - [`OperationOutput`] is what a value says of how its operation ended: an `http::Response`
//!   its status, a process its exit status. The [`DefaultClassifier`] (the classifier of
//!   [`ResourcesOperationLayer::new`](crate::ResourcesOperationLayer::new)) reads it from a
//!   service's response, and [`resources_operation`](crate::resources_operation) from the output
//!   of its work.
//!
//! A drop before the end is `cancelled` (or `timeout` past the caller's deadline) and a panic is
//! `crashed`, whatever the classifier says; an outcome chosen with
//! [`set_outcome`](crate::set_outcome) wins over all of them. A classifier that panics costs the
//! operation its outcome (`error`), never the response.

use std::any::Any;
use std::error::Error;

use ::http::HeaderMap;

use crate::attributes::Outcome;

mod http;
mod output;

pub use self::http::HttpClassifier;
pub use self::output::OperationOutput;

/// Maps the result of the inner service to an [`Outcome`].
///
/// Implemented by the crate's classifiers and by every `Fn(Result<&Res, &Err>) -> Outcome`, so
/// a closure works wherever a classifier is:
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
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot tell how an operation that answered `{Res}` ended",
    label = "this layer's classifier cannot read `{Res}`",
    note = "the `DefaultClassifier` (of `ResourcesOperationLayer::new`) reads a response that implements `classify::OperationOutput`: implement it for `{Res}` (which of its values are an `error`?), or give the layer a classifier of its own: a closure of the result that says its `Outcome`",
    note = "`HttpClassifier` reads an `http::Response`, and a gRPC one by its `grpc-status`"
)]
pub trait ClassifyOutcome<Res, Err> {
    /// The outcome of an operation whose inner future returned `result`.
    fn classify(&self, result: Result<&Res, &Err>) -> Outcome;

    /// In the body-end form ([`until_body_end`](crate::ResourcesOperationLayer::until_body_end)):
    /// whether the end of the stream, rather than the head `response`, decides the outcome, and
    /// how: from the trailers, or `None` when the stream ended without any. Defaults to `None`:
    /// the head decides. The crate's classifiers read the trailers' `grpc-status` for a gRPC
    /// response whose head carries none.
    fn classify_at_end(&self, response: &Res) -> Option<fn(Option<&HeaderMap>) -> Outcome> {
        let _ = response;
        None
    }
}

/// How the end of a stream decides an operation's outcome: from its trailers, or `None` when
/// the stream ended without any. See [`ClassifyOutcome::classify_at_end`].
pub(crate) type ClassifyTrailers = fn(Option<&HeaderMap>) -> Outcome;

impl<F, Res, Err> ClassifyOutcome<Res, Err> for F
where
    F: Fn(Result<&Res, &Err>) -> Outcome,
{
    fn classify(&self, result: Result<&Res, &Err>) -> Outcome {
        self(result)
    }
}

/// The classifier of [`ResourcesOperationLayer::new`](crate::ResourcesOperationLayer::new): an
/// answer is what it says of itself ([`OperationOutput`]), an `Err` is [`Outcome::Error`].
///
/// So an `http::Response` is read as [`HttpClassifier::new`] reads it (by its status: a `5xx` is
/// `error`, a `408` or `504` `timeout`; a gRPC response by its `grpc-status`), a process's
/// `Output` by its exit status, and a plain value
/// (`()`, `bool`, a number, a string) is `ok`. `new(..)` on an axum route, a hyper service or a
/// tonic service therefore counts a `500` as `error`, as `new_for_http` does.
///
/// It puts no bound on the error type, so a layer with it compiles wherever tower's
/// `ConcurrencyLimit` does for every response type that implements [`OperationOutput`]. For a
/// response type of your own, implement [`OperationOutput`] for it, or give the layer a
/// classifier of its own (a closure) that counts every answer as `ok`:
///
/// ```compile_fail,E0277
/// use tower::{service_fn, Layer, ServiceExt};
/// use tower_resources_operation::ResourcesOperationLayer;
///
/// struct Verdict {
///     passed: bool,
/// }
///
/// # async fn run() {
/// let verifier = ResourcesOperationLayer::new(2).layer(service_fn(|answer: u32| async move {
///     Ok::<_, std::convert::Infallible>(Verdict { passed: answer == 42 })
/// }));
/// // `Verdict: OperationOutput` is not satisfied: the layer cannot tell how it ended.
/// let _ = verifier.oneshot(42).await;
/// # }
/// ```
///
/// ```
/// use tower::{service_fn, Layer, ServiceExt};
/// use std::convert::Infallible;
/// use tower_resources_operation::classify::OperationOutput;
/// use tower_resources_operation::{Outcome, ResourcesOperationLayer};
///
/// struct Verdict {
///     passed: bool,
/// }
///
/// // What a verdict says of its operation: a verifier that could not pass it failed.
/// impl OperationOutput for Verdict {
///     fn outcome(&self) -> Outcome {
///         if self.passed { Outcome::Ok } else { Outcome::Error }
///     }
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let verify = |answer: u32| async move { Ok::<_, Infallible>(Verdict { passed: answer == 42 }) };
/// let read = ResourcesOperationLayer::new(2).layer(service_fn(verify));
/// assert!(read.oneshot(42).await.unwrap().passed);
/// // Or count every verdict as `ok`, whatever it says.
/// let every_answer_ok = |result: Result<&Verdict, &Infallible>| match result {
///     Ok(_) => Outcome::Ok,
///     Err(_) => Outcome::Error,
/// };
/// let any = ResourcesOperationLayer::new(2).classifier(every_answer_ok).layer(service_fn(verify));
/// assert!(!any.oneshot(7).await.unwrap().passed);
/// # }
/// ```
#[derive(Clone, Copy, Debug, Default)]
pub struct DefaultClassifier;

impl<Res: OperationOutput, Err> ClassifyOutcome<Res, Err> for DefaultClassifier {
    #[inline]
    fn classify(&self, result: Result<&Res, &Err>) -> Outcome {
        match result {
            Ok(response) => response.outcome(),
            Err(_) => Outcome::Error,
        }
    }

    fn classify_at_end(&self, response: &Res) -> Option<fn(Option<&HeaderMap>) -> Outcome> {
        response.outcome_at_end()
    }
}

/// Another classifier (by default the [`DefaultClassifier`]), plus: an error that is, or wraps,
/// tower's or tokio's `Elapsed`, or an `io::Error` of kind `TimedOut`, is [`Outcome::Timeout`]:
/// the error itself, or one in its source chain.
///
/// It looks into the error through `Any`, so it works for any error type: a boxed error such as
/// tower's `BoxError` (and its source chain), `std::io::Error`, `Elapsed` itself, `Infallible`.
///
/// `Any` needs the error type to be `'static`, and rustc cannot always prove that inside an
/// async block (rust-lang/rust#110338): a layered service whose error is a `BoxError`, driven
/// with `oneshot` inside `tokio::spawn(async move { .. })`, then fails to compile. See the
/// [crate docs](crate#compile-errors-and-what-to-do-about-them) for the ways around it.
///
/// ```
/// use std::time::Duration;
/// use tower::ServiceBuilder;
/// use tower_resources_operation::classify::TimeoutClassifier;
/// use tower_resources_operation::ResourcesOperationLayer;
///
/// let verifier = ServiceBuilder::new()
///     .layer(ResourcesOperationLayer::new(2).classifier(TimeoutClassifier::new()))
///     .timeout(Duration::from_secs(30))
///     .service_fn(|answer: String| async move { Ok::<_, tower::BoxError>(answer == "42") });
/// # drop(verifier);
/// ```
#[derive(Clone, Copy, Debug, Default)]
pub struct TimeoutClassifier<C = DefaultClassifier> {
    inner: C,
}

impl TimeoutClassifier {
    /// The [`DefaultClassifier`], plus timeouts. For a response type that does not implement
    /// [`OperationOutput`], wrap a classifier of your own instead ([`wrap`](Self::wrap)).
    pub const fn new() -> Self {
        Self {
            inner: DefaultClassifier,
        }
    }
}

impl<C> TimeoutClassifier<C> {
    /// `inner`, plus timeouts: an error that is not a timeout goes to `inner`.
    pub const fn wrap(inner: C) -> Self {
        Self { inner }
    }

    /// The classifier inside.
    pub const fn inner(&self) -> &C {
        &self.inner
    }
}

impl<C, Res, Err: 'static> ClassifyOutcome<Res, Err> for TimeoutClassifier<C>
where
    C: ClassifyOutcome<Res, Err>,
{
    fn classify(&self, result: Result<&Res, &Err>) -> Outcome {
        match result {
            Err(error) if any_error_outcome(error) == Outcome::Timeout => Outcome::Timeout,
            result => self.inner.classify(result),
        }
    }

    fn classify_at_end(&self, response: &Res) -> Option<fn(Option<&HeaderMap>) -> Outcome> {
        self.inner.classify_at_end(response)
    }
}

/// Longest source chain [`error_outcome`] follows, in case a chain loops.
const MAX_SOURCE_DEPTH: usize = 32;

/// [`Outcome::Timeout`] if `error`, or an error in its source chain, is tower's or tokio's
/// `Elapsed` or an `std::io::Error` of kind `TimedOut`; [`Outcome::Error`] otherwise.
pub(crate) fn error_outcome(error: &(dyn Error + 'static)) -> Outcome {
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
///
/// Why a downcast, and not a bound on the error as tower-http's classifiers have (`E:
/// Display`): the one bound that would read a timeout in the chain is `E: Error + 'static`,
/// and neither `BoxError` (`Box<dyn Error + Send + Sync>` does not implement `Error`) nor
/// `anyhow::Error` meets it. A trait of the crate's own would need an impl for `BoxError` beside
/// a blanket impl for every `Error`, which Rust refuses (std may one day implement `Error` for
/// the box), and an `anyhow::Error` user could not implement it (the orphan rule). So a work's
/// `Result` of any error type stays an `OperationOutput`, and `TimeoutClassifier` takes any
/// error, at the price of `'static` (see the crate docs' compile errors). The ladder reads
/// only std's, tower's and tokio's types, never the crate's own.
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

#[cfg(test)]
mod tests {
    use super::*;

    type BoxError = Box<dyn Error + Send + Sync>;

    fn classify<E: 'static>(error: E) -> Outcome {
        ClassifyOutcome::<(), E>::classify(&TimeoutClassifier::new(), Err(&error))
    }

    #[test]
    fn ok_is_ok_and_any_error_is_error_by_default() {
        let ok = ClassifyOutcome::<u8, BoxError>::classify(&DefaultClassifier, Ok(&1));
        assert_eq!(ok, Outcome::Ok);
        let elapsed: BoxError = Box::new(tower::timeout::error::Elapsed::new());
        let err = ClassifyOutcome::<u8, BoxError>::classify(&DefaultClassifier, Err(&elapsed));
        assert_eq!(err, Outcome::Error);
    }

    #[test]
    fn the_default_reads_what_a_response_says() {
        let server_error = ::http::Response::builder().status(500).body(()).unwrap();
        let default =
            ClassifyOutcome::<_, BoxError>::classify(&DefaultClassifier, Ok(&server_error));
        assert_eq!(default, Outcome::Error);
        let boom: BoxError = "boom".into();
        let failed = ClassifyOutcome::<(), BoxError>::classify(&DefaultClassifier, Err(&boom));
        assert_eq!(failed, Outcome::Error);
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
    fn a_timeout_wrapped_in_an_io_error_is_found_and_any_other_error_is_not() {
        let wrapped = std::io::Error::other(tower::timeout::error::Elapsed::new());
        assert_eq!(error_outcome(&wrapped), Outcome::Timeout);
        assert_eq!(error_outcome(&std::fmt::Error), Outcome::Error);
    }

    #[test]
    fn other_errors_are_errors() {
        let boxed: BoxError = "boom".into();
        assert_eq!(classify(boxed), Outcome::Error);
        assert_eq!(classify("a &str error"), Outcome::Error);
        assert_eq!(classify(std::io::Error::other("boom")), Outcome::Error);
    }
}
