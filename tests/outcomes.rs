//! How an operation behind the layer ends: the classifier, drops, panics and `set_outcome`.

mod support;

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use support::{only, panic_message, panics_in_call, Telemetry};
use tokio_test::{assert_pending, task};
use tower::timeout::TimeoutLayer;
use tower::{service_fn, BoxError, Layer, Service, ServiceBuilder, ServiceExt};
use tower_resources_operation::classify::{ClassifyOutcome, TimeoutClassifier};
use tower_resources_operation::names::{ACTIVE_INSTRUMENT, OPERATION_ATTRIBUTE};
use tower_resources_operation::protocol::Protocol;
use tower_resources_operation::{
    set_outcome, Acquire, Limit, Operation, Outcome, Rejected, ResourcesOperationLayer,
};

/// The outcomes of the operations tagged `operation`.
fn outcomes_of(t: &Telemetry, operation: &str) -> BTreeMap<String, u64> {
    t.outcomes(&[(OPERATION_ATTRIBUTE, operation)])
}

fn outcomes(t: &Telemetry) -> BTreeMap<String, u64> {
    t.outcomes(&[])
}

fn layer(t: &Telemetry) -> ResourcesOperationLayer {
    ResourcesOperationLayer::new(1).metrics(t.metrics.clone())
}

/// The limit is free again and nothing counts as active.
fn assert_released<C: Clone, P: Clone>(
    t: &Telemetry,
    layer: &ResourcesOperationLayer<C, Limit, P>,
) {
    assert_eq!(layer.limit().available(), 1, "the permit is back");
    assert_eq!(
        t.live_value(ACTIVE_INSTRUMENT, &[]),
        0,
        "active is back to 0"
    );
}

// ---------------------------------------------------------------------------------------------
// DefaultClassifier
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn default_classifier_records_ok_for_an_ok_response() {
    let t = Telemetry::new();
    let svc = layer(&t).layer(service_fn(|n: u32| async move { Ok::<_, BoxError>(n) }));
    assert_eq!(svc.oneshot(5).await.unwrap(), 5);
    assert_eq!(outcomes(&t), only("ok"));
}

#[tokio::test]
async fn default_classifier_records_error_for_an_error() {
    let t = Telemetry::new();
    let svc = layer(&t).layer(service_fn(|()| async {
        Err::<(), BoxError>("boom".into())
    }));
    assert_eq!(svc.oneshot(()).await.unwrap_err().to_string(), "boom");
    assert_eq!(outcomes(&t), only("error"));
}

/// One request that tower's `Timeout` (100 ms, inside `layer`) ends with its `Elapsed`.
async fn through_towers_timeout<C>(layer: ResourcesOperationLayer<C>)
where
    C: ClassifyOutcome<(), BoxError> + Clone,
{
    let svc = ServiceBuilder::new()
        .layer(layer)
        .layer(TimeoutLayer::new(Duration::from_millis(100)))
        .service(service_fn(|()| async {
            tokio::time::sleep(Duration::from_secs(10)).await;
            Ok::<_, BoxError>(())
        }));
    let error = svc.oneshot(()).await.unwrap_err();
    assert!(error.is::<tower::timeout::error::Elapsed>());
}

/// tokio's `timeout` of 100 ms around a sleep of 10 s: always `Elapsed`.
async fn tokio_timeout() -> Result<(), tokio::time::error::Elapsed> {
    tokio::time::timeout(
        Duration::from_millis(100),
        tokio::time::sleep(Duration::from_secs(10)),
    )
    .await
}

#[tokio::test(start_paused = true)]
async fn default_classifier_records_error_for_an_elapsed_as_any_other_error() {
    let t = Telemetry::new();
    through_towers_timeout(layer(&t)).await;
    assert_eq!(outcomes(&t), only("error"));
}

