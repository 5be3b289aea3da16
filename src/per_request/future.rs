//! [`PerRequestFuture`]: a limited request's response future, or an unlimited one's.

use std::fmt;
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::task::{Context, Poll};

use pin_project_lite::pin_project;

use crate::layer::End;
use crate::limit::Acquire;

pin_project! {
    /// The response future of [`PerRequestOperation`]: a limited request's, or an unlimited
    /// one's.
    pub struct PerRequestFuture<A, U, E, K, L> {
        #[pin]
        kind: Kind<A, U>,
        _end: PhantomData<fn() -> (E, K, L)>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<A, U> {
        Limited { #[pin] future: A },
        Unlimited { #[pin] future: U },
    }
}

impl<A, U, E, K, L> PerRequestFuture<A, U, E, K, L> {
    pub(super) fn limited(future: A) -> Self {
        Self {
            kind: Kind::Limited { future },
            _end: PhantomData,
        }
    }

    pub(super) fn unlimited(future: U) -> Self {
        Self {
            kind: Kind::Unlimited { future },
            _end: PhantomData,
        }
    }
}

impl<A, U, E, K, L, Res, Err> Future for PerRequestFuture<A, U, E, K, L>
where
    A: Future<Output = Result<E::Response, Err>>,
    U: Future<Output = Result<Res, Err>>,
    L: Acquire,
    E: End<Res, Err, K, L>,
{
    type Output = Result<E::Response, Err>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().kind.project() {
            KindProj::Limited { future } => future.poll(cx),
            KindProj::Unlimited { future } => future.poll(cx).map(E::unmetered),
        }
    }
}

impl<A, U, E, K, L> fmt::Debug for PerRequestFuture<A, U, E, K, L> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.kind {
            Kind::Limited { .. } => "limited",
            Kind::Unlimited { .. } => "unlimited",
        };
        f.debug_struct("PerRequestFuture")
            .field("kind", &kind)
            .finish()
    }
}
