//! What the tests share. Here: a real OpenTelemetry SDK pipeline (an in-memory exporter behind a
//! periodic reader that never fires on its own, read back with `force_flush`), waits with a
//! safety net, and the small services and checks many tests use. In the modules: axum servers
//! and hyper clients (`http`), a tonic server and clients (`grpc`), a real Prometheus
//! (`prometheus`), a real Redis (`redis_server`), and the drivers of the reliability tests
//! (`reliability`).
#![allow(dead_code, unreachable_pub)]

#[cfg(feature = "tracing")]
pub mod captured;
#[cfg(feature = "tonic")]
pub mod grpc;
pub mod http;
pub mod prometheus;
pub mod reliability;
pub mod simulation;
#[cfg(feature = "tracing")]
pub mod traces;

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::time::Duration;

use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tower::{service_fn, BoxError, Service, ServiceExt as _};
use tower_resources_operation::names::{
    ABANDONED_INSTRUMENT, ACTIVE_INSTRUMENT, OPERATION_ATTRIBUTE, QUEUED_INSTRUMENT,
};
use tower_resources_operation::{set_outcome, Limit, Outcome};

mod telemetry;

pub use telemetry::*;

/// What [`Telemetry::outcomes`] reads after one operation that ended `outcome`.
pub fn only(outcome: &str) -> BTreeMap<String, u64> {
    BTreeMap::from([(outcome.to_owned(), 1)])
}

/// `(queued, active)` over every series.
pub fn live(t: &Telemetry) -> (i64, i64) {
    (
        t.live_value(QUEUED_INSTRUMENT, &[]),
        t.live_value(ACTIVE_INSTRUMENT, &[]),
    )
}

/// How many waits of `operation` were given up.
pub fn abandoned(t: &Telemetry, operation: &str) -> i64 {
    t.live_value(ABANDONED_INSTRUMENT, &[(OPERATION_ATTRIBUTE, operation)])
}

/// Nothing waits or runs, in any series, and every permit of `limit` is back.
pub fn assert_idle(t: &Telemetry, limit: &Limit) {
    assert_eq!(live(t), (0, 0), "(queued, active)");
    assert_eq!(limit.available(), limit.capacity(), "permits back");
    assert_eq!(limit.queued(), 0, "waiters on the limit");
}

/// An inner service that answers once the request's sender fires (or is dropped).
pub fn held(
) -> impl Service<oneshot::Receiver<()>, Response = (), Error = BoxError, Future: Send> + Clone + Send
{
    service_fn(|release: oneshot::Receiver<()>| async move {
        let _ = release.await;
        Ok::<_, BoxError>(())
    })
}

/// The task of an operation started by [`spawn_held`]: what the service answered.
pub type HeldTask<S> = JoinHandle<
    Result<
        <S as Service<oneshot::Receiver<()>>>::Response,
        <S as Service<oneshot::Receiver<()>>>::Error,
    >,
>;

/// Starts an operation of `service`, on a task of its own, that runs until the sender returned
/// fires (or is dropped).
pub fn spawn_held<S>(service: &S) -> (oneshot::Sender<()>, HeldTask<S>)
where
    S: Service<oneshot::Receiver<()>> + Clone + Send + 'static,
    S::Future: Send,
    S::Response: Send + 'static,
    S::Error: Send + 'static,
{
    let (release, rx) = oneshot::channel();
    (release, tokio::spawn(service.clone().oneshot(rx)))
}

/// An inner service whose `call` itself (not the future it returns) panics, with
/// `call panicked: <request>`, after setting `outcome` if it has one.
pub fn panics_in_call<R: std::fmt::Debug>(
    outcome: Option<Outcome>,
) -> impl Service<R, Response = (), Error = Infallible> + Clone {
    service_fn(
        move |request: R| -> std::future::Ready<Result<(), Infallible>> {
            if let Some(outcome) = outcome {
                assert!(set_outcome(outcome), "inside the operation");
            }
            panic!("call panicked: {request:?}")
        },
    )
}

/// Lets every task of a current-thread runtime run until it waits on something; under paused
/// time no timer fires meanwhile, so the clock does not move.
pub async fn settle() {
    for _ in 0..32 {
        tokio::task::yield_now().await;
    }
}

/// The message of the panic that ends `task`, which must panic, not end otherwise or hang (up to
/// [`DEADLINE`]).
pub async fn panic_of<T>(what: &str, task: JoinHandle<T>) -> String {
    let Err(error) = within(what, task).await else {
        panic!("{what} ended without a panic")
    };
    assert!(error.is_panic(), "{what}: {error}");
    panic_message(&*error.into_panic())
}

/// The message of a panic payload (`&str` or `String`).
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "<non-string panic payload>".to_owned()
    }
}

/// How many handlers run now, and the most that ever ran at once.
#[derive(Debug, Default)]
pub struct Load {
    running: std::sync::atomic::AtomicUsize,
    max: std::sync::atomic::AtomicUsize,
}

impl Load {
    /// Counts as running for `how_long`.
    pub async fn work(&self, how_long: Duration) {
        self.enter();
        tokio::time::sleep(how_long).await;
        self.leave();
    }

    /// Counts as running, until [`leave`](Self::leave).
    pub fn enter(&self) {
        use std::sync::atomic::Ordering::SeqCst;
        let now = self.running.fetch_add(1, SeqCst) + 1;
        self.max.fetch_max(now, SeqCst);
    }

    /// Stops counting as running.
    pub fn leave(&self) {
        self.running
            .fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }

    /// How many run now.
    pub fn now(&self) -> usize {
        self.running.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// The most that ever ran at once.
    pub fn max(&self) -> usize {
        self.max.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// Takes one place of `limit` outside any layer, as other work sharing it would.
pub fn take(limit: &Limit) -> tower_resources_operation::limit::LimitPermit {
    use tower_resources_operation::Acquire as _;
    limit
        .try_acquire()
        .expect("a free place")
        .expect("an open limit")
}

/// The rejection inside a generic layer's `BoxError`.
pub fn rejection_of(error: &tower::BoxError) -> tower_resources_operation::Rejection {
    error
        .downcast_ref::<tower_resources_operation::Rejected>()
        .unwrap_or_else(|| panic!("not a rejection: {error}"))
        .rejection()
}
