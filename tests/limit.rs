//! The layer's readiness is tower's `ConcurrencyLimit`'s: mirrored from tower's own
//! `tests/limit/concurrency.rs`, one behaviour per test, with and without metrics.

mod support;

use std::any::Any;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use tokio::sync::Semaphore;
use tokio_test::{assert_pending, assert_ready_ok};
use tower::{Layer as _, ServiceExt as _};
use tower_test::{assert_request_eq, mock};

use support::Telemetry;
use tower_resources_operation::{
    Limit, OperationMetrics, ResourcesOperationLayer, DURATION_INSTRUMENT, OUTCOME_ATTRIBUTE,
    QUEUED_INSTRUMENT, QUEUE_DURATION_INSTRUMENT,
};

/// A limit of `max` that records nothing, so no test depends on the global provider.
fn quiet(max: usize) -> ResourcesOperationLayer {
    ResourcesOperationLayer::new(max).metrics(OperationMetrics::disabled())
}

/// The text of a caught panic.
fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(message) = payload.downcast_ref::<&'static str>() {
        (*message).to_owned()
    } else if let Some(message) = payload.downcast_ref::<String>() {
        message.clone()
    } else {
        panic!("panic payload is neither &str nor String")
    }
}

/// tower's `basic_service_limit_functionality_with_poll_ready`, through our layer reporting
/// through `metrics`.
async fn limit_of_two_admits_two_and_wakes_the_third_when_a_response_completes(
    metrics: OperationMetrics,
) {
    let layer = ResourcesOperationLayer::new(2).metrics(metrics);
    let (mut service, mut handle) = mock::spawn_layer::<&str, &str, _>(layer);

    assert_ready_ok!(service.poll_ready());
    let r1 = service.call("hello 1");

    assert_ready_ok!(service.poll_ready());
    let r2 = service.call("hello 2");

    // Both permits are out: the third operation waits, and nothing wakes it yet.
    assert_pending!(service.poll_ready());
    assert!(!service.is_woken());

    assert_request_eq!(handle, "hello 1").send_response("world 1");
    assert_request_eq!(handle, "hello 2").send_response("world 2");
    assert_pending!(handle.poll_request());

    // A response that was sent but not yet polled to completion still holds its permit.
    assert!(!service.is_woken());

    assert_eq!(r1.await.unwrap(), "world 1");
    assert!(service.is_woken());

    assert_ready_ok!(service.poll_ready());
    let r3 = service.call("hello 3");

    assert_pending!(service.poll_ready());
    assert!(!service.is_woken());

    assert_eq!(r2.await.unwrap(), "world 2");
    assert!(service.is_woken());

    assert_request_eq!(handle, "hello 3").send_response("world 3");
    assert_eq!(r3.await.unwrap(), "world 3");

    // r2 and r3 have finished, so both permits are free again, the one this service took in
    // its last poll_ready included.
    assert_ready_ok!(service.poll_ready());
    let mut other = service.clone();
    assert_ready_ok!(other.poll_ready());
}

#[tokio::test(flavor = "current_thread")]
async fn limit_of_two_admits_two_calls_and_third_waits_unwoken_until_a_response_completes_with_metrics_disabled(
) {
    limit_of_two_admits_two_and_wakes_the_third_when_a_response_completes(
        OperationMetrics::disabled(),
    )
    .await;
}

#[tokio::test(flavor = "current_thread")]
async fn limit_of_two_admits_two_calls_and_third_waits_unwoken_until_a_response_completes_with_metrics_enabled(
) {
    let telemetry = Telemetry::new();
    limit_of_two_admits_two_and_wakes_the_third_when_a_response_completes(
        telemetry.metrics.clone(),
    )
    .await;

    // The metrics were really on: three operations ran to `ok`, and five were admitted (the
    // last two only reserved their permits, and their services were dropped: `cancelled`).
    assert_eq!(
        telemetry.count(DURATION_INSTRUMENT, &[(OUTCOME_ATTRIBUTE, "ok")]),
        3
    );
    assert_eq!(telemetry.count(QUEUE_DURATION_INSTRUMENT, &[]), 5);
    assert_eq!(
        telemetry.count(DURATION_INSTRUMENT, &[(OUTCOME_ATTRIBUTE, "cancelled")]),
        2
    );
}

