#![cfg(feature = "tonic")]
//! The body-end form of the layer (`until_body_end`) on real tonic servers and clients over
//! 127.0.0.1: a server stream's operation lasts until its last message and trailers, and its
//! outcome comes from the `grpc-status` of those trailers (where the head-end form, tower's
//! semantics, sees `ok`); a unary call's outcome is read at its head when tonic answers
//! trailers-only, at its trailers otherwise. Also: gRPC deadlines (the client's `grpc-timeout`
//! firing mid-stream, tonic's `Server::timeout`) end operations as `timeout`; a client that hangs
//! up mid-stream ends them as `cancelled`; a limit of 1 holds a second stream until the first
//! ends; the per-request form over a whole `Server` limits and records only the methods it is
//! told to; a gRPC layer answers RESOURCE_EXHAUSTED to a call that finds the limit full.
//!
//! The service is tonic-health's generated `grpc.health.v1.Health` (no `protoc`) around a
//! `Health` of our own, whose `Watch` streams are fed by the test, message by message, through a
//! channel: the test decides when each message goes, how the stream ends, and sees when the
//! server drops it. Every test ends with the live counts back to 0 and the permits back.

mod support;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use tokio::sync::mpsc::{self, UnboundedReceiver, UnboundedSender};
use tokio::sync::Notify;
use tokio::time::Instant;
use tonic::codegen::tokio_stream::Stream;
use tonic::server::NamedService;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Channel, Endpoint, Server};
use tonic::{Code, Request, Response, Status, Streaming};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::health_server::{Health, HealthServer};
use tonic_health::pb::{HealthCheckRequest, HealthCheckResponse};
use tower::{Layer, Service, ServiceExt as _};

use support::Telemetry;
use tower_resources_operation::classify::GrpcClassifier;
use tower_resources_operation::layer::AtBodyEnd;
use tower_resources_operation::metrics::{REJECTED_INSTRUMENT, REJECTION_ATTRIBUTE};
use tower_resources_operation::per_request::{ByGrpcMethod, Choice};
use tower_resources_operation::protocol::{Grpc, Plain};
use tower_resources_operation::{
    Executor, Limit, Operation, ResourcesOperationLayer, ACTIVE_INSTRUMENT, DURATION_INSTRUMENT,
    EXECUTOR_ATTRIBUTE, OPERATION_ATTRIBUTE, QUEUED_INSTRUMENT, QUEUE_DURATION_INSTRUMENT,
};

/// A safety net so a broken limit fails the test instead of hanging it; not a performance bound.
const DEADLINE: Duration = Duration::from_secs(60);

/// The series of the per-service layers of this file.
const TOOL_PROCESS: [(&str, &str); 2] = [
    (OPERATION_ATTRIBUTE, "tool"),
    (EXECUTOR_ATTRIBUTE, "process"),
];

// ---------------------------------------------------------------------------------------------
// The server side.

type Item = Result<HealthCheckResponse, Status>;
type WatchStream = Pin<Box<dyn Stream<Item = Item> + Send>>;

/// The handlers.
///
/// `Check` does what the requested service name says: `ok` answers SERVING at once;
/// `internal`, `deadline`, `cancelled` fail with that status (tonic answers trailers-only);
/// `hang` signals `hanging`, then never answers.
///
/// `Watch` hands the test a [`WatchCall`] and streams whatever the test feeds it, until the test
/// drops the feed (a normal end: tonic sends trailers with `grpc-status` 0) or feeds an `Err`
/// (tonic sends that status in the trailers).
#[derive(Debug)]
struct Backend {
    watches: UnboundedSender<WatchCall>,
    checks: AtomicUsize,
    hanging: Notify,
}

/// One `Watch` call as its handler started it: the test's end of its stream.
#[derive(Debug)]
struct WatchCall {
    service: String,
    feed: UnboundedSender<Item>,
}

impl Backend {
    /// A backend, and the receiver of the `Watch` calls its handler starts, in order.
    fn new() -> (Arc<Self>, UnboundedReceiver<WatchCall>) {
        let (watches, calls) = mpsc::unbounded_channel();
        let backend = Self {
            watches,
            checks: AtomicUsize::new(0),
            hanging: Notify::new(),
        };
        (Arc::new(backend), calls)
    }

    /// How many times the `Check` handler was called.
    fn checks(&self) -> usize {
        self.checks.load(Ordering::SeqCst)
    }
}

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
        self.checks.fetch_add(1, Ordering::SeqCst);
        match request.into_inner().service.as_str() {
            "ok" => Ok(Response::new(serving())),
            "internal" => Err(Status::internal("the probe broke")),
            "deadline" => Err(Status::deadline_exceeded("the probe ran out of time")),
            "cancelled" => Err(Status::cancelled("the probe was called off")),
            "hang" => {
                self.hanging.notify_one();
                std::future::pending().await
            }
            other => Err(Status::not_found(format!("no probe {other:?}"))),
        }
    }

    type WatchStream = WatchStream;

    async fn watch(
        &self,
        request: Request<HealthCheckRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        let (feed, items) = mpsc::unbounded_channel();
        let call = WatchCall {
            service: request.into_inner().service,
            feed,
        };
        self.watches
            .send(call)
            .expect("the test stopped listening for Watch calls");
        let stream = futures_util::stream::unfold(items, |mut items| async move {
            items.recv().await.map(|item| (item, items))
        });
        Ok(Response::new(Box::pin(stream)))
    }
}

