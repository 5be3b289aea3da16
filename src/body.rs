//! [`OperationBody`]: the response body that carries its operation to the end of the stream.

use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

use crate::classify::{ClassifiedResponse, ClassifyEos};
use crate::lifecycle::Running;
use crate::metrics::Series;
use crate::{scope, Outcome};

pin_project! {
    /// The body of a response whose operation ends when the body does (the layer's
    /// [`until_body_end`](crate::ResourcesOperationLayer::until_body_end) form).
    ///
    /// It passes frames, `size_hint` and `is_end_stream` through unchanged, and holds the
    /// operation's permit until the stream ends:
    ///
    /// - at the end of the stream (the trailers, a frame after which `is_end_stream` is true, or
    ///   the end itself; or at once, for a body empty from the start), the operation ends with
    ///   what the head decided, or what the [`ClassifyEos`] says of the trailers;
    /// - a body error ends it as `error` (or what the [`ClassifyEos`] says of the error);
    /// - dropped before its end (the client hung up), it ends as `cancelled`, or `timeout` past
    ///   the request's deadline;
    /// - a panic while it is polled ends it as `crashed`, and the panic goes on;
    /// - [`set_outcome`](crate::set_outcome) called while the body is polled wins over all of
    ///   these.
    pub struct OperationBody<B, E, P> {
        #[pin]
        inner: B,
        // `None` once the operation has ended, or for a body no operation measured.
        operation: Option<Streaming<E, P>>,
    }
}

/// An operation that goes on while its body streams. Declared before the permit, so that
/// dropped together, the operation records its end before the permit goes back.
struct Streaming<E, P> {
    running: Running<Series>,
    /// What ends it: the head's outcome, or the end of the stream.
    end: ClassifiedResponse<E>,
    _permit: Option<P>,
}

impl<B: Body, E: ClassifyEos, P> OperationBody<B, E, P> {
    pub(crate) fn new(
        inner: B,
        running: Running<Series>,
        permit: Option<P>,
        end: ClassifiedResponse<E>,
    ) -> Self {
        let ended = inner.is_end_stream();
        let streaming = Streaming {
            running,
            end,
            _permit: permit,
        };
        if ended {
            streaming.end_of_stream(None);
            return Self::unmetered(inner);
        }
        Self {
            inner,
            operation: Some(streaming),
        }
    }
}

impl<B, E, P> OperationBody<B, E, P> {
    /// A body that carries no operation.
    pub(crate) fn unmetered(inner: B) -> Self {
        Self {
            inner,
            operation: None,
        }
    }

    /// The body inside.
    pub fn get_ref(&self) -> &B {
        &self.inner
    }

    /// The body inside, unwrapped; its operation, if it is still going, ends as `cancelled`.
    pub fn into_inner(self) -> B {
        self.inner
    }
}

impl<E: ClassifyEos, P> Streaming<E, P> {
    /// The stream ended, with `trailers` if it sent any.
    fn end_of_stream(mut self, trailers: Option<&HeaderMap>) {
        let end = self.end;
        self.running.finish_with(|| match end {
            ClassifiedResponse::Ready(outcome) => outcome,
            ClassifiedResponse::RequiresEos(eos) => eos.classify_eos(trailers),
        });
    }

    /// The body failed with `error`.
    fn failed<Err>(mut self, error: &Err) {
        let end = self.end;
        self.running.finish_with(|| match end {
            ClassifiedResponse::Ready(_) => Outcome::Error,
            ClassifiedResponse::RequiresEos(eos) => eos.classify_body_error(error),
        });
    }
}

impl<B: Body, E: ClassifyEos, P> Body for OperationBody<B, E, P> {
    type Data = B::Data;
    type Error = B::Error;

    #[inline]
    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = self.project();
        let Some(streaming) = this.operation else {
            return this.inner.poll_frame(cx);
        };
        let mut inner = this.inner;
        let polled = if streaming.running.is_recording() {
            scope::enter(&mut streaming.running, || inner.as_mut().poll_frame(cx))
        } else {
            inner.as_mut().poll_frame(cx)
        };
        let ended = match &polled {
            Poll::Pending => false,
            Poll::Ready(Some(Ok(frame))) => frame.is_trailers() || inner.is_end_stream(),
            Poll::Ready(Some(Err(_)) | None) => true,
        };
        if ended {
            end(this.operation, &polled);
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
#[inline(never)]
fn end<D, Err, E: ClassifyEos, P>(
    operation: &mut Option<Streaming<E, P>>,
    polled: &Poll<Option<Result<Frame<D>, Err>>>,
) {
    let Some(streaming) = operation.take() else {
        return;
    };
    match polled {
        Poll::Ready(Some(Ok(frame))) => streaming.end_of_stream(frame.trailers_ref()),
        Poll::Ready(Some(Err(error))) => streaming.failed(error),
        Poll::Ready(None) | Poll::Pending => streaming.end_of_stream(None),
    }
}

impl<B, E, P> fmt::Debug for OperationBody<B, E, P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OperationBody")
            .field("ended", &self.operation.is_none())
            .finish_non_exhaustive()
    }
}
