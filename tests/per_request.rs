#![cfg(feature = "axum")]
//! The per-request form of the layer: one `ResourcesOperationLayer::per_request(chooser)` on a
//! whole axum `Router` (`Router::layer`), each request choosing its operation and executor, or to
//! go unlimited, over real axum servers on 127.0.0.1 with hyper clients.
//!
//! `ByRoute` records each request under the series of the route template it matched, lets
//! `/metrics` through unlimited and unrecorded (it answers at once while the limit is full), and
//! sends a 404 to `otherwise`; the limit holds across connections and counts waiters in `queued`
//! from `call` on; a closure chooser maps arbitrary header values onto the bounded values only;
//! `ByRoute` lets method rules win over service rules; a chooser that panics costs the request
//! only its tags; and an HTTP layer answers a full queue with 503 and counts it in
//! `gym.resources.operation.rejected`.

mod support;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::Path;
use axum::routing::{get, post, MethodRouter};
use axum::Router;
use bytes::Bytes;
use http::header::HOST;
use http::{Method, Request};
use http_body_util::Empty;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use support::http::{serve, Client};
use support::{eventually, Load, Telemetry, DEADLINE};
use tower_resources_operation::classify::HttpClassifier;
use tower_resources_operation::names::{
    ACTIVE_INSTRUMENT, DURATION_INSTRUMENT, EXECUTORS, EXECUTOR_ATTRIBUTE, OPERATIONS,
    OPERATION_ATTRIBUTE, OUTCOME_ATTRIBUTE, QUEUED_INSTRUMENT, QUEUE_DURATION_INSTRUMENT,
    REJECTED_INSTRUMENT, REJECTION_ATTRIBUTE,
};
use tower_resources_operation::per_request::{ByRoute, Choice, ChooseFn, ChooseOperation};
use tower_resources_operation::protocol::Http;
use tower_resources_operation::{Executor, Limit, Operation, ResourcesOperationLayer};

const VERIFY: Choice = Choice::limited(Operation::Verify, Executor::Subprocess);
const JUDGE: Choice = Choice::limited(Operation::Judge, Executor::Inline);
const TOOL: Choice = Choice::limited(Operation::Tool, Executor::Thread);

/// The attributes of the series of `choice`, a limited one.
fn series(choice: Choice) -> [(&'static str, &'static str); 2] {
    let Choice::Limited {
        operation,
        executor,
        ..
    } = choice
    else {
        panic!("an unlimited choice has no series")
    };
    [
        (OPERATION_ATTRIBUTE, operation.as_str()),
        (EXECUTOR_ATTRIBUTE, executor.as_str()),
    ]
}

/// How many operations of `choice`'s series ended.
fn ended(telemetry: &Telemetry, choice: Choice) -> u64 {
    telemetry.count(DURATION_INSTRUMENT, &series(choice))
}

/// The (operation, executor) of every series the duration histogram exported.
fn recorded_series(telemetry: &Telemetry) -> BTreeSet<(String, String)> {
    telemetry
        .histogram(DURATION_INSTRUMENT)
        .iter()
        .map(|p| {
            (
                p.attributes[OPERATION_ATTRIBUTE].clone(),
                p.attributes[EXECUTOR_ATTRIBUTE].clone(),
            )
        })
        .collect()
}

fn pair(operation: &str, executor: &str) -> (String, String) {
    (operation.to_owned(), executor.to_owned())
}

/// Sends `method path` with `headers` on a connection of its own; returns status and body.
async fn send(
    addr: SocketAddr,
    method: Method,
    path: &str,
    headers: &[(&str, &str)],
) -> (u16, String) {
    let mut request = Request::builder()
        .method(method)
        .uri(path)
        .header(HOST, "127.0.0.1");
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let mut client = Client::open(addr).await;
    let answer = client.exchange(request.body(Empty::new()).unwrap()).await;
    client.closed().await;
    answer
}

async fn get_path(addr: SocketAddr, path: &str) -> (u16, String) {
    send(addr, Method::GET, path, &[]).await
}

/// `path` GET on a connection of its own, in a task of its own.
fn spawn_get(addr: SocketAddr, path: &'static str) -> JoinHandle<(u16, String)> {
    tokio::spawn(async move { get_path(addr, path).await })
}