// ---------------------------------------------------------------------------------------------
// TimeoutClassifier
// ---------------------------------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn timeout_classifier_records_timeout_for_towers_timeout_layer_inside() {
    let t = Telemetry::new();
    through_towers_timeout(layer(&t).classifier(TimeoutClassifier::new())).await;
    assert_eq!(outcomes(&t), only("timeout"));
}

#[tokio::test(start_paused = true)]
async fn timeout_classifier_records_timeout_for_a_boxed_tokio_elapsed() {
    let t = Telemetry::new();
    let layer = layer(&t).classifier(TimeoutClassifier::new());
    let svc = layer.layer(service_fn(|()| async {
        tokio_timeout().await.map_err(BoxError::from)
    }));
    let error = svc.oneshot(()).await.unwrap_err();
    assert!(error.is::<tokio::time::error::Elapsed>());
    assert_eq!(outcomes(&t), only("timeout"));
}

#[tokio::test(start_paused = true)]
async fn timeout_classifier_records_timeout_for_tokio_elapsed_as_the_error_type() {
    let t = Telemetry::new();
    let layer = layer(&t).classifier(TimeoutClassifier::new());
    let svc = layer.layer(service_fn(|()| tokio_timeout()));
    svc.oneshot(()).await.unwrap_err();
    assert_eq!(outcomes(&t), only("timeout"));
}

// ---------------------------------------------------------------------------------------------
// Custom classifiers
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn closure_classifier_decides_the_outcome() {
    let t = Telemetry::new();
    // Responses carry their own verdict: an odd number is a timeout, even though it is `Ok`.
    let svc = layer(&t)
        .classifier(|result: Result<&u32, &Infallible>| match result {
            Ok(n) if n % 2 == 1 => Outcome::Timeout,
            Ok(_) => Outcome::Ok,
            Err(never) => match *never {},
        })
        .layer(service_fn(|n: u32| async move { Ok::<_, Infallible>(n) }));

    for n in [1, 2, 3] {
        assert_eq!(svc.clone().oneshot(n).await.unwrap(), n);
    }
    assert_eq!(
        outcomes(&t),
        BTreeMap::from([("ok".to_owned(), 1), ("timeout".to_owned(), 2)])
    );
}

/// Maps a "cancelled" response to `cancelled` and every error to `crashed`.
#[derive(Clone)]
struct Verdicts;

impl ClassifyOutcome<&'static str, BoxError> for Verdicts {
    fn classify(&self, result: Result<&&'static str, &BoxError>) -> Outcome {
        match result {
            Ok(&"cancelled") => Outcome::Cancelled,
            Ok(_) => Outcome::Ok,
            Err(_) => Outcome::Crashed,
        }
    }
}

#[tokio::test]
async fn custom_classify_outcome_impl_decides_the_outcome() {
    let t = Telemetry::new();
    let svc =
        layer(&t)
            .classifier(Verdicts)
            .layer(service_fn(|verdict: &'static str| async move {
                if verdict == "fail" {
                    Err::<&'static str, BoxError>("failed".into())
                } else {
                    Ok(verdict)
                }
            }));

    assert_eq!(svc.clone().oneshot("fine").await.unwrap(), "fine");
    assert_eq!(svc.clone().oneshot("cancelled").await.unwrap(), "cancelled");
    assert!(svc.clone().oneshot("fail").await.is_err());
    assert_eq!(
        outcomes(&t),
        BTreeMap::from([
            ("cancelled".to_owned(), 1),
            ("crashed".to_owned(), 1),
            ("ok".to_owned(), 1),
        ])
    );
}

#[tokio::test]
async fn panicking_classifier_keeps_the_response_and_records_error() {
    let t = Telemetry::new();
    let layer = layer(&t)
        .classifier(|_: Result<&u32, &Infallible>| -> Outcome { panic!("classifier bug") });
    echo_through(&layer, 9).await;
    assert_eq!(outcomes(&t), only("error"));
    assert_released(&t, &layer);
}

