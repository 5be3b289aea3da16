//! Each operation in its request's trace, through a real pipeline: `tracing-subscriber`,
//! `tracing-opentelemetry` and the OpenTelemetry SDK exporting spans over OTLP to a receiver on
//! 127.0.0.1 (tests/support/traces.rs); an axum server with tower-http's `TraceLayer` and a
//! limit of 1; every ending of an operation, and tonic once.
#![cfg(feature = "tracing")]

mod support;

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::StatusCode;
use axum::routing::{get, MethodRouter};
use axum::Router;
use bytes::Bytes;
use opentelemetry_proto::tonic::trace::v1::Span;
use tokio::sync::Notify;
use tower_http::catch_panic::CatchPanicLayer;
use tower_http::timeout::TimeoutLayer;
use tower_http::trace::TraceLayer;

use support::http::{get_request, serve, verify_layer, Client};
use support::traces::{attributes, length, number, string, traces, Trace};
use support::{eventually, Telemetry};
use tower_resources_operation::names::{
    DURATION_ATTRIBUTE, DURATION_INSTRUMENT, EXECUTOR_ATTRIBUTE, LIMIT_ATTRIBUTE,
    OPERATION_ATTRIBUTE, OUTCOME_ATTRIBUTE, QUEUED_AHEAD_ATTRIBUTE, QUEUED_INSTRUMENT,
    QUEUE_DURATION_ATTRIBUTE, QUEUE_DURATION_INSTRUMENT, REJECTION_ATTRIBUTE, RUN_SPAN,
    WAIT_ATTRIBUTE, WAIT_SPAN,
};
use tower_resources_operation::{Executor, Limit, Operation};

/// How long the request ahead holds the place.
const HELD: Duration = Duration::from_millis(200);

const VERIFY: [(&str, &str); 1] = [(OPERATION_ATTRIBUTE, "verify")];

/// Sends `first`, then, once its operation runs, `second`, which waits behind it; both are
/// answered 200.
async fn one_behind_another(
    addr: std::net::SocketAddr,
    telemetry: &Telemetry,
    first: &'static str,
    second: &'static str,
) {
    let ahead = tokio::spawn(async move { Client::open(addr).await.get(first).await });
    eventually("the first runs", || {
        telemetry.live_value(tower_resources_operation::names::ACTIVE_INSTRUMENT, &VERIFY) == 1
    })
    .await;
    assert_eq!(Client::open(addr).await.get(second).await.0, 200);
    assert_eq!(ahead.await.unwrap().0, 200);
}

/// A named limit of 1, with at most `queued` waiting.
fn verifiers(queued: usize) -> Limit {
    Limit::builder(1)
        .max_queued(queued)
        .name("verifiers")
        .build()
}

/// A handler that holds its place until `release` is notified.
fn held(release: &Arc<Notify>) -> MethodRouter {
    let release = Arc::clone(release);
    get(move || async move {
        release.notified().await;
        "released"
    })
}

fn slow() -> MethodRouter {
    get(|| async {
        tokio::time::sleep(HELD).await;
        "done"
    })
}

/// The parent of `span` is `parent`.
fn assert_child(span: &Span, parent: &Span) {
    assert_eq!(
        span.parent_span_id, parent.span_id,
        "{} is not a child of {}",
        span.name, parent.name
    );
    assert_eq!(span.trace_id, parent.trace_id);
}

/// The wait span of a trace, closed, under its request.
fn wait_of(trace: &Trace) -> &Span {
    let wait = trace.one(WAIT_SPAN);
    assert_child(wait, &trace.request);
    assert!(wait.end_time_unix_nano >= wait.start_time_unix_nano);
    let attrs = attributes(wait);
    assert_eq!(attrs[OPERATION_ATTRIBUTE], "verify", "{attrs:?}");
    assert_eq!(attrs[EXECUTOR_ATTRIBUTE], "subprocess", "{attrs:?}");
    assert_eq!(attrs[LIMIT_ATTRIBUTE], "verifiers", "{attrs:?}");
    wait
}

/// A server whose `/hold` (on `limit`) holds its place until released, beside `rest`, all
/// inside `TraceLayer`.
struct Held {
    addr: std::net::SocketAddr,
    holder: tokio::task::JoinHandle<(u16, String)>,
    release: Arc<Notify>,
}