#[tokio::test(flavor = "current_thread")]
async fn poll_ready_takes_the_permit_before_call() {
    let layer = quiet(1);
    let semaphore = layer.limit().clone();
    let (mut s1, mut handle) = mock::spawn_layer::<&str, &str, _>(layer);
    let mut s2 = s1.clone();

    assert_eq!(semaphore.available(), 1);
    assert_ready_ok!(s1.poll_ready());
    // Taken by poll_ready alone, with no call made.
    assert_eq!(semaphore.available(), 0);
    assert_pending!(s2.poll_ready());

    // Polling ready again does not take a second permit (there is none to take).
    assert_ready_ok!(s1.poll_ready());

    let r1 = s1.call("hello");
    assert_eq!(semaphore.available(), 0);
    assert_request_eq!(handle, "hello").send_response("world");
    assert_pending!(s2.poll_ready());

    assert_eq!(r1.await.unwrap(), "world");
    // The freed permit goes straight to the waiting s2.
    assert!(s2.is_woken());
    assert_ready_ok!(s2.poll_ready());
    assert_eq!(semaphore.available(), 0);
    drop(s1);
    drop(s2);
    assert_eq!(semaphore.available(), 1);
}

#[tokio::test(flavor = "current_thread")]
async fn waiters_are_served_first_come_first_served() {
    let (mut s1, _handle) = mock::spawn_layer::<(), (), _>(quiet(1));
    let mut s2 = s1.clone();
    let mut s3 = s1.clone();

    assert_ready_ok!(s1.poll_ready());

    // s2 starts waiting before s3.
    assert_pending!(s2.poll_ready());
    assert_pending!(s3.poll_ready());

    drop(s1);

    // The freed permit goes to s2 only.
    assert!(s2.is_woken());
    assert!(!s3.is_woken());
    assert_pending!(s3.poll_ready());
    assert_ready_ok!(s2.poll_ready());

    drop(s2);

    assert!(s3.is_woken());
    assert_ready_ok!(s3.poll_ready());
}

#[tokio::test(flavor = "current_thread")]
async fn clone_of_a_ready_service_starts_without_a_permit() {
    let (mut s1, _handle) = mock::spawn_layer::<(), (), _>(quiet(1));

    assert_ready_ok!(s1.poll_ready());

    // The clone shares the limit, which s1's permit exhausts; it does not share s1's permit.
    let mut s2 = s1.clone();
    assert_pending!(s2.poll_ready());
    assert!(!s2.is_woken());

    drop(s1);
    assert!(s2.is_woken());
    assert_ready_ok!(s2.poll_ready());
}

#[tokio::test(flavor = "current_thread")]
async fn dropping_a_service_with_an_unused_permit_frees_it_and_wakes_the_waiter() {
    let layer = quiet(1);
    let semaphore = layer.limit().clone();
    let (mut s1, _handle) = mock::spawn_layer::<(), (), _>(layer);
    let mut s2 = s1.clone();

    assert_ready_ok!(s1.poll_ready());
    assert_pending!(s2.poll_ready());
    assert!(!s2.is_woken());

    drop(s1);

    assert!(s2.is_woken());
    assert_ready_ok!(s2.poll_ready());
    drop(s2);
    assert_eq!(semaphore.available(), 1);
}

#[tokio::test(flavor = "current_thread")]
async fn permit_is_freed_when_the_response_future_completes_ok() {
    let (mut s1, mut handle) = mock::spawn_layer::<&str, &str, _>(quiet(1));
    let mut s2 = s1.clone();

    assert_ready_ok!(s1.poll_ready());
    let r1 = s1.call("hello");
    assert_pending!(s2.poll_ready());

    assert_request_eq!(handle, "hello").send_response("world");
    assert_eq!(r1.await.unwrap(), "world");

    assert!(s2.is_woken());
    assert_ready_ok!(s2.poll_ready());
}

