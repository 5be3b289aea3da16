#![cfg(feature = "tonic")]
//! The layer on real tonic servers and clients over 127.0.0.1: per service (through
//! `add_service`, which needs the `NamedService` the `tonic` feature forwards) and on the whole
//! server (`Server::builder().layer(...)`). Outcomes come from the `grpc-status` of tonic's
//! trailers-only error responses; the limit holds across connections; live counts go back to 0.
//!
//! The gRPC service is the tests' `Backend` (in `support::grpc`): the requested service name
//! picks what its handler does.

mod support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Barrier;
use tokio::task::JoinHandle;
use tonic::server::NamedService;
use tonic::transport::{Channel, Server};
use tonic::{Code, Status};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::health_server::HealthServer;
use tower::ServiceExt as _;

use support::grpc::{
    asking, check, check_past_a_client_deadline, connect, grpc_layer, serve, serve_timing_out,
    serve_with, Backend, GrpcLayer, Served,
};
use support::{assert_idle, eventually, within, Telemetry, DEADLINE};
use tower_resources_operation::names::{
    ACTIVE_INSTRUMENT, DURATION_INSTRUMENT, EXECUTOR_ATTRIBUTE, OPERATION_ATTRIBUTE,
    QUEUED_INSTRUMENT, QUEUE_DURATION_INSTRUMENT,
};
use tower_resources_operation::{Executor, Limit, Operation};

