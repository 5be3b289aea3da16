//! Bounded waiting: the crate's `Limit` (capacity, what is free, who waits, resizing it while it
//! serves, closing it), its queue bound (`with_max_queued`, fixed when the limit is made, shared
//! by every layer and by the scoped API), each layer's own queue timeout, tower's `LoadShed`
//! semantics for a rejection (`poll_ready` ready, `call` answers without the inner service), how
//! each kind of layer answers (a `BoxError` or an error of your own, HTTP 503/429, gRPC
//! RESOURCE_EXHAUSTED, an axum route that stays `Infallible`, a real tonic client), that a layer
//! that cannot answer refuses a limit that may turn operations away, and the metrics of
//! turned-away and abandoned operations with their books: every operation that asks for a permit
//! ends up exactly one of admitted, rejected or abandoned.

mod support;

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http::header::{CONTENT_TYPE, RETRY_AFTER};
use http::{Request, Response, StatusCode};
use tokio_test::{assert_pending, assert_ready, assert_ready_ok, task};
use tower::{service_fn, BoxError, Layer as _, Service, ServiceExt as _};
use tower_test::mock;

use support::{abandoned, live, panic_message, rejection_of, settle, take, Telemetry};
use tower_resources_operation::classify::DefaultClassifier;
use tower_resources_operation::names::{
    DURATION_INSTRUMENT, OPERATION_ATTRIBUTE, QUEUE_DURATION_INSTRUMENT, REJECTED_INSTRUMENT,
    REJECTION_ATTRIBUTE,
};
use tower_resources_operation::per_request::{Choice, ChooseFn};
use tower_resources_operation::protocol::{Http, RejectAsError};
use tower_resources_operation::{
    Acquire, Executor, Limit, Operation, OperationMetrics, Rejected, Rejection,
    ResourcesOperationLayer,
};

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// A layer on `limit` that records nothing, so no test depends on the global provider.
fn quiet(limit: &Limit) -> ResourcesOperationLayer {
    ResourcesOperationLayer::new(limit.clone()).metrics(OperationMetrics::disabled())
}

/// A generic layer on `limit` tagged `operation`, reporting to `t`, that answers a rejection
/// with its service's error, made from `Rejected`.
fn answering(
    t: &Telemetry,
    limit: &Limit,
    operation: Operation,
) -> ResourcesOperationLayer<DefaultClassifier, Limit, RejectAsError> {
    ResourcesOperationLayer::new(limit.clone())
        .operation(operation)
        .metrics(t.metrics.clone())
        .protocol(RejectAsError)
}

/// What `layer` panics with when it refuses to make its service over `inner`.
fn refusal<S, L: tower::Layer<S>>(layer: &L, inner: S) -> String {
    let refused = catch_unwind(AssertUnwindSafe(|| drop(layer.layer(inner))));
    panic_message(&*refused.expect_err("the layer refuses"))
}

/// Turned-away operations of `operation`, for `reason`.
fn rejected(t: &Telemetry, operation: &str, reason: &str) -> i64 {
    t.live_value(
        REJECTED_INSTRUMENT,
        &[
            (OPERATION_ATTRIBUTE, operation),
            (REJECTION_ATTRIBUTE, reason),
        ],
    )
}

// ---------------------------------------------------------------------------------------------
// `Limit::close`
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "current_thread")]
async fn closing_the_limit_wakes_a_waiting_poll_ready_to_an_unavailable_answer_and_later_callers_get_it_at_once(
) {
    let t = Telemetry::new();
    let limit = Limit::new(1);
    let (mut running, mut handle) =
        mock::spawn_layer::<&str, &str, _>(answering(&t, &limit, Operation::Verify));
    assert_ready_ok!(running.poll_ready());
    let response = running.call("running");
    let mut waiter = running.clone();
    assert_pending!(waiter.poll_ready());

    limit.close();
    assert!(waiter.is_woken(), "closing wakes the waiter");
    assert_ready_ok!(waiter.poll_ready(), "ready, to answer");
    let error = waiter.call("woken").await.unwrap_err();
    assert_eq!(rejection_of(&error), Rejection::Unavailable);

    let mut later = running.clone();
    assert_ready_ok!(later.poll_ready());
    let error = later.call("later").await.unwrap_err();
    assert_eq!(rejection_of(&error), Rejection::Unavailable);

    let (request, send) = handle.next_request().await.unwrap();
    assert_eq!(request, "running");
    assert_pending!(handle.poll_request(), "the inner service saw neither");
    send.send_response("finished");
    assert_eq!(
        response.await.unwrap(),
        "finished",
        "an operation already running finishes normally"
    );
    assert_eq!(rejected(&t, "verify", "unavailable"), 2);
    assert_eq!(abandoned(&t, "verify"), 0, "turned away, not abandoned");
    assert_eq!(live(&t), (0, 0));
}

#[tokio::test(flavor = "current_thread")]
async fn under_a_layer_that_cannot_answer_closing_the_limit_wakes_a_waiter_to_a_panic_naming_the_limit(
) {
    let t = Telemetry::new();
    let limit = Limit::new(1);
    let layer = ResourcesOperationLayer::new(limit.clone()).metrics(t.metrics.clone());
    let (mut running, mut handle) = mock::spawn_layer::<&str, &str, _>(layer);
    assert_ready_ok!(running.poll_ready());
    let response = running.call("running");
    let mut waiter = running.clone();
    assert_pending!(waiter.poll_ready());

    limit.close();
    assert!(waiter.is_woken(), "closing wakes the waiter");
    let panicked = catch_unwind(AssertUnwindSafe(|| waiter.poll_ready())).unwrap_err();
    let message = panic_message(&*panicked);
    assert!(
        message.contains(std::any::type_name::<Limit>()),
        "names the limit: {message}"
    );
    assert!(message.contains("closed"), "says it is closed: {message}");

    let later = catch_unwind(AssertUnwindSafe(|| running.clone().poll_ready())).unwrap_err();
    assert!(panic_message(&*later).contains("closed"));

    handle
        .next_request()
        .await
        .unwrap()
        .1
        .send_response("finished");
    assert_eq!(
        response.await.unwrap(),
        "finished",
        "an operation already running finishes normally"
    );
    assert_eq!(
        rejected(&t, "other", "unavailable"),
        2,
        "counted as turned away before the panic"
    );
    assert_eq!(live(&t), (0, 0));
}