impl WatchCall {
    /// Streams one SERVING message.
    fn send(&self) {
        self.feed
            .send(Ok(serving()))
            .expect("the server dropped the stream");
    }

    /// Fails the stream with `status`: tonic sends it in the trailers.
    fn fail(self, status: Status) {
        self.feed
            .send(Err(status))
            .expect("the server dropped the stream");
    }

    /// Ends the stream normally: tonic sends trailers with `grpc-status` 0.
    fn finish(self) {}

    /// Waits until the server has dropped the stream (the response body).
    async fn dropped(&self) {
        tokio::time::timeout(DEADLINE, self.feed.closed())
            .await
            .expect("the server never dropped the stream");
    }
}

/// The next `Watch` call the handler started; fails the test after [`DEADLINE`].
async fn next_watch(watches: &mut UnboundedReceiver<WatchCall>) -> WatchCall {
    tokio::time::timeout(DEADLINE, watches.recv())
        .await
        .expect("the Watch handler was never called")
        .expect("the backend is gone")
}

/// Asserts that the `Watch` handler started no call the test has not taken yet.
fn assert_no_watch_started(watches: &mut UnboundedReceiver<WatchCall>, why: &str) {
    if let Ok(call) = watches.try_recv() {
        panic!("the Watch handler was called ({:?}): {why}", call.service);
    }
}

/// A listener on an ephemeral port of 127.0.0.1, and its address.
fn incoming() -> (TcpIncoming, SocketAddr) {
    let incoming = TcpIncoming::bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = incoming.local_addr().unwrap();
    (incoming, addr)
}

/// A server whose only service is `backend` under `layer`, limited per service through
/// `add_service`.
fn serve<L>(backend: &Arc<Backend>, layer: L) -> SocketAddr
where
    L: Layer<HealthServer<Backend>>,
    L::Service: Service<http::Request<tonic::body::Body>, Error = Infallible>
        + NamedService
        + Clone
        + Send
        + Sync
        + 'static,
    <L::Service as Service<http::Request<tonic::body::Body>>>::Response:
        axum::response::IntoResponse,
    <L::Service as Service<http::Request<tonic::body::Body>>>::Future: Send + 'static,
{
    let service = layer.layer(HealthServer::from_arc(Arc::clone(backend)));
    let (incoming, addr) = incoming();
    let router = Server::builder().add_service(service);
    tokio::spawn(async move { router.serve_with_incoming(incoming).await.unwrap() });
    addr
}

/// The gRPC layer of `new_for_grpc`, tagged tool/process, in the body-end form.
fn body_end(
    telemetry: &Telemetry,
    max: usize,
) -> ResourcesOperationLayer<GrpcClassifier, Limit, Grpc, AtBodyEnd> {
    at_head(telemetry, max).until_body_end()
}

/// The gRPC layer of `new_for_grpc`, tagged tool/process, in the default (head-end) form.
fn at_head(
    telemetry: &Telemetry,
    max: usize,
) -> ResourcesOperationLayer<GrpcClassifier, Limit, Grpc> {
    ResourcesOperationLayer::new_for_grpc(max)
        .operation(Operation::Tool)
        .executor(Executor::Process)
        .metrics(telemetry.metrics.clone())
}

// ---------------------------------------------------------------------------------------------
// The client side.

/// A new HTTP/2 connection to `addr`.
async fn connect(addr: SocketAddr) -> Channel {
    Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap()
}

fn asking(service: &str) -> Request<HealthCheckRequest> {
    Request::new(HealthCheckRequest {
        service: service.to_owned(),
    })
}

/// Opens a `Watch` of `service` on `channel`: returns once the response head is in.
async fn watch(channel: &Channel, service: &str) -> Result<Streaming<HealthCheckResponse>, Status> {
    let response = tokio::time::timeout(
        DEADLINE,
        HealthClient::new(channel.clone()).watch(asking(service)),
    )
    .await
    .expect("the Watch head never came")?;
    Ok(response.into_inner())
}

/// The next message of `stream`: `Ok(None)` at a normal end, `Err` with the trailers' status.
async fn message(
    stream: &mut Streaming<HealthCheckResponse>,
) -> Result<Option<HealthCheckResponse>, Status> {
    tokio::time::timeout(DEADLINE, stream.message())
        .await
        .expect("the stream stalled")
}

/// Reads `stream` to its end: the number of messages, and the status it ended with.
async fn drain(mut stream: Streaming<HealthCheckResponse>) -> (usize, Result<(), Status>) {
    let mut messages = 0;
    loop {
        match message(&mut stream).await {
            Ok(Some(response)) => {
                assert_eq!(response.status, ServingStatus::Serving as i32);
                messages += 1;
            }
            Ok(None) => return (messages, Ok(())),
            Err(status) => return (messages, Err(status)),
        }
    }
}

/// One `Check` of `service` on `channel`.
async fn check(channel: &Channel, service: &str) -> Result<i32, Status> {
    let response = tokio::time::timeout(
        DEADLINE,
        HealthClient::new(channel.clone()).check(asking(service)),
    )
    .await
    .expect("the Check never answered")?;
    Ok(response.into_inner().status)
}

