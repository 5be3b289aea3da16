//! [`ResponseFuture`]: where the inner work runs as the admitted operation, and where the answer
//! to a rejection waits to be taken.

use std::fmt;
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use pin_project_lite::pin_project;

use super::body::End;
use crate::limit::Acquire;
use crate::operation::Lifecycle;

pin_project! {
    /// The response future of [`ResourcesOperation`](crate::ResourcesOperation).
    ///
    /// It records the operation's end when it completes, and holds the permit until it is
    /// dropped (which `.await` does then), as tower's limit does; in the
    /// [`until_body_end`](crate::ResourcesOperationLayer::until_body_end) form, the body it
    /// returns takes both over. Dropped before it completed, the operation ends as
    /// [`Outcome::Cancelled`](crate::Outcome::Cancelled).
    pub struct ResponseFuture<F, C, L: Acquire, R, E> {
        #[pin]
        state: State<F, C, L, R>,
        _end: PhantomData<fn() -> E>,
    }
}

pin_project! {
    /// One enum, the operation inside its variant: its tag then fits in the operation's spare
    /// values, and a queued request's task stays a word smaller.
    #[project = StateProj]
    enum State<F, C, L: Acquire, R> {
        /// The inner service was called, as the operation.
        Called {
            #[pin]
            inner: F,
            operation: Lifecycle<L, Option<C>>,
        },
        /// The limit turned the operation away; this is the answer, until taken.
        Answered { answer: Option<R> },
    }
}

impl<F, C, L: Acquire, R, E> ResponseFuture<F, C, L, R, E> {
    #[inline]
    pub(crate) fn called(inner: F, operation: Lifecycle<L, Option<C>>) -> Self {
        Self {
            state: State::Called { inner, operation },
            _end: PhantomData,
        }
    }

    pub(crate) fn answered(answer: R) -> Self {
        Self {
            state: State::Answered {
                answer: Some(answer),
            },
            _end: PhantomData,
        }
    }
}

impl<F, C, L, E, Res, Err> Future for ResponseFuture<F, C, L, Result<Res, Err>, E>
where
    F: Future<Output = Result<Res, Err>>,
    L: Acquire,
    E: End<Res, Err, C, L>,
{
    type Output = Result<E::Response, Err>;

    #[inline]
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().state.project() {
            StateProj::Called { inner, operation } => {
                let result = ready!(operation.poll(|| inner.poll(cx)));
                Poll::Ready(E::complete(result, operation))
            }
            StateProj::Answered { answer } => {
                let answer = answer
                    .take()
                    .expect("a rejected operation's response future polled after it completed");
                Poll::Ready(E::unmetered(answer))
            }
        }
    }
}

impl<F, C, L: Acquire, R, E> fmt::Debug for ResponseFuture<F, C, L, R, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match &self.state {
            State::Called { operation, .. } if operation.is_admitted() => "called",
            State::Called { .. } => "completed",
            State::Answered { .. } => "rejected",
        };
        f.debug_struct("ResponseFuture")
            .field("state", &state)
            .finish_non_exhaustive()
    }
}