#[tokio::test(flavor = "current_thread")]
async fn closing_the_limit_turns_a_waiting_scoped_operation_away_as_unavailable() {
    let t = Telemetry::new();
    let limit = Limit::new(1);
    let held = take(&limit);
    let metrics = t.metrics.clone();
    let waiting = limit.clone();
    let waiter = tokio::spawn(async move {
        metrics
            .resources_operation(waiting, Operation::Judge, Executor::Inline, async {})
            .await
    });
    settle().await;
    assert_eq!(limit.queued(), 1);

    limit.close();
    let answer = support::within("the woken waiter", waiter).await.unwrap();
    assert_eq!(answer, Err(Rejected::new(Rejection::Unavailable)));
    drop(held);
    assert_eq!(live(&t), (0, 0));
    assert_eq!(rejected(&t, "judge", "unavailable"), 1);
    assert_eq!(abandoned(&t, "judge"), 0);
    assert_eq!(t.count(QUEUE_DURATION_INSTRUMENT, &[]), 0);
}

#[tokio::test(flavor = "current_thread")]
async fn a_closed_limit_is_answered_503_by_an_http_layer_and_unavailable_by_a_grpc_layer() {
    let limit = Limit::new(1);
    limit.close();
    let http = ResourcesOperationLayer::new_for_http(limit.clone())
        .metrics(OperationMetrics::disabled())
        .protocol(Http::new().rejection_status(StatusCode::TOO_MANY_REQUESTS))
        .layer(service_fn(|_: Request<()>| async {
            Ok::<_, Infallible>(Response::new(String::new()))
        }));
    let response = http.oneshot(Request::new(())).await.unwrap();
    assert_eq!(
        response.status(),
        StatusCode::SERVICE_UNAVAILABLE,
        "503 whatever status the other rejections get"
    );

    let grpc = ResourcesOperationLayer::new_for_grpc(limit)
        .metrics(OperationMetrics::disabled())
        .layer(service_fn(|_: Request<()>| async {
            Ok::<_, Infallible>(Response::new(String::new()))
        }));
    let response = grpc.oneshot(Request::new(())).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(response.headers()["grpc-status"], "14", "UNAVAILABLE");
    assert_eq!(response.headers()[CONTENT_TYPE], "application/grpc");
}

// ---------------------------------------------------------------------------------------------
// `Limit::with_max_queued`
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "current_thread")]
async fn a_queue_bound_lets_n_wait_across_every_layer_sharing_it_and_turns_the_next_away_with_queue_full(
) {
    let t = Telemetry::new();
    let limit = Limit::with_max_queued(1, 2);
    let verify = answering(&t, &limit, Operation::Verify);
    let judge = answering(&t, &limit, Operation::Judge);
    let (mut verifier, mut verify_handle) = mock::spawn_layer::<&str, &str, _>(verify);
    let (mut judge, mut judge_handle) = mock::spawn_layer::<&str, &str, _>(judge);

    let _held = take(&limit);
    let mut first = verifier.clone();
    assert_pending!(first.poll_ready());
    assert_pending!(judge.poll_ready());
    assert_eq!(limit.queued(), 2, "one waiter from each layer");

    // One more, from either layer, is turned away at once.
    assert_ready_ok!(verifier.poll_ready());
    let error = verifier.call("one too many").await.unwrap_err();
    assert_eq!(rejection_of(&error), Rejection::QueueFull);
    assert_pending!(verify_handle.poll_request());
    assert_eq!(limit.queued(), 2);

    let mut third = judge.clone();
    assert_ready_ok!(third.poll_ready());
    let error = third.call("one too many").await.unwrap_err();
    assert_eq!(rejection_of(&error), Rejection::QueueFull);
    assert_pending!(judge_handle.poll_request());

    assert_eq!(rejected(&t, "verify", "queue_full"), 1);
    assert_eq!(rejected(&t, "judge", "queue_full"), 1);
    assert_eq!(rejected(&t, "verify", "queue_timeout"), 0);
}

#[tokio::test(flavor = "current_thread")]
async fn a_queue_bound_of_zero_turns_away_every_operation_that_finds_no_free_place() {
    let limit = Limit::with_max_queued(1, 0);
    let (mut service, mut handle) =
        mock::spawn_layer::<&str, &str, _>(quiet(&limit).protocol(RejectAsError));

    assert_ready_ok!(service.poll_ready());
    let admitted = service.call("admitted");

    let mut second = service.clone();
    assert_ready_ok!(second.poll_ready());
    let error = second.call("turned away").await.unwrap_err();
    assert_eq!(rejection_of(&error), Rejection::QueueFull);
    assert_eq!(limit.queued(), 0, "no one ever waits");

    let (request, send) = handle.next_request().await.unwrap();
    assert_eq!(request, "admitted");
    send.send_response("done");
    admitted.await.unwrap();

    assert_ready_ok!(second.poll_ready());
    let again = second.call("a free place again");
    handle.next_request().await.unwrap().1.send_response("ok");
    assert_eq!(again.await.unwrap(), "ok");
}