/// What a unary call put where: the `grpc-status` of its response head and of its trailers.
#[derive(Debug, PartialEq, Eq)]
struct StatusPlaces {
    head: Option<String>,
    trailers: Option<String>,
}

/// One `Check` of `service` sent as a bare HTTP/2 request, read to its end: where the answer put
/// its `grpc-status`.
async fn raw_check(channel: &Channel, service: &str) -> StatusPlaces {
    // The protobuf of HealthCheckRequest { service }: field 1, length-delimited.
    let length = u8::try_from(service.len()).expect("a short service name");
    assert!(length < 0x80, "a one-byte varint");
    let mut message = vec![0x0a, length];
    message.extend_from_slice(service.as_bytes());
    // The gRPC frame: not compressed, the length in 4 bytes big-endian, the message.
    let mut frame = vec![0];
    frame.extend_from_slice(&u32::try_from(message.len()).unwrap().to_be_bytes());
    frame.extend_from_slice(&message);

    let request = http::Request::post("/grpc.health.v1.Health/Check")
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(tonic::body::Body::new(Full::new(Bytes::from(frame))))
        .unwrap();
    let response = tokio::time::timeout(DEADLINE, channel.clone().oneshot(request))
        .await
        .expect("the Check never answered")
        .unwrap();
    let head = grpc_status(response.headers());
    let collected = tokio::time::timeout(DEADLINE, response.into_body().collect())
        .await
        .expect("the Check's body never ended")
        .unwrap();
    StatusPlaces {
        head,
        trailers: collected.trailers().and_then(grpc_status),
    }
}

fn grpc_status(headers: &http::HeaderMap) -> Option<String> {
    headers
        .get("grpc-status")
        .map(|value| value.to_str().unwrap().to_owned())
}

// ---------------------------------------------------------------------------------------------
// Reading the metrics.

/// How many operations of `series` ended with `outcome`.
fn ended(telemetry: &Telemetry, series: &[(&str, &str)], outcome: &str) -> u64 {
    telemetry
        .outcomes(series)
        .get(outcome)
        .copied()
        .unwrap_or(0)
}

/// How many operations of `series` ended, whatever their outcome.
fn ended_at_all(telemetry: &Telemetry, series: &[(&str, &str)]) -> u64 {
    telemetry.count(DURATION_INSTRUMENT, series)
}

