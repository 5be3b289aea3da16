//! [`ResponseFuture`]: where the inner work runs as the admitted operation, and where the
//! answer to a rejection waits to be taken.

use std::fmt;
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use pin_project_lite::pin_project;

use crate::end::{Admitted, End};
use crate::lifecycle::Running;
use crate::metrics::Series;
use crate::reject::TakeAnswer;
use crate::scope;

pin_project! {
    /// The response future of [`ResourcesOperation`](crate::ResourcesOperation).
    ///
    /// It holds the permit until the operation ends: when it completes (or, in the
    /// [`until_body_end`](crate::ResourcesOperationLayer::until_body_end) form, when the body it
    /// returns ends). Dropped before it completed, the operation ends as
    /// [`Outcome::Cancelled`](crate::Outcome::Cancelled).
    pub struct ResponseFuture<F, K, P, X, E> {
        #[pin]
        state: State<F, K, P, X>,
        _end: PhantomData<fn() -> E>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<F, K, P, X> {
        /// The inner service was called.
        Called {
            #[pin]
            inner: F,
            operation: Admitted<K, P>,
        },
        /// The inner service was called for an operation with nothing to record (its metrics
        /// are disabled): it carries only its permit.
        Unrecorded {
            #[pin]
            inner: F,
            permit: Option<P>,
        },
        /// The limit turned the operation away; this is the answer.
        Answered { answer: X },
    }
}

impl<F, K, P, X, E> ResponseFuture<F, K, P, X, E> {
    pub(crate) fn called(inner: F, operation: Admitted<K, P>) -> Self {
        Self {
            state: State::Called { inner, operation },
            _end: PhantomData,
        }
    }

    pub(crate) fn unrecorded(inner: F, permit: P) -> Self {
        Self {
            state: State::Unrecorded {
                inner,
                permit: Some(permit),
            },
            _end: PhantomData,
        }
    }

    pub(crate) fn answered(answer: X) -> Self {
        Self {
            state: State::Answered { answer },
            _end: PhantomData,
        }
    }
}

impl<F, K, P, X, E, Res, Err> Future for ResponseFuture<F, K, P, X, E>
where
    F: Future<Output = Result<Res, Err>>,
    X: TakeAnswer<Result<Res, Err>>,
    E: End<Res, Err, K, P>,
{
    type Output = Result<E::Response, Err>;

    #[inline]
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().state.project() {
            StateProj::Called { inner, operation } => {
                let result = if operation.running.is_recording() {
                    ready!(poll_in_scope(inner, &mut operation.running, cx))
                } else {
                    ready!(inner.poll(cx))
                };
                Poll::Ready(E::complete(result, operation))
            }
            StateProj::Unrecorded { inner, permit } => {
                let result = ready!(inner.poll(cx));
                Poll::Ready(E::complete_unrecorded(result, permit))
            }
            StateProj::Answered { answer } => Poll::Ready(E::unmetered(answer.take_answer())),
        }
    }
}

/// Polls the inner future of an operation that records metrics, as that operation.
#[inline(never)]
fn poll_in_scope<F: Future>(
    inner: Pin<&mut F>,
    running: &mut Running<Series>,
    cx: &mut Context<'_>,
) -> Poll<F::Output> {
    scope::enter(running, || inner.poll(cx))
}

impl<F, K, P, X, E> fmt::Debug for ResponseFuture<F, K, P, X, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match &self.state {
            State::Called { operation, .. } if operation.permit.is_some() => "called",
            State::Called { .. } => "completed",
            State::Unrecorded { permit, .. } if permit.is_some() => "called",
            State::Unrecorded { .. } => "completed",
            State::Answered { .. } => "rejected",
        };
        f.debug_struct("ResponseFuture")
            .field("state", &state)
            .finish_non_exhaustive()
    }
}