#[tokio::test(flavor = "current_thread")]
async fn the_queue_bound_counts_waiters_of_the_scoped_api_too() {
    let t = Telemetry::new();
    let limit = Limit::with_max_queued(1, 1);
    let held = take(&limit);

    // A scoped waiter fills the queue: the layer's operation is turned away.
    let mut scoped = task::spawn(t.metrics.resources_operation(
        &limit,
        Operation::Tool,
        Executor::Inline,
        async { Ok::<_, Infallible>("scoped") },
    ));
    assert_pending!(scoped.poll());
    let layer = answering(&t, &limit, Operation::Verify);
    let (mut service, mut handle) = mock::spawn_layer::<&str, &str, _>(layer);
    assert_ready_ok!(service.poll_ready());
    let error = service.call("turned away").await.unwrap_err();
    assert_eq!(rejection_of(&error), Rejection::QueueFull);
    assert_pending!(handle.poll_request());

    // The scoped waiter gets the place; then a layer waiter fills the queue, and a scoped
    // operation is turned away.
    drop(held);
    let output = assert_ready!(scoped.poll()).unwrap();
    assert_eq!(output, Ok("scoped"));
    let _held = take(&limit);
    assert_pending!(service.poll_ready());
    let turned_away = t
        .metrics
        .resources_operation(&limit, Operation::Tool, Executor::Inline, async {})
        .await;
    assert_eq!(turned_away.unwrap_err().rejection(), Rejection::QueueFull);

    assert_eq!(rejected(&t, "verify", "queue_full"), 1);
    assert_eq!(rejected(&t, "tool", "queue_full"), 1);
}

// ---------------------------------------------------------------------------------------------
// Queue timeout (paused time)
// ---------------------------------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn an_operation_that_waited_its_queue_timeout_is_turned_away_with_queue_timeout() {
    let t = Telemetry::new();
    let limit = Limit::new(1);
    let layer = answering(&t, &limit, Operation::Verify).queue_timeout(Duration::from_millis(100));
    let (mut service, mut handle) = mock::spawn_layer::<&str, &str, _>(layer);
    let held = take(&limit);

    assert_pending!(service.poll_ready());
    tokio::time::advance(Duration::from_millis(99)).await;
    assert_pending!(service.poll_ready());
    assert_eq!(live(&t), (1, 0));

    tokio::time::advance(Duration::from_millis(1)).await;
    assert!(service.is_woken(), "the queue timeout wakes the waiter");
    assert_ready_ok!(service.poll_ready());
    assert_eq!(limit.queued(), 0, "a turned-away operation left the queue");
    let error = service.call("waited too long").await.unwrap_err();
    assert_eq!(rejection_of(&error), Rejection::QueueTimeout);
    assert_pending!(handle.poll_request());

    assert_eq!(rejected(&t, "verify", "queue_timeout"), 1);
    assert_eq!(rejected(&t, "verify", "queue_full"), 0);
    assert_eq!(abandoned(&t, "verify"), 0);
    assert_eq!(live(&t), (0, 0));
    assert_eq!(t.count(QUEUE_DURATION_INSTRUMENT, &[]), 0);
    drop(held);
    assert_eq!(limit.available(), 1);
}

#[tokio::test(start_paused = true)]
async fn an_operation_that_got_its_permit_before_its_queue_timeout_is_not_turned_away() {
    let t = Telemetry::new();
    let limit = Limit::new(1);
    let layer = answering(&t, &limit, Operation::Other).queue_timeout(Duration::from_millis(100));
    let (mut service, mut handle) = mock::spawn_layer::<&str, &str, _>(layer);
    let held = take(&limit);

    assert_pending!(service.poll_ready());
    tokio::time::advance(Duration::from_millis(60)).await;
    drop(held);
    assert!(service.is_woken());
    assert_ready_ok!(service.poll_ready());

    // Running well past the queue timeout is fine: the timeout bounds the wait only.
    let response = service.call("admitted");
    tokio::time::advance(Duration::from_millis(500)).await;
    handle.next_request().await.unwrap().1.send_response("done");
    assert_eq!(response.await.unwrap(), "done");

    assert_eq!(t.live_value(REJECTED_INSTRUMENT, &[]), 0);
    assert_eq!(t.count(QUEUE_DURATION_INSTRUMENT, &[]), 1);
    assert_eq!(t.sum(QUEUE_DURATION_INSTRUMENT, &[]), 60.0);
    assert_eq!(t.outcomes(&[]), BTreeMap::from([("ok".to_owned(), 1)]));
}

#[tokio::test(start_paused = true)]
async fn each_layer_sharing_a_limit_has_its_own_queue_timeout() {
    let t = Telemetry::new();
    let limit = Limit::new(1);
    let impatient =
        answering(&t, &limit, Operation::Verify).queue_timeout(Duration::from_millis(100));
    let patient = answering(&t, &limit, Operation::Judge).queue_timeout(Duration::from_millis(300));
    let unbounded = quiet(&limit);
    let (mut impatient, _h1) = mock::spawn_layer::<&str, &str, _>(impatient);
    let (mut patient, _h2) = mock::spawn_layer::<&str, &str, _>(patient);
    let (mut forever, _h3) = mock::spawn_layer::<&str, &str, _>(unbounded);
    let _held = take(&limit);

    assert_pending!(impatient.poll_ready());
    assert_pending!(patient.poll_ready());
    assert_pending!(forever.poll_ready());

    tokio::time::advance(Duration::from_millis(100)).await;
    assert_ready_ok!(impatient.poll_ready());
    assert_pending!(patient.poll_ready());
    let error = impatient.call("100 ms").await.unwrap_err();
    assert_eq!(rejection_of(&error), Rejection::QueueTimeout);

    tokio::time::advance(Duration::from_millis(200)).await;
    assert_ready_ok!(patient.poll_ready());
    let error = patient.call("300 ms").await.unwrap_err();
    assert_eq!(rejection_of(&error), Rejection::QueueTimeout);

    tokio::time::advance(Duration::from_secs(3600)).await;
    assert_pending!(
        forever.poll_ready(),
        "a layer without a queue timeout waits as long as it takes"
    );
    assert_eq!(rejected(&t, "verify", "queue_timeout"), 1);
    assert_eq!(rejected(&t, "judge", "queue_timeout"), 1);
}