async fn join(task: JoinHandle<(u16, String)>) -> (u16, String) {
    tokio::time::timeout(DEADLINE, task)
        .await
        .expect("a client hung")
        .unwrap()
}

/// A gate that handlers wait on until the test opens it.
struct Gate {
    open: watch::Sender<bool>,
}

impl Gate {
    fn new() -> Self {
        Self {
            open: watch::channel(false).0,
        }
    }

    /// A GET route that waits for the gate, then answers `answer`.
    fn route(&self, answer: &'static str) -> MethodRouter {
        let open = self.open.subscribe();
        get(move || {
            let mut open = open.clone();
            async move {
                open.wait_for(|open| *open).await.unwrap();
                answer
            }
        })
    }

    fn open(&self) {
        self.open.send_replace(true);
    }
}

/// `/verify`, `/judge/{model}` and `/metrics`, under one per-request layer of limit 4 that
/// chooses by matched route, with `otherwise` if given.
async fn matched_path_server(telemetry: &Telemetry, otherwise: Option<Choice>) -> SocketAddr {
    let mut chooser = ByRoute::new()
        .route("/verify", VERIFY)
        .route("/judge/{model}", JUDGE)
        .route("/metrics", Choice::Unlimited);
    if let Some(otherwise) = otherwise {
        chooser = chooser.otherwise(otherwise);
    }
    let router = Router::new()
        .route("/verify", get(|| async { "verified" }))
        .route(
            "/judge/{model}",
            get(|Path(model): Path<String>| async move { format!("judged by {model}") }),
        )
        .route("/metrics", get(|| async { "# metrics" }));
    serve_choosing(telemetry, &Limit::new(4), router, chooser).await
}

