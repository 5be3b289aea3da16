//! [`ResponseFuture`]: where the inner work runs as the admitted operation, and where the answer
//! to a rejection waits to be taken.

use std::fmt;
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use http_body::Body;
use pin_project_lite::pin_project;

use crate::body::{AtBodyEnd, OperationBody};
use crate::classify::{ClassifyOutcome, DefaultClassifier};
use crate::limit::{Acquire, Limit};
use crate::operation::{Ending, Lifecycle};

pin_project! {
    /// The response future of [`ResourcesOperation`](crate::ResourcesOperation), on the inner
    /// service's future `F`, with its classifier `C` and limit `L`.
    ///
    /// It records the operation's end when it completes, and holds the permit until it is
    /// dropped (which `.await` does then), as tower's limit does; in the
    /// [`until_body_end`](crate::ResourcesOperationLayer::until_body_end) form
    /// (`E` is [`AtBodyEnd`]), the [`OperationBody`] it returns takes both over. Dropped before it completed, the
    /// operation ends as [`Outcome::Cancelled`](crate::Outcome::Cancelled).
    pub struct ResponseFuture<F, C = DefaultClassifier, L = Limit, E = ()>
    where
        F: Future,
        L: Acquire,
    {
        #[pin]
        state: State<F, C, L>,
        _end: PhantomData<fn() -> E>,
    }
}

pin_project! {
    /// One enum, the operation inside its variant: its tag then fits in the operation's spare
    /// values, and a queued request's task stays a word smaller.
    #[project = StateProj]
    enum State<F, C, L>
    where
        F: Future,
        L: Acquire,
    {
        /// The inner service was called, as the operation.
        Called {
            #[pin]
            inner: F,
            operation: Lifecycle<L, Option<C>>,
        },
        /// The limit turned the operation away; this is the answer, until taken.
        Answered { answer: Option<F::Output> },
    }
}

impl<F: Future, C, L: Acquire, E> ResponseFuture<F, C, L, E> {
    #[inline(always)]
    pub(crate) fn called(inner: F, operation: Lifecycle<L, Option<C>>) -> Self {
        Self {
            state: State::Called { inner, operation },
            _end: PhantomData,
        }
    }

    pub(crate) fn answered(answer: F::Output) -> Self {
        Self {
            state: State::Answered {
                answer: Some(answer),
            },
            _end: PhantomData,
        }
    }
}

impl<F, C, L, Res, Err> Future for ResponseFuture<F, C, L>
where
    F: Future<Output = Result<Res, Err>>,
    C: ClassifyOutcome<Res, Err>,
    L: Acquire,
{
    type Output = Result<Res, Err>;

    #[inline(always)]
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().state.project() {
            StateProj::Called { inner, operation } => {
                let result = ready!(operation.poll(|| inner.poll(cx)));
                operation.finish(Ending::Returned, |classifier| {
                    classifier.as_ref().map(|c| c.classify(result.as_ref()))
                });
                Poll::Ready(result)
            }
            StateProj::Answered { answer } => Poll::Ready(taken(answer)),
        }
    }
}

impl<F, C, L, B, Err> Future for ResponseFuture<F, C, L, AtBodyEnd>
where
    F: Future<Output = Result<http::Response<B>, Err>>,
    B: Body,
    C: ClassifyOutcome<http::Response<B>, Err>,
    L: Acquire,
{
    type Output = Result<http::Response<OperationBody<B, L>>, Err>;

    #[inline(always)]
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().state.project() {
            StateProj::Called { inner, operation } => {
                let result = ready!(operation.poll(|| inner.poll(cx)));
                Poll::Ready(OperationBody::head(result, operation))
            }
            StateProj::Answered { answer } => Poll::Ready(OperationBody::unmetered(taken(answer))),
        }
    }
}

/// A rejected operation's answer, taken once.
fn taken<T>(answer: &mut Option<T>) -> T {
    answer
        .take()
        .expect("a rejected operation's response future polled after it completed")
}

impl<F: Future, C, L: Acquire, E> fmt::Debug for ResponseFuture<F, C, L, E> {
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
