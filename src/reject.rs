//! Rejections: how an operation that the limit turned away is answered.
//!
//! A layer is [`Unbounded`] until it is told how to answer: [`bounded`] picks its protocol's
//! answer, [`reject_with`] takes one, [`queue_timeout`] bounds the wait (and picks the answer
//! if none was). Then a rejection makes `poll_ready` ready, and `call` answers it without
//! calling the inner service, as tower's `LoadShed` does.
//!
//! [`bounded`]: crate::ResourcesOperationLayer::bounded
//! [`reject_with`]: crate::ResourcesOperationLayer::reject_with
//! [`queue_timeout`]: crate::ResourcesOperationLayer::queue_timeout

use std::convert::Infallible;
use std::error::Error;
use std::fmt;
use std::time::Duration;

use http::header::{CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderValue, Response, StatusCode};

use crate::{
    Deadline, DefaultClassifier, GrpcClassifier, HttpClassifier, Rejection, SharedClassifier,
    TimeoutClassifier,
};

/// An operation turned away without a permit: the error a bounded generic layer answers with
/// (converted into the service's error type), and the error of
/// [`resources_operation`](crate::resources_operation).
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
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rejected {
    rejection: Rejection,
}

impl Rejected {
    /// An operation turned away for `rejection`.
    pub const fn new(rejection: Rejection) -> Self {
        Self { rejection }
    }

    /// Why it was turned away.
    pub const fn rejection(&self) -> Rejection {
        self.rejection
    }
}

impl fmt::Display for Rejected {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.rejection {
            Rejection::QueueFull => f.write_str("rejected: the limit's queue is full"),
            Rejection::QueueTimeout => {
                f.write_str("rejected: waited for the limit as long as the queue timeout lets")
            }
        }
    }
}

impl Error for Rejected {}

/// How a bounded layer answers a rejected operation, for a service that answers `Res` or fails
/// with `Err`.
pub trait AnswerRejection<Res, Err> {
    /// The answer to an operation turned away for `rejected`.
    fn answer(&self, rejected: Rejected) -> Result<Res, Err>;
}

/// Answers a rejection with the service's error, made from [`Rejected`]: the answer of a
/// bounded generic layer. The service's error must convert from `Rejected`, as `BoxError` does.
#[derive(Clone, Copy, Debug, Default)]
pub struct RejectAsError;

impl<Res, Err: From<Rejected>> AnswerRejection<Res, Err> for RejectAsError {
    fn answer(&self, rejected: Rejected) -> Result<Res, Err> {
        Err(rejected.into())
    }
}

/// Answers a rejection with an empty HTTP response: `503 Service Unavailable` unless told
/// otherwise, with `Retry-After` when given one. The answer of bounded HTTP layers.
///
/// ```
/// use std::time::Duration;
/// use http::StatusCode;
/// use tower_resources_operation::HttpRejection;
///
/// let answer = HttpRejection::new()
///     .status(StatusCode::TOO_MANY_REQUESTS)
///     .retry_after(Duration::from_secs(2));
/// # drop(answer);
/// ```
#[derive(Clone, Debug)]
pub struct HttpRejection {
    status: StatusCode,
    retry_after: Option<HeaderValue>,
}

impl Default for HttpRejection {
    fn default() -> Self {
        Self::new()
    }
}

impl HttpRejection {
    /// `503 Service Unavailable`, no `Retry-After`.
    pub fn new() -> Self {
        Self {
            status: StatusCode::SERVICE_UNAVAILABLE,
            retry_after: None,
        }
    }

    /// Answers with `status` instead (for example `429 Too Many Requests`).
    pub fn status(mut self, status: StatusCode) -> Self {
        self.status = status;
        self
    }

    /// Adds `Retry-After`, in whole seconds, rounded up.
    pub fn retry_after(mut self, after: Duration) -> Self {
        let seconds = after.as_secs() + u64::from(after.subsec_nanos() > 0);
        self.retry_after = Some(HeaderValue::from(seconds));
        self
    }
}

impl<B: Default, Err> AnswerRejection<Response<B>, Err> for HttpRejection {
    fn answer(&self, _rejected: Rejected) -> Result<Response<B>, Err> {
        let mut response = Response::new(B::default());
        *response.status_mut() = self.status;
        if let Some(after) = &self.retry_after {
            response.headers_mut().insert(RETRY_AFTER, after.clone());
        }
        Ok(response)
    }
}

/// Answers a rejection as a gRPC server does: a trailers-only response with `grpc-status` 8,
/// RESOURCE_EXHAUSTED (as tonic answers tower's `Overloaded`). The answer of bounded gRPC layers.
#[derive(Clone, Copy, Debug, Default)]
pub struct GrpcRejection;

impl<B: Default, Err> AnswerRejection<Response<B>, Err> for GrpcRejection {
    fn answer(&self, rejected: Rejected) -> Result<Response<B>, Err> {
        let mut response = Response::new(B::default());
        let headers = response.headers_mut();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
        headers.insert("grpc-status", HeaderValue::from_static("8"));
        let message = match rejected.rejection() {
            Rejection::QueueFull => "rejected: the limit's queue is full",
            Rejection::QueueTimeout => "rejected: waited for the limit as long as it lets",
        };
        headers.insert("grpc-message", HeaderValue::from_static(message));
        Ok(response)
    }
}

