//! The layer's readiness is tower's `ConcurrencyLimit`'s: mirrored from tower's own
//! `tests/limit/concurrency.rs`, one behaviour per test, with and without metrics.

mod support;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Semaphore;
use tokio_test::{assert_pending, assert_ready_ok, task};
use tower::{service_fn, BoxError, Layer as _, ServiceExt as _};
use tower_test::{assert_request_eq, mock};

use support::{panic_message, rejection_of, take, Telemetry};
use tower_resources_operation::names::{
    ABANDONED_INSTRUMENT, DURATION_INSTRUMENT, OUTCOME_ATTRIBUTE, QUEUED_INSTRUMENT,
    QUEUE_DURATION_INSTRUMENT,
};
use tower_resources_operation::protocol::RejectAsError;
use tower_resources_operation::{
    Executor, Limit, Operation, OperationMetrics, Rejection, ResourcesOperationLayer,
};

/// A limit of `max` that records nothing, so no test depends on the global provider.
fn quiet(max: usize) -> ResourcesOperationLayer {
    ResourcesOperationLayer::new(max).metrics(OperationMetrics::disabled())
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

    // The metrics were really on: three operations ran to `ok`. Two more only reserved their
    // permits, and their services were dropped before they were called: abandoned, with no
    // queue sample and no outcome (their work never began).
    assert_eq!(
        telemetry.count(DURATION_INSTRUMENT, &[(OUTCOME_ATTRIBUTE, "ok")]),
        3
    );
    assert_eq!(telemetry.count(QUEUE_DURATION_INSTRUMENT, &[]), 3);
    assert_eq!(telemetry.count(DURATION_INSTRUMENT, &[]), 3);
    assert_eq!(telemetry.live_value(ABANDONED_INSTRUMENT, &[]), 2);
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
async fn a_fresh_caller_does_not_take_the_place_freed_for_a_waiter_nor_lose_it_when_the_waiter_leaves(
) {
    use tower_resources_operation::Acquire;

    let limit = Limit::new(1);
    let held = limit.try_acquire().expect("free").expect("open");
    let mut waiter = task::spawn(limit.clone().acquire_owned());
    assert_pending!(waiter.poll());
    assert_eq!(limit.queued(), 1);

    // Freed while someone waits: the place is the waiter's, not the next caller's.
    drop(held);
    assert!(waiter.is_woken());
    assert!(
        limit.try_acquire().is_none(),
        "a fresh caller jumped the queue"
    );

    // The waiter goes away before it takes it: the place is free for the next caller.
    drop(waiter);
    assert_eq!((limit.queued(), limit.available()), (0, 1));
    let next = limit
        .try_acquire()
        .expect("the place is free")
        .expect("open");
    assert_eq!(limit.available(), 0);
    drop(next);
    assert_eq!((limit.queued(), limit.available()), (0, 1));
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

#[test]
fn a_limit_of_zero_is_refused_when_it_is_built_naming_the_value() {
    // tower's `ConcurrencyLimit::new(0)` is never ready; a limit of 0 here is a mistake caught
    // where it is made.
    let error = Limit::try_new(0).unwrap_err();
    assert_eq!(error.setting(), "capacity");
    assert!(error.to_string().contains("a limit of 0"), "{error}");
    assert!(Limit::builder(0).try_build().is_err());
    let panic = std::panic::catch_unwind(|| quiet(0)).unwrap_err();
    assert!(panic_message(&*panic).contains("a limit of 0"));
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
async fn under_a_layer_that_cannot_answer_closing_the_semaphore_wakes_a_waiter_to_a_panic_counted_unavailable(
) {
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
    // ...and it no longer counts as queued, but as turned away.
    assert_eq!(telemetry.live_value(QUEUED_INSTRUMENT, &[]), 0);
    assert_eq!(
        telemetry.live_value(
            tower_resources_operation::names::REJECTED_INSTRUMENT,
            &[(
                tower_resources_operation::names::REJECTION_ATTRIBUTE,
                "unavailable"
            )]
        ),
        1
    );
}

#[tokio::test(flavor = "current_thread")]
async fn closing_the_semaphore_under_an_answering_layer_wakes_a_waiter_to_an_unavailable_error() {
    let semaphore = Arc::new(Semaphore::new(1));
    let layer = ResourcesOperationLayer::new(Arc::clone(&semaphore))
        .metrics(OperationMetrics::disabled())
        .protocol(tower_resources_operation::protocol::RejectAsError);
    let (mut s1, _handle) = mock::spawn_layer::<(), (), _>(layer);
    let mut s2 = s1.clone();
    assert_ready_ok!(s1.poll_ready());
    assert_pending!(s2.poll_ready());

    semaphore.close();
    assert!(s2.is_woken());
    assert_ready_ok!(s2.poll_ready());
    let error = s2.call(()).await.unwrap_err();
    let rejected = error
        .downcast_ref::<tower_resources_operation::Rejected>()
        .expect("a Rejected");
    assert_eq!(
        rejected.rejection(),
        tower_resources_operation::Rejection::Unavailable
    );
}

#[tokio::test(flavor = "current_thread")]
#[should_panic(expected = "the limit is closed")]
async fn a_fresh_service_of_a_layer_that_cannot_answer_panics_on_a_closed_semaphore_instead_of_hanging(
) {
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
    let mut service = quiet_on(&limit).layer(PanicsWhenPolled);
    let panicked = catch_unwind(AssertUnwindSafe(|| {
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        let _ = tower::Service::poll_ready(&mut service, &mut cx);
    }));
    assert!(panicked.is_err());
    assert_eq!(limit.available(), 1, "the permit stayed in the service");
    drop(service);
    assert_eq!(limit.available(), 1);
}

/// A layer on `limit` that records nothing.
fn quiet_on(limit: &Limit) -> ResourcesOperationLayer {
    ResourcesOperationLayer::new(limit.clone()).metrics(OperationMetrics::disabled())
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

    async fn acquire(&self) -> Result<WatchedPermit, tower_resources_operation::Rejected> {
        let place = Arc::clone(&self.places)
            .acquire_owned()
            .await
            .map_err(|_| tower_resources_operation::Rejected::closed())?;
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
                    telemetry.live_value(tower_resources_operation::names::ACTIVE_INSTRUMENT, &[]);
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
    // Admitted by poll_ready, never called: the service is dropped holding its permit, its
    // caller gone before its work began: abandoned.
    assert_ready_ok!(service.poll_ready());
    drop(service);

    assert_eq!(*seen.lock().unwrap(), [0, 0, 0]);
    assert_eq!(
        telemetry.outcomes(&[]),
        [("cancelled".to_owned(), 1), ("ok".to_owned(), 1)]
            .into_iter()
            .collect()
    );
    assert_eq!(
        telemetry.live_value(tower_resources_operation::names::ABANDONED_INSTRUMENT, &[]),
        1
    );
}

// ---------------------------------------------------------------------------------------------
// Resizing a limit while it serves: `Limit::set_capacity`.

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

// ---------------------------------------------------------------------------------------------
// `Limit`: capacity, available, queued
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "current_thread")]
async fn a_limit_reports_its_capacity_its_free_places_and_its_bound_and_clones_share_them() {
    let limit = Limit::new(3);
    assert_eq!(
        (limit.capacity(), limit.available(), limit.queued()),
        (3, 3, 0)
    );
    assert_eq!(limit.queue_bound(), None);

    let (mut service, mut handle) = mock::spawn_layer::<&str, &str, _>(quiet_on(&limit));
    assert_ready_ok!(service.poll_ready());
    assert_eq!(
        limit.available(),
        2,
        "a permit taken through a layer on a clone is gone from the limit"
    );
    let response = service.call("one");
    let other = take(&limit);
    assert_eq!((limit.capacity(), limit.available()), (3, 1));

    handle.next_request().await.unwrap().1.send_response("done");
    assert_eq!(response.await.unwrap(), "done");
    drop(other);
    assert_eq!((limit.capacity(), limit.available()), (3, 3));

    // The bound is fixed when the limit is made.
    let bounded = Limit::with_max_queued(3, 5);
    assert_eq!(bounded.queue_bound(), Some(5));
    assert_eq!(
        bounded.clone().queue_bound(),
        Some(5),
        "the bound is the limit's, shared by every clone"
    );
    assert_eq!(
        limit.queue_bound(),
        None,
        "a limit made without one has none"
    );
}

#[tokio::test(flavor = "current_thread")]
async fn queued_counts_the_waiters_of_layers_and_of_resources_operation() {
    let limit = Limit::new(1);
    let held = take(&limit);

    let (mut waiter, _handle) = mock::spawn_layer::<(), (), _>(quiet_on(&limit));
    assert_pending!(waiter.poll_ready());
    assert_eq!(limit.queued(), 1, "a layer's pending poll_ready waits");

    let metrics = OperationMetrics::disabled();
    let mut scoped = task::spawn(metrics.resources_operation(
        &limit,
        Operation::Tool,
        Executor::Inline,
        async {},
    ));
    assert_pending!(scoped.poll());
    assert_eq!(
        limit.queued(),
        2,
        "a scoped operation waits in the same queue"
    );

    drop(waiter);
    assert_eq!(limit.queued(), 1, "a dropped service leaves the queue");
    drop(scoped);
    assert_eq!(
        limit.queued(),
        0,
        "a dropped scoped future leaves the queue"
    );
    assert_eq!(limit.available(), 0, "the held place is still held");
    drop(held);
    assert_eq!(limit.available(), 1);
}

#[tokio::test(flavor = "current_thread")]
async fn raising_the_capacity_wakes_a_pending_poll_ready_which_becomes_ready_at_once() {
    let limit = Limit::new(1);
    let _held = take(&limit);
    let (mut waiter, _handle) = mock::spawn_layer::<(), (), _>(quiet_on(&limit));
    assert_pending!(waiter.poll_ready());
    assert!(!waiter.is_woken());

    limit.set_capacity(2).unwrap();
    assert!(waiter.is_woken(), "the new place wakes the waiter");
    assert_ready_ok!(waiter.poll_ready());
    assert_eq!(
        (limit.capacity(), limit.available(), limit.queued()),
        (2, 0, 0)
    );

    limit.set_capacity(4).unwrap();
    assert_eq!(
        limit.available(),
        2,
        "with no one waiting, the new places are free"
    );
}

/// Three operations run under a capacity of 3, which is lowered to `to`: none of them is
/// revoked, and a new operation waits until `4 - to` of them have finished (so that fewer than
/// `to` run); meanwhile `available()` stays 0, the places coming back paying the debt.
async fn lowering_from_three_revokes_nothing_and_admits_a_new_one_after(to: usize) {
    let limit = Limit::new(3);
    let (mut service, mut handle) = mock::spawn_layer::<usize, usize, _>(quiet_on(&limit));
    let mut responses = Vec::new();
    for i in 0..3 {
        assert_ready_ok!(service.poll_ready());
        responses.push(service.call(i));
    }
    let mut running = Vec::new();
    for _ in 0..3 {
        running.push(handle.next_request().await.unwrap().1);
    }
    assert_eq!(limit.available(), 0);

    limit.set_capacity(to).unwrap();
    assert_eq!(limit.capacity(), to);
    assert_eq!(limit.available(), 0);

    let mut newcomer = service.clone();
    assert_pending!(newcomer.poll_ready());
    assert!(!newcomer.is_woken());

    let admitted_after = 4 - to;
    for (finished, (send, response)) in running.into_iter().zip(responses).enumerate() {
        let finished = finished + 1;
        send.send_response(finished);
        assert_eq!(
            response.await.unwrap(),
            finished,
            "running operation {finished} was not revoked: it answered"
        );
        if finished < admitted_after {
            assert!(
                !newcomer.is_woken(),
                "after {finished} finished, {} still run at capacity {to}",
                3 - finished
            );
            assert_pending!(newcomer.poll_ready());
            assert_eq!(
                limit.available(),
                0,
                "the place of operation {finished} paid the debt, it is not free"
            );
        } else if finished == admitted_after {
            assert!(
                newcomer.is_woken(),
                "after {finished} finished, fewer than {to} run"
            );
            assert_ready_ok!(newcomer.poll_ready());
        }
    }

    let last = newcomer.call(99);
    handle.next_request().await.unwrap().1.send_response(99);
    assert_eq!(last.await.unwrap(), 99);
    assert_eq!(
        (limit.capacity(), limit.available(), limit.queued()),
        (to, to, 0),
        "once the debt is paid, the limit has its new capacity, all free"
    );
}

#[tokio::test(flavor = "current_thread")]
async fn lowering_the_capacity_to_one_under_three_running_revokes_none_and_admits_after_all_three()
{
    lowering_from_three_revokes_nothing_and_admits_a_new_one_after(1).await;
}

#[tokio::test(flavor = "current_thread")]
async fn lowering_the_capacity_to_two_under_three_running_revokes_none_and_admits_after_two() {
    lowering_from_three_revokes_nothing_and_admits_a_new_one_after(2).await;
}

#[tokio::test(flavor = "current_thread")]
async fn lowering_the_capacity_takes_free_places_at_once() {
    let limit = Limit::new(3);
    let held = take(&limit);
    limit.set_capacity(1).unwrap();
    assert_eq!(limit.available(), 0, "the two free places are gone at once");
    limit.set_capacity(2).unwrap();
    assert_eq!(limit.available(), 1);
    drop(held);
    assert_eq!((limit.capacity(), limit.available()), (2, 2));
}

#[tokio::test(flavor = "current_thread")]
async fn raising_the_capacity_while_a_lowering_drains_cancels_the_debt_first() {
    let limit = Limit::new(3);
    let running: Vec<_> = (0..3).map(|_| take(&limit)).collect();
    limit.set_capacity(1).unwrap(); // two places owed
    limit.set_capacity(2).unwrap(); // one of them forgiven
    assert_eq!(limit.available(), 0, "three run, above the capacity of 2");

    let mut running = running.into_iter();
    drop(running.next());
    assert_eq!(limit.available(), 0, "the first place back pays the debt");
    drop(running.next());
    assert_eq!(limit.available(), 1, "one runs under a capacity of 2");
    drop(running.next());
    assert_eq!((limit.capacity(), limit.available()), (2, 2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resizing_while_operations_run_neither_leaks_nor_multiplies_places() {
    use std::sync::atomic::AtomicUsize;

    const OPERATIONS: usize = 400;
    const LARGEST: usize = 5;
    let limit = Limit::new(3);
    let running = Arc::new(AtomicUsize::new(0));
    let peak = Arc::new(AtomicUsize::new(0));
    let work = {
        let (running, peak) = (Arc::clone(&running), Arc::clone(&peak));
        move || {
            let (running, peak) = (Arc::clone(&running), Arc::clone(&peak));
            async move {
                let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                peak.fetch_max(now, Ordering::SeqCst);
                for _ in 0..3 {
                    tokio::task::yield_now().await;
                }
                running.fetch_sub(1, Ordering::SeqCst);
                Ok::<_, BoxError>(())
            }
        }
    };
    let service = quiet_on(&limit).layer(service_fn({
        let work = work.clone();
        move |()| work()
    }));
    let metrics = OperationMetrics::disabled();

    let resizer = {
        let limit = limit.clone();
        tokio::spawn(async move {
            for i in 0..300 {
                limit.set_capacity(1 + (i * 7) % LARGEST).unwrap();
                tokio::task::yield_now().await;
            }
        })
    };
    let callers: Vec<_> = (0..OPERATIONS)
        .map(|i| {
            let (service, limit, metrics, work) = (
                service.clone(),
                limit.clone(),
                metrics.clone(),
                work.clone(),
            );
            tokio::spawn(async move {
                if i % 2 == 0 {
                    service.oneshot(()).await
                } else {
                    metrics
                        .resources_operation(&limit, Operation::Tool, Executor::Inline, work())
                        .await
                        .unwrap()
                }
            })
        })
        .collect();
    resizer.await.unwrap();
    limit.set_capacity(4).unwrap();
    for caller in callers {
        tokio::time::timeout(Duration::from_secs(60), caller)
            .await
            .expect("every operation is admitted in the end")
            .unwrap()
            .unwrap();
    }
    assert!(
        peak.load(Ordering::SeqCst) <= LARGEST,
        "{} ran at once; the capacity was never above {LARGEST}",
        peak.load(Ordering::SeqCst)
    );
    assert_eq!(
        (limit.capacity(), limit.available(), limit.queued()),
        (4, 4, 0),
        "after every resize, every place is back, and no more"
    );
}

#[tokio::test(flavor = "current_thread")]
async fn a_capacity_of_zero_pauses_admission_until_it_is_raised() {
    let limit = Limit::new(1);
    limit.set_capacity(0).unwrap();
    assert_eq!((limit.capacity(), limit.available()), (0, 0));
    let (mut waiter, _handle) = mock::spawn_layer::<(), (), _>(quiet_on(&limit));
    assert_pending!(waiter.poll_ready());
    limit.set_capacity(1).unwrap();
    assert!(waiter.is_woken());
    assert_ready_ok!(waiter.poll_ready());

    let paused = Limit::with_max_queued(1, 0);
    paused.set_capacity(0).unwrap();
    let (mut turned_away, _handle) =
        mock::spawn_layer::<(), (), _>(quiet_on(&paused).protocol(RejectAsError));
    assert_ready_ok!(turned_away.poll_ready());
    let error = turned_away.call(()).await.unwrap_err();
    assert_eq!(rejection_of(&error), Rejection::QueueFull);
}

#[test]
fn set_capacity_above_tokios_max_permits_is_an_error_naming_it_and_changes_nothing() {
    let limit = Limit::new(2);
    let too_many = Semaphore::MAX_PERMITS + 1;
    let error = limit.set_capacity(too_many).unwrap_err();
    let message = error.to_string();
    assert!(message.contains("MAX_PERMITS"), "{message}");
    assert!(message.contains(&too_many.to_string()), "{message}");
    assert_eq!((limit.capacity(), limit.available()), (2, 2));

    assert!(Limit::try_new(too_many).is_err());
    limit.set_capacity(Semaphore::MAX_PERMITS).unwrap();
    assert_eq!(limit.available(), Semaphore::MAX_PERMITS);
}

#[test]
fn a_layers_debug_shows_its_limits_name_and_capacity_not_a_type_name() {
    let layer = ResourcesOperationLayer::new(Limit::builder(3).name("verifiers").build());
    let shown = format!("{layer:?}");
    assert!(shown.contains("capacity: Some(3)"), "{shown}");
    assert!(shown.contains("\"verifiers\""), "{shown}");
    assert!(!shown.contains("tower_resources_operation::"), "{shown}");
}

/// One limit in two layers of one stack (tower's limits deadlock there once every place is held
/// by a request that waits for a second): each request is admitted once, on the place the outer
/// layer took, with metrics off as on, so at most 2 run and 2 do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_limit_in_two_layers_of_a_stack_admits_each_request_once() {
    use tower::ServiceBuilder;

    for metrics in [
        OperationMetrics::disabled(),
        Telemetry::new().metrics.clone(),
    ] {
        let limit = Limit::new(2);
        let load = Arc::new(support::Load::default());
        let twice = {
            let load = Arc::clone(&load);
            ServiceBuilder::new()
                .layer(ResourcesOperationLayer::new(limit.clone()).metrics(metrics.clone()))
                .layer(ResourcesOperationLayer::new(limit.clone()).metrics(metrics))
                .service(service_fn(move |n: u32| {
                    let load = Arc::clone(&load);
                    async move {
                        load.work(Duration::from_millis(50)).await;
                        Ok::<_, BoxError>(n)
                    }
                }))
        };
        let calls = (0..6).map(|n| tokio::spawn(twice.clone().oneshot(n)));
        let answered = tokio::time::timeout(
            Duration::from_secs(10),
            futures_util::future::join_all(calls),
        )
        .await
        .expect("every request is answered");
        for (n, answer) in answered.into_iter().enumerate() {
            assert_eq!(answer.unwrap().unwrap(), n as u32);
        }
        assert_eq!(load.max(), 2, "at most 2 ran at once, and 2 did");
        assert_eq!(limit.available(), 2);
    }
}