#[tokio::test(flavor = "current_thread")]
async fn permit_is_freed_when_the_response_future_errors() {
    let (mut s1, mut handle) = mock::spawn_layer::<&str, (), _>(quiet(1));
    let mut s2 = s1.clone();

    assert_ready_ok!(s1.poll_ready());
    let r1 = s1.call("hello");
    assert_pending!(s2.poll_ready());

    assert_request_eq!(handle, "hello").send_error("boom");
    let error = r1.await.unwrap_err();
    assert_eq!(error.to_string(), "boom");

    assert!(s2.is_woken());
    assert_ready_ok!(s2.poll_ready());
}

#[tokio::test(flavor = "current_thread")]
async fn permit_is_freed_when_the_response_future_is_dropped() {
    let (mut s1, _handle) = mock::spawn_layer::<&str, (), _>(quiet(1));
    let mut s2 = s1.clone();

    assert_ready_ok!(s1.poll_ready());
    let r1 = s1.call("hello");
    assert_pending!(s2.poll_ready());

    drop(r1);

    assert!(s2.is_woken());
    assert_ready_ok!(s2.poll_ready());
}

#[tokio::test(flavor = "current_thread")]
async fn limit_of_zero_is_never_ready() {
    let (mut service, _handle) = mock::spawn_layer::<(), (), _>(quiet(0));

    assert_pending!(service.poll_ready());
    assert!(!service.is_woken());
    assert_pending!(service.poll_ready());

    // Neither does a clone get anything.
    let mut clone = service.clone();
    assert_pending!(clone.poll_ready());
    assert!(!service.is_woken());
}

#[tokio::test(flavor = "current_thread")]
#[should_panic(expected = "poll_ready")]
async fn call_without_poll_ready_panics_saying_poll_ready_must_be_called() {
    // An inner service that never panics itself, so the panic can only be the layer's.
    let mut service = tower::ServiceBuilder::new()
        .layer(quiet(1))
        .service(tower::service_fn(|request: &'static str| async move {
            Ok::<_, std::convert::Infallible>(request)
        }));

    drop(tower::Service::call(&mut service, "hello"));
}

#[tokio::test(flavor = "current_thread")]
async fn call_after_ready_does_not_panic() {
    // The counterpart of the test above: the same service, driven properly, answers.
    let service = tower::ServiceBuilder::new()
        .layer(quiet(1))
        .service(tower::service_fn(|request: &'static str| async move {
            Ok::<_, std::convert::Infallible>(request)
        }));

    assert_eq!(service.oneshot("hello").await.unwrap(), "hello");
}

#[tokio::test(flavor = "current_thread")]
async fn closing_the_semaphore_wakes_a_waiter_to_a_panic_and_clears_its_queued_count() {
    let telemetry = Telemetry::new();
    let semaphore = Arc::new(Semaphore::new(1));
    let layer =
        ResourcesOperationLayer::new(Arc::clone(&semaphore)).metrics(telemetry.metrics.clone());
    let (mut s1, _handle) = mock::spawn_layer::<(), (), _>(layer);
    let mut s2 = s1.clone();

    assert_ready_ok!(s1.poll_ready());
    assert_pending!(s2.poll_ready());
    assert_eq!(telemetry.live_value(QUEUED_INSTRUMENT, &[]), 1);
    assert!(!s2.is_woken());

    semaphore.close();

    // The waiter is not left hanging...
    assert!(s2.is_woken());
    // ...its next poll_ready panics and says why...
    let payload = catch_unwind(AssertUnwindSafe(|| s2.poll_ready()))
        .expect_err("poll_ready on a closed semaphore must panic");
    let message = panic_message(&*payload);
    assert!(
        message.contains("the limit is closed"),
        "unexpected panic message: {message}"
    );
    // ...and it no longer counts as queued.
    assert_eq!(telemetry.live_value(QUEUED_INSTRUMENT, &[]), 0);
}