/// One request through a service of `layer` that echoes it: the answer goes out, whatever the
/// layer's own user code (classifier, protocol) does.
async fn echo_through<C, P>(layer: &ResourcesOperationLayer<C, Limit, P>, n: u32)
where
    C: ClassifyOutcome<u32, Infallible> + Clone,
    P: Protocol<u32, u32, Infallible>,
{
    let svc = layer.layer(service_fn(|n: u32| async move { Ok::<_, Infallible>(n) }));
    assert_eq!(
        svc.oneshot(n).await.unwrap(),
        n,
        "the response still goes out"
    );
}

/// Counts the calls it panics in, so that a test can tell that the user code did run.
#[derive(Clone, Default)]
struct Panics(Arc<AtomicUsize>);

impl Panics {
    fn now(&self, what: &str) -> ! {
        self.0.fetch_add(1, SeqCst);
        panic!("{what} bug")
    }

    fn times(&self) -> usize {
        self.0.load(SeqCst)
    }
}

/// A classifier whose every clone panics: the layer clones its classifier for each operation.
struct PanicsWhenCloned(Panics);

impl Clone for PanicsWhenCloned {
    fn clone(&self) -> Self {
        self.0.now("classifier clone")
    }
}

impl ClassifyOutcome<u32, Infallible> for PanicsWhenCloned {
    fn classify(&self, _: Result<&u32, &Infallible>) -> Outcome {
        Outcome::Ok
    }
}

#[tokio::test]
async fn classifier_whose_clone_panics_keeps_the_response_and_records_error() {
    let t = Telemetry::new();
    let panics = Panics::default();
    let layer = layer(&t).classifier(PanicsWhenCloned(panics.clone()));
    echo_through(&layer, 4).await;
    assert_eq!(
        panics.times(),
        1,
        "the classifier was cloned for the operation"
    );
    assert_eq!(outcomes(&t), only("error"));
    assert_released(&t, &layer);
}

/// A protocol whose deadline reader panics (and which never has a rejection to answer: the
/// limit has no queue bound).
#[derive(Clone)]
struct PanicsReadingTheDeadline(Panics);

impl<Req, Res, Err> Protocol<Req, Res, Err> for PanicsReadingTheDeadline {
    fn answer(&self, rejected: Rejected) -> Result<Res, Err> {
        unreachable!("an unbounded limit rejects nothing: {rejected}")
    }

    fn deadline(&self, _: &Req) -> Option<Duration> {
        self.0.now("deadline reader")
    }
}

#[tokio::test]
async fn protocol_whose_deadline_panics_keeps_the_response_and_records_the_operation() {
    let t = Telemetry::new();
    let panics = Panics::default();
    let layer = layer(&t).protocol(PanicsReadingTheDeadline(panics.clone()));
    echo_through(&layer, 6).await;
    assert_eq!(
        outcomes(&t),
        only("ok"),
        "only the deadline is lost, not the operation"
    );
    assert_eq!(panics.times(), 1, "the deadline was read");
    assert_released(&t, &layer);
}

// ---------------------------------------------------------------------------------------------
// Cancellation
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn response_future_dropped_before_completion_is_cancelled() {
    let t = Telemetry::new();
    let layer = layer(&t);
    let mut svc = layer.layer(service_fn(|()| {
        std::future::pending::<Result<(), Infallible>>()
    }));

    let mut response = task::spawn(svc.ready().await.unwrap().call(()));
    assert_pending!(response.poll());
    assert!(outcomes(&t).is_empty(), "still running");
    drop(response);

    assert_eq!(outcomes(&t), only("cancelled"));
    assert_released(&t, &layer);
}