// ---------------------------------------------------------------------------------------------
// Tower semantics and answers
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "current_thread")]
async fn a_rejection_makes_poll_ready_ready_and_call_answers_it_without_calling_the_inner_service()
{
    let limit = Limit::with_max_queued(1, 0);
    let (mut service, mut handle) =
        mock::spawn_layer::<&str, &str, _>(quiet(&limit).protocol(RejectAsError));
    let held = take(&limit);

    // Ready, even though no place is free: the operation is already decided.
    assert_ready_ok!(service.poll_ready());
    assert_ready_ok!(
        service.poll_ready(),
        "polled again, it stays ready for the same answer"
    );
    let answer = service.call("turned away");
    assert_pending!(
        handle.poll_request(),
        "the inner service never saw the request"
    );
    assert_eq!(
        rejection_of(&answer.await.unwrap_err()),
        Rejection::QueueFull
    );

    // The answer spent the rejection: the next operation asks the limit anew.
    drop(held);
    assert_ready_ok!(service.poll_ready());
    let admitted = service.call("admitted");
    let (request, send) = handle.next_request().await.unwrap();
    assert_eq!(request, "admitted");
    send.send_response("served");
    assert_eq!(admitted.await.unwrap(), "served");
}

#[tokio::test(flavor = "current_thread")]
async fn a_generic_layer_answers_a_rejection_with_a_box_error_that_downcasts_to_rejected() {
    let limit = Limit::with_max_queued(1, 0);
    let service = quiet(&limit)
        .protocol(RejectAsError)
        .layer(service_fn(|x: u32| async move { Ok::<_, BoxError>(x) }));
    let _held = take(&limit);
    let error: BoxError = service.oneshot(7).await.unwrap_err();
    let rejected = error.downcast_ref::<Rejected>().expect("a Rejected");
    assert_eq!(rejected.rejection(), Rejection::QueueFull);
    assert_eq!(*rejected, Rejected::new(Rejection::QueueFull));
}

/// An application's own error, which a generic layer answering with `RejectAsError` makes from
/// `Rejected`.
#[derive(Debug, PartialEq)]
enum AppError {
    Busy(Rejection),
    Broken,
}

impl From<Rejected> for AppError {
    fn from(rejected: Rejected) -> Self {
        AppError::Busy(rejected.rejection())
    }
}

#[tokio::test(start_paused = true)]
async fn a_generic_layer_answers_with_an_error_type_of_your_own_made_from_rejected() {
    let limit = Limit::new(1);
    let service = quiet(&limit)
        .protocol(RejectAsError)
        .queue_timeout(Duration::from_millis(20))
        .layer(service_fn(|fail: bool| async move {
            if fail {
                Err(AppError::Broken)
            } else {
                Ok("fine")
            }
        }));
    assert_eq!(service.clone().oneshot(false).await, Ok("fine"));
    assert_eq!(
        service.clone().oneshot(true).await,
        Err(AppError::Broken),
        "the service's own errors pass through"
    );

    let _held = take(&limit);
    assert_eq!(
        service.oneshot(false).await,
        Err(AppError::Busy(Rejection::QueueTimeout))
    );
}

#[tokio::test(flavor = "current_thread")]
async fn an_http_layer_answers_a_rejection_with_503_and_no_retry_after() {
    let t = Telemetry::new();
    let layer = ResourcesOperationLayer::new_for_http(Limit::with_max_queued(1, 0))
        .operation(Operation::Tool)
        .metrics(t.metrics.clone());
    let limit = layer.limit().clone();
    let (mut service, mut handle) = mock::spawn_layer::<Request<()>, Response<String>, _>(layer);
    let _held = take(&limit);

    assert_ready_ok!(service.poll_ready());
    let response = service.call(Request::new(())).await.unwrap();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(response.headers().get(RETRY_AFTER).is_none());
    assert!(response.body().is_empty());
    assert_pending!(handle.poll_request());
    assert_eq!(rejected(&t, "tool", "queue_full"), 1);
    assert_eq!(
        t.count(DURATION_INSTRUMENT, &[]),
        0,
        "a 503 answered for a rejection is no operation's outcome"
    );
}

#[tokio::test(flavor = "current_thread")]
async fn an_http_protocol_with_a_rejection_status_answers_429_with_retry_after_rounded_up_to_whole_seconds(
) {
    let limit = Limit::with_max_queued(1, 0);
    let layer = ResourcesOperationLayer::new_for_http(limit.clone())
        .metrics(OperationMetrics::disabled())
        .protocol(
            Http::new()
                .rejection_status(StatusCode::TOO_MANY_REQUESTS)
                .retry_after(Duration::from_millis(1500)),
        );
    let (mut service, mut handle) = mock::spawn_layer::<Request<()>, Response<String>, _>(layer);
    let _held = take(&limit);

    assert_ready_ok!(service.poll_ready());
    let response = service.call(Request::new(())).await.unwrap();
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(response.headers()[RETRY_AFTER], "2");
    assert_pending!(handle.poll_request());
}

#[tokio::test(flavor = "current_thread")]
async fn a_grpc_layer_answers_a_rejection_with_grpc_status_resource_exhausted_in_an_http_200() {
    let layer = ResourcesOperationLayer::new_for_grpc(Limit::with_max_queued(1, 0))
        .metrics(OperationMetrics::disabled());
    let limit = layer.limit().clone();
    let (mut service, mut handle) = mock::spawn_layer::<Request<()>, Response<String>, _>(layer);
    let _held = take(&limit);

    assert_ready_ok!(service.poll_ready());
    let response = service.call(Request::new(())).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(response.headers()["grpc-status"], "8", "RESOURCE_EXHAUSTED");
    assert_eq!(response.headers()[CONTENT_TYPE], "application/grpc");
    assert!(response.headers().contains_key("grpc-message"));
    assert_pending!(handle.poll_request());
}