#[tokio::test(flavor = "current_thread")]
#[should_panic(expected = "the limit is closed")]
async fn fresh_service_on_a_closed_semaphore_panics_instead_of_hanging() {
    let semaphore = Arc::new(Semaphore::new(1));
    semaphore.close();
    let layer = ResourcesOperationLayer::new(semaphore).metrics(OperationMetrics::disabled());
    let (mut service, _handle) = mock::spawn_layer::<(), (), _>(layer);

    let _ = service.poll_ready();
}

#[test]
#[should_panic(expected = "MAX_PERMITS")]
fn new_above_max_permits_panics_naming_max_permits() {
    let _ = ResourcesOperationLayer::new(usize::MAX);
}

#[test]
fn try_new_above_max_permits_is_an_error_naming_max_permits() {
    let error = Limit::try_new(usize::MAX).unwrap_err();
    let message = error.to_string();
    assert!(message.contains("MAX_PERMITS"), "{message}");

    let error = Limit::try_new(Semaphore::MAX_PERMITS + 1).unwrap_err();
    assert!(error.to_string().contains("MAX_PERMITS"), "{error}");
}

#[test]
fn try_new_at_max_permits_is_ok() {
    let limit =
        Limit::try_new(Semaphore::MAX_PERMITS).expect("Semaphore::MAX_PERMITS is a valid limit");
    let layer = ResourcesOperationLayer::new(limit);
    assert_eq!(layer.limit().available(), Semaphore::MAX_PERMITS);
}

// ---------------------------------------------------------------------------------------------
// Defects found in the seams of the previous version, each pinned.

/// An inner service whose `poll_ready` panics.
#[derive(Clone)]
struct PanicsWhenPolled;

impl tower::Service<()> for PanicsWhenPolled {
    type Response = ();
    type Error = std::convert::Infallible;
    type Future = std::future::Ready<Result<(), std::convert::Infallible>>;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        panic!("expected test panic: the inner poll_ready")
    }

    fn call(&mut self, (): ()) -> Self::Future {
        std::future::ready(Ok(()))
    }
}

/// With metrics off the operation takes the same path: a panic in the inner `poll_ready` ends
/// it and gives its permit back, though the service lives on.
#[tokio::test(flavor = "current_thread")]
async fn with_metrics_disabled_a_panic_in_the_inner_poll_ready_gives_the_permit_back() {
    let limit = Limit::new(1);
    let mut service = quiet_on(limit.clone()).layer(PanicsWhenPolled);
    let panicked = catch_unwind(AssertUnwindSafe(|| {
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        let _ = tower::Service::poll_ready(&mut service, &mut cx);
    }));
    assert!(panicked.is_err());
    assert_eq!(limit.available(), 1, "the permit stayed in the service");
    drop(service);
    assert_eq!(limit.available(), 1);
}

fn quiet_on(limit: Limit) -> ResourcesOperationLayer {
    ResourcesOperationLayer::new(limit).metrics(OperationMetrics::disabled())
}

/// A limit whose permits, when they go back, note how many operations the metrics counted as
/// active at that moment.
#[derive(Clone)]
struct Watched {
    places: Arc<Semaphore>,
    on_release: Arc<dyn Fn() + Send + Sync>,
}

struct WatchedPermit {
    _place: tokio::sync::OwnedSemaphorePermit,
    on_release: Arc<dyn Fn() + Send + Sync>,
}

impl Drop for WatchedPermit {
    fn drop(&mut self) {
        (self.on_release)();
    }
}

impl tower_resources_operation::Acquire for Watched {
    type Permit = WatchedPermit;

    async fn acquire(
        &self,
    ) -> Result<WatchedPermit, tower_resources_operation::limit::AcquireError> {
        let place = Arc::clone(&self.places)
            .acquire_owned()
            .await
            .map_err(|_| tower_resources_operation::limit::AcquireError::closed())?;
        Ok(WatchedPermit {
            _place: place,
            on_release: Arc::clone(&self.on_release),
        })
    }
}

