//! [`ResponseFuture`]: where the outcome is decided and the run time recorded.

use std::fmt;
use std::future::Future;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use pin_project_lite::pin_project;

use crate::classify::ClassifyOutcome;
use crate::service::Admitted;
use crate::{scope, Outcome};

pin_project! {
    /// The response future of [`ResourcesOperation`](crate::ResourcesOperation).
    ///
    /// It holds the permit until the inner future completes; dropped earlier, it gives the
    /// permit back and the operation ends as [`Outcome::Cancelled`].
    pub struct ResponseFuture<F, C> {
        #[pin]
        inner: F,
        // `None` once the inner future has completed and the permit has gone back.
        admitted: Option<Admitted>,
        classifier: C,
    }
}

impl<F, C> ResponseFuture<F, C> {
    pub(crate) fn new(inner: F, admitted: Admitted, classifier: C) -> Self {
        Self {
            inner,
            admitted: Some(admitted),
            classifier,
        }
    }
}

impl<F, C, T, E> Future for ResponseFuture<F, C>
where
    F: Future<Output = Result<T, E>>,
    C: ClassifyOutcome<T, E>,
{
    type Output = Result<T, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let inner = this.inner;
        let running = match this.admitted.as_mut() {
            Some(admitted) => admitted.running.as_mut(),
            None => None,
        };
        let result = match running {
            None => ready!(inner.poll(cx)),
            Some(running) => {
                let result = ready!(scope::enter(running, || inner.poll(cx)));
                let outcome = if running.outcome_chosen() {
                    Outcome::Ok // ignored: the chosen outcome wins in `finish`
                } else {
                    classify(this.classifier, &result)
                };
                running.finish(outcome);
                result
            }
        };
        *this.admitted = None;
        Poll::Ready(result)
    }
}

/// Runs the classifier; a panicking classifier costs the operation its outcome, not its response.
fn classify<C: ClassifyOutcome<T, E>, T, E>(classifier: &C, result: &Result<T, E>) -> Outcome {
    catch_unwind(AssertUnwindSafe(|| classifier.classify(result.as_ref())))
        .unwrap_or(Outcome::Error)
}

impl<F, C> fmt::Debug for ResponseFuture<F, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture")
            .field("has_permit", &self.admitted.is_some())
            .finish_non_exhaustive()
    }
}