/// A caller that took its permit (`ready`) and went away before it called: its work never
/// began, so it is abandoned, with no queue sample and no outcome, and its place goes back.
#[tokio::test]
async fn permit_taken_by_poll_ready_and_service_dropped_without_call_is_abandoned() {
    let t = Telemetry::new();
    let layer = layer(&t);
    let mut svc = layer.layer(service_fn(|()| async { Ok::<_, Infallible>(()) }));

    ServiceExt::<()>::ready(&mut svc).await.unwrap();
    assert_eq!(layer.limit().available(), 0);
    drop(svc);

    assert!(outcomes(&t).is_empty(), "{:?}", outcomes(&t));
    assert_eq!(
        t.count(
            tower_resources_operation::names::QUEUE_DURATION_INSTRUMENT,
            &[]
        ),
        0
    );
    assert_eq!(
        t.live_value(tower_resources_operation::names::ABANDONED_INSTRUMENT, &[]),
        1
    );
    assert_released(&t, &layer);
}

// ---------------------------------------------------------------------------------------------
// Panics
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn panic_in_inner_call_is_crashed_and_propagates_unchanged() {
    assert_eq!(outcomes_of_a_panicking_call(None).await, only("crashed"));
}

/// Calls a [`panics_in_call`] that sets `outcome` first, if given, behind a layer: the panic goes
/// on unchanged and the permit comes back. The outcomes recorded.
async fn outcomes_of_a_panicking_call(outcome: Option<Outcome>) -> BTreeMap<String, u64> {
    let t = Telemetry::new();
    let layer = layer(&t);
    let mut svc = layer.layer(panics_in_call(outcome));

    svc.ready().await.unwrap();
    let payload = catch_unwind(AssertUnwindSafe(|| svc.call(42))).unwrap_err();
    assert_eq!(panic_message(&*payload), "call panicked: 42");
    assert_released(&t, &layer);
    outcomes(&t)
}

#[tokio::test]
async fn panic_while_polling_the_inner_future_is_crashed_and_propagates_unchanged() {
    let t = Telemetry::new();
    let layer = layer(&t);
    let svc = layer.layer(service_fn(|n: u32| async move {
        tokio::task::yield_now().await;
        if n > 0 {
            panic!("future panicked: {n}");
        }
        Ok::<_, Infallible>(())
    }));

    let error = tokio::spawn(svc.oneshot(7)).await.unwrap_err();
    assert!(error.is_panic());
    assert_eq!(panic_message(&*error.into_panic()), "future panicked: 7");

    assert_eq!(outcomes(&t), only("crashed"));
    assert_released(&t, &layer);
}

/// An inner service whose `poll_ready` panics, with `poll_ready panicked`, after the limit has
/// already given a permit: every time, or only the first time (then it answers each request
/// with the request).
#[derive(Clone)]
struct PanicsInPollReady {
    again: bool,
    panicked: Arc<AtomicBool>,
}

impl PanicsInPollReady {
    fn every_time() -> Self {
        Self {
            again: true,
            panicked: Arc::default(),
        }
    }

    fn the_first_time() -> Self {
        Self {
            again: false,
            panicked: Arc::default(),
        }
    }
}

impl Service<u32> for PanicsInPollReady {
    type Response = u32;
    type Error = Infallible;
    type Future = std::future::Ready<Result<u32, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        if !self.panicked.swap(true, SeqCst) || self.again {
            panic!("poll_ready panicked")
        }
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: u32) -> Self::Future {
        std::future::ready(Ok(request))
    }
}

#[tokio::test]
async fn panic_in_inner_poll_ready_after_the_permit_is_crashed_and_propagates_unchanged() {
    let t = Telemetry::new();
    let layer = layer(&t);
    let svc = layer.layer(PanicsInPollReady::every_time());

    let error = tokio::spawn(svc.oneshot(1)).await.unwrap_err();
    assert!(error.is_panic());
    assert_eq!(panic_message(&*error.into_panic()), "poll_ready panicked");

    assert_eq!(outcomes(&t), only("crashed"));
    assert_released(&t, &layer);
}