#[tokio::test(flavor = "current_thread")]
async fn an_axum_route_with_an_http_layer_keeps_its_infallible_error_and_answers_503() {
    use axum::body::Body;
    use axum::routing::get;
    use axum::Router;

    let t = Telemetry::new();
    let limit = Limit::with_max_queued(1, 0);
    let layer = ResourcesOperationLayer::new_for_http(limit.clone())
        .operation(Operation::Judge)
        .metrics(t.metrics.clone());

    // The layered service's error is still `Infallible`, which `Router::route` requires.
    fn infallible<S: Service<Request<Body>, Error = Infallible>>(_: &S) {}
    infallible(&layer.layer(service_fn(|_: Request<Body>| async {
        Ok::<_, Infallible>(Response::new(Body::empty()))
    })));

    let app = Router::new().route("/judge", get(|| async { "graded" }).layer(layer));
    let get_judge = || Request::get("/judge").body(Body::empty()).unwrap();

    let response = app.clone().oneshot(get_judge()).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);

    let held = take(&limit);
    let response: Response<Body> = app.clone().oneshot(get_judge()).await.unwrap();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    drop(held);

    let response = app.oneshot(get_judge()).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(rejected(&t, "judge", "queue_full"), 1);
    assert_eq!(
        t.outcomes(&[(OPERATION_ATTRIBUTE, "judge")]),
        BTreeMap::from([("ok".to_owned(), 2)])
    );
}

#[cfg(feature = "tonic")]
mod grpc_over_the_wire {
    //! A real tonic server and client on 127.0.0.1: the client reads a gRPC layer's answer to a
    //! rejection as a RESOURCE_EXHAUSTED status.

    use super::*;

    use tonic::Code;

    use support::grpc::{check, grpc_layer, serve};

    #[tokio::test]
    async fn a_tonic_client_reads_a_grpc_layers_rejection_as_resource_exhausted() {
        let t = Telemetry::new();
        let limit = Limit::with_max_queued(1, 0);
        let layer = grpc_layer(&t, &limit).operation(Operation::Verify);
        let channel = serve(layer).await.channel;

        check(&channel, "ok").await.expect("a free place: served");
        let held = take(&limit);
        let status = check(&channel, "ok").await.unwrap_err();
        assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
        assert!(status.message().contains("queue is full"), "{status:?}");
        drop(held);
        check(&channel, "ok").await.expect("served again");

        assert_eq!(rejected(&t, "verify", "queue_full"), 1);
        assert_eq!(t.count(QUEUE_DURATION_INSTRUMENT, &[]), 2);
    }
}

/// Health checks go unlimited; everything else is a verification.
fn choose(request: &Request<()>) -> Choice {
    if request.uri().path() == "/health" {
        Choice::Unlimited
    } else {
        Choice::limited(Operation::Verify, Executor::Subprocess)
    }
}

#[tokio::test(flavor = "current_thread")]
async fn a_per_request_layer_answers_a_rejection_from_its_response_future() {
    let t = Telemetry::new();
    let limit = Limit::with_max_queued(1, 0);
    let inner = service_fn(|_: Request<()>| async {
        Ok::<_, Infallible>(Response::new(String::from("served")))
    });
    let service = ResourcesOperationLayer::new_for_http(limit.clone())
        .metrics(t.metrics.clone())
        .per_request(ChooseFn::new(choose))
        .layer(inner);
    let get = |path: &str| Request::get(path).body(()).unwrap();

    let held = take(&limit);
    let response = service.clone().oneshot(get("/verify")).await.unwrap();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(response.body().is_empty());
    let response = service.clone().oneshot(get("/health")).await.unwrap();
    assert_eq!(
        (response.status(), response.body().as_str()),
        (StatusCode::OK, "served"),
        "an unlimited request is never turned away"
    );
    drop(held);
    let response = service.oneshot(get("/verify")).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);

    assert_eq!(rejected(&t, "verify", "queue_full"), 1);
    assert_eq!(t.count(QUEUE_DURATION_INSTRUMENT, &[]), 1);
}

#[test]
fn a_per_request_layer_that_cannot_answer_refuses_a_limit_with_a_bound_and_an_http_one_takes_it() {
    let limit = Limit::with_max_queued(1, 0);
    let inner =
        || service_fn(|_: Request<()>| async { Ok::<_, Infallible>(Response::new(String::new())) });
    let plain = ResourcesOperationLayer::new(limit.clone())
        .metrics(OperationMetrics::disabled())
        .per_request(ChooseFn::new(choose));
    let message = refusal(&plain, inner());
    assert!(message.contains("cannot answer a rejection"), "{message}");

    // An HTTP layer answers rejections from the start.
    let _ = ResourcesOperationLayer::new_for_http(limit)
        .metrics(OperationMetrics::disabled())
        .per_request(ChooseFn::new(choose))
        .layer(inner());
}

#[tokio::test(flavor = "current_thread")]
async fn a_layer_that_holds_operations_until_the_body_ends_answers_a_rejection_with_an_empty_body()
{
    use bytes::Bytes;
    use http_body_util::{BodyExt as _, Full};

    let t = Telemetry::new();
    let limit = Limit::with_max_queued(1, 0);
    let service = ResourcesOperationLayer::new_for_http(limit.clone())
        .operation(Operation::Tool)
        .metrics(t.metrics.clone())
        .until_body_end()
        .layer(service_fn(|_: Request<()>| async {
            Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"streamed"))))
        }));

    let held = take(&limit);
    let response = service.clone().oneshot(Request::new(())).await.unwrap();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert!(body.is_empty());
    assert_eq!(t.count(DURATION_INSTRUMENT, &[]), 0);
    drop(held);

    let response = service.oneshot(Request::new(())).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(
        limit.available(),
        0,
        "the operation lasts while its body streams"
    );
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(&body[..], b"streamed");
    assert_eq!(limit.available(), 1);
    assert_eq!(rejected(&t, "tool", "queue_full"), 1);
    assert_eq!(
        t.outcomes(&[(OPERATION_ATTRIBUTE, "tool")]),
        BTreeMap::from([("ok".to_owned(), 1)])
    );
}

