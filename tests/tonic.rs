#![cfg(feature = "tonic")]
//! The layer on real tonic servers and clients over 127.0.0.1: per service (through
//! `add_service`, which needs the `NamedService` the `tonic` feature forwards) and on the whole
//! server (`Server::builder().layer(...)`). Outcomes come from the `grpc-status` of tonic's
//! trailers-only error responses; the limit holds across connections; live counts go back to 0.
//!
//! The gRPC service is tonic-health's generated `HealthServer` around a `Health` of our own, so
//! no `protoc` is needed: the requested service name picks what the handler does.

mod support;

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt as _;
use tokio::sync::{Barrier, Notify};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tonic::codegen::tokio_stream::Stream;
use tonic::server::NamedService;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Channel, Endpoint, Server};
use tonic::{Code, Request, Response, Status};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::health_server::{Health, HealthServer};
use tonic_health::pb::{HealthCheckRequest, HealthCheckResponse};
use tower::{ServiceBuilder, ServiceExt as _};

use support::{Load, Telemetry};
use tower_resources_operation::classify::GrpcClassifier;
use tower_resources_operation::protocol::{Grpc, Plain};
use tower_resources_operation::{
    Executor, Limit, Operation, ResourcesOperation, ResourcesOperationLayer, ACTIVE_INSTRUMENT,
    DURATION_INSTRUMENT, EXECUTOR_ATTRIBUTE, OPERATION_ATTRIBUTE, OUTCOME_ATTRIBUTE,
    QUEUED_INSTRUMENT, QUEUE_DURATION_INSTRUMENT,
};

/// The gRPC layer of these tests: a [`Limit`], the gRPC classifier and protocol.
type GrpcLayer = ResourcesOperationLayer<GrpcClassifier, Limit, Grpc>;

/// How long a `slow` handler holds its permit.
const WORK: Duration = Duration::from_millis(100);
/// A safety net so a broken limit fails the test instead of hanging it; not a performance bound.
const DEADLINE: Duration = Duration::from_secs(60);

/// The handlers. `Check` does what the requested service name says:
///
/// - `ok`: answers SERVING at once; `slow`: after one unit of [`Load`] work;
/// - `deadline`, `cancelled`, `internal`: fails with that status (a trailers-only response);
/// - `hang`: signals `started`, then never answers (the client has to give up).
///
/// `Watch` sends SERVING, waits for `release`, then fails the stream with `internal`: a status
/// that only the trailers carry.
#[derive(Debug, Default)]
struct Backend {
    load: Arc<Load>,
    started: Arc<Notify>,
    release: Arc<Notify>,
}

type WatchStream = Pin<Box<dyn Stream<Item = Result<HealthCheckResponse, Status>> + Send>>;

fn serving() -> HealthCheckResponse {
    HealthCheckResponse {
        status: ServingStatus::Serving as i32,
    }
}

#[tonic::async_trait]
impl Health for Backend {
    async fn check(
        &self,
        request: Request<HealthCheckRequest>,
    ) -> Result<Response<HealthCheckResponse>, Status> {
        match request.into_inner().service.as_str() {
            "ok" => {}
            "slow" => self.load.work(WORK).await,
            "deadline" => return Err(Status::deadline_exceeded("the probe ran out of time")),
            "cancelled" => return Err(Status::cancelled("the probe was called off")),
            "internal" => return Err(Status::internal("the probe broke")),
            "hang" => {
                self.started.notify_one();
                std::future::pending::<()>().await;
            }
            other => return Err(Status::not_found(format!("no probe {other:?}"))),
        }
        Ok(Response::new(serving()))
    }

    type WatchStream = WatchStream;

    async fn watch(
        &self,
        _request: Request<HealthCheckRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        let release = Arc::clone(&self.release);
        let first = futures_util::stream::iter([Ok(serving())]);
        let then_fail = futures_util::stream::once(async move {
            release.notified().await;
            Err(Status::internal("the watch broke after its first message"))
        });
        Ok(Response::new(Box::pin(first.chain(then_fail))))
    }
}

/// A listener on an ephemeral port of 127.0.0.1, and its address.
fn incoming() -> (TcpIncoming, SocketAddr) {
    let incoming = TcpIncoming::bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = incoming.local_addr().unwrap();
    (incoming, addr)
}

/// A server whose only service is `backend`, limited per service by `layer` through
/// `add_service`.
fn serve_per_service(backend: &Arc<Backend>, layer: GrpcLayer) -> SocketAddr {
    let limited = ServiceBuilder::new()
        .layer(layer)
        .service(HealthServer::from_arc(Arc::clone(backend)));
    let (incoming, addr) = incoming();
    let router = Server::builder().add_service(limited);
    tokio::spawn(async move { router.serve_with_incoming(incoming).await.unwrap() });
    addr
}

