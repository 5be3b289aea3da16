//! [`OperationBody`]: the response body that carries its operation to the end of the stream.

use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

use crate::classify::ClassifyEos;
use crate::end::{guarded, Admitted};
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
    ///   what the head decided, or what [`ClassifyEos::classify_eos`] says of the trailers;
    /// - a body error ends it with [`ClassifyEos::classify_body_error`] (`error`);
    /// - dropped before its end (the client hung up), it ends as `cancelled`, or `timeout` past
    ///   the request's deadline;
    /// - a panic while it is polled ends it as `crashed`, and the panic goes on;
    /// - [`set_outcome`](crate::set_outcome) called while the body is polled wins over all of
    ///   these.
    pub struct OperationBody<B, K, P> {
        #[pin]
        inner: B,
        // `None` once the operation has ended, or for a body no operation measured.
        operation: Option<Streaming<K, P>>,
    }
}

/// An operation that goes on while its body streams.
struct Streaming<K, P> {
    admitted: Admitted<K, P>,
    /// The outcome the head decided, if it did.
    decided: Option<Outcome>,
}

impl<B: Body, K: ClassifyEos, P> OperationBody<B, K, P> {
    pub(crate) fn new(inner: B, admitted: Admitted<K, P>, decided: Option<Outcome>) -> Self {
        let mut body = Self {
            operation: Some(Streaming { admitted, decided }),
            inner,
        };
        if body.inner.is_end_stream() {
            body.end(None);
        }
        body
    }

    /// Ends the operation at the end of the stream, with `trailers` if it sent any.
    fn end(&mut self, trailers: Option<&HeaderMap>) {
        if let Some(streaming) = self.operation.take() {
            streaming.end_of_stream(trailers);
        }
    }
}

impl<B, K, P> OperationBody<B, K, P> {
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

impl<K: ClassifyEos, P> Streaming<K, P> {
    fn end_of_stream(self, trailers: Option<&HeaderMap>) {
        let Admitted {
            mut running,
            classifier,
            permit,
        } = self.admitted;
        let decided = self.decided;
        running.finish_with(|| {
            decided.unwrap_or_else(|| {
                guarded(|| Some(classifier.classify_eos(trailers))).unwrap_or(Outcome::Error)
            })
        });
        drop(permit);
    }

    fn failed<E>(self, error: &E) {
        let Admitted {
            mut running,
            classifier,
            permit,
        } = self.admitted;
        running.finish_with(|| classifier.classify_body_error(error));
        drop(permit);
    }
}

impl<B: Body, K: ClassifyEos, P> Body for OperationBody<B, K, P> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = self.project();
        let Some(streaming) = this.operation.as_mut() else {
            return this.inner.poll_frame(cx);
        };
        let mut inner = this.inner;
        let polled = if streaming.admitted.running.is_recording() {
            scope::enter(&mut streaming.admitted.running, || {
                inner.as_mut().poll_frame(cx)
            })
        } else {
            inner.as_mut().poll_frame(cx)
        };
        match &polled {
            Poll::Pending => {}
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(trailers) = frame.trailers_ref() {
                    if let Some(streaming) = this.operation.take() {
                        streaming.end_of_stream(Some(trailers));
                    }
                } else if inner.is_end_stream() {
                    if let Some(streaming) = this.operation.take() {
                        streaming.end_of_stream(None);
                    }
                }
            }
            Poll::Ready(Some(Err(error))) => {
                if let Some(streaming) = this.operation.take() {
                    streaming.failed(error);
                }
            }
            Poll::Ready(None) => {
                if let Some(streaming) = this.operation.take() {
                    streaming.end_of_stream(None);
                }
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl<B, K, P> fmt::Debug for OperationBody<B, K, P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OperationBody")
            .field("ended", &self.operation.is_none())
            .finish_non_exhaustive()
    }
}