/// Waits until `condition` holds; fails the test after [`DEADLINE`].
async fn eventually(what: &str, mut condition: impl FnMut() -> bool) {
    let give_up = Instant::now() + DEADLINE;
    while !condition() {
        assert!(Instant::now() < give_up, "still not true: {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Nothing waits or runs, in any series, and every permit of `limit` is back.
fn assert_idle(telemetry: &Telemetry, limit: &Limit) {
    assert_eq!(telemetry.live_value(QUEUED_INSTRUMENT, &[]), 0, "queued");
    assert_eq!(telemetry.live_value(ACTIVE_INSTRUMENT, &[]), 0, "active");
    assert_eq!(limit.available(), limit.capacity(), "permits back");
    assert_eq!(limit.queued(), 0, "waiters on the limit");
}

// ---------------------------------------------------------------------------------------------
// A status only the trailers carry.

/// A server stream that sends messages and then fails has its status only in the trailers. The
/// body-end form reads it there: `error`. The head-end form ended the operation with the head,
/// which carries no status: `ok` (the documented limitation the body-end form fixes).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stream_that_fails_after_its_messages_is_an_error_at_body_end_and_ok_at_head() {
    // The body-end form.
    let telemetry = Telemetry::new();
    let (backend, mut watches) = Backend::new();
    let layer = body_end(&telemetry, 1);
    let limit = layer.limit().clone();
    let channel = connect(serve(&backend, layer)).await;

    let failures = [
        Status::internal("the watch broke"),
        Status::unavailable("the watched service went away"),
    ];
    for (round, failure) in (1..).zip(failures) {
        let code = failure.code();
        let mut stream = watch(&channel, "").await.unwrap();
        let call = next_watch(&mut watches).await;
        call.send();
        call.send();
        for _ in 0..2 {
            assert!(message(&mut stream).await.unwrap().is_some());
        }
        // Two messages out, the stream still open: the operation still runs, holding its permit.
        assert_eq!(
            ended_at_all(&telemetry, &TOOL_PROCESS),
            round - 1,
            "{code:?}"
        );
        assert_eq!(telemetry.live_value(ACTIVE_INSTRUMENT, &TOOL_PROCESS), 1);
        assert_eq!(limit.available(), 0);

        call.fail(failure);
        let status = message(&mut stream).await.unwrap_err();
        assert_eq!(status.code(), code, "{status:?}");
        // The operation ended when its trailers went out, before the client read them.
        assert_eq!(ended(&telemetry, &TOOL_PROCESS, "error"), round, "{code:?}");
        assert_eq!(ended_at_all(&telemetry, &TOOL_PROCESS), round);
        assert_idle(&telemetry, &limit);
    }
    assert_eq!(ended(&telemetry, &TOOL_PROCESS, "error"), 2);
    assert_eq!(ended(&telemetry, &TOOL_PROCESS, "ok"), 0);
    assert_idle(&telemetry, &limit);

    // The head-end form, same calls.
    let telemetry = Telemetry::new();
    let (backend, mut watches) = Backend::new();
    let layer = at_head(&telemetry, 1);
    let limit = layer.limit().clone();
    let channel = connect(serve(&backend, layer)).await;

    for failure in [
        Status::internal("the watch broke"),
        Status::unavailable("the watched service went away"),
    ] {
        let code = failure.code();
        let mut stream = watch(&channel, "").await.unwrap();
        let call = next_watch(&mut watches).await;
        call.send();
        call.send();
        for _ in 0..2 {
            assert!(message(&mut stream).await.unwrap().is_some());
        }
        // The head is out: the head-end operation is over while the stream still streams.
        assert_eq!(limit.available(), 1);
        call.fail(failure);
        let status = message(&mut stream).await.unwrap_err();
        assert_eq!(status.code(), code, "{status:?}");
    }
    assert_eq!(ended(&telemetry, &TOOL_PROCESS, "ok"), 2);
    assert_eq!(ended(&telemetry, &TOOL_PROCESS, "error"), 0);
    assert_eq!(ended_at_all(&telemetry, &TOOL_PROCESS), 2);
    assert_idle(&telemetry, &limit);
}

// ---------------------------------------------------------------------------------------------
// The outcome a stream's trailers carry.

/// A stream that ends normally (trailers with `grpc-status` 0) is `ok`; one whose trailers
/// carry DEADLINE_EXCEEDED (4) is `timeout`, CANCELLED (1) `cancelled`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stream_ends_with_the_outcome_its_trailers_carry() {
    let telemetry = Telemetry::new();
    let (backend, mut watches) = Backend::new();
    let layer = body_end(&telemetry, 1);
    let limit = layer.limit().clone();
    let channel = connect(serve(&backend, layer)).await;

    let endings: [(Option<Status>, Result<(), Code>, &str); 3] = [
        (None, Ok(()), "ok"),
        (
            Some(Status::deadline_exceeded("the watch ran out of time")),
            Err(Code::DeadlineExceeded),
            "timeout",
        ),
        (
            Some(Status::cancelled("the watch was called off")),
            Err(Code::Cancelled),
            "cancelled",
        ),
    ];
    for (ending, seen, outcome) in endings {
        let stream = watch(&channel, "").await.unwrap();
        let call = next_watch(&mut watches).await;
        call.send();
        call.send();
        call.send();
        match ending {
            None => call.finish(),
            Some(status) => call.fail(status),
        }
        let (messages, status) = drain(stream).await;
        assert_eq!(messages, 3, "{outcome}");
        assert_eq!(status.map_err(|s| s.code()), seen, "{outcome}");
        assert_eq!(ended(&telemetry, &TOOL_PROCESS, outcome), 1, "{outcome}");
        assert_idle(&telemetry, &limit);
    }
    assert_eq!(ended_at_all(&telemetry, &TOOL_PROCESS), 3);
    assert_eq!(ended(&telemetry, &TOOL_PROCESS, "error"), 0);
    assert_eq!(telemetry.count(QUEUE_DURATION_INSTRUMENT, &TOOL_PROCESS), 3);
    assert_idle(&telemetry, &limit);
}

// ---------------------------------------------------------------------------------------------
// Unary calls.

/// A unary call that succeeds answers a head without `grpc-status` and trailers with
/// `grpc-status` 0: `ok` in both forms (the head-end form sees no status in the head, the
/// body-end form reads the trailers). A handler's `Err(Status)` is answered trailers-only (the
/// status in the head, no trailers): both forms decide at the head. In the body-end form that
/// is what makes it an error: the body ends with no trailers, which alone would be `ok`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn unary_calls_are_ok_from_their_trailers_and_failures_are_decided_at_the_head() {
    async fn calls(channel: &Channel, backend: &Backend) {
        assert_eq!(
            check(channel, "ok").await.unwrap(),
            ServingStatus::Serving as i32
        );
        assert_eq!(
            raw_check(channel, "ok").await,
            StatusPlaces {
                head: None,
                trailers: Some("0".to_owned()),
            },
            "a unary success: no status in the head, 0 in the trailers"
        );
        for (service, code, number) in [
            ("internal", Code::Internal, "13"),
            ("deadline", Code::DeadlineExceeded, "4"),
            ("cancelled", Code::Cancelled, "1"),
        ] {
            let status = check(channel, service).await.unwrap_err();
            assert_eq!(status.code(), code, "{service}: {status:?}");
            assert_eq!(
                raw_check(channel, service).await,
                StatusPlaces {
                    head: Some(number.to_owned()),
                    trailers: None,
                },
                "{service}: a trailers-only answer"
            );
        }
        assert_eq!(backend.checks(), 8);
    }

    for body_end_form in [true, false] {
        let form = if body_end_form { "body end" } else { "head" };
        let telemetry = Telemetry::new();
        let (backend, _watches) = Backend::new();
        let (addr, limit) = if body_end_form {
            let layer = body_end(&telemetry, 1);
            let limit = layer.limit().clone();
            (serve(&backend, layer), limit)
        } else {
            let layer = at_head(&telemetry, 1);
            let limit = layer.limit().clone();
            (serve(&backend, layer), limit)
        };
        let channel = connect(addr).await;

        calls(&channel, &backend).await;

        let outcomes = telemetry.outcomes(&TOOL_PROCESS);
        let expected = [("cancelled", 2), ("error", 2), ("ok", 2), ("timeout", 2)]
            .map(|(outcome, n)| (outcome.to_owned(), n))
            .into_iter()
            .collect();
        assert_eq!(outcomes, expected, "{form}");
        assert_idle(&telemetry, &limit);
    }
}

