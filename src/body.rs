//! An operation that ends when its response body does ([`AtBodyEnd`]): the [`OperationBody`]
//! that holds it while the body streams.

use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::{HeaderMap, Response};
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

use crate::attributes::Outcome;
use crate::classify::{ClassifyOutcome, ClassifyTrailers};
use crate::limit::{Acquire, Limit};
use crate::operation::{Ending, Lifecycle};

/// Where a layer's operations end, in its last type parameter `E`: the operation of an
/// `http::Response` service lasts until the response body ends, and its permit, its place in
/// `active` and its run time go on while the body streams. See
/// [`until_body_end`](crate::ResourcesOperationLayer::until_body_end). The default, `()`, ends
/// it when the inner service answers, as tower's `ConcurrencyLimit` frees its permit.
#[derive(Clone, Copy, Debug, Default)]
pub struct AtBodyEnd;

/// What decides the outcome of an operation at the end of its stream.
pub(crate) struct StreamEnd {
    /// What the head said.
    head: Outcome,
    /// How the end of the stream decides instead, if it does.
    at_end: Option<ClassifyTrailers>,
}

impl StreamEnd {
    fn outcome(&self, trailers: Option<&HeaderMap>) -> Outcome {
        self.at_end.map_or(self.head, |at_end| at_end(trailers))
    }
}

pin_project! {
    /// The body of a response whose operation ends when the body does (the layer's
    /// [`until_body_end`](crate::ResourcesOperationLayer::until_body_end) form).
    ///
    /// It passes frames, `size_hint` and `is_end_stream` through unchanged, and holds the
    /// operation's permit until the stream ends:
    ///
    /// - at the end of the stream (the trailers, a frame after which `is_end_stream` is true, or
    ///   the end itself; or at once, for a body empty from the start), the operation ends with
    ///   what the head decided, or what the trailers say when the classifier lets them decide
    ///   ([`ClassifyOutcome::classify_at_end`]: a gRPC stream's status);
    /// - a body error ends it as `error`;
    /// - dropped before its end (the client hung up), it ends as `cancelled`, or `timeout` past
    ///   the caller's deadline;
    /// - a panic while it is polled ends it as `crashed`, and the panic goes on;
    /// - [`set_outcome`](crate::set_outcome) called while the body is polled wins over all of
    ///   these.
    pub struct OperationBody<B, L: Acquire = Limit> {
        #[pin]
        inner: B,
        operation: Lifecycle<L, Option<StreamEnd>>,
    }
}

impl<B: Body, L: Acquire> OperationBody<B, L> {
    /// The inner service answered `result`: a response's operation goes on in its body; an
    /// error ends it.
    pub(crate) fn head<C, Err>(
        result: Result<Response<B>, Err>,
        operation: &mut Lifecycle<L, Option<C>>,
    ) -> Result<Response<Self>, Err>
    where
        C: ClassifyOutcome<Response<B>, Err>,
    {
        match result {
            Ok(response) => {
                let streaming = operation.carry(|classifier| {
                    classifier.as_ref().map(|classifier| StreamEnd {
                        head: classifier.classify(Ok(&response)),
                        at_end: classifier.classify_at_end(&response),
                    })
                });
                Ok(response.map(|body| OperationBody::new(body, streaming)))
            }
            Err(error) => {
                operation.end(Ending::Returned, |classifier| {
                    classifier.as_ref().map(|c| c.classify(Err(&error)))
                });
                Err(error)
            }
        }
    }

    /// An answer no operation measured: a rejection's, or an unlimited request's.
    pub(crate) fn unmetered<Err>(result: Result<Response<B>, Err>) -> Result<Response<Self>, Err> {
        result.map(|response| response.map(Self::unmetered_body))
    }

    /// A body no operation measures.
    pub(crate) fn unmetered_body(body: B) -> Self {
        OperationBody::new(body, Lifecycle::new())
    }

    fn new(inner: B, mut operation: Lifecycle<L, Option<StreamEnd>>) -> Self {
        if inner.is_end_stream() {
            operation.end(Ending::Returned, |end| {
                end.as_ref().map(|end| end.outcome(None))
            });
        }
        Self { inner, operation }
    }
}

impl<B, L: Acquire> OperationBody<B, L> {
    /// The body inside.
    pub fn get_ref(&self) -> &B {
        &self.inner
    }

    /// The body inside, unwrapped; its operation, if it is still going, ends as `cancelled`.
    pub fn into_inner(self) -> B {
        self.inner
    }
}

impl<B: Body, L: Acquire> Body for OperationBody<B, L> {
    type Data = B::Data;
    type Error = B::Error;

    #[inline]
    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = self.project();
        if !this.operation.is_admitted() {
            return this.inner.poll_frame(cx);
        }
        let mut inner = this.inner;
        let polled = this.operation.poll(|| inner.as_mut().poll_frame(cx));
        let ended = match &polled {
            Poll::Pending => false,
            Poll::Ready(Some(Ok(frame))) => frame.is_trailers() || inner.is_end_stream(),
            Poll::Ready(Some(Err(_)) | None) => true,
        };
        if ended {
            end_of_stream(this.operation, &polled);
        }
        polled
    }

    #[inline]
    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    #[inline]
    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The stream ended with the frame (or error, or end) of `polled`: ends the operation. Out of
/// line: once per operation, not per frame.
fn end_of_stream<L: Acquire, D, E>(
    operation: &mut Lifecycle<L, Option<StreamEnd>>,
    polled: &Poll<Option<Result<Frame<D>, E>>>,
) {
    let trailers = match polled {
        Poll::Ready(Some(Err(_))) => return operation.end(Ending::Failed, |_| None),
        Poll::Ready(Some(Ok(frame))) => frame.trailers_ref(),
        Poll::Ready(None) | Poll::Pending => None,
    };
    operation.end(Ending::Returned, |end| {
        end.as_ref().map(|end| end.outcome(trailers))
    });
}

impl<B, L: Acquire> fmt::Debug for OperationBody<B, L> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OperationBody")
            .field("ended", &!self.operation.is_admitted())
            .finish_non_exhaustive()
    }
}
