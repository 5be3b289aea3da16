//! [`ResponseFuture`]: where the outcome is decided and the run time recorded.

use std::fmt;
use std::future::Future;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use pin_project_lite::pin_project;
use tokio::sync::OwnedSemaphorePermit;

use crate::classify::ClassifyOutcome;
use crate::metrics::Running;
use crate::{scope, Outcome};

pin_project! {
    /// The response future of [`ResourcesOperation`](crate::ResourcesOperation).
    ///
    /// It holds the permit until it is dropped, as tower's limit does. Dropped before the inner
    /// future completed, the operation ends as [`Outcome::Cancelled`].
    pub struct ResponseFuture<F, C> {
        #[pin]
        inner: F,
        // Empty when metrics are disabled, and once the operation has ended. Declared before
        // the permit, so that a drop records `cancelled` before the permit goes back.
        running: Running,
        classifier: C,
        _permit: OwnedSemaphorePermit,
    }
}

impl<F, C> ResponseFuture<F, C> {
    pub(crate) fn new(
        inner: F,
        running: Running,
        permit: OwnedSemaphorePermit,
        classifier: C,
    ) -> Self {
        Self {
            inner,
            running,
            classifier,
            _permit: permit,
        }
    }
}

impl<F, C, T, E> Future for ResponseFuture<F, C>
where
    F: Future<Output = Result<T, E>>,
    C: ClassifyOutcome<T, E>,
{
    type Output = Result<T, E>;

    #[inline]
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        if !this.running.is_recording() {
            return this.inner.poll(cx);
        }
        poll_running(this.inner, this.running, this.classifier, cx)
    }
}

/// `poll` for an operation that records metrics: the inner future is polled as the current
/// operation, and the operation ends when it completes. Kept out of line so that the disabled
/// path, which is tower's, stays small enough to inline.
#[inline(never)]
fn poll_running<F, C, T, E>(
    inner: Pin<&mut F>,
    running: &mut Running,
    classifier: &C,
    cx: &mut Context<'_>,
) -> Poll<Result<T, E>>
where
    F: Future<Output = Result<T, E>>,
    C: ClassifyOutcome<T, E>,
{
    let result = ready!(scope::enter(running, || inner.poll(cx)));
    let outcome = if running.chosen_outcome().is_some() {
        Outcome::Ok // ignored: the chosen outcome wins in `finish`
    } else {
        classify(classifier, &result)
    };
    running.finish(outcome);
    Poll::Ready(result)
}

/// Runs the classifier; a panicking classifier costs the operation its outcome, not its response.
fn classify<C: ClassifyOutcome<T, E>, T, E>(classifier: &C, result: &Result<T, E>) -> Outcome {
    catch_unwind(AssertUnwindSafe(|| classifier.classify(result.as_ref())))
        .unwrap_or(Outcome::Error)
}

impl<F, C> fmt::Debug for ResponseFuture<F, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture")
            .field("running", &self.running.is_recording())
            .finish_non_exhaustive()
    }
}