/// Serves `/hold` and `rest`, and holds the place.
async fn serve_held(telemetry: &Telemetry, limit: &Limit, rest: Router) -> Held {
    let release = Arc::new(Notify::new());
    let app = Router::new()
        .route(
            "/hold",
            held(&release).layer(verify_layer(telemetry, limit)),
        )
        .merge(rest)
        .layer(TraceLayer::new_for_http());
    let addr = serve(app).await;
    let holder = tokio::spawn(async move { Client::open(addr).await.get("/hold").await });
    eventually("the place is held", || {
        telemetry.live_value(tower_resources_operation::names::ACTIVE_INSTRUMENT, &VERIFY) == 1
    })
    .await;
    Held {
        addr,
        holder,
        release,
    }
}

impl Held {
    /// Lets the held request end.
    async fn release(self) {
        self.release.notify_one();
        assert_eq!(self.holder.await.unwrap().0, 200);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_is_a_span_under_its_request_as_long_as_the_recorded_queue_time() {
    let traces = traces();
    let telemetry = Telemetry::new();
    let limit = verifiers(8);
    let app = Router::new()
        .route(
            "/waited/first",
            slow().layer(verify_layer(&telemetry, &limit)),
        )
        .route(
            "/waited/second",
            slow().layer(verify_layer(&telemetry, &limit)),
        )
        .layer(TraceLayer::new_for_http());
    let addr = serve(app).await;
    one_behind_another(addr, &telemetry, "/waited/first", "/waited/second").await;

    let trace = traces.trace_of("/waited/second", 2).await;
    let wait = wait_of(&trace);
    let attrs = attributes(wait);
    assert_eq!(attrs[WAIT_ATTRIBUTE], "admitted", "{attrs:?}");
    assert_eq!(attrs[QUEUED_AHEAD_ATTRIBUTE], "0", "{attrs:?}");
    assert!(!attrs.contains_key(REJECTION_ATTRIBUTE), "{attrs:?}");

    // The queue time: the first request's had none, so the largest recorded is this one's.
    let recorded = telemetry.max(QUEUE_DURATION_INSTRUMENT, &VERIFY).unwrap();
    assert!(recorded > 100.0, "it waited about {HELD:?}: {recorded} ms");
    assert_eq!(number(wait, QUEUE_DURATION_ATTRIBUTE), Some(recorded));
    let drawn = length(wait).as_secs_f64() * 1e3;
    assert!(
        (drawn - recorded).abs() < 1.0,
        "the wait span lasts {drawn} ms, the histogram says {recorded} ms"
    );

    let run = trace.one(RUN_SPAN);
    assert_child(run, &trace.request);
    assert!(run.start_time_unix_nano >= wait.end_time_unix_nano);
    let run_attrs = attributes(run);
    assert_eq!(run_attrs[OUTCOME_ATTRIBUTE], "ok", "{run_attrs:?}");
    assert_eq!(number(run, QUEUE_DURATION_ATTRIBUTE), Some(recorded));
    let ran = telemetry.max(DURATION_INSTRUMENT, &VERIFY).unwrap();
    let run_ms = number(run, DURATION_ATTRIBUTE).unwrap();
    assert!(
        run_ms >= 150.0 && run_ms <= ran,
        "{run_ms} ms of at most {ran}"
    );
    assert!((length(run).as_secs_f64() * 1e3 - run_ms).abs() < 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operation_that_did_not_wait_has_a_run_span_only() {
    let traces = traces();
    let telemetry = Telemetry::new();
    let limit = verifiers(8);
    let app = Router::new()
        .route(
            "/at_once",
            get(|| async { "done" }).layer(verify_layer(&telemetry, &limit)),
        )
        .layer(TraceLayer::new_for_http());
    let addr = serve(app).await;
    assert_eq!(Client::open(addr).await.get("/at_once").await.0, 200);

    let trace = traces.trace_of("/at_once", 1).await;
    assert!(trace.named(WAIT_SPAN).is_empty(), "{trace:#?}");
    let run = trace.one(RUN_SPAN);
    assert_child(run, &trace.request);
    assert_eq!(string(run, OUTCOME_ATTRIBUTE).as_deref(), Some("ok"));
    assert_eq!(number(run, QUEUE_DURATION_ATTRIBUTE), Some(0.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rejection_closes_its_wait_span_with_the_reason() {
    let traces = traces();
    let telemetry = Telemetry::new();
    let limit = verifiers(0);
    let rest = Router::new().route("/rejected", slow().layer(verify_layer(&telemetry, &limit)));
    let held = serve_held(&telemetry, &limit, rest).await;
    assert_eq!(Client::open(held.addr).await.get("/rejected").await.0, 503);
    held.release().await;

    let trace = traces.trace_of("/rejected", 1).await;
    let attrs = attributes(wait_of(&trace));
    assert_eq!(attrs[WAIT_ATTRIBUTE], "rejected", "{attrs:?}");
    assert_eq!(attrs[REJECTION_ATTRIBUTE], "queue_full", "{attrs:?}");
    assert!(trace.named(RUN_SPAN).is_empty(), "it never ran: {trace:#?}");
}

/// A request turned away at once because the queue is full has a wait span of no length that
/// counts the request waiting ahead of it: that one is why the queue was full.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_turned_away_at_once_counts_the_waiters_ahead_of_it() {
    let traces = traces();
    let telemetry = Telemetry::new();
    let limit = verifiers(1);
    let rest = Router::new()
        .route(
            "/waits-ahead",
            slow().layer(verify_layer(&telemetry, &limit)),
        )
        .route(
            "/turned-away",
            slow().layer(verify_layer(&telemetry, &limit)),
        );
    let held = serve_held(&telemetry, &limit, rest).await;
    let addr = held.addr;
    let waiting = tokio::spawn(async move { Client::open(addr).await.get("/waits-ahead").await });
    eventually("one request waits", || limit.queued() == 1).await;
    assert_eq!(
        Client::open(held.addr).await.get("/turned-away").await.0,
        503
    );
    held.release().await;
    assert_eq!(waiting.await.unwrap().0, 200);

    let trace = traces.trace_of("/turned-away", 1).await;
    let attrs = attributes(wait_of(&trace));
    assert_eq!(attrs[WAIT_ATTRIBUTE], "rejected", "{attrs:?}");
    assert_eq!(attrs[REJECTION_ATTRIBUTE], "queue_full", "{attrs:?}");
    assert_eq!(attrs[QUEUED_AHEAD_ATTRIBUTE], "1", "{attrs:?}");
    let waited = traces.trace_of("/waits-ahead", 2).await;
    let attrs = attributes(wait_of(&waited));
    assert_eq!(
        attrs[QUEUED_AHEAD_ATTRIBUTE], "0",
        "nobody waited ahead of it: {attrs:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_wait_closes_its_span_as_abandoned() {
    let traces = traces();
    let telemetry = Telemetry::new();
    let limit = verifiers(8);
    let rest = Router::new().route("/abandoned", slow().layer(verify_layer(&telemetry, &limit)));
    let held = serve_held(&telemetry, &limit, rest).await;
    let mut client = Client::open(held.addr).await;
    let response = client.send(get_request("/abandoned")).await;
    let waiting = tokio::spawn(response);
    eventually("it waits", || {
        telemetry.live_value(QUEUED_INSTRUMENT, &VERIFY) == 1
    })
    .await;
    waiting.abort();
    client.hang_up();
    eventually("the server drops it", || {
        telemetry.live_value(QUEUED_INSTRUMENT, &VERIFY) == 0
    })
    .await;
    held.release().await;

    let trace = traces.trace_of("/abandoned", 1).await;
    let wait = wait_of(&trace);
    let attrs = attributes(wait);
    assert_eq!(attrs[WAIT_ATTRIBUTE], "abandoned", "{attrs:?}");
    assert!(!attrs.contains_key(REJECTION_ATTRIBUTE), "{attrs:?}");
    assert!(
        number(wait, QUEUE_DURATION_ATTRIBUTE).is_some(),
        "{attrs:?}"
    );
    assert!(trace.named(RUN_SPAN).is_empty(), "it never ran: {trace:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_dropped_at_the_servers_deadline_closes_its_span_as_a_deadline_rejection() {
    const DEADLINE_OF_SERVER: Duration = Duration::from_millis(300);
    let traces = traces();
    let telemetry = Telemetry::new();
    let limit = verifiers(8);
    let told = verify_layer(&telemetry, &limit).server_timeout(DEADLINE_OF_SERVER);
    let timing_out =
        Router::new()
            .route("/deadline", slow().layer(told))
            .layer(TimeoutLayer::with_status_code(
                StatusCode::REQUEST_TIMEOUT,
                DEADLINE_OF_SERVER,
            ));
    let held = serve_held(&telemetry, &limit, timing_out).await;
    assert_eq!(Client::open(held.addr).await.get("/deadline").await.0, 408);
    held.release().await;

    let trace = traces.trace_of("/deadline", 1).await;
    let wait = wait_of(&trace);
    let attrs = attributes(wait);
    assert_eq!(attrs[WAIT_ATTRIBUTE], "rejected", "{attrs:?}");
    assert_eq!(attrs[REJECTION_ATTRIBUTE], "deadline", "{attrs:?}");
    assert!(length(wait) >= Duration::from_millis(250), "{attrs:?}");
    assert!(trace.named(RUN_SPAN).is_empty(), "it never ran: {trace:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_closes_the_run_span_as_crashed() {
    let traces = traces();
    let telemetry = Telemetry::new();
    let limit = verifiers(8);
    let panics = get(|| async {
        if true {
            panic!("the verifier panicked");
        }
        "unreachable"
    });
    let app = Router::new()
        .route("/panics", panics.layer(verify_layer(&telemetry, &limit)))
        .layer(CatchPanicLayer::new())
        .layer(TraceLayer::new_for_http());
    let addr = serve(app).await;
    assert_eq!(Client::open(addr).await.get("/panics").await.0, 500);

    let trace = traces.trace_of("/panics", 1).await;
    let run = trace.one(RUN_SPAN);
    assert_child(run, &trace.request);
    assert_eq!(string(run, OUTCOME_ATTRIBUTE).as_deref(), Some("crashed"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_bodys_run_span_ends_when_the_body_ends() {
    const BETWEEN: Duration = Duration::from_millis(150);
    let traces = traces();
    let telemetry = Telemetry::new();
    let limit = verifiers(8);
    let streams = get(|| async {
        let chunks = futures_util::stream::unfold(0, |sent| async move {
            if sent == 2 {
                return None;
            }
            if sent == 1 {
                tokio::time::sleep(BETWEEN).await;
            }
            Some((Ok::<_, Infallible>(Bytes::from("chunk")), sent + 1))
        });
        Body::from_stream(chunks)
    });
    let app = Router::new()
        .route(
            "/streamed",
            streams.layer(verify_layer(&telemetry, &limit).until_body_end()),
        )
        .layer(TraceLayer::new_for_http());
    let addr = serve(app).await;
    let (status, body) = Client::open(addr).await.get("/streamed").await;
    assert_eq!((status, body.as_str()), (200, "chunkchunk"));

    let trace = traces.trace_of("/streamed", 1).await;
    let run = trace.one(RUN_SPAN);
    assert_child(run, &trace.request);
    assert_eq!(string(run, OUTCOME_ATTRIBUTE).as_deref(), Some("ok"));
    // The handler answered at once; the span lasted as long as the body streamed.
    assert!(length(run) >= BETWEEN, "{:?}", length(run));
    let run_ms = number(run, DURATION_ATTRIBUTE).unwrap();
    assert!(run_ms >= 150.0, "{run_ms}");
    assert_eq!(telemetry.max(DURATION_INSTRUMENT, &VERIFY), Some(run_ms));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_scoped_form_traces_inside_the_span_that_calls_it() {
    let traces = traces();
    let telemetry = Arc::new(Telemetry::new());
    let limit = verifiers(8);
    let (first, second) = {
        let route = |telemetry: &Arc<Telemetry>| {
            let (telemetry, limit) = (Arc::clone(telemetry), limit.clone());
            get(move || async move {
                telemetry
                    .metrics
                    .resources_operation(limit, Operation::Verify, Executor::Subprocess, async {
                        tokio::time::sleep(HELD).await;
                    })
                    .await
                    .unwrap();
                "done"
            })
        };
        (route(&telemetry), route(&telemetry))
    };
    let app = Router::new()
        .route("/scoped/first", first)
        .route("/scoped/second", second)
        .layer(TraceLayer::new_for_http());
    let addr = serve(app).await;
    one_behind_another(addr, &telemetry, "/scoped/first", "/scoped/second").await;

    let trace = traces.trace_of("/scoped/second", 2).await;
    let wait = wait_of(&trace);
    assert_eq!(string(wait, WAIT_ATTRIBUTE).as_deref(), Some("admitted"));
    let recorded = telemetry.max(QUEUE_DURATION_INSTRUMENT, &VERIFY).unwrap();
    assert_eq!(number(wait, QUEUE_DURATION_ATTRIBUTE), Some(recorded));
    let run = trace.one(RUN_SPAN);
    assert_child(run, &trace.request);
    assert_eq!(string(run, OUTCOME_ATTRIBUTE).as_deref(), Some("ok"));
}

/// With the layer outside `TraceLayer`, no span is current when the operation waits: the run
/// span is the wait's child, and the request span the run's, one trace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outside_the_request_span_the_wait_and_the_request_stay_one_trace() {
    let traces = traces();
    let telemetry = Telemetry::new();
    let limit = verifiers(8);
    let app = Router::new()
        .route("/outside/first", slow())
        .route("/outside/second", slow())
        .layer(TraceLayer::new_for_http())
        .layer(verify_layer(&telemetry, &limit));
    let addr = serve(app).await;
    one_behind_another(addr, &telemetry, "/outside/first", "/outside/second").await;

    let trace = traces.trace_of("/outside/second", 2).await;
    let wait = trace.one(WAIT_SPAN);
    assert!(
        wait.parent_span_id.is_empty(),
        "the wait is the root: {wait:#?}"
    );
    let run = trace.one(RUN_SPAN);
    assert_child(run, wait);
    assert_child(&trace.request, run);
}

#[cfg(feature = "tonic")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpc_call_that_waits_has_its_wait_span_under_its_request() {
    use support::grpc::{check, grpc_layer, serve_with};
    use support::within;
    use tonic::transport::Server;

    let traces = traces();
    let telemetry = Telemetry::new();
    let limit = verifiers(8);
    let layer = grpc_layer(&telemetry, &limit);
    let served = serve_with(|health, incoming| {
        Server::builder()
            .layer(TraceLayer::new_for_grpc())
            .add_service(tower::Layer::layer(&layer, health))
            .serve_with_incoming(incoming)
    })
    .await;
    let channel = served.channel.clone();
    let ahead = tokio::spawn(async move { check(&channel, "slow").await });
    let other = [(OPERATION_ATTRIBUTE, "other")];
    eventually("the first runs", || {
        telemetry.live_value(tower_resources_operation::names::ACTIVE_INSTRUMENT, &other) == 1
    })
    .await;
    within("the second check", check(&served.channel, "slow"))
        .await
        .unwrap();
    ahead.await.unwrap().unwrap();

    // Both calls have the same URI: the second is the one whose operation waited.
    let mut found = None;
    for _ in 0..100 {
        let spans = traces.flush().await;
        let waited = spans.iter().find(|span| {
            span.name == WAIT_SPAN && string(span, OPERATION_ATTRIBUTE).as_deref() == Some("other")
        });
        if let Some(wait) = waited {
            let parent = spans.iter().find(|s| s.span_id == wait.parent_span_id);
            if let Some(parent) = parent {
                found = Some((wait.clone(), parent.clone()));
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (wait, request) = found.expect("a gRPC wait span under its request");
    assert_eq!(request.name, "request");
    let uri = string(&request, "uri").unwrap();
    assert!(uri.ends_with("/grpc.health.v1.Health/Check"), "{uri}");
    assert_eq!(string(&wait, WAIT_ATTRIBUTE).as_deref(), Some("admitted"));
    let recorded = telemetry.max(QUEUE_DURATION_INSTRUMENT, &other).unwrap();
    assert_eq!(number(&wait, QUEUE_DURATION_ATTRIBUTE), Some(recorded));
    assert!(recorded > 50.0, "{recorded}");
}

/// The per-request form, one layer on the whole `Router` under `TraceLayer`: the operation each
/// request chose is in its spans, under its request, as with a layer per route.
#[cfg(feature = "axum")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_per_request_form_traces_the_operation_each_request_chose() {
    use tower_resources_operation::per_request::{ByRoute, Choice};
    use tower_resources_operation::ResourcesOperationLayer;

    let traces = traces();
    let telemetry = Telemetry::new();
    let limit = verifiers(8);
    let verify = Choice::limited(Operation::Verify, Executor::Subprocess);
    let chooser = ByRoute::new()
        .route("/chosen/first", verify)
        .route("/chosen/second", verify);
    let per_request = ResourcesOperationLayer::new_for_http(limit.clone())
        .metrics(telemetry.metrics.clone())
        .per_request(chooser);
    let app = Router::new()
        .route("/chosen/first", slow())
        .route("/chosen/second", slow())
        .layer(per_request)
        .layer(TraceLayer::new_for_http());
    let addr = serve(app).await;
    one_behind_another(addr, &telemetry, "/chosen/first", "/chosen/second").await;

    let trace = traces.trace_of("/chosen/second", 2).await;
    let wait = wait_of(&trace);
    let attrs = attributes(wait);
    assert_eq!(attrs[WAIT_ATTRIBUTE], "admitted", "{attrs:?}");
    let recorded = telemetry.max(QUEUE_DURATION_INSTRUMENT, &VERIFY).unwrap();
    assert_eq!(number(wait, QUEUE_DURATION_ATTRIBUTE), Some(recorded));
    let run = trace.one(RUN_SPAN);
    assert_child(run, &trace.request);
    assert_eq!(string(run, OUTCOME_ATTRIBUTE).as_deref(), Some("ok"));
    assert_eq!(string(run, OPERATION_ATTRIBUTE).as_deref(), Some("verify"));
}
