//! The layer under `axum::serve`, on real sockets: the limit holds across connections (where
//! tower's `ConcurrencyLimitLayer` does not), and what ran is what the metrics say.

mod support;

use std::io::ErrorKind;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::routing::{get, MethodRouter};
use axum::Router;
use tokio::net::TcpStream;
use tokio::sync::{Barrier, Semaphore};

use support::http::serve;
use support::{Load, Telemetry, DEADLINE};
use tower_resources_operation::names::{
    ACTIVE_INSTRUMENT, DURATION_INSTRUMENT, EXECUTOR_ATTRIBUTE, OPERATION_ATTRIBUTE,
    OUTCOME_ATTRIBUTE, QUEUED_INSTRUMENT, QUEUE_DURATION_INSTRUMENT,
};
use tower_resources_operation::{Executor, Operation, ResourcesOperationLayer};

/// How long each handler holds its permit.
const WORK: Duration = Duration::from_millis(100);

/// A GET route whose handler does one unit of `load`'s work.
fn work_route(load: &Arc<Load>) -> MethodRouter {
    let load = Arc::clone(load);
    get(move || {
        let load = Arc::clone(&load);
        async move {
            load.work(WORK).await;
            "done"
        }
    })
}

/// Writes all of `bytes` to `stream`.
async fn write_all(stream: &TcpStream, mut bytes: &[u8]) {
    while !bytes.is_empty() {
        stream.writable().await.unwrap();
        match stream.try_write(bytes) {
            Ok(n) => bytes = &bytes[n..],
            Err(e) if e.kind() == ErrorKind::WouldBlock => {}
            Err(e) => panic!("write: {e}"),
        }
    }
}

/// Reads `stream` to its end.
async fn read_to_end(stream: &TcpStream) -> Vec<u8> {
    let mut out = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        stream.readable().await.unwrap();
        match stream.try_read(&mut chunk) {
            Ok(0) => return out,
            Ok(n) => out.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == ErrorKind::WouldBlock => {}
            Err(e) => panic!("read: {e}"),
        }
    }
}

