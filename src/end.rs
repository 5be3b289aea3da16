//! Where an admitted operation ends: when the inner service answers ([`AtHead`], tower's
//! semantics), or when the response body ends ([`AtBodyEnd`]).

use http::Response;

use crate::body::OperationBody;
use crate::classify::{ClassifiedResponse, ClassifyOutcome, ClassifyResponse};
use crate::lifecycle::Running;
use crate::metrics::Series;
use crate::Outcome;

/// An admitted operation, as a response future carries it: what records its end, what
/// classifies it, and its permit (dropped after the end is recorded).
#[derive(Debug)]
pub struct Admitted<K, P> {
    pub(crate) running: Running<Series>,
    pub(crate) classifier: K,
    /// `None` once the operation has ended (or moved into the body).
    pub(crate) permit: Option<P>,
}

/// The operation ends, and its permit goes back, when the inner service's future completes, as
/// with tower's `ConcurrencyLimit`. The default.
#[derive(Clone, Copy, Debug, Default)]
pub struct AtHead;

/// The operation of an `http::Response` service lasts until the response body ends: its permit,
/// its place in `active` and its run time go on while the body streams. See
/// [`until_body_end`](crate::ResourcesOperationLayer::until_body_end).
#[derive(Clone, Copy, Debug, Default)]
pub struct AtBodyEnd;

mod sealed {
    pub trait Sealed {}
    impl Sealed for super::AtHead {}
    impl Sealed for super::AtBodyEnd {}
}

/// Where an operation ends: [`AtHead`] or [`AtBodyEnd`].
pub trait End<Res, Err, K, P>: sealed::Sealed {
    /// What the layered service answers.
    type Response;

    /// The inner service answered `result`: ends the operation, or hands it to the body.
    #[doc(hidden)]
    fn complete(
        result: Result<Res, Err>,
        operation: &mut Admitted<K, P>,
    ) -> Result<Self::Response, Err>;

    /// The inner service answered `result` for an operation that records nothing: gives its
    /// permit back, or hands it to the body.
    #[doc(hidden)]
    fn complete_unrecorded(
        result: Result<Res, Err>,
        permit: &mut Option<P>,
    ) -> Result<Self::Response, Err>;

    /// An answer no operation measured: a rejection's, or an unlimited request's.
    #[doc(hidden)]
    fn unmetered(result: Result<Res, Err>) -> Result<Self::Response, Err>;
}

impl<Res, Err, K: ClassifyOutcome<Res, Err>, P> End<Res, Err, K, P> for AtHead {
    type Response = Res;

    #[inline]
    fn complete(result: Result<Res, Err>, operation: &mut Admitted<K, P>) -> Result<Res, Err> {
        let classifier = &operation.classifier;
        operation
            .running
            .finish_with(|| classifier.classify(result.as_ref()));
        operation.permit = None;
        result
    }

    #[inline]
    fn complete_unrecorded(result: Result<Res, Err>, permit: &mut Option<P>) -> Result<Res, Err> {
        *permit = None;
        result
    }

    #[inline]
    fn unmetered(result: Result<Res, Err>) -> Result<Res, Err> {
        result
    }
}

impl<B, Err, K, P> End<Response<B>, Err, K, P> for AtBodyEnd
where
    B: http_body::Body,
    K: ClassifyOutcome<Response<B>, Err> + ClassifyResponse,
{
    type Response = Response<OperationBody<B, K::ClassifyEos, P>>;

    fn complete(
        result: Result<Response<B>, Err>,
        operation: &mut Admitted<K, P>,
    ) -> Result<Self::Response, Err> {
        match result {
            Ok(response) => {
                // What ends the operation: the head's outcome, or the end of the stream. With
                // nothing to record, the head is not classified at all.
                let end = if operation.running.is_recording() {
                    let classifier = &operation.classifier;
                    guarded(|| classifier.classify_response(&response))
                } else {
                    ClassifiedResponse::Ready(Outcome::Ok)
                };
                let running = std::mem::replace(&mut operation.running, Running::EMPTY);
                let permit = operation.permit.take();
                Ok(response.map(|body| OperationBody::new(body, running, permit, end)))
            }
            Err(error) => {
                let classifier = &operation.classifier;
                operation
                    .running
                    .finish_with(|| classifier.classify(Err(&error)));
                operation.permit = None;
                Err(error)
            }
        }
    }

    fn complete_unrecorded(
        result: Result<Response<B>, Err>,
        permit: &mut Option<P>,
    ) -> Result<Self::Response, Err> {
        let permit = permit.take();
        result.map(|response| {
            response.map(|body| {
                OperationBody::new(
                    body,
                    Running::EMPTY,
                    permit,
                    ClassifiedResponse::Ready(Outcome::Ok),
                )
            })
        })
    }

    fn unmetered(result: Result<Response<B>, Err>) -> Result<Self::Response, Err> {
        result.map(|response| response.map(OperationBody::unmetered))
    }
}

/// Runs the classifier of a response head: one that panics costs the operation its outcome
/// (`error`), never the response.
fn guarded<E>(classify: impl FnOnce() -> ClassifiedResponse<E>) -> ClassifiedResponse<E> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(classify))
        .unwrap_or(ClassifiedResponse::Ready(Outcome::Error))
}