/// A server with `layer` on `Server::builder()`: one limit for everything it serves.
fn serve_whole_server(backend: &Arc<Backend>, layer: GrpcLayer) -> SocketAddr {
    let (incoming, addr) = incoming();
    let router = Server::builder()
        .layer(layer)
        .add_service(HealthServer::from_arc(Arc::clone(backend)));
    tokio::spawn(async move { router.serve_with_incoming(incoming).await.unwrap() });
    addr
}

/// A new HTTP/2 connection to `addr`.
async fn connect(addr: SocketAddr) -> Channel {
    Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap()
}

/// One `Check` of `service` on `channel`.
async fn check(channel: &Channel, service: &str) -> Result<i32, Status> {
    let request = HealthCheckRequest {
        service: service.to_owned(),
    };
    let response = HealthClient::new(channel.clone()).check(request).await?;
    Ok(response.into_inner().status)
}

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
        let result = tokio::time::timeout(DEADLINE, client)
            .await
            .expect("client hung")
            .expect("client task failed");
        results.push(result);
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

/// Waits until `condition` holds; fails the test after [`DEADLINE`].
async fn eventually(what: &str, mut condition: impl FnMut() -> bool) {
    let give_up = Instant::now() + DEADLINE;
    while !condition() {
        assert!(Instant::now() < give_up, "still not true: {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Starts a `Check` of `service` on a task of its own.
fn spawn_check(channel: &Channel, service: &'static str) -> JoinHandle<Result<i32, Status>> {
    let channel = channel.clone();
    tokio::spawn(async move { check(&channel, service).await })
}

const VERIFY_SUBPROCESS: [(&str, &str); 2] = [
    (OPERATION_ATTRIBUTE, "verify"),
    (EXECUTOR_ATTRIBUTE, "subprocess"),
];

fn verify_subprocess(telemetry: &Telemetry, max: usize) -> GrpcLayer {
    ResourcesOperationLayer::new_for_grpc(max)
        .operation(Operation::Verify)
        .executor(Executor::Subprocess)
        .metrics(telemetry.metrics.clone())
}

/// Count of the duration histogram for `series` and `outcome`.
fn ended(telemetry: &Telemetry, series: [(&str, &str); 2], outcome: &str) -> u64 {
    let [operation, executor] = series;
    telemetry.count(
        DURATION_INSTRUMENT,
        &[operation, executor, (OUTCOME_ATTRIBUTE, outcome)],
    )
}

fn assert_idle(telemetry: &Telemetry, series: [(&str, &str); 2]) {
    assert_eq!(
        telemetry.live_value(QUEUED_INSTRUMENT, &series),
        0,
        "queued"
    );
    assert_eq!(
        telemetry.live_value(ACTIVE_INSTRUMENT, &series),
        0,
        "active"
    );
}

#[test]
fn the_layered_service_keeps_the_grpc_service_name() {
    type Limited = ResourcesOperation<HealthServer<Backend>, GrpcClassifier, Limit, Grpc>;
    assert_eq!(<Limited as NamedService>::NAME, "grpc.health.v1.Health");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn per_service_outcomes_come_from_the_grpc_status() {
    let telemetry = Telemetry::new();
    let backend = Arc::new(Backend::default());
    let addr = serve_per_service(&backend, verify_subprocess(&telemetry, 2));
    let channel = connect(addr).await;

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
    assert_eq!(ended(&telemetry, series, "ok"), 1);
    assert_eq!(ended(&telemetry, series, "timeout"), 1);
    assert_eq!(ended(&telemetry, series, "cancelled"), 1);
    assert_eq!(
        ended(&telemetry, series, "error"),
        2,
        "internal and not found"
    );
    assert_eq!(ended(&telemetry, series, "crashed"), 0);
    assert_eq!(telemetry.count(DURATION_INSTRUMENT, &[]), 5);
    assert_eq!(telemetry.count(QUEUE_DURATION_INSTRUMENT, &series), 5);
    assert_idle(&telemetry, series);
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
    let telemetry = Telemetry::new();
    let backend = Arc::new(Backend::default());
    let layer = verify_subprocess(&telemetry, 2);
    let slots = layer.limit().clone();
    let addr = serve_per_service(&backend, layer);

    let results = check_all(addr, &["slow"; 8]).await;

    assert_all_served_two_at_a_time(&results, &backend, &slots);

    let series = VERIFY_SUBPROCESS;
    assert_eq!(ended(&telemetry, series, "ok"), 8);
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
    assert_idle(&telemetry, series);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn whole_server_layer_limits_and_reports_every_call() {
    let telemetry = Telemetry::new();
    let backend = Arc::new(Backend::default());
    let layer = ResourcesOperationLayer::new_for_grpc(2)
        .operation(Operation::Judge)
        .executor(Executor::Inline)
        .metrics(telemetry.metrics.clone());
    let slots = layer.limit().clone();
    let addr = serve_whole_server(&backend, layer);

    let results = check_all(addr, &["slow"; 8]).await;
    assert_all_served_two_at_a_time(&results, &backend, &slots);

    // Outcomes read the same at this placement: tonic's error answers are trailers-only.
    let channel = connect(addr).await;
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
    assert_eq!(ended(&telemetry, series, "ok"), 8);
    assert_eq!(ended(&telemetry, series, "timeout"), 1);
    assert_eq!(
        ended(&telemetry, series, "error"),
        2,
        "internal and unimplemented"
    );
    assert_eq!(telemetry.count(DURATION_INSTRUMENT, &[]), 11);
    assert_eq!(telemetry.count(QUEUE_DURATION_INSTRUMENT, &series), 11);
    assert_idle(&telemetry, series);
}

/// The per-service placement counts only its own service: a call the server routes elsewhere
/// (here tonic's UNIMPLEMENTED fallback) records nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn per_service_limit_ignores_calls_to_other_services() {
    let telemetry = Telemetry::new();
    let backend = Arc::new(Backend::default());
    let addr = serve_per_service(&backend, verify_subprocess(&telemetry, 2));
    let channel = connect(addr).await;

    assert_eq!(call_unknown_service(&channel).await.as_deref(), Some("12"));
    assert_eq!(telemetry.count(DURATION_INSTRUMENT, &[]), 0);
    assert_eq!(telemetry.count(QUEUE_DURATION_INSTRUMENT, &[]), 0);

    check(&channel, "ok").await.unwrap();
    assert_eq!(ended(&telemetry, VERIFY_SUBPROCESS, "ok"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn client_that_hangs_up_while_running_is_cancelled_and_frees_its_permit() {
    let telemetry = Telemetry::new();
    let backend = Arc::new(Backend::default());
    let layer = verify_subprocess(&telemetry, 1);
    let slots = layer.limit().clone();
    let addr = serve_per_service(&backend, layer);
    let channel = connect(addr).await;

    let call = spawn_check(&channel, "hang");
    tokio::time::timeout(DEADLINE, backend.started.notified())
        .await
        .expect("handler never started");
    assert_eq!(
        telemetry.live_value(ACTIVE_INSTRUMENT, &VERIFY_SUBPROCESS),
        1
    );

    call.abort(); // drops the call: the client resets the HTTP/2 stream
    let series = VERIFY_SUBPROCESS;
    eventually("the reset call ended as cancelled", || {
        ended(&telemetry, series, "cancelled") == 1
    })
    .await;
    assert_eq!(telemetry.count(DURATION_INSTRUMENT, &series), 1);
    assert_eq!(slots.available(), 1);
    assert_idle(&telemetry, series);

    // The one permit is free again: the next call runs.
    check(&channel, "ok").await.unwrap();
    assert_eq!(ended(&telemetry, series, "ok"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn client_that_gives_up_while_queued_records_no_sample_and_leaves_the_queue() {
    let telemetry = Telemetry::new();
    let backend = Arc::new(Backend::default());
    let layer = verify_subprocess(&telemetry, 1);
    let slots = layer.limit().clone();
    let addr = serve_per_service(&backend, layer);
    let series = VERIFY_SUBPROCESS;

    let holder = spawn_check(&connect(addr).await, "hang");
    tokio::time::timeout(DEADLINE, backend.started.notified())
        .await
        .expect("handler never started");
    let waiter = spawn_check(&connect(addr).await, "ok");
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
    eventually("the holder ended as cancelled", || {
        ended(&telemetry, series, "cancelled") == 1
    })
    .await;
    assert_eq!(telemetry.count(DURATION_INSTRUMENT, &series), 1);
    assert_eq!(slots.available(), 1);
    assert_idle(&telemetry, series);
}

/// A `Check` of `hang` whose client deadline, 100 ms sent as `grpc-timeout`, passes: tonic gives
/// up on the call, and the client sees DEADLINE_EXCEEDED or CANCELLED.
async fn check_past_a_client_deadline(channel: Channel) {
    let mut request = Request::new(HealthCheckRequest {
        service: "hang".to_owned(),
    });
    request.set_timeout(Duration::from_millis(100));
    let status = tokio::time::timeout(DEADLINE, HealthClient::new(channel).check(request))
        .await
        .expect("nobody enforced the client's deadline")
        .unwrap_err();
    assert!(
        matches!(status.code(), Code::DeadlineExceeded | Code::Cancelled),
        "{status:?}"
    );
}

/// A deadline tonic enforces (`Server::timeout`, or the client's `grpc-timeout`) wraps the
/// layered service from outside: when it fires, tonic drops the operation (and answers
/// CANCELLED, "Timeout expired"). The gRPC layer reads the request's `grpc-timeout` (and, with
/// `server_timeout`, the server's timeout), so such a drop counts as `timeout`; a layer that
/// reads no deadline sees a plain drop, `cancelled`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn deadlines_enforced_by_tonic_end_the_operation_as_timeout() {
    let telemetry = Telemetry::new();
    let backend = Arc::new(Backend::default());
    let server_timeout = Duration::from_millis(300);
    let limited = ServiceBuilder::new()
        .layer(verify_subprocess(&telemetry, 1).server_timeout(server_timeout))
        .service(HealthServer::from_arc(Arc::clone(&backend)));
    let (incoming, addr) = incoming();
    let router = Server::builder()
        .timeout(server_timeout)
        .add_service(limited);
    tokio::spawn(async move { router.serve_with_incoming(incoming).await.unwrap() });
    let channel = connect(addr).await;
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
    check_past_a_client_deadline(channel).await;
    eventually("the second operation ended", || {
        telemetry.count(DURATION_INSTRUMENT, &series) == 2
    })
    .await;

    assert_eq!(ended(&telemetry, series, "timeout"), 2);
    assert_eq!(ended(&telemetry, series, "cancelled"), 0);
    assert_idle(&telemetry, series);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_layer_that_reads_no_deadline_counts_tonics_deadline_as_cancelled() {
    let telemetry = Telemetry::new();
    let backend = Arc::new(Backend::default());
    // The gRPC classifier, with the `Plain` protocol: no `grpc-timeout` is read.
    let limited = ServiceBuilder::new()
        .layer(verify_subprocess(&telemetry, 1).protocol(Plain))
        .service(HealthServer::from_arc(Arc::clone(&backend)));
    let (incoming, addr) = incoming();
    let router = Server::builder().add_service(limited);
    tokio::spawn(async move { router.serve_with_incoming(incoming).await.unwrap() });
    let channel = connect(addr).await;
    let series = VERIFY_SUBPROCESS;

    check_past_a_client_deadline(channel).await;
    eventually("the operation ended", || {
        telemetry.count(DURATION_INSTRUMENT, &series) == 1
    })
    .await;
    assert_eq!(ended(&telemetry, series, "cancelled"), 1);
    assert_idle(&telemetry, series);
}

/// The outcome is decided when the response head is ready. A streaming call's head goes out
/// with its first message, so the operation ends there: the permit is free while the stream is
/// still open, and a status that only the trailers carry is not seen (the call counts as `ok`).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn streaming_call_ends_with_its_head_and_a_status_only_in_trailers_counts_as_ok() {
    let telemetry = Telemetry::new();
    let backend = Arc::new(Backend::default());
    let layer = verify_subprocess(&telemetry, 1);
    let slots = layer.limit().clone();
    let addr = serve_per_service(&backend, layer);
    let channel = connect(addr).await;

    let request = HealthCheckRequest {
        service: String::new(),
    };
    let mut stream = HealthClient::new(channel.clone())
        .watch(request)
        .await
        .unwrap()
        .into_inner();
    let first = stream.message().await.unwrap().expect("a first message");
    assert_eq!(first.status, ServingStatus::Serving as i32);

    // The stream is open, yet its operation is over and the one permit is free.
    let series = VERIFY_SUBPROCESS;
    assert_eq!(ended(&telemetry, series, "ok"), 1);
    assert_eq!(slots.available(), 1);
    tokio::time::timeout(DEADLINE, check(&channel, "ok"))
        .await
        .expect("the open stream still holds the permit")
        .unwrap();

    backend.release.notify_one();
    let status = stream.message().await.unwrap_err();
    assert_eq!(status.code(), Code::Internal, "{status:?}");

    // The INTERNAL in the trailers changed nothing: two calls, both `ok`.
    assert_eq!(ended(&telemetry, series, "ok"), 2);
    assert_eq!(ended(&telemetry, series, "error"), 0);
    assert_idle(&telemetry, series);
}