/// One GET per path, each on its own TCP connection, all connected first and then sent at once;
/// returns each response's status line, in the order of `paths`.
async fn get_all(addr: SocketAddr, paths: &[&'static str]) -> Vec<String> {
    let barrier = Arc::new(Barrier::new(paths.len()));
    let clients: Vec<_> = paths
        .iter()
        .map(|&path| {
            let barrier = Arc::clone(&barrier);
            tokio::spawn(async move {
                let stream = TcpStream::connect(addr).await.unwrap();
                barrier.wait().await;
                let request =
                    format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
                write_all(&stream, request.as_bytes()).await;
                let response = String::from_utf8(read_to_end(&stream).await).unwrap();
                response.lines().next().unwrap_or_default().to_owned()
            })
        })
        .collect();

    let mut statuses = Vec::with_capacity(clients.len());
    for client in clients {
        let status = tokio::time::timeout(DEADLINE, client)
            .await
            .expect("client hung")
            .expect("client task failed");
        statuses.push(status);
    }
    statuses
}

fn assert_all_ok(statuses: &[String]) {
    for status in statuses {
        assert_eq!(status, "HTTP/1.1 200 OK", "all: {statuses:?}");
    }
}

/// Eight clients at once on `/work` of the router that `place` makes of the work route and a
/// layer that limits to 2, reporting as verify/thread: asserts that two ran at once, all answered
/// 200, and what the metrics say.
async fn eight_clients_run_two_at_a_time(
    place: impl FnOnce(MethodRouter, ResourcesOperationLayer) -> Router,
) {
    let telemetry = Telemetry::new();
    let load = Arc::new(Load::default());
    let layer = ResourcesOperationLayer::new(2)
        .operation(Operation::Verify)
        .executor(Executor::Thread)
        .metrics(telemetry.metrics.clone());
    let addr = serve(place(work_route(&load), layer)).await;
    let statuses = get_all(addr, &["/work"; 8]).await;

    assert_all_ok(&statuses);
    assert_eq!(load.max(), 2, "handlers that ran at once");

    let series = [
        (OPERATION_ATTRIBUTE, "verify"),
        (EXECUTOR_ATTRIBUTE, "thread"),
    ];
    assert_eq!(telemetry.count(QUEUE_DURATION_INSTRUMENT, &series), 8);
    let ok = [
        (OPERATION_ATTRIBUTE, "verify"),
        (EXECUTOR_ATTRIBUTE, "thread"),
        (OUTCOME_ATTRIBUTE, "ok"),
    ];
    assert_eq!(telemetry.count(DURATION_INSTRUMENT, &ok), 8);
    assert_eq!(telemetry.count(DURATION_INSTRUMENT, &series), 8);

    // Six of the eight had to wait for a permit, for about one unit of work or more.
    let queue = telemetry.histogram(QUEUE_DURATION_INSTRUMENT);
    let [point] = queue.as_slice() else {
        panic!("one queue series expected: {queue:?}")
    };
    assert!(point.sum > 0.0, "{point:?}");
    assert!(point.max.unwrap() > 50.0, "{point:?}");
    // Bucket 0 is (-inf, 1 ms]: the two admitted at once are there, the six waiters above it.
    let waited = point.count - point.bucket_counts[0];
    assert!(
        waited >= 6,
        "waiters with a queue time above 1 ms: {point:?}"
    );

    assert_eq!(telemetry.live_value(QUEUED_INSTRUMENT, &series), 0);
    assert_eq!(telemetry.live_value(ACTIVE_INSTRUMENT, &series), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn limit_on_router_layer_holds_across_connections() {
    eight_clients_run_two_at_a_time(|work, limit| Router::new().route("/work", work).layer(limit))
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn limit_on_route_layer_holds_across_connections() {
    eight_clients_run_two_at_a_time(|work, limit| {
        Router::new().route("/work", work).route_layer(limit)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn limit_on_method_router_layer_holds_across_connections() {
    eight_clients_run_two_at_a_time(|work, limit| Router::new().route("/work", work.layer(limit)))
        .await;
}

/// Documents the bug this crate exists for: tower's layer on `Router::layer` under
/// `axum::serve` gets a semaphore per connection, so eight connections are not held to 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn towers_concurrency_limit_on_router_layer_is_per_connection() {
    let load = Arc::new(Load::default());
    let router = Router::new()
        .route("/work", work_route(&load))
        .layer(tower::limit::ConcurrencyLimitLayer::new(2));
    let addr = serve(router).await;

    let statuses = get_all(addr, &["/work"; 8]).await;

    assert_all_ok(&statuses);
    assert!(
        load.max() > 2,
        "tower's limit held across connections: max {}",
        load.max()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_routes_with_layers_from_one_semaphore_share_its_cap() {
    let telemetry = Telemetry::new();
    let load = Arc::new(Load::default());
    let slots = Arc::new(Semaphore::new(2));
    let verify = ResourcesOperationLayer::new(Arc::clone(&slots))
        .operation(Operation::Verify)
        .executor(Executor::Subprocess)
        .metrics(telemetry.metrics.clone());
    let judge = ResourcesOperationLayer::new(Arc::clone(&slots))
        .operation(Operation::Judge)
        .executor(Executor::Inline)
        .metrics(telemetry.metrics.clone());
    let router = Router::new()
        .route("/verify", work_route(&load).layer(verify))
        .route("/judge", work_route(&load).layer(judge));
    let addr = serve(router).await;

    let paths = [
        "/verify", "/judge", "/verify", "/judge", "/verify", "/judge", "/verify", "/judge",
    ];
    let statuses = get_all(addr, &paths).await;

    assert_all_ok(&statuses);
    assert_eq!(
        load.max(),
        2,
        "handlers that ran at once across both routes"
    );
    assert_eq!(slots.available_permits(), 2);

    let verify = [
        (OPERATION_ATTRIBUTE, "verify"),
        (EXECUTOR_ATTRIBUTE, "subprocess"),
    ];
    let judge = [
        (OPERATION_ATTRIBUTE, "judge"),
        (EXECUTOR_ATTRIBUTE, "inline"),
    ];
    for series in [verify, judge] {
        let [(op_key, op), (ex_key, ex)] = series;
        let ok = [(op_key, op), (ex_key, ex), (OUTCOME_ATTRIBUTE, "ok")];
        assert_eq!(telemetry.count(DURATION_INSTRUMENT, &ok), 4, "{series:?}");
        assert_eq!(
            telemetry.count(DURATION_INSTRUMENT, &series),
            4,
            "{series:?}"
        );
        assert_eq!(
            telemetry.count(QUEUE_DURATION_INSTRUMENT, &series),
            4,
            "{series:?}"
        );

        for instrument in [QUEUED_INSTRUMENT, ACTIVE_INSTRUMENT] {
            let points = telemetry.live(instrument);
            let reported: Vec<_> = points
                .iter()
                .filter(|p| support::matches(&p.attributes, &series))
                .collect();
            assert_eq!(reported.len(), 1, "{instrument} {series:?}: {points:?}");
            assert_eq!(reported[0].value, 0, "{instrument} {series:?}");
        }
    }
    // Nothing was recorded under any other series.
    assert_eq!(telemetry.count(DURATION_INSTRUMENT, &[]), 8);
}

/// `new(..)`, the name that mirrors tower's `ConcurrencyLimitLayer::new`, on axum routes: each
/// response is read by its status, as `new_for_http` reads it, so a 500 is not `ok`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_generic_layer_on_axum_routes_reads_each_responses_status() {
    use axum::http::StatusCode;

    let telemetry = Telemetry::new();
    let slots = tower_resources_operation::Limit::new(2);
    let verify = || {
        ResourcesOperationLayer::new(slots.clone())
            .operation(Operation::Verify)
            .executor(Executor::Subprocess)
            .metrics(telemetry.metrics.clone())
    };
    let answering = |status: StatusCode| get(move || async move { (status, "answered") });
    let router = Router::new()
        .route("/ok", answering(StatusCode::OK).layer(verify()))
        .route("/missing", answering(StatusCode::NOT_FOUND).layer(verify()))
        .route(
            "/broken",
            answering(StatusCode::INTERNAL_SERVER_ERROR).layer(verify()),
        )
        .route(
            "/unavailable",
            answering(StatusCode::SERVICE_UNAVAILABLE).layer(verify()),
        )
        .route(
            "/upstream",
            answering(StatusCode::GATEWAY_TIMEOUT).layer(verify()),
        );
    let addr = serve(router).await;

    let statuses = get_all(
        addr,
        &["/ok", "/missing", "/broken", "/unavailable", "/upstream"],
    )
    .await;
    let codes: Vec<_> = statuses
        .iter()
        .map(|line| line.split(' ').nth(1).unwrap_or_default())
        .collect();
    assert_eq!(codes, ["200", "404", "500", "503", "504"], "{statuses:?}");

    let series = [
        (OPERATION_ATTRIBUTE, "verify"),
        (EXECUTOR_ATTRIBUTE, "subprocess"),
    ];
    assert_eq!(telemetry.ended(&series, "ok"), 2, "the 200 and the 404");
    assert_eq!(telemetry.ended(&series, "error"), 2, "the 500 and the 503");
    assert_eq!(telemetry.ended(&series, "timeout"), 1, "the 504");
    assert_eq!(telemetry.count(DURATION_INSTRUMENT, &[]), 5);
}