/// Every way an admitted operation ends records its end before its permit goes back, so that
/// `active` never counts an operation whose place is already free: `active` is 0 at each release.
#[tokio::test(flavor = "current_thread")]
async fn an_operation_is_recorded_as_ended_before_its_permit_goes_back() {
    let telemetry = Arc::new(Telemetry::new());
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let limit = Watched {
        places: Arc::new(Semaphore::new(1)),
        on_release: {
            let (telemetry, seen) = (Arc::clone(&telemetry), Arc::clone(&seen));
            Arc::new(move || {
                let active =
                    telemetry.live_value(tower_resources_operation::ACTIVE_INSTRUMENT, &[]);
                seen.lock().unwrap().push(active);
            })
        },
    };
    let layer = ResourcesOperationLayer::new(limit).metrics(telemetry.metrics.clone());
    let (mut service, mut handle) = mock::spawn_layer::<&str, &str, _>(layer);

    // Completed.
    assert_ready_ok!(service.poll_ready());
    let response = service.call("done");
    assert_request_eq!(handle, "done").send_response("ok");
    response.await.unwrap();
    // Dropped before it completed.
    assert_ready_ok!(service.poll_ready());
    drop(service.call("dropped"));
    // Admitted by poll_ready, never called: the service is dropped holding its permit.
    assert_ready_ok!(service.poll_ready());
    drop(service);

    assert_eq!(*seen.lock().unwrap(), [0, 0, 0]);
    assert_eq!(
        telemetry.outcomes(&[]),
        [("cancelled".to_owned(), 2), ("ok".to_owned(), 1)]
            .into_iter()
            .collect()
    );
}

// ---------------------------------------------------------------------------------------------
// Resizing a limit while it serves.

/// Threads take and give back places while another resizes the limit down and up, without a
/// pause: at the end, with nothing held, every place of the final capacity is free, and no more.
/// (The protocol is checked under loom too: `RUSTFLAGS="--cfg tro_loom" cargo test --release
/// --lib limit::resize`; this samples it on the real semaphore.)
#[test]
fn resizing_while_operations_come_and_go_loses_and_makes_up_no_place() {
    use tower_resources_operation::Acquire as _;
    let limit = Limit::new(5);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let workers: Vec<_> = (0..3)
        .map(|_| {
            let (limit, stop) = (limit.clone(), Arc::clone(&stop));
            std::thread::spawn(move || {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    if let Some(Ok(permit)) = limit.try_acquire() {
                        std::hint::spin_loop();
                        drop(permit);
                    }
                }
            })
        })
        .collect();
    let started = std::time::Instant::now();
    let mut capacity = 5;
    while started.elapsed() < std::time::Duration::from_millis(500) {
        capacity = if capacity == 5 { 1 } else { 5 };
        limit.set_capacity(capacity).unwrap();
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for worker in workers {
        worker.join().unwrap();
    }
    limit.set_capacity(5).unwrap();
    assert_eq!(limit.capacity(), 5);
    assert_eq!(limit.available(), 5, "places were lost or made up");
}

/// Lowering the capacity revokes nobody: the running operations finish, and the places above
/// the new capacity leave as they come back; raising it again admits at once.
#[tokio::test(flavor = "current_thread")]
async fn lowering_the_capacity_revokes_nobody_and_raising_it_admits_at_once() {
    use tower_resources_operation::Acquire as _;
    let limit = Limit::new(3);
    let held: Vec<_> = (0..3)
        .map(|_| limit.try_acquire().unwrap().unwrap())
        .collect();
    limit.set_capacity(1).unwrap();
    assert_eq!((limit.capacity(), limit.available()), (1, 0));
    drop(held);
    assert_eq!(
        limit.available(),
        1,
        "two of the three places left as they came back"
    );
    limit.set_capacity(4).unwrap();
    assert_eq!(limit.available(), 4);
}
