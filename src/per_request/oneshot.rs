//! [`Oneshot`]: a service driven to readiness, then called once, as hyper and axum drive a clone
//! of a service per request (tower's `ServiceExt::oneshot`, without the rest of tower's `util`).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use pin_project_lite::pin_project;
use tower_service::Service;

pin_project! {
    /// The future of one request through a service of its own.
    pub struct Oneshot<S: Service<Req>, Req> {
        #[pin]
        state: State<S, Req>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<S: Service<Req>, Req> {
        /// Waiting for the service to be ready.
        NotReady { service: S, request: Option<Req> },
        /// Called.
        Called { #[pin] future: S::Future },
        /// Completed.
        Done,
    }
}

impl<S: Service<Req>, Req> Oneshot<S, Req> {
    pub(super) fn new(service: S, request: Req) -> Self {
        Self {
            state: State::NotReady {
                service,
                request: Some(request),
            },
        }
    }
}

impl<S: Service<Req>, Req> Future for Oneshot<S, Req> {
    type Output = Result<S::Response, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            match this.state.as_mut().project() {
                StateProj::NotReady { service, request } => {
                    ready!(service.poll_ready(cx))?;
                    let request = request.take().expect("a oneshot calls its service once");
                    let future = service.call(request);
                    this.state.set(State::Called { future });
                }
                StateProj::Called { future } => {
                    let output = ready!(future.poll(cx));
                    this.state.set(State::Done);
                    return Poll::Ready(output);
                }
                StateProj::Done => panic!("a oneshot future polled after it completed"),
            }
        }
    }
}

impl<S: Service<Req>, Req> fmt::Debug for Oneshot<S, Req> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match self.state {
            State::NotReady { .. } => "not ready",
            State::Called { .. } => "called",
            State::Done => "done",
        };
        f.debug_struct("Oneshot").field("state", &state).finish()
    }
}