/// The operation admitted before the panic ends once, as `crashed`, and gives its permit back:
/// the same service, asked again, admits (and records) a new operation, rather than calling the
/// inner service unrecorded on the crashed operation's permit.
#[tokio::test]
async fn after_a_panic_in_inner_poll_ready_the_same_service_records_every_later_operation() {
    let t = Telemetry::new();
    let layer = layer(&t);
    let mut svc = layer.layer(PanicsInPollReady::the_first_time());

    let mut ready = task::spawn(());
    let panicked = catch_unwind(AssertUnwindSafe(|| {
        ready.enter(|cx, _| Service::<u32>::poll_ready(&mut svc, cx))
    }));
    assert!(panicked.is_err());
    assert_eq!(outcomes(&t), only("crashed"));
    assert_eq!(
        layer.limit().available(),
        1,
        "the crashed operation's permit is back"
    );

    // `call` without a new `poll_ready` has no permit to spend.
    let unprepared = catch_unwind(AssertUnwindSafe(|| svc.call(1)));
    assert!(unprepared.is_err(), "call without poll_ready panics");

    assert_eq!(svc.ready().await.unwrap().call(2).await.unwrap(), 2);
    assert_eq!(
        outcomes(&t),
        BTreeMap::from([("crashed".to_owned(), 1), ("ok".to_owned(), 1)])
    );
    assert_eq!(
        t.count(
            tower_resources_operation::names::QUEUE_DURATION_INSTRUMENT,
            &[]
        ),
        2,
        "two admitted operations, two queue samples"
    );
    assert_released(&t, &layer);
}

// ---------------------------------------------------------------------------------------------
// set_outcome
// ---------------------------------------------------------------------------------------------

#[test]
fn set_outcome_outside_any_operation_returns_false() {
    assert!(!set_outcome(Outcome::Timeout));
}

#[tokio::test]
async fn set_outcome_inside_an_operation_returns_true() {
    let t = Telemetry::new();
    let svc = layer(&t).layer(service_fn(|()| async {
        Ok::<_, Infallible>(set_outcome(Outcome::Ok))
    }));
    assert!(svc.oneshot(()).await.unwrap());
}

#[tokio::test]
async fn set_outcome_in_a_task_spawned_from_the_work_returns_false_and_changes_nothing() {
    let t = Telemetry::new();
    let svc = layer(&t).layer(service_fn(|()| async {
        let spawned = tokio::spawn(async { set_outcome(Outcome::Timeout) })
            .await
            .unwrap();
        Ok::<_, Infallible>(spawned)
    }));
    assert!(!svc.oneshot(()).await.unwrap());
    assert_eq!(outcomes(&t), only("ok"));
}

#[tokio::test]
async fn set_outcome_in_the_inner_future_wins_over_the_classifier() {
    let t = Telemetry::new();
    let svc = layer(&t).layer(service_fn(|n: u32| async move {
        tokio::task::yield_now().await;
        assert!(set_outcome(Outcome::Timeout));
        tokio::task::yield_now().await;
        Ok::<_, Infallible>(n)
    }));
    assert_eq!(svc.oneshot(3).await.unwrap(), 3);
    assert_eq!(outcomes(&t), only("timeout"));
}

#[tokio::test]
async fn set_outcome_last_call_wins() {
    let t = Telemetry::new();
    let svc = layer(&t).layer(service_fn(|()| async {
        assert!(set_outcome(Outcome::Timeout));
        tokio::task::yield_now().await;
        assert!(set_outcome(Outcome::Cancelled));
        Err::<(), BoxError>("boom".into())
    }));
    svc.oneshot(()).await.unwrap_err();
    assert_eq!(outcomes(&t), only("cancelled"));
}

#[tokio::test]
async fn set_outcome_in_the_inner_call_wins_over_the_classifier() {
    let t = Telemetry::new();
    // The outcome is set in the synchronous `call`, not in the future it returns.
    let svc = layer(&t).layer(service_fn(|_: u32| {
        assert!(set_outcome(Outcome::Timeout));
        std::future::ready(Err::<(), BoxError>("boom".into()))
    }));
    svc.oneshot(1).await.unwrap_err();
    assert_eq!(outcomes(&t), only("timeout"));
}