// ---------------------------------------------------------------------------------------------
// Deadlines.

/// Opens a `Watch` with a client deadline of `client_deadline`, sent as `grpc-timeout`, on a
/// stream that runs longer (a message every 20 ms until the server drops it), and gives up at the
/// deadline, mid-stream: drops the stream, which resets it. Returns once the server has dropped
/// the body.
async fn give_up_at_the_deadline_mid_stream(
    channel: &Channel,
    watches: &mut UnboundedReceiver<WatchCall>,
    limit: &Limit,
    client_deadline: Duration,
) {
    let mut request = asking("ticking");
    request.set_timeout(client_deadline);
    let gives_up = Instant::now() + client_deadline;
    let mut stream =
        tokio::time::timeout_at(gives_up, HealthClient::new(channel.clone()).watch(request))
            .await
            .expect("the head came after the client's deadline")
            .unwrap()
            .into_inner();
    let call = next_watch(watches).await;
    let feed = call.feed.clone();
    let ticker = tokio::spawn(async move {
        let mut sent = 0_usize;
        while feed.send(Ok(serving())).is_ok() {
            sent += 1;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        sent
    });

    let mut received = 0;
    let read = tokio::time::timeout_at(gives_up, async {
        while let Some(response) = stream.message().await? {
            assert_eq!(response.status, ServingStatus::Serving as i32);
            received += 1;
        }
        Ok::<_, Status>(())
    })
    .await;
    assert!(
        read.is_err(),
        "the stream ended before the deadline: {read:?}"
    );
    assert!(
        received >= 1,
        "the stream was under way when the deadline fired"
    );
    assert_eq!(
        limit.available(),
        0,
        "the stream holds its permit until then"
    );
    drop(stream); // the client's deadline fired: it cancels the call

    call.dropped().await;
    let sent = tokio::time::timeout(DEADLINE, ticker)
        .await
        .unwrap()
        .unwrap();
    assert!(sent >= received);
}

/// The client sends its deadline as `grpc-timeout` and gives up at it, mid-stream: it drops the
/// stream, the client resets it, the server drops the body. `new_for_grpc` reads the deadline
/// (its `Grpc` protocol), so the operation ends `timeout`, not `cancelled`; a layer that reads no
/// deadline (`.protocol(Plain)`) sees the same drop as `cancelled`. (tonic's server
/// applies `grpc-timeout` to the response head only: a stream goes on until someone drops it.) A
/// stream that ends before the client's deadline is still `ok`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_client_deadline_that_fires_mid_stream_ends_the_operation_as_timeout() {
    let client_deadline = Duration::from_millis(300);
    let telemetry = Telemetry::new();
    let (backend, mut watches) = Backend::new();
    let layer = body_end(&telemetry, 1);
    let limit = layer.limit().clone();
    let channel = connect(serve(&backend, layer)).await;

    give_up_at_the_deadline_mid_stream(&channel, &mut watches, &limit, client_deadline).await;
    eventually("the operation ended", || {
        ended_at_all(&telemetry, &TOOL_PROCESS) == 1
    })
    .await;
    assert_eq!(ended(&telemetry, &TOOL_PROCESS, "timeout"), 1);
    assert_eq!(ended(&telemetry, &TOOL_PROCESS, "cancelled"), 0);
    assert_idle(&telemetry, &limit);

    // A stream that ends within its deadline is `ok`, deadline or not.
    let mut request = asking("short");
    request.set_timeout(DEADLINE);
    let stream = HealthClient::new(channel.clone())
        .watch(request)
        .await
        .unwrap()
        .into_inner();
    let call = next_watch(&mut watches).await;
    call.send();
    call.finish();
    let (messages, status) = drain(stream).await;
    assert_eq!((messages, status.map_err(|s| s.code())), (1, Ok(())));
    assert_eq!(ended(&telemetry, &TOOL_PROCESS, "ok"), 1);
    assert_eq!(ended(&telemetry, &TOOL_PROCESS, "timeout"), 1);
    assert_eq!(ended_at_all(&telemetry, &TOOL_PROCESS), 2);
    assert_idle(&telemetry, &limit);

    // The contrast: a body-end layer that reads no deadline.
    let telemetry = Telemetry::new();
    let (backend, mut watches) = Backend::new();
    let layer = body_end(&telemetry, 1).protocol(Plain);
    let limit = layer.limit().clone();
    let channel = connect(serve(&backend, layer)).await;

    give_up_at_the_deadline_mid_stream(&channel, &mut watches, &limit, client_deadline).await;
    eventually("the operation ended", || {
        ended_at_all(&telemetry, &TOOL_PROCESS) == 1
    })
    .await;
    assert_eq!(ended(&telemetry, &TOOL_PROCESS, "cancelled"), 1);
    assert_eq!(ended(&telemetry, &TOOL_PROCESS, "timeout"), 0);
    assert_idle(&telemetry, &limit);
}