/// Two verifies, two judges on two models, two scrapes and a 404.
async fn one_of_each(addr: SocketAddr) {
    for (path, expected) in [
        ("/verify", (200, "verified")),
        ("/verify", (200, "verified")),
        ("/judge/gpt", (200, "judged by gpt")),
        ("/judge/llama", (200, "judged by llama")),
        ("/metrics", (200, "# metrics")),
        ("/metrics", (200, "# metrics")),
        ("/no/such/route", (404, "")),
    ] {
        let (status, body) = get_path(addr, path).await;
        assert_eq!((status, body.as_str()), expected, "{path}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn by_matched_path_records_each_request_under_its_route_template_and_a_404_as_other() {
    let telemetry = Telemetry::new();
    let addr = matched_path_server(&telemetry, None).await;

    one_of_each(addr).await;

    assert_eq!(ended(&telemetry, VERIFY), 2);
    // `/judge/gpt` and `/judge/llama` match the rule of the template `/judge/{model}`: the raw
    // paths name no rule, and would have been `other`.
    assert_eq!(ended(&telemetry, JUDGE), 2);
    assert_eq!(
        telemetry.count(QUEUE_DURATION_INSTRUMENT, &series(JUDGE)),
        2
    );
    // The 404 matched no route: `otherwise`, by default other/other (and a 404 is ok to the HTTP
    // classifier).
    assert_eq!(ended(&telemetry, Choice::OTHER), 1);
    let other_ok = [
        (OPERATION_ATTRIBUTE, "other"),
        (EXECUTOR_ATTRIBUTE, "other"),
        (OUTCOME_ATTRIBUTE, "ok"),
    ];
    assert_eq!(telemetry.count(DURATION_INSTRUMENT, &other_ok), 1);
    // `/metrics` is recorded nowhere.
    assert_eq!(telemetry.count(DURATION_INSTRUMENT, &[]), 5);
    assert_eq!(telemetry.count(QUEUE_DURATION_INSTRUMENT, &[]), 5);
    assert_eq!(
        recorded_series(&telemetry),
        BTreeSet::from([
            pair("verify", "subprocess"),
            pair("judge", "inline"),
            pair("other", "other"),
        ])
    );
    assert_eq!(telemetry.live_value(ACTIVE_INSTRUMENT, &[]), 0);
    assert_eq!(telemetry.live_value(QUEUED_INSTRUMENT, &[]), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn by_matched_path_otherwise_unlimited_leaves_a_404_unrecorded() {
    let telemetry = Telemetry::new();
    let addr = matched_path_server(&telemetry, Some(Choice::Unlimited)).await;

    one_of_each(addr).await;

    assert_eq!(ended(&telemetry, VERIFY), 2);
    assert_eq!(ended(&telemetry, JUDGE), 2);
    assert_eq!(ended(&telemetry, Choice::OTHER), 0);
    assert_eq!(telemetry.count(DURATION_INSTRUMENT, &[]), 4);
    assert_eq!(
        recorded_series(&telemetry),
        BTreeSet::from([pair("verify", "subprocess"), pair("judge", "inline")])
    );
}

/// `/verify`, which waits for `gate`, as [`VERIFY`], and `unlimited` (a path and its answer),
/// unlimited, under one per-request HTTP layer on `limit` that chooses by matched route.
async fn gated_verify_server(
    telemetry: &Telemetry,
    limit: &Limit,
    gate: &Gate,
    (unlimited, answer): (&'static str, &'static str),
) -> SocketAddr {
    let router = Router::new()
        .route("/verify", gate.route("verified"))
        .route(unlimited, get(move || async move { answer }));
    let chooser = ByRoute::new()
        .route("/verify", VERIFY)
        .route(unlimited, Choice::Unlimited);
    serve_choosing(telemetry, limit, router, chooser).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_answers_at_once_while_the_limit_is_full_and_requests_queue_behind_it() {
    let telemetry = Telemetry::new();
    let limit = Limit::new(2);
    let gate = Gate::new();
    let addr = gated_verify_server(&telemetry, &limit, &gate, ("/metrics", "# metrics")).await;

    // A burst: two hold the limit (at the gate), two wait behind them.
    let burst: Vec<_> = (0..4).map(|_| spawn_get(addr, "/verify")).collect();
    eventually("two run and two queue", || {
        limit.queued() == 2 && telemetry.live_value(ACTIVE_INSTRUMENT, &series(VERIFY)) == 2
    })
    .await;

    // The scrape does not wait behind the burst.
    assert_eq!(get_path(addr, "/metrics").await, (200, "# metrics".into()));
    assert!(
        burst.iter().all(|request| !request.is_finished()),
        "the scrape was answered only once the burst was"
    );
    assert_eq!(limit.queued(), 2, "the burst still waits");
    assert_eq!(telemetry.live_value(QUEUED_INSTRUMENT, &series(VERIFY)), 2);
    assert_eq!(telemetry.live_value(ACTIVE_INSTRUMENT, &series(VERIFY)), 2);

    gate.open();
    for request in burst {
        assert_eq!(join(request).await, (200, "verified".into()));
    }
    assert_eq!(ended(&telemetry, VERIFY), 4);
    assert_eq!(
        telemetry.count(DURATION_INSTRUMENT, &[]),
        4,
        "the scrape is not recorded"
    );
    assert_eq!(limit.available(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_limit_holds_across_connections_and_counts_waiters_in_queued_from_call_on() {
    let telemetry = Telemetry::new();
    let limit = Limit::new(2);
    let load = Arc::new(Load::default());
    let (open_tx, open) = watch::channel(false);
    let work = {
        let load = Arc::clone(&load);
        get(move || {
            let (load, mut open) = (Arc::clone(&load), open.clone());
            async move {
                open.wait_for(|open| *open).await.unwrap();
                load.work(Duration::from_millis(50)).await;
                "verified"
            }
        })
    };
    let router = Router::new().route("/verify", work);
    let chooser = ByRoute::new().route("/verify", VERIFY);
    let addr = serve_choosing(&telemetry, &limit, router, chooser).await;

    let clients: Vec<_> = (0..8).map(|_| spawn_get(addr, "/verify")).collect();

    // Two hold the limit; the six others wait for it, counted as queued while they wait.
    eventually("six queued behind two", || {
        telemetry.live_value(QUEUED_INSTRUMENT, &series(VERIFY)) == 6
    })
    .await;
    assert_eq!(limit.queued(), 6);
    assert_eq!(limit.available(), 0);
    assert_eq!(telemetry.live_value(ACTIVE_INSTRUMENT, &series(VERIFY)), 2);

    open_tx.send_replace(true);
    for client in clients {
        assert_eq!(join(client).await, (200, "verified".into()));
    }
    assert_eq!(load.max(), 2, "handlers that ran at once");
    assert_eq!(ended(&telemetry, VERIFY), 8);
    assert_eq!(
        telemetry.count(QUEUE_DURATION_INSTRUMENT, &series(VERIFY)),
        8
    );
    let queue = telemetry.points(QUEUE_DURATION_INSTRUMENT, &series(VERIFY));
    let [point] = queue.as_slice() else {
        panic!("one queue series expected: {queue:?}")
    };
    // Bucket 0 is (-inf, 1 ms]: the six that waited behind the gate are above it.
    assert!(point.count - point.bucket_counts[0] >= 6, "{point:?}");
    assert_eq!(telemetry.live_value(QUEUED_INSTRUMENT, &series(VERIFY)), 0);
    assert_eq!(telemetry.live_value(ACTIVE_INSTRUMENT, &series(VERIFY)), 0);
    assert_eq!(limit.available(), 2);
}

/// The HTTP layer on `limit`, recording to `telemetry`.
fn http_layer(
    telemetry: &Telemetry,
    limit: &Limit,
) -> ResourcesOperationLayer<HttpClassifier, Limit, Http> {
    ResourcesOperationLayer::new_for_http(limit.clone()).metrics(telemetry.metrics.clone())
}

/// `router` under one per-request HTTP layer on `limit` that chooses with `chooser`, served.
async fn serve_choosing<F>(
    telemetry: &Telemetry,
    limit: &Limit,
    router: Router,
    chooser: F,
) -> SocketAddr
where
    F: ChooseOperation<Request<Body>> + Clone + Send + Sync + 'static,
{
    serve(router.layer(http_layer(telemetry, limit).per_request(chooser))).await
}

/// `/work`, answering "done", under one per-request HTTP layer of limit 4 that chooses with
/// `chooser`.
async fn work_server<F>(telemetry: &Telemetry, chooser: F) -> SocketAddr
where
    F: ChooseOperation<Request<Body>> + Clone + Send + Sync + 'static,
{
    let router = Router::new().route("/work", get(|| async { "done" }));
    serve_choosing(telemetry, &Limit::new(4), router, chooser).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closure_chooser_maps_arbitrary_header_values_onto_the_bounded_values_only() {
    let telemetry = Telemetry::new();
    let chooser = |request: &Request<Body>| match request
        .headers()
        .get("x-operation")
        .map(|v| v.as_bytes())
    {
        Some(b"verify") => VERIFY,
        Some(b"judge") => JUDGE,
        Some(b"health") => Choice::Unlimited,
        _ => Choice::OTHER,
    };
    let addr = work_server(&telemetry, ChooseFn::new(chooser)).await;

    let long = "x".repeat(2000);
    // (HTTP trims whitespace around a header value, so "verify " would arrive as "verify".)
    let arbitrary = [
        "VERIFY",
        "verify!",
        "jud ge",
        "tool",
        "subprocess",
        "other",
        "../../etc/passwd",
        "%00",
        "verify,judge",
        "\"verify\"",
        long.as_str(),
    ];
    let mut sent = vec!["verify", "judge", "health", "verify"];
    sent.extend(arbitrary);
    for value in &sent {
        let answer = send(addr, Method::GET, "/work", &[("x-operation", value)]).await;
        assert_eq!(answer, (200, "done".into()), "{value}");
    }
    let answer = send(addr, Method::GET, "/work", &[]).await;
    assert_eq!(answer, (200, "done".into()), "no header");

    assert_eq!(ended(&telemetry, VERIFY), 2);
    assert_eq!(ended(&telemetry, JUDGE), 1);
    assert_eq!(ended(&telemetry, Choice::OTHER), arbitrary.len() as u64 + 1);
    assert_eq!(
        telemetry.count(DURATION_INSTRUMENT, &[]),
        sent.len() as u64,
        "health is not recorded"
    );
    let recorded = recorded_series(&telemetry);
    assert_eq!(
        recorded,
        BTreeSet::from([
            pair("verify", "subprocess"),
            pair("judge", "inline"),
            pair("other", "other"),
        ])
    );
    for exported in telemetry.collect() {
        for (operation, executor) in points_attributes(&exported) {
            assert!(
                OPERATIONS.contains(&operation.as_str()),
                "{}: {operation}",
                exported.name
            );
            assert!(
                EXECUTORS.contains(&executor.as_str()),
                "{}: {executor}",
                exported.name
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chooser_that_panics_leaves_the_request_served_and_counted_as_other() {
    let telemetry = Telemetry::new();
    let chosen = Arc::new(AtomicBool::new(false));
    let chooser = {
        let chosen = Arc::clone(&chosen);
        move |_: &Request<Body>| -> Choice {
            chosen.store(true, SeqCst);
            panic!("chooser bug")
        }
    };
    let addr = work_server(&telemetry, ChooseFn::new(chooser)).await;

    let answer = send(addr, Method::GET, "/work", &[("x-operation", "verify")]).await;
    assert_eq!(answer, (200, "done".into()), "the request is served");
    assert!(chosen.load(SeqCst), "the chooser ran");
    assert_eq!(
        ended(&telemetry, Choice::OTHER),
        1,
        "limited as other/other"
    );
    let other_ok = [
        (OPERATION_ATTRIBUTE, "other"),
        (EXECUTOR_ATTRIBUTE, "other"),
        (OUTCOME_ATTRIBUTE, "ok"),
    ];
    assert_eq!(telemetry.count(DURATION_INSTRUMENT, &other_ok), 1);
    assert_eq!(
        recorded_series(&telemetry),
        BTreeSet::from([pair("other", "other")])
    );
    assert_eq!(telemetry.live_value(ACTIVE_INSTRUMENT, &[]), 0);
}

/// The (operation, executor) attribute values of every point of `exported`.
fn points_attributes(exported: &support::Exported) -> Vec<(String, String)> {
    let attributes: Vec<&support::Attributes> = match &exported.data {
        support::Data::Histogram(points) => points.iter().map(|p| &p.attributes).collect(),
        support::Data::Sum { points, .. } | support::Data::Gauge(points) => {
            points.iter().map(|p| &p.attributes).collect()
        }
        support::Data::GaugeF64(points) => points.iter().map(|p| &p.attributes).collect(),
        support::Data::Other(other) => panic!("{}: {other}", exported.name),
    };
    attributes
        .into_iter()
        .filter_map(|a| {
            Some((
                a.get(OPERATION_ATTRIBUTE)?.clone(),
                a.get(EXECUTOR_ATTRIBUTE)?.clone(),
            ))
        })
        .collect()
}

/// A router that answers every POST, under one per-request HTTP layer of limit 4 that chooses
/// with `chooser`.
async fn grpc_like_server(telemetry: &Telemetry, chooser: ByRoute) -> SocketAddr {
    let router = Router::new().route("/{*rpc}", post(|| async { "answered" }));
    serve_choosing(telemetry, &Limit::new(4), router, chooser).await
}

fn verifier_rules() -> ByRoute {
    ByRoute::new()
        .service("nemo.Verifier", VERIFY)
        .route("nemo.Verifier/Judge", JUDGE)
        .service("grpc.health.v1.Health", Choice::Unlimited)
}

async fn call_each_rpc(addr: SocketAddr) {
    for path in [
        "/nemo.Verifier/Check",
        "/nemo.Verifier/Verify",
        "/nemo.Verifier/Judge",
        "/grpc.health.v1.Health/Check",
        "/grpc.health.v1.Health/Watch",
        "/unknown.Service/Call",
    ] {
        let answer = send(addr, Method::POST, path, &[]).await;
        assert_eq!(answer, (200, "answered".into()), "{path}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn by_grpc_method_over_plain_http_method_rules_win_and_unknown_is_otherwise() {
    let telemetry = Telemetry::new();
    let addr = grpc_like_server(&telemetry, verifier_rules()).await;

    call_each_rpc(addr).await;

    // Check and Verify by the service's rule; Judge by its own, over the service's.
    assert_eq!(ended(&telemetry, VERIFY), 2);
    assert_eq!(ended(&telemetry, JUDGE), 1);
    // The health service is unlimited; the unknown one is `other`/`other`.
    assert_eq!(ended(&telemetry, Choice::OTHER), 1);
    assert_eq!(telemetry.count(DURATION_INSTRUMENT, &[]), 4);

    // With `otherwise`, the unknown service is that.
    let telemetry = Telemetry::new();
    let addr = grpc_like_server(&telemetry, verifier_rules().otherwise(TOOL)).await;

    call_each_rpc(addr).await;

    assert_eq!(ended(&telemetry, VERIFY), 2);
    assert_eq!(ended(&telemetry, JUDGE), 1);
    assert_eq!(ended(&telemetry, TOOL), 1);
    assert_eq!(ended(&telemetry, Choice::OTHER), 0);
    assert_eq!(telemetry.count(DURATION_INSTRUMENT, &[]), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_is_answered_503_and_counted_while_an_unlimited_route_still_answers() {
    let telemetry = Telemetry::new();
    let limit = Limit::with_max_queued(1, 0);
    let gate = Gate::new();
    let addr = gated_verify_server(&telemetry, &limit, &gate, ("/health", "healthy")).await;

    let holder = spawn_get(addr, "/verify");
    eventually("the first request holds the permit", || {
        telemetry.live_value(ACTIVE_INSTRUMENT, &series(VERIFY)) == 1
    })
    .await;

    let (status, _) = get_path(addr, "/verify").await;
    assert_eq!(status, 503, "a second request finds the queue full");
    let rejected = [
        (OPERATION_ATTRIBUTE, "verify"),
        (EXECUTOR_ATTRIBUTE, "subprocess"),
        (REJECTION_ATTRIBUTE, "queue_full"),
    ];
    assert_eq!(telemetry.live_value(REJECTED_INSTRUMENT, &rejected), 1);
    assert_eq!(get_path(addr, "/health").await, (200, "healthy".into()));
    assert!(!holder.is_finished(), "the first request is still held");

    gate.open();
    assert_eq!(join(holder).await, (200, "verified".into()));
    assert_eq!(ended(&telemetry, VERIFY), 1, "the rejected one never ran");
    assert_eq!(telemetry.count(DURATION_INSTRUMENT, &[]), 1);
    assert_eq!(telemetry.live_value(REJECTED_INSTRUMENT, &[]), 1);
    assert_eq!(limit.available(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_request_in_the_body_end_form_holds_a_streamed_route_until_its_body_ends() {
    let telemetry = Telemetry::new();
    let limit = Limit::new(1);
    let (end_tx, end) = watch::channel(false);
    let first_chunk_out = Arc::new(AtomicBool::new(false));
    // One chunk, then the end once the test says so.
    let stream = {
        let first_chunk_out = Arc::clone(&first_chunk_out);
        get(move || {
            let state = (0, end.clone(), Arc::clone(&first_chunk_out));
            let chunks = futures_util::stream::unfold(state, |(sent, mut end, out)| async move {
                if sent == 1 {
                    end.wait_for(|end| *end).await.unwrap();
                    return None;
                }
                out.store(true, SeqCst);
                let chunk = Ok::<_, std::io::Error>(Bytes::from_static(b"chunk"));
                Some((chunk, (sent + 1, end, out)))
            });
            async move { Body::from_stream(chunks) }
        })
    };
    let router = Router::new()
        .route("/stream", stream)
        .route("/metrics", get(|| async { "# metrics" }))
        .layer(
            http_layer(&telemetry, &limit).until_body_end().per_request(
                ByRoute::new()
                    .route("/stream", JUDGE)
                    .route("/metrics", Choice::Unlimited),
            ),
        );
    let addr = serve(router).await;

    let streamed = spawn_get(addr, "/stream");
    eventually("the first chunk went out", || first_chunk_out.load(SeqCst)).await;
    assert_eq!(telemetry.live_value(ACTIVE_INSTRUMENT, &series(JUDGE)), 1);
    // The unlimited route's body passes through, unmetered, while the stream holds the permit.
    assert_eq!(get_path(addr, "/metrics").await, (200, "# metrics".into()));
    assert_eq!(limit.available(), 0, "held while the body streams");
    assert_eq!(telemetry.count(DURATION_INSTRUMENT, &[]), 0);

    end_tx.send_replace(true);
    assert_eq!(join(streamed).await, (200, "chunk".into()));
    eventually("the stream's operation ended", || {
        telemetry.count(DURATION_INSTRUMENT, &[]) == 1
    })
    .await;
    assert_eq!(ended(&telemetry, JUDGE), 1);
    assert_eq!(limit.available(), 1);
    assert_eq!(telemetry.live_value(ACTIVE_INSTRUMENT, &[]), 0);
}