/// One `Check` of `service` per entry, each on its own connection, all connected first and then
/// sent at once; returns each result, in order.
async fn check_all(addr: SocketAddr, services: &[&'static str]) -> Vec<Result<i32, Code>> {
    let barrier = Arc::new(Barrier::new(services.len()));
    let mut clients = Vec::new();
    for &service in services {
        let channel = connect(addr).await;
        let barrier = Arc::clone(&barrier);
        clients.push(tokio::spawn(async move {
            barrier.wait().await;
            check(&channel, service).await.map_err(|s| s.code())
        }));
    }
    let mut results = Vec::with_capacity(clients.len());
    for client in clients {
        let result = within("a client", client).await;
        results.push(result.expect("client task failed"));
    }
    results
}

/// Calls a method of a service the server does not have, with a bare HTTP/2 request; returns the
/// `grpc-status` header of the answer (tonic's fallback answers UNIMPLEMENTED, 12, trailers-only).
async fn call_unknown_service(channel: &Channel) -> Option<String> {
    let request = http::Request::post("/nowhere.Service/Method")
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(tonic::body::Body::empty())
        .unwrap();
    let response = channel.clone().oneshot(request).await.unwrap();
    response
        .headers()
        .get("grpc-status")
        .map(|v| v.to_str().unwrap().to_owned())
}

/// Starts a `Check` of `service` on a task of its own.
fn spawn_check(channel: &Channel, service: &'static str) -> JoinHandle<Result<i32, Status>> {
    let channel = channel.clone();
    tokio::spawn(async move { check(&channel, service).await })
}

/// The series of [`verify_subprocess`].
const VERIFY_SUBPROCESS: [(&str, &str); 2] = [
    (OPERATION_ATTRIBUTE, "verify"),
    (EXECUTOR_ATTRIBUTE, "subprocess"),
];

/// The gRPC layer on `limit`, tagged verify/subprocess.
fn verify_subprocess(telemetry: &Telemetry, limit: &Limit) -> GrpcLayer {
    grpc_layer(telemetry, limit)
        .operation(Operation::Verify)
        .executor(Executor::Subprocess)
}

/// A backend served per service under [`verify_subprocess`] on a limit of `max`, with the
/// layer's telemetry and limit.
async fn serve_verify_subprocess(max: usize) -> (Telemetry, Limit, Served) {
    let (telemetry, slots) = (Telemetry::new(), Limit::new(max));
    let served = serve(verify_subprocess(&telemetry, &slots)).await;
    (telemetry, slots, served)
}

#[test]
fn the_layered_service_keeps_the_grpc_service_name() {
    type Limited = tower_resources_operation::HttpService<HealthServer<Backend>>;
    assert_eq!(<Limited as NamedService>::NAME, "grpc.health.v1.Health");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn per_service_outcomes_come_from_the_grpc_status() {
    let (telemetry, slots, served) = serve_verify_subprocess(2).await;
    let channel = served.channel;

    assert_eq!(
        check(&channel, "ok").await.unwrap(),
        ServingStatus::Serving as i32
    );
    for (service, code) in [
        ("deadline", Code::DeadlineExceeded),
        ("cancelled", Code::Cancelled),
        ("internal", Code::Internal),
        ("nonexistent", Code::NotFound),
    ] {
        let status = check(&channel, service).await.unwrap_err();
        assert_eq!(status.code(), code, "{service}: {status:?}");
    }

    let series = VERIFY_SUBPROCESS;
    assert_eq!(telemetry.ended(&series, "ok"), 1);
    assert_eq!(telemetry.ended(&series, "timeout"), 1);
    assert_eq!(telemetry.ended(&series, "cancelled"), 1);
    assert_eq!(
        telemetry.ended(&series, "error"),
        2,
        "internal and not found"
    );
    assert_eq!(telemetry.ended(&series, "crashed"), 0);
    assert_eq!(telemetry.count(DURATION_INSTRUMENT, &[]), 5);
    assert_eq!(telemetry.count(QUEUE_DURATION_INSTRUMENT, &series), 5);
    assert_idle(&telemetry, &slots);
}

/// Every call was served, never more than 2 ran at once, and both permits are back.
fn assert_all_served_two_at_a_time<E: std::fmt::Debug>(
    results: &[Result<i32, E>],
    backend: &Backend,
    slots: &Limit,
) {
    for result in results {
        assert!(
            matches!(result, Ok(status) if *status == ServingStatus::Serving as i32),
            "all: {results:?}"
        );
    }
    assert_eq!(backend.load.max(), 2, "handlers that ran at once");
    assert_eq!(slots.available(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn per_service_limit_holds_across_connections() {
    let (telemetry, slots, served) = serve_verify_subprocess(2).await;

    let results = check_all(served.addr, &["slow"; 8]).await;

    assert_all_served_two_at_a_time(&results, &served.backend, &slots);

    let series = VERIFY_SUBPROCESS;
    assert_eq!(telemetry.ended(&series, "ok"), 8);
    assert_eq!(telemetry.count(DURATION_INSTRUMENT, &series), 8);
    let queue = telemetry.points(QUEUE_DURATION_INSTRUMENT, &series);
    let [point] = queue.as_slice() else {
        panic!("one queue series expected: {queue:?}")
    };
    assert_eq!(point.count, 8);
    // Bucket 0 is (-inf, 1 ms]: the two admitted at once are there, the six waiters above it.
    let waited = point.count - point.bucket_counts[0];
    assert!(
        waited >= 6,
        "waiters with a queue time above 1 ms: {point:?}"
    );
    assert_idle(&telemetry, &slots);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn whole_server_layer_limits_and_reports_every_call() {
    let (telemetry, slots) = (Telemetry::new(), Limit::new(2));
    let layer = grpc_layer(&telemetry, &slots)
        .operation(Operation::Judge)
        .executor(Executor::Inline);
    let served = serve_with(|health, incoming| {
        Server::builder()
            .layer(layer)
            .add_service(health)
            .serve_with_incoming(incoming)
    })
    .await;

    let results = check_all(served.addr, &["slow"; 8]).await;
    assert_all_served_two_at_a_time(&results, &served.backend, &slots);

    // Outcomes read the same at this placement: tonic's error answers are trailers-only.
    let channel = served.channel;
    let status = check(&channel, "deadline").await.unwrap_err();
    assert_eq!(status.code(), Code::DeadlineExceeded);
    let status = check(&channel, "internal").await.unwrap_err();
    assert_eq!(status.code(), Code::Internal);

    // The whole-server limit sees every request, a call to no service of this server included:
    // tonic's fallback answers UNIMPLEMENTED, which counts as an error.
    assert_eq!(call_unknown_service(&channel).await.as_deref(), Some("12"));

    let series = [
        (OPERATION_ATTRIBUTE, "judge"),
        (EXECUTOR_ATTRIBUTE, "inline"),
    ];
    assert_eq!(telemetry.ended(&series, "ok"), 8);
    assert_eq!(telemetry.ended(&series, "timeout"), 1);
    assert_eq!(
        telemetry.ended(&series, "error"),
        2,
        "internal and unimplemented"
    );
    assert_eq!(telemetry.count(DURATION_INSTRUMENT, &[]), 11);
    assert_eq!(telemetry.count(QUEUE_DURATION_INSTRUMENT, &series), 11);
    assert_idle(&telemetry, &slots);
}

/// The per-service placement counts only its own service: a call the server routes elsewhere
/// (here tonic's UNIMPLEMENTED fallback) records nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn per_service_limit_ignores_calls_to_other_services() {
    let (telemetry, _, served) = serve_verify_subprocess(2).await;
    let channel = served.channel;

    assert_eq!(call_unknown_service(&channel).await.as_deref(), Some("12"));
    assert_eq!(telemetry.count(DURATION_INSTRUMENT, &[]), 0);
    assert_eq!(telemetry.count(QUEUE_DURATION_INSTRUMENT, &[]), 0);

    check(&channel, "ok").await.unwrap();
    assert_eq!(telemetry.ended(&VERIFY_SUBPROCESS, "ok"), 1);
}

/// Waits until `call`, dropped by its client, ended as `cancelled`, the first of its series to
/// end, and checks that its permit is back and nothing waits or runs.
async fn the_dropped_call_ended_cancelled(telemetry: &Telemetry, slots: &Limit, call: &str) {
    eventually(&format!("{call} ended as cancelled"), || {
        telemetry.ended(&VERIFY_SUBPROCESS, "cancelled") == 1
    })
    .await;
    assert_eq!(telemetry.count(DURATION_INSTRUMENT, &VERIFY_SUBPROCESS), 1);
    assert_eq!(slots.available(), 1);
    assert_idle(telemetry, slots);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn client_that_hangs_up_while_running_is_cancelled_and_frees_its_permit() {
    let (telemetry, slots, served) = serve_verify_subprocess(1).await;
    let channel = served.channel;

    let call = spawn_check(&channel, "hang");
    within("the handler's start", served.backend.hanging.notified()).await;
    assert_eq!(
        telemetry.live_value(ACTIVE_INSTRUMENT, &VERIFY_SUBPROCESS),
        1
    );

    call.abort(); // drops the call: the client resets the HTTP/2 stream
    the_dropped_call_ended_cancelled(&telemetry, &slots, "the reset call").await;

    // The one permit is free again: the next call runs.
    check(&channel, "ok").await.unwrap();
    assert_eq!(telemetry.ended(&VERIFY_SUBPROCESS, "ok"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn client_that_gives_up_while_queued_records_no_sample_and_leaves_the_queue() {
    let (telemetry, slots, served) = serve_verify_subprocess(1).await;
    let series = VERIFY_SUBPROCESS;

    let holder = spawn_check(&served.channel, "hang");
    within("the handler's start", served.backend.hanging.notified()).await;
    let waiter = spawn_check(&connect(served.addr).await, "ok");
    eventually("the second call waits for the permit", || {
        telemetry.live_value(QUEUED_INSTRUMENT, &series) == 1
    })
    .await;

    waiter.abort();
    eventually("the abandoned wait leaves the queue", || {
        telemetry.live_value(QUEUED_INSTRUMENT, &series) == 0
    })
    .await;
    assert_eq!(
        telemetry.count(QUEUE_DURATION_INSTRUMENT, &series),
        1,
        "only the holder"
    );
    assert_eq!(telemetry.live_value(ACTIVE_INSTRUMENT, &series), 1);
    assert_eq!(telemetry.count(DURATION_INSTRUMENT, &series), 0);

    holder.abort();
    the_dropped_call_ended_cancelled(&telemetry, &slots, "the holder").await;
}

/// A deadline tonic enforces (`Server::timeout`, or the client's `grpc-timeout`) wraps the
/// layered service from outside: when it fires, tonic drops the operation (and answers
/// CANCELLED, "Timeout expired"). The gRPC layer reads the request's `grpc-timeout` (and, with
/// `server_timeout`, the server's timeout), so such a drop counts as `timeout`; a layer that
/// reads no deadline sees a plain drop, `cancelled`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn deadlines_enforced_by_tonic_end_the_operation_as_timeout() {
    let (telemetry, slots) = (Telemetry::new(), Limit::new(1));
    let server_timeout = Duration::from_millis(300);
    let channel = serve_timing_out(server_timeout, verify_subprocess(&telemetry, &slots))
        .await
        .channel;
    let series = VERIFY_SUBPROCESS;

    // The server's own timeout.
    let status = tokio::time::timeout(DEADLINE, check(&channel, "hang"))
        .await
        .expect("the server never enforced its timeout")
        .unwrap_err();
    assert_eq!(status.code(), Code::Cancelled, "{status:?}");
    eventually("the first operation ended", || {
        telemetry.count(DURATION_INSTRUMENT, &series) == 1
    })
    .await;

    // The client's deadline, sent as `grpc-timeout`.
    check_past_a_client_deadline(&channel).await;
    eventually("the second operation ended", || {
        telemetry.count(DURATION_INSTRUMENT, &series) == 2
    })
    .await;

    assert_eq!(telemetry.ended(&series, "timeout"), 2);
    assert_eq!(telemetry.ended(&series, "cancelled"), 0);
    assert_idle(&telemetry, &slots);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_layer_that_reads_no_deadline_counts_tonics_deadline_as_cancelled() {
    let (telemetry, slots) = (Telemetry::new(), Limit::new(1));
    // The gRPC classifier, with no protocol (`()`): no `grpc-timeout` is read.
    let channel = serve(verify_subprocess(&telemetry, &slots).protocol(()))
        .await
        .channel;
    let series = VERIFY_SUBPROCESS;

    check_past_a_client_deadline(&channel).await;
    eventually("the operation ended", || {
        telemetry.count(DURATION_INSTRUMENT, &series) == 1
    })
    .await;
    assert_eq!(telemetry.ended(&series, "cancelled"), 1);
    assert_idle(&telemetry, &slots);
}

/// The outcome is decided when the response head is ready. A streaming call's head goes out
/// with its first message, so the operation ends there: the permit is free while the stream is
/// still open, and a status that only the trailers carry is not seen (the call counts as `ok`).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn streaming_call_ends_with_its_head_and_a_status_only_in_trailers_counts_as_ok() {
    let (telemetry, slots, mut served) = serve_verify_subprocess(1).await;
    let channel = served.channel.clone();

    let mut stream = HealthClient::new(channel.clone())
        .watch(asking(""))
        .await
        .unwrap()
        .into_inner();
    let call = served.next_watch().await;
    call.send();
    let first = stream.message().await.unwrap().expect("a first message");
    assert_eq!(first.status, ServingStatus::Serving as i32);

    // The stream is open, yet its operation is over and the one permit is free.
    let series = VERIFY_SUBPROCESS;
    assert_eq!(telemetry.ended(&series, "ok"), 1);
    assert_eq!(slots.available(), 1);
    tokio::time::timeout(DEADLINE, check(&channel, "ok"))
        .await
        .expect("the open stream still holds the permit")
        .unwrap();

    call.fail(Status::internal("the watch broke after its first message"));
    let status = stream.message().await.unwrap_err();
    assert_eq!(status.code(), Code::Internal, "{status:?}");

    // The INTERNAL in the trailers changed nothing: two calls, both `ok`.
    assert_eq!(telemetry.ended(&series, "ok"), 2);
    assert_eq!(telemetry.ended(&series, "error"), 0);
    assert_idle(&telemetry, &slots);
}

/// `new(..)`, put where tower's `ConcurrencyLimitLayer::new` was around a generated server,
/// reads each call's `grpc-status` as `new_for_grpc` does: tonic's HTTP status is 200 whatever
/// the call did.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_generic_layer_reads_each_calls_grpc_status_too() {
    let (telemetry, slots) = (Telemetry::new(), Limit::new(2));
    let layer = tower_resources_operation::ResourcesOperationLayer::new(slots.clone())
        .operation(Operation::Verify)
        .executor(Executor::Subprocess)
        .metrics(telemetry.metrics.clone());
    let channel = serve(layer).await.channel;

    assert_eq!(
        check(&channel, "ok").await.unwrap(),
        ServingStatus::Serving as i32
    );
    for service in ["deadline", "internal"] {
        check(&channel, service).await.unwrap_err();
    }

    let series = VERIFY_SUBPROCESS;
    assert_eq!(telemetry.ended(&series, "ok"), 1);
    assert_eq!(telemetry.ended(&series, "timeout"), 1);
    assert_eq!(telemetry.ended(&series, "error"), 1);
    assert_idle(&telemetry, &slots);
}