/// The bound is fixed when the limit is made, so a layer knows, when it makes its service,
/// whether its limit may turn an operation away: one that cannot answer a rejection refuses such
/// a limit then (rather than fail a caller later), and takes a limit made without a bound, which
/// never turns anyone away.
#[tokio::test(start_paused = true)]
async fn a_layer_that_cannot_answer_refuses_a_limit_made_with_a_bound_and_one_made_without_never_turns_away(
) {
    let inner = || service_fn(|x: u32| async move { Ok::<_, BoxError>(x) });
    let limit = Limit::with_max_queued(1, 4);
    assert!(limit.may_reject());
    let message = refusal(&quiet(&limit), inner());
    assert!(message.contains("cannot answer a rejection"), "{message}");
    assert!(
        message.contains(std::any::type_name::<Limit>()),
        "{message}"
    );
    // A queue timeout may turn operations away too, whatever the limit: a layer that cannot
    // answer refuses it where it is set (the `should_panic` example of `queue_timeout`); no
    // protocol (`()`), given after it, is refused where its service is first asked.
    let timed = quiet(&Limit::new(1))
        .protocol(RejectAsError)
        .queue_timeout(Duration::from_secs(1));
    let (mut service, _) = mock::spawn_layer::<(), (), _>(timed.protocol(()));
    let refused = catch_unwind(AssertUnwindSafe(|| service.poll_ready()));
    let message = panic_message(&*refused.expect_err("no protocol is refused"));
    assert!(message.contains("cannot answer a rejection"), "{message}");

    // Each way of answering takes the limit.
    let _ = quiet(&limit).protocol(RejectAsError).layer(inner());
    let _ = quiet(&limit)
        .protocol(RejectAsError)
        .queue_timeout(Duration::from_secs(1))
        .layer(inner());
    let _ = quiet(&limit)
        .protocol(|rejected: Rejected| Err::<u32, BoxError>(rejected.into()))
        .layer(inner());

    // A limit made without a bound: a layer that cannot answer takes it, and its callers wait
    // as long as it takes, however many they are.
    let unbounded = Limit::new(1);
    assert!(!unbounded.may_reject());
    let _held = take(&unbounded);
    let mut waiters: Vec<_> = (0..50)
        .map(|_| mock::spawn_layer::<(), (), _>(quiet(&unbounded)))
        .collect();
    for (waiter, _) in &mut waiters {
        assert_pending!(waiter.poll_ready());
    }
    tokio::time::advance(Duration::from_secs(3600)).await;
    for (waiter, _) in &mut waiters {
        assert_pending!(waiter.poll_ready(), "never turned away");
    }
    assert_eq!(unbounded.queued(), 50);
}

// ---------------------------------------------------------------------------------------------
// The scoped API
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "current_thread")]
async fn resources_operation_returns_queue_full_and_does_not_run_the_work_when_the_bound_is_reached(
) {
    let t = Telemetry::new();
    let limit = Limit::with_max_queued(1, 0);
    let held = take(&limit);
    let ran = AtomicBool::new(false);
    let result = t
        .metrics
        .resources_operation(&limit, Operation::Tool, Executor::Thread, async {
            ran.store(true, Ordering::SeqCst);
            Ok::<_, Infallible>(())
        })
        .await;
    assert_eq!(result.unwrap_err(), Rejected::new(Rejection::QueueFull));
    assert!(!ran.load(Ordering::SeqCst), "the work did not run");
    assert_eq!(rejected(&t, "tool", "queue_full"), 1);
    assert_eq!(t.count(QUEUE_DURATION_INSTRUMENT, &[]), 0);
    assert_eq!(t.count(DURATION_INSTRUMENT, &[]), 0);
    drop(held);
    assert_eq!(limit.available(), 1);
}

// ---------------------------------------------------------------------------------------------
// Metrics: rejected and abandoned
// ---------------------------------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn rejections_are_counted_per_series_by_reason() {
    let t = Telemetry::new();
    let limit = Limit::with_max_queued(1, 1);
    let layer = |operation| {
        answering(&t, &limit, operation)
            .executor(Executor::Process)
            .queue_timeout(Duration::from_millis(50))
            .layer(service_fn(|()| async { Ok::<_, BoxError>(()) }))
    };
    let verify = layer(Operation::Verify);
    let judge = layer(Operation::Judge);
    let _held = take(&limit);

    // A verify operation waits and times out while two judge operations find the queue full.
    let waiting = tokio::spawn(verify.clone().oneshot(()));
    settle().await;
    for _ in 0..2 {
        let error = judge.clone().oneshot(()).await.unwrap_err();
        assert_eq!(rejection_of(&error), Rejection::QueueFull);
    }
    let error = waiting.await.unwrap().unwrap_err();
    assert_eq!(rejection_of(&error), Rejection::QueueTimeout);

    assert_eq!(rejected(&t, "verify", "queue_timeout"), 1);
    assert_eq!(rejected(&t, "verify", "queue_full"), 0);
    assert_eq!(rejected(&t, "judge", "queue_full"), 2);
    assert_eq!(rejected(&t, "judge", "queue_timeout"), 0);
    assert_eq!(rejected(&t, "verify", "unavailable"), 0);
    assert_eq!(rejected(&t, "judge", "unavailable"), 0);
    let points = t.live(REJECTED_INSTRUMENT);
    assert!(
        points.iter().all(|p| p.attributes[REJECTION_ATTRIBUTE]
            .parse::<Rejection>()
            .is_ok()),
        "{points:?}"
    );
    assert_eq!(abandoned(&t, "verify") + abandoned(&t, "judge"), 0);
}