/// tonic's own `Server::timeout` drops a unary call whose handler runs too long (and answers
/// CANCELLED, "Timeout expired"); the body-end layer told `.server_timeout(server_timeout)`
/// counts that drop as `timeout`, as it
/// does the client's own `grpc-timeout`, which tonic enforces the same way before the head.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tonics_server_timeout_on_a_unary_call_is_timeout_in_the_body_end_form() {
    let telemetry = Telemetry::new();
    let (backend, _watches) = Backend::new();
    let server_timeout = Duration::from_millis(300);
    let layer = body_end(&telemetry, 1).server_timeout(server_timeout);
    let limit = layer.limit().clone();
    let service = layer.layer(HealthServer::from_arc(Arc::clone(&backend)));
    let (incoming, addr) = incoming();
    let router = Server::builder()
        .timeout(server_timeout)
        .add_service(service);
    tokio::spawn(async move { router.serve_with_incoming(incoming).await.unwrap() });
    let channel = connect(addr).await;

    // The server's own timeout.
    let hung = tokio::spawn({
        let channel = channel.clone();
        async move { check(&channel, "hang").await }
    });
    tokio::time::timeout(DEADLINE, backend.hanging.notified())
        .await
        .expect("the handler never started");
    assert_eq!(limit.available(), 0);
    let status = hung.await.unwrap().unwrap_err();
    assert_eq!(status.code(), Code::Cancelled, "{status:?}");
    eventually("the first operation ended", || {
        ended_at_all(&telemetry, &TOOL_PROCESS) == 1
    })
    .await;
    assert_eq!(ended(&telemetry, &TOOL_PROCESS, "timeout"), 1);
    assert_idle(&telemetry, &limit);

    // The client's deadline, shorter than the server's.
    let mut request = asking("hang");
    request.set_timeout(Duration::from_millis(100));
    let status = tokio::time::timeout(DEADLINE, HealthClient::new(channel.clone()).check(request))
        .await
        .expect("nobody enforced the client's deadline")
        .unwrap_err();
    assert!(
        matches!(status.code(), Code::DeadlineExceeded | Code::Cancelled),
        "{status:?}"
    );
    eventually("the second operation ended", || {
        ended_at_all(&telemetry, &TOOL_PROCESS) == 2
    })
    .await;
    assert_eq!(ended(&telemetry, &TOOL_PROCESS, "timeout"), 2);
    assert_eq!(ended(&telemetry, &TOOL_PROCESS, "cancelled"), 0);

    // The permit is back: a call within the deadline is served, and `ok`.
    check(&channel, "ok").await.unwrap();
    assert_eq!(ended(&telemetry, &TOOL_PROCESS, "ok"), 1);
    assert_idle(&telemetry, &limit);
}

// ---------------------------------------------------------------------------------------------
// A limit of 1, held by a stream.

/// With a limit of 1, a second stream waits until the first has sent its last message and its
/// trailers: its handler is not called before, its queue time covers the rest of the first
/// stream, and the permit goes back when the second stream ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_a_limit_of_one_a_second_stream_waits_for_the_first_stream_to_end() {
    const REST: Duration = Duration::from_millis(150);
    let telemetry = Telemetry::new();
    let (backend, mut watches) = Backend::new();
    let layer = body_end(&telemetry, 1);
    let limit = layer.limit().clone();
    let addr = serve(&backend, layer);

    let mut first = watch(&connect(addr).await, "first").await.unwrap();
    let first_call = next_watch(&mut watches).await;
    assert_eq!(first_call.service, "first");
    first_call.send();
    assert!(message(&mut first).await.unwrap().is_some());

    let second_channel = connect(addr).await;
    let second = tokio::spawn(async move {
        let stream = watch(&second_channel, "second").await?;
        Ok::<_, Status>(drain(stream).await)
    });
    eventually("the second stream waits for the permit", || {
        telemetry.live_value(QUEUED_INSTRUMENT, &TOOL_PROCESS) == 1
    })
    .await;
    let queued_by = Instant::now();
    assert_eq!(limit.queued(), 1);
    assert_no_watch_started(
        &mut watches,
        "the second stream was admitted while the first ran",
    );

    // The rest of the first stream: a message, a while, its last message.
    first_call.send();
    assert!(message(&mut first).await.unwrap().is_some());
    tokio::time::sleep(REST).await;
    first_call.send();
    assert!(message(&mut first).await.unwrap().is_some());
    assert_no_watch_started(
        &mut watches,
        "the second stream was admitted before the first sent its trailers",
    );
    assert_eq!(telemetry.live_value(QUEUED_INSTRUMENT, &TOOL_PROCESS), 1);
    assert_eq!(telemetry.live_value(ACTIVE_INSTRUMENT, &TOOL_PROCESS), 1);
    assert_eq!(ended_at_all(&telemetry, &TOOL_PROCESS), 0);
    assert_eq!(limit.available(), 0);

    // Its trailers: the first operation ends and hands its permit to the second.
    let first_ends = Instant::now();
    first_call.finish();
    assert!(message(&mut first).await.unwrap().is_none(), "a normal end");
    assert_eq!(ended(&telemetry, &TOOL_PROCESS, "ok"), 1);
    let second_call = next_watch(&mut watches).await;
    assert_eq!(second_call.service, "second");
    assert_eq!(telemetry.live_value(QUEUED_INSTRUMENT, &TOOL_PROCESS), 0);
    assert_eq!(telemetry.live_value(ACTIVE_INSTRUMENT, &TOOL_PROCESS), 1);
    assert_eq!(limit.available(), 0, "the second stream holds the permit");

    second_call.send();
    second_call.finish();
    let (messages, status) = tokio::time::timeout(DEADLINE, second)
        .await
        .expect("the second stream never ended")
        .unwrap()
        .unwrap();
    assert_eq!((messages, status.map_err(|s| s.code())), (1, Ok(())));

    // The second started waiting before `queued_by` and was admitted after `first_ends`.
    let rest = first_ends.duration_since(queued_by).as_secs_f64() * 1000.0;
    assert!(rest >= REST.as_secs_f64() * 1000.0);
    let waited = telemetry
        .max(QUEUE_DURATION_INSTRUMENT, &TOOL_PROCESS)
        .expect("queue samples");
    assert!(
        waited >= rest,
        "the second stream waited {waited} ms, the rest of the first took {rest} ms"
    );
    assert_eq!(telemetry.count(QUEUE_DURATION_INSTRUMENT, &TOOL_PROCESS), 2);
    assert_eq!(ended(&telemetry, &TOOL_PROCESS, "ok"), 2);
    assert_eq!(ended_at_all(&telemetry, &TOOL_PROCESS), 2);
    assert_eq!(backend.checks(), 0);
    assert_idle(&telemetry, &limit);
}