#[tokio::test]
async fn set_outcome_before_a_panic_in_the_inner_future_wins_over_crashed() {
    let t = Telemetry::new();
    let layer = layer(&t);
    let svc = layer.layer(service_fn(|()| async {
        assert!(set_outcome(Outcome::Timeout));
        tokio::task::yield_now().await;
        if true {
            panic!("after set_outcome");
        }
        Ok::<_, Infallible>(())
    }));

    let error = tokio::spawn(svc.oneshot(())).await.unwrap_err();
    assert_eq!(panic_message(&*error.into_panic()), "after set_outcome");
    assert_eq!(outcomes(&t), only("timeout"));
    assert_released(&t, &layer);
}

#[tokio::test]
async fn set_outcome_before_a_panic_in_the_inner_call_wins_over_crashed() {
    assert_eq!(
        outcomes_of_a_panicking_call(Some(Outcome::Error)).await,
        only("error")
    );
}

#[tokio::test]
async fn set_outcome_before_the_response_future_is_dropped_wins_over_cancelled() {
    let t = Telemetry::new();
    let layer = layer(&t);
    let mut svc = layer.layer(service_fn(|()| async {
        assert!(set_outcome(Outcome::Timeout));
        std::future::pending::<Result<(), Infallible>>().await
    }));

    let mut response = task::spawn(svc.ready().await.unwrap().call(()));
    assert_pending!(response.poll());
    drop(response);
    assert_eq!(outcomes(&t), only("timeout"));
    assert_released(&t, &layer);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn set_outcome_is_kept_when_the_work_moves_between_threads() {
    let t = Telemetry::new();
    let svc = layer(&t).layer(service_fn(|()| async {
        assert!(set_outcome(Outcome::Timeout));
        let mut threads = std::collections::HashSet::new();
        for _ in 0..200 {
            threads.insert(std::thread::current().id());
            tokio::task::yield_now().await;
        }
        Ok::<_, Infallible>(threads.len())
    }));
    let tasks: Vec<_> = (0..4)
        .map(|_| tokio::spawn(svc.clone().oneshot(())))
        .collect();
    for task in tasks {
        task.await.unwrap().unwrap();
    }
    assert_eq!(
        outcomes(&t),
        BTreeMap::from([("timeout".to_owned(), 4)]),
        "each operation keeps the outcome it set, whichever thread polls it"
    );
}

/// A service behind a layer of its own, tagged `operation`: each operation sets the outcome it
/// is told to, if any, then works for 10 ms.
fn sets_what_it_is_told(
    t: &Telemetry,
    operation: Operation,
) -> impl Service<Option<Outcome>, Response = (), Error = Infallible, Future: Send>
       + Clone
       + Send
       + 'static {
    layer(t)
        .operation(operation)
        .layer(service_fn(|told: Option<Outcome>| async move {
            if let Some(outcome) = told {
                assert!(set_outcome(outcome));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
            Ok::<_, Infallible>(())
        }))
}

#[tokio::test(start_paused = true)]
async fn nested_operations_each_keep_their_own_outcome() {
    let t = Telemetry::new();
    let inner = sets_what_it_is_told(&t, Operation::Judge);
    let outer = layer(&t)
        .operation(Operation::Verify)
        .layer(service_fn(move |()| {
            let inner = inner.clone();
            async move {
                // The outer operation's own choice, made before any inner operation runs.
                assert!(set_outcome(Outcome::Error));
                // One inner operation sets its own outcome, one sets none.
                inner.clone().oneshot(Some(Outcome::Timeout)).await?;
                inner.clone().oneshot(None).await?;
                tokio::time::sleep(Duration::from_millis(10)).await;
                Ok::<_, Infallible>(())
            }
        }));

    outer.oneshot(()).await.unwrap();

    assert_eq!(
        outcomes_of(&t, "verify"),
        only("error"),
        "the outer operation keeps its own outcome"
    );
    assert_eq!(
        outcomes_of(&t, "judge"),
        BTreeMap::from([("ok".to_owned(), 1), ("timeout".to_owned(), 1)]),
        "each inner operation has its own outcome"
    );
}

#[tokio::test(start_paused = true)]
async fn outer_operation_without_set_outcome_is_classified_after_an_inner_one_sets_its_own() {
    let t = Telemetry::new();
    let inner = sets_what_it_is_told(&t, Operation::Tool);
    let outer = layer(&t)
        .operation(Operation::Verify)
        .layer(service_fn(move |()| {
            let inner = inner.clone();
            async move {
                inner.oneshot(Some(Outcome::Crashed)).await.unwrap();
                Err::<(), BoxError>("outer failed".into())
            }
        }));

    outer.oneshot(()).await.unwrap_err();
    assert_eq!(outcomes_of(&t, "tool"), only("crashed"));
    assert_eq!(
        outcomes_of(&t, "verify"),
        only("error"),
        "the inner operation's set_outcome does not leak into the outer one"
    );
}

#[tokio::test]
async fn a_disabled_limit_is_transparent_to_set_outcome_of_the_enabled_operation_around_it() {
    let t = Telemetry::new();
    // The inner limit reports nothing: its work is part of the outer operation's work, so
    // set_outcome there sets the outer operation's outcome, as if the inner limit were not there.
    let inner = ResourcesOperationLayer::new(1)
        .metrics(tower_resources_operation::OperationMetrics::disabled())
        .layer(service_fn(|()| async {
            Ok::<_, Infallible>(set_outcome(Outcome::Timeout))
        }));
    let outer = layer(&t)
        .operation(Operation::Verify)
        .layer(service_fn(move |()| inner.clone().oneshot(())));

    let set = outer.oneshot(()).await.unwrap();
    assert!(set, "the enclosing enabled operation takes the outcome");
    assert_eq!(outcomes_of(&t, "verify"), only("timeout"),);
}

// ---------------------------------------------------------------------------------------------
// Constructors that pick a classifier
// ---------------------------------------------------------------------------------------------

/// A response that the HTTP classifier calls `timeout` (504) and the gRPC one `cancelled`
/// (`grpc-status: 1`), so each constructor shows which classifier it picked.
fn gateway_timeout_with_grpc_cancelled() -> http::Response<()> {
    http::Response::builder()
        .status(504)
        .header("grpc-status", "1")
        .body(())
        .unwrap()
}

/// The outcomes a layer records for one [`gateway_timeout_with_grpc_cancelled`] response.
async fn outcome_through<C, L, P>(layer: ResourcesOperationLayer<C, L, P>) -> BTreeMap<String, u64>
where
    C: ClassifyOutcome<http::Response<()>, Infallible> + Clone,
    L: Acquire + Clone + Send + Sync + 'static,
    L::Permit: Send + 'static,
    P: Protocol<http::Request<()>, http::Response<()>, Infallible> + Clone,
{
    let t = Telemetry::new();
    let svc = layer
        .metrics(t.metrics.clone())
        .layer(service_fn(|_: http::Request<()>| async {
            Ok::<_, Infallible>(gateway_timeout_with_grpc_cancelled())
        }));
    svc.oneshot(http::Request::new(())).await.unwrap();
    outcomes(&t)
}

#[tokio::test]
async fn the_http_constructors_classify_by_status_and_the_grpc_ones_by_grpc_status() {
    let semaphore = || std::sync::Arc::new(tokio::sync::Semaphore::new(1));
    let http = ResourcesOperationLayer::new_for_http(1);
    assert_eq!(outcome_through(http).await, only("timeout"));
    let http = ResourcesOperationLayer::new_for_http(semaphore());
    assert_eq!(outcome_through(http).await, only("timeout"));
    let grpc = ResourcesOperationLayer::new_for_grpc(1);
    assert_eq!(outcome_through(grpc).await, only("cancelled"));
    let grpc = ResourcesOperationLayer::new_for_grpc(semaphore());
    assert_eq!(outcome_through(grpc).await, only("cancelled"));
}