#[tokio::test(flavor = "current_thread")]
async fn a_service_dropped_while_its_poll_ready_waited_counts_as_abandoned() {
    let t = Telemetry::new();
    let limit = Limit::new(1);
    let layer = ResourcesOperationLayer::new(limit.clone())
        .operation(Operation::Verify)
        .metrics(t.metrics.clone());
    let (mut waiter, _handle) = mock::spawn_layer::<(), (), _>(layer);
    let held = take(&limit);
    assert_pending!(waiter.poll_ready());
    assert_pending!(waiter.poll_ready());
    assert_eq!(live(&t), (1, 0), "polled twice, counted once");

    drop(waiter);
    assert_eq!(live(&t), (0, 0));
    assert_eq!(abandoned(&t, "verify"), 1);
    assert_eq!(t.count(QUEUE_DURATION_INSTRUMENT, &[]), 0);
    assert_eq!(t.count(DURATION_INSTRUMENT, &[]), 0);
    assert_eq!(limit.queued(), 0);
    drop(held);
    assert_eq!(limit.available(), 1);
}

#[tokio::test(flavor = "current_thread")]
async fn a_scoped_future_dropped_while_it_waited_counts_as_abandoned() {
    let t = Telemetry::new();
    let limit = Limit::new(1);
    let held = take(&limit);
    let mut scoped = task::spawn(t.metrics.resources_operation(
        &limit,
        Operation::Judge,
        Executor::Inline,
        async {},
    ));
    assert_pending!(scoped.poll());
    assert_eq!(live(&t), (1, 0));
    drop(scoped);
    assert_eq!(live(&t), (0, 0));
    assert_eq!(abandoned(&t, "judge"), 1);
    assert_eq!(t.count(QUEUE_DURATION_INSTRUMENT, &[]), 0);
    assert_eq!(limit.queued(), 0);
    drop(held);
    assert_eq!(limit.available(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_tokio_timeout_around_a_waiting_oneshot_counts_as_abandoned_and_after_admission_as_cancelled(
) {
    let t = Telemetry::new();
    let limit = Limit::new(1);
    let service = ResourcesOperationLayer::new(limit.clone())
        .operation(Operation::Tool)
        .metrics(t.metrics.clone())
        .layer(service_fn(|ms: u64| async move {
            tokio::time::sleep(Duration::from_millis(ms)).await;
            Ok::<_, BoxError>(ms)
        }));

    let held = take(&limit);
    let gave_up = tokio::time::timeout(Duration::from_millis(50), service.clone().oneshot(0)).await;
    assert!(gave_up.is_err(), "no place was free");
    assert_eq!(abandoned(&t, "tool"), 1);
    assert_eq!(live(&t), (0, 0));
    drop(held);

    // A caller that gives up once its operation runs cancels it: that is an outcome, not an
    // abandoned wait.
    let gave_up =
        tokio::time::timeout(Duration::from_millis(50), service.clone().oneshot(1_000)).await;
    assert!(gave_up.is_err());
    assert_eq!(abandoned(&t, "tool"), 1);
    assert_eq!(
        t.outcomes(&[(OPERATION_ATTRIBUTE, "tool")]),
        BTreeMap::from([("cancelled".to_owned(), 1)])
    );
    assert_eq!(t.count(QUEUE_DURATION_INSTRUMENT, &[]), 1);
    assert_eq!((limit.available(), limit.queued()), (1, 0));
}

#[tokio::test(flavor = "current_thread")]
async fn a_rejection_costs_no_queue_or_duration_sample_and_leaves_queued_unchanged() {
    let t = Telemetry::new();
    let limit = Limit::with_max_queued(1, 1);
    let layer = answering(&t, &limit, Operation::Verify);
    let (mut service, mut handle) = mock::spawn_layer::<&str, &str, _>(layer);

    assert_ready_ok!(service.poll_ready());
    let running = service.call("running");
    let mut waiter = service.clone();
    assert_pending!(waiter.poll_ready());

    let before = (
        t.count(QUEUE_DURATION_INSTRUMENT, &[]),
        t.count(DURATION_INSTRUMENT, &[]),
        live(&t),
        limit.queued(),
    );
    assert_eq!(before, (1, 0, (1, 1), 1));

    let mut turned_away = service.clone();
    assert_ready_ok!(turned_away.poll_ready());
    let error = turned_away.call("turned away").await.unwrap_err();
    assert_eq!(rejection_of(&error), Rejection::QueueFull);
    let scoped = t
        .metrics
        .resources_operation(&limit, Operation::Verify, Executor::Other, async {})
        .await;
    assert_eq!(scoped.unwrap_err().rejection(), Rejection::QueueFull);

    let after = (
        t.count(QUEUE_DURATION_INSTRUMENT, &[]),
        t.count(DURATION_INSTRUMENT, &[]),
        live(&t),
        limit.queued(),
    );
    assert_eq!(
        after, before,
        "the two rejections left no trace but their count"
    );
    assert_eq!(rejected(&t, "verify", "queue_full"), 2);

    handle.next_request().await.unwrap().1.send_response("done");
    running.await.unwrap();
    assert_ready_ok!(waiter.poll_ready());
}

// ---------------------------------------------------------------------------------------------
// The books
// ---------------------------------------------------------------------------------------------

/// What one caller saw of its operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Seen {
    Ok,
    Error,
    Cancelled,
    QueueFull,
    QueueTimeout,
    Abandoned,
}

/// One job: how long it runs, whether it fails, and whether its caller was admitted.
#[derive(Clone)]
struct Job {
    run: Duration,
    fail: bool,
    started: Arc<AtomicBool>,
}

async fn run_job(job: Job) -> Result<(), BoxError> {
    tokio::time::sleep(job.run).await;
    if job.fail {
        Err("the job failed".into())
    } else {
        Ok(())
    }
}

#[tokio::test(start_paused = true)]
async fn every_operation_that_asked_is_exactly_one_of_admitted_rejected_or_abandoned() {
    const OPERATIONS: usize = 50;
    let t = Telemetry::new();
    let limit = Limit::with_max_queued(2, 5);
    let worker = service_fn(|job: Job| {
        job.started.store(true, Ordering::SeqCst);
        run_job(job)
    });
    let verify = answering(&t, &limit, Operation::Verify)
        .queue_timeout(Duration::from_millis(20))
        .layer(worker);
    let judge = answering(&t, &limit, Operation::Judge).layer(worker);

    let mut callers = Vec::new();
    for i in 0..OPERATIONS {
        let series = ["verify", "judge", "tool"][i % 3];
        let job = Job {
            run: Duration::from_millis(5 + (i as u64 * 7) % 16),
            fail: i % 5 == 4,
            started: Arc::new(AtomicBool::new(false)),
        };
        let patience = (i % 4 == 1).then_some(Duration::from_millis(15));
        let (verify, judge, limit, metrics) = (
            verify.clone(),
            judge.clone(),
            limit.clone(),
            t.metrics.clone(),
        );
        callers.push(tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(3 * i as u64)).await;
            let started = Arc::clone(&job.started);
            let operation = async move {
                let result = match series {
                    "verify" => verify.oneshot(job).await,
                    "judge" => judge.oneshot(job).await,
                    _ => metrics
                        .resources_operation(limit, Operation::Tool, Executor::Inline, async {
                            job.started.store(true, Ordering::SeqCst);
                            run_job(job).await
                        })
                        .await
                        .map_err(BoxError::from)
                        .and_then(|output| output),
                };
                match result {
                    Ok(()) => Seen::Ok,
                    Err(error) => match error.downcast_ref::<Rejected>() {
                        Some(r) if r.rejection() == Rejection::QueueFull => Seen::QueueFull,
                        Some(_) => Seen::QueueTimeout,
                        None => Seen::Error,
                    },
                }
            };
            let seen = match patience {
                None => operation.await,
                Some(patience) => match tokio::time::timeout(patience, operation).await {
                    Ok(seen) => seen,
                    Err(_) if started.load(Ordering::SeqCst) => Seen::Cancelled,
                    Err(_) => Seen::Abandoned,
                },
            };
            (series, seen)
        }));
    }

    let mut books: BTreeMap<(&str, Seen), i64> = BTreeMap::new();
    for caller in callers {
        *books.entry(caller.await.unwrap()).or_default() += 1;
    }
    println!("books: {books:?}");
    let seen = |series: &str, what: Seen| books.get(&(series, what)).copied().unwrap_or(0);
    for what in [
        Seen::Ok,
        Seen::Error,
        Seen::Cancelled,
        Seen::QueueFull,
        Seen::QueueTimeout,
        Seen::Abandoned,
    ] {
        assert!(
            ["verify", "judge", "tool"]
                .iter()
                .any(|series| seen(series, what) > 0),
            "the scenario never produced {what:?}: {books:?}"
        );
    }

    let mut asked_in_all = 0;
    for series in ["verify", "judge", "tool"] {
        let filter = [(OPERATION_ATTRIBUTE, series)];
        let asked = (0..OPERATIONS).filter(|i| ["verify", "judge", "tool"][i % 3] == series);
        let asked = asked.count() as i64;
        asked_in_all += asked;

        let admitted = i64::try_from(t.count(QUEUE_DURATION_INSTRUMENT, &filter)).unwrap();
        let ended = i64::try_from(t.count(DURATION_INSTRUMENT, &filter)).unwrap();
        let full = rejected(&t, series, "queue_full");
        let timed_out = rejected(&t, series, "queue_timeout");
        let gone = abandoned(&t, series);

        assert_eq!(
            admitted + full + timed_out + gone,
            asked,
            "{series}: admitted {admitted} + rejected {full}+{timed_out} + abandoned {gone}"
        );
        assert_eq!(
            ended, admitted,
            "{series}: one duration per admitted operation"
        );
        assert_eq!(
            admitted,
            seen(series, Seen::Ok) + seen(series, Seen::Error) + seen(series, Seen::Cancelled),
            "{series}: admitted as its callers saw"
        );
        assert_eq!(full, seen(series, Seen::QueueFull), "{series}: queue_full");
        assert_eq!(
            timed_out,
            seen(series, Seen::QueueTimeout),
            "{series}: queue_timeout"
        );
        assert_eq!(gone, seen(series, Seen::Abandoned), "{series}: abandoned");

        let outcomes = t.outcomes(&filter);
        for (outcome, what) in [
            ("ok", Seen::Ok),
            ("error", Seen::Error),
            ("cancelled", Seen::Cancelled),
        ] {
            assert_eq!(
                outcomes.get(outcome).copied().unwrap_or(0) as i64,
                seen(series, what),
                "{series}: {outcome}, {outcomes:?}"
            );
        }
    }
    assert_eq!(asked_in_all, OPERATIONS as i64);
    assert_eq!(
        seen("judge", Seen::QueueTimeout) + seen("tool", Seen::QueueTimeout),
        0,
        "only verify has a queue timeout"
    );

    assert_eq!(live(&t), (0, 0), "live counts back to 0");
    assert_eq!(
        (limit.available(), limit.queued()),
        (2, 0),
        "every place is back"
    );
}