// ---------------------------------------------------------------------------------------------
// A client that hangs up mid-stream.

/// A client that drops the stream mid-way (no deadline involved) resets it; the server drops the
/// body, which ends the operation `cancelled` and frees the permit for the next call.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_client_that_hangs_up_mid_stream_ends_the_operation_cancelled_and_frees_the_permit() {
    let telemetry = Telemetry::new();
    let (backend, mut watches) = Backend::new();
    let layer = body_end(&telemetry, 1);
    let limit = layer.limit().clone();
    let channel = connect(serve(&backend, layer)).await;

    let mut stream = watch(&channel, "abandoned").await.unwrap();
    let call = next_watch(&mut watches).await;
    call.send();
    assert!(message(&mut stream).await.unwrap().is_some());
    assert_eq!(telemetry.live_value(ACTIVE_INSTRUMENT, &TOOL_PROCESS), 1);
    assert_eq!(limit.available(), 0);

    drop(stream); // the client hangs up
    call.dropped().await;
    eventually("the operation ended as cancelled", || {
        ended(&telemetry, &TOOL_PROCESS, "cancelled") == 1
    })
    .await;
    assert_eq!(ended_at_all(&telemetry, &TOOL_PROCESS), 1);
    assert_idle(&telemetry, &limit);

    // The permit is free again: the next stream is admitted at once, and ends `ok`.
    let stream = watch(&channel, "next").await.unwrap();
    let call = next_watch(&mut watches).await;
    assert_eq!(call.service, "next");
    call.send();
    call.finish();
    let (messages, status) = drain(stream).await;
    assert_eq!((messages, status.map_err(|s| s.code())), (1, Ok(())));
    assert_eq!(ended(&telemetry, &TOOL_PROCESS, "ok"), 1);
    assert_eq!(ended(&telemetry, &TOOL_PROCESS, "cancelled"), 1);
    assert_idle(&telemetry, &limit);
}

// ---------------------------------------------------------------------------------------------
// Per request, over a whole server.