/// The answer a classifier's protocol gives a rejection, which
/// [`bounded`](crate::ResourcesOperationLayer::bounded) picks: [`RejectAsError`] for the generic
/// classifiers, [`HttpRejection`] for the [`HttpClassifier`], [`GrpcRejection`] for the
/// [`GrpcClassifier`].
pub trait DefaultAnswer {
    /// The answer.
    type Answer;

    /// The answer, as new.
    fn default_answer(&self) -> Self::Answer;
}

impl DefaultAnswer for DefaultClassifier {
    type Answer = RejectAsError;

    fn default_answer(&self) -> RejectAsError {
        RejectAsError
    }
}

impl DefaultAnswer for HttpClassifier {
    type Answer = HttpRejection;

    fn default_answer(&self) -> HttpRejection {
        HttpRejection::new()
    }
}

impl DefaultAnswer for GrpcClassifier {
    type Answer = GrpcRejection;

    fn default_answer(&self) -> GrpcRejection {
        GrpcRejection
    }
}

impl<C: DefaultAnswer> DefaultAnswer for TimeoutClassifier<C> {
    type Answer = C::Answer;

    fn default_answer(&self) -> C::Answer {
        self.inner().default_answer()
    }
}

impl<C: DefaultAnswer> DefaultAnswer for SharedClassifier<C> {
    type Answer = C::Answer;

    fn default_answer(&self) -> C::Answer {
        self.get_ref().default_answer()
    }
}

impl<C: DefaultAnswer> DefaultAnswer for Deadline<C> {
    type Answer = C::Answer;

    fn default_answer(&self) -> C::Answer {
        self.classifier().default_answer()
    }
}

/// A layer that never turns an operation away: its operations wait for the limit as long as it
/// takes, as with tower's `ConcurrencyLimit`. The default.
#[derive(Clone, Copy, Debug, Default)]
pub struct Unbounded;

/// A layer that answers rejected operations with `A`, and lets an operation wait at most its
/// queue timeout, if it has one.
#[derive(Clone, Debug)]
pub struct Bounded<A> {
    pub(crate) answer: A,
    pub(crate) queue_timeout: Option<Duration>,
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for super::Unbounded {}
    impl<A> Sealed for super::Bounded<A> {}
}

/// Whether a layer answers rejections: [`Unbounded`] or [`Bounded`].
pub trait Rejections: sealed::Sealed + Clone {
    /// What a service holds for a rejected operation until `call` answers it: nothing at all
    /// for [`Unbounded`], whose services are never rejected.
    #[doc(hidden)]
    type Held;

    /// What a response future holds for a rejected operation whose answer is a `T`.
    #[doc(hidden)]
    type Answered<T>: TakeAnswer<T>;

    /// The rejection to hold for `call`, or `Err` if this layer cannot answer one.
    #[doc(hidden)]
    fn hold(rejection: Rejection) -> Result<Self::Held, Rejection>;

    /// How long an operation may wait, if not for ever.
    #[doc(hidden)]
    fn queue_timeout(&self) -> Option<Duration>;
}

/// Answers a held rejection, for a service that answers `Res` or fails with `Err`.
#[doc(hidden)]
pub trait RespondRejected<Res, Err>: Rejections {
    /// The answer to `held`, as a response future holds it.
    fn respond(&self, held: Self::Held) -> Self::Answered<Result<Res, Err>>;
}

impl Rejections for Unbounded {
    type Held = Infallible;
    type Answered<T> = Infallible;

    fn hold(rejection: Rejection) -> Result<Infallible, Rejection> {
        Err(rejection)
    }

    fn queue_timeout(&self) -> Option<Duration> {
        None
    }
}

impl<Res, Err> RespondRejected<Res, Err> for Unbounded {
    fn respond(&self, held: Infallible) -> Infallible {
        held
    }
}

impl<A: Clone> Rejections for Bounded<A> {
    type Held = Rejection;
    type Answered<T> = Option<T>;

    fn hold(rejection: Rejection) -> Result<Rejection, Rejection> {
        Ok(rejection)
    }

    fn queue_timeout(&self) -> Option<Duration> {
        self.queue_timeout
    }
}

impl<A: Clone + AnswerRejection<Res, Err>, Res, Err> RespondRejected<Res, Err> for Bounded<A> {
    fn respond(&self, held: Rejection) -> Option<Result<Res, Err>> {
        Some(self.answer.answer(Rejected::new(held)))
    }
}

/// Takes the answer out of what a response future holds, once.
#[doc(hidden)]
pub trait TakeAnswer<T> {
    /// The answer.
    fn take_answer(&mut self) -> T;
}

impl<T> TakeAnswer<T> for Option<T> {
    fn take_answer(&mut self) -> T {
        self.take()
            .expect("a rejected response future polled after it completed")
    }
}

impl<T> TakeAnswer<T> for Infallible {
    fn take_answer(&mut self) -> T {
        match *self {}
    }
}

/// Ends a caller whose limit turned it away when its layer cannot answer a rejection.
#[cold]
#[inline(never)]
#[track_caller]
pub(crate) fn unanswerable<L: ?Sized>(rejected: Rejected) -> ! {
    panic!(
        "tower-resources-operation: the limit ({}) turned an operation away ({rejected}), but \
         this layer cannot answer a rejection: make it bounded (.bounded(), .reject_with(..) or \
         .queue_timeout(..))",
        std::any::type_name::<L>()
    )
}