/// One body-end layer on `Server::builder()`, choosing per method: `Watch` calls are limited and
/// recorded as judge/inline; `Check` calls are neither, so a `Check` answers while the limit is
/// full of `Watch` streams, and records nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn per_request_over_a_whole_server_limits_and_records_watch_but_not_check() {
    let telemetry = Telemetry::new();
    let (backend, mut watches) = Backend::new();
    let layer = ResourcesOperationLayer::new_for_grpc(2)
        .metrics(telemetry.metrics.clone())
        .until_body_end()
        .per_request(
            ByGrpcMethod::new()
                .method(
                    "grpc.health.v1.Health/Watch",
                    Choice::limited(Operation::Judge, Executor::Inline),
                )
                .method("grpc.health.v1.Health/Check", Choice::Unlimited),
        );
    let limit = layer.limit().clone();
    let (incoming, addr) = incoming();
    let router = Server::builder()
        .layer(layer)
        .add_service(HealthServer::from_arc(Arc::clone(&backend)));
    tokio::spawn(async move { router.serve_with_incoming(incoming).await.unwrap() });
    let channel = connect(addr).await;
    let judge_inline = [
        (OPERATION_ATTRIBUTE, "judge"),
        (EXECUTOR_ATTRIBUTE, "inline"),
    ];

    // Two streams fill the limit; a third waits.
    let a = watch(&channel, "a").await.unwrap();
    let a_call = next_watch(&mut watches).await;
    let b = watch(&channel, "b").await.unwrap();
    let b_call = next_watch(&mut watches).await;
    assert_eq!(limit.available(), 0);
    assert_eq!(telemetry.live_value(ACTIVE_INSTRUMENT, &judge_inline), 2);
    let c = tokio::spawn({
        let channel = channel.clone();
        async move { drain(watch(&channel, "c").await?).await.1 }
    });
    eventually("the third stream waits for a permit", || {
        telemetry.live_value(QUEUED_INSTRUMENT, &judge_inline) == 1
    })
    .await;
    assert_no_watch_started(
        &mut watches,
        "a third stream ran beside two on a limit of 2",
    );

    // Check is not limited: it answers now, and is recorded nowhere.
    for _ in 0..3 {
        assert_eq!(
            check(&channel, "ok").await.unwrap(),
            ServingStatus::Serving as i32
        );
    }
    let status = check(&channel, "internal").await.unwrap_err();
    assert_eq!(status.code(), Code::Internal);
    assert_eq!(backend.checks(), 4);
    assert_eq!(telemetry.count(DURATION_INSTRUMENT, &[]), 0);
    assert_eq!(
        telemetry.count(QUEUE_DURATION_INSTRUMENT, &[]),
        2,
        "a and b"
    );
    assert_eq!(telemetry.live_value(QUEUED_INSTRUMENT, &[]), 1, "c");
    assert_eq!(telemetry.live_value(ACTIVE_INSTRUMENT, &[]), 2, "a and b");

    // The first stream to end lets the third in.
    a_call.send();
    a_call.finish();
    assert_eq!(drain(a).await.0, 1);
    let c_call = next_watch(&mut watches).await;
    assert_eq!(c_call.service, "c");
    b_call.fail(Status::internal("b broke"));
    assert_eq!(drain(b).await.1.unwrap_err().code(), Code::Internal);
    c_call.finish();
    tokio::time::timeout(DEADLINE, c)
        .await
        .expect("c never ended")
        .unwrap()
        .unwrap();

    let outcomes = telemetry.outcomes(&judge_inline);
    assert_eq!(outcomes.get("ok"), Some(&2), "{outcomes:?}");
    assert_eq!(outcomes.get("error"), Some(&1), "{outcomes:?}");
    // Only the three Watch calls were recorded, all as judge/inline.
    assert_eq!(telemetry.count(DURATION_INSTRUMENT, &[]), 3);
    assert_eq!(telemetry.count(QUEUE_DURATION_INSTRUMENT, &[]), 3);
    assert_eq!(telemetry.count(QUEUE_DURATION_INSTRUMENT, &judge_inline), 3);
    assert_idle(&telemetry, &limit);
}

// ---------------------------------------------------------------------------------------------
// Rejections in gRPC.

/// A gRPC layer on a limit that lets nobody wait: a call that finds the limit full (here
/// held by a stream) is answered RESOURCE_EXHAUSTED without reaching its handler, and counted in
/// `gym.resources.operation.rejected{rejection="queue_full"}`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_call_that_finds_the_limit_full_gets_resource_exhausted_and_is_counted_rejected() {
    let telemetry = Telemetry::new();
    let (backend, mut watches) = Backend::new();
    let limit = Limit::with_max_queued(1, 0);
    let layer = ResourcesOperationLayer::new_for_grpc(limit.clone())
        .operation(Operation::Tool)
        .executor(Executor::Process)
        .metrics(telemetry.metrics.clone())
        .until_body_end();
    let channel = connect(serve(&backend, layer)).await;
    let queue_full = [
        TOOL_PROCESS[0],
        TOOL_PROCESS[1],
        (REJECTION_ATTRIBUTE, "queue_full"),
    ];

    // A stream holds the one permit.
    let mut holder = watch(&channel, "holder").await.unwrap();
    let holder_call = next_watch(&mut watches).await;
    holder_call.send();
    assert!(message(&mut holder).await.unwrap().is_some());
    assert_eq!(limit.available(), 0);

    let status = check(&channel, "ok").await.unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(status.message().contains("queue is full"), "{status:?}");
    let status = watch(&channel, "turned away").await.unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert_eq!(
        backend.checks(),
        0,
        "a rejected call never reaches its handler"
    );
    assert_no_watch_started(&mut watches, "a rejected stream reached its handler");
    assert_eq!(telemetry.live_value(REJECTED_INSTRUMENT, &queue_full), 2);
    assert_eq!(telemetry.live_value(REJECTED_INSTRUMENT, &[]), 2);
    assert_eq!(telemetry.live_value(QUEUED_INSTRUMENT, &TOOL_PROCESS), 0);
    assert_eq!(
        telemetry.count(QUEUE_DURATION_INSTRUMENT, &TOOL_PROCESS),
        1,
        "the holder only"
    );
    assert_eq!(
        ended_at_all(&telemetry, &TOOL_PROCESS),
        0,
        "the holder still runs"
    );

    // The holder ends; the permit is back and the next call is served.
    holder_call.finish();
    assert!(message(&mut holder).await.unwrap().is_none());
    assert_eq!(limit.available(), 1);
    check(&channel, "ok").await.unwrap();
    assert_eq!(ended(&telemetry, &TOOL_PROCESS, "ok"), 2);
    assert_eq!(ended_at_all(&telemetry, &TOOL_PROCESS), 2);
    assert_eq!(telemetry.live_value(REJECTED_INSTRUMENT, &[]), 2);
    assert_idle(&telemetry, &limit);
}
