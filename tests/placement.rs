#![cfg(feature = "axum")]
//! Where tower-http's `TimeoutLayer` and `CatchPanicLayer`, and tower's limit, sit relative to
//! the layer, and what each placement records: one test per row of the crate docs' placement
//! table ("Where the other layers go"), over real axum servers on 127.0.0.1.
//!
//! In axum, the last `.layer(..)` is the outermost: `.layer(inner).layer(ours)` puts `inner`
//! between this crate's layer and the handler.

mod support;

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::routing::{get, MethodRouter};
use axum::Router;
use http::StatusCode;
use tokio::sync::Notify;
use tower::limit::{ConcurrencyLimitLayer, GlobalConcurrencyLimitLayer};
use tower_http::catch_panic::CatchPanicLayer;
use tower_http::timeout::TimeoutLayer;

use support::http::{serve, Client};
use support::{eventually, only, Load, Telemetry, DEADLINE};
use tower_resources_operation::classify::HttpClassifier;
use tower_resources_operation::names::{
    ABANDONED_INSTRUMENT, ACTIVE_INSTRUMENT, OPERATION_ATTRIBUTE, QUEUED_INSTRUMENT,
    QUEUE_DURATION_INSTRUMENT, REJECTED_INSTRUMENT, REJECTION_ATTRIBUTE,
};
use tower_resources_operation::per_request::{ByRoute, Choice};
use tower_resources_operation::protocol::Http;
use tower_resources_operation::{Executor, Limit, Operation, ResourcesOperationLayer};

/// The server's own timeout in these tests, and how long the slow handler takes.
const SERVER_TIMEOUT: Duration = Duration::from_millis(100);
const SLOW: Duration = Duration::from_secs(5);

const VERIFY: [(&str, &str); 1] = [(OPERATION_ATTRIBUTE, "verify")];

fn ours(telemetry: &Telemetry) -> ResourcesOperationLayer<HttpClassifier, Limit, Http> {
    ResourcesOperationLayer::new_for_http(4)
        .operation(Operation::Verify)
        .executor(Executor::Subprocess)
        .metrics(telemetry.metrics.clone())
}

fn timeout() -> TimeoutLayer {
    TimeoutLayer::with_status_code(StatusCode::REQUEST_TIMEOUT, SERVER_TIMEOUT)
}

fn panics() -> MethodRouter {
    get(|| async {
        if true {
            panic!("the handler panics");
        }
        "unreachable"
    })
}

fn slow() -> MethodRouter {
    get(|| async {
        tokio::time::sleep(SLOW).await;
        "too late"
    })
}

/// Serves `/verify` as `route`, sends one request, and waits until the operation has ended:
/// the status the client got, and the outcomes recorded.
async fn one_request(telemetry: &Telemetry, router: Router) -> (u16, BTreeMap<String, u64>) {
    let addr = serve(router).await;
    let (status, _) = Client::open(addr).await.get("/verify").await;
    eventually("the operation ends", || {
        telemetry.outcomes(&VERIFY).values().sum::<u64>() == 1
    })
    .await;
    (status, telemetry.outcomes(&VERIFY))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn catch_panic_inside_the_layer_turns_a_panic_into_a_500_recorded_as_error() {
    let telemetry = Telemetry::new();
    let route = panics()
        .layer::<_, Infallible>(CatchPanicLayer::new())
        .layer::<_, Infallible>(ours(&telemetry));
    let router = Router::new().route("/verify", route);
    assert_eq!(one_request(&telemetry, router).await, (500, only("error")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn catch_panic_outside_the_layer_lets_it_see_the_panic_recorded_as_crashed() {
    let telemetry = Telemetry::new();
    let route = panics()
        .layer::<_, Infallible>(ours(&telemetry))
        .layer::<_, Infallible>(CatchPanicLayer::new());
    let router = Router::new().route("/verify", route);
    assert_eq!(
        one_request(&telemetry, router).await,
        (500, only("crashed"))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timeout_inside_the_layer_answers_408_recorded_as_timeout() {
    let telemetry = Telemetry::new();
    let route = slow()
        .layer::<_, Infallible>(timeout())
        .layer::<_, Infallible>(ours(&telemetry));
    let router = Router::new().route("/verify", route);
    assert_eq!(
        one_request(&telemetry, router).await,
        (408, only("timeout"))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timeout_outside_the_layer_drops_the_operation_recorded_as_cancelled() {
    let telemetry = Telemetry::new();
    let route = slow()
        .layer::<_, Infallible>(ours(&telemetry))
        .layer::<_, Infallible>(timeout());
    let router = Router::new().route("/verify", route);
    assert_eq!(
        one_request(&telemetry, router).await,
        (408, only("cancelled"))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timeout_outside_the_layer_told_with_server_timeout_is_recorded_as_timeout() {
    let telemetry = Telemetry::new();
    let layer = ours(&telemetry).server_timeout(SERVER_TIMEOUT);
    let route = slow()
        .layer::<_, Infallible>(layer)
        .layer::<_, Infallible>(timeout());
    let router = Router::new().route("/verify", route);
    assert_eq!(
        one_request(&telemetry, router).await,
        (408, only("timeout"))
    );
}

/// A per-request layer over the Router, and the server's timeout in front of it, Router-wide.
fn router_wide(telemetry: &Telemetry, server_timeout: Option<Duration>) -> Router {
    let chooser = ByRoute::new()
        .route(
            "/verify",
            Choice::limited(Operation::Verify, Executor::Subprocess),
        )
        .otherwise(Choice::Unlimited);
    let mut layer = ours(telemetry);
    if let Some(timeout) = server_timeout {
        layer = layer.server_timeout(timeout);
    }
    Router::new()
        .route("/verify", slow())
        .layer(layer.per_request(chooser))
        .layer(timeout())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_wide_timeout_in_front_of_a_per_request_layer_is_cancelled_unless_told() {
    let telemetry = Telemetry::new();
    let router = router_wide(&telemetry, None);
    assert_eq!(
        one_request(&telemetry, router).await,
        (408, only("cancelled"))
    );

    let telemetry = Telemetry::new();
    let router = router_wide(&telemetry, Some(SERVER_TIMEOUT));
    assert_eq!(
        one_request(&telemetry, router).await,
        (408, only("timeout"))
    );
}

/// Three requests at once on a route whose handler takes 500 ms (long enough for all three to
/// arrive while the first runs, on a slow machine too); how many ran at once, and the most
/// `queued` and `active` the metrics showed meanwhile.
async fn three_at_once(
    telemetry: &Telemetry,
    route: impl FnOnce(MethodRouter) -> MethodRouter,
) -> (usize, i64, i64) {
    let load = Arc::new(Load::default());
    let handler = {
        let load = Arc::clone(&load);
        get(move || {
            let load = Arc::clone(&load);
            async move {
                load.work(Duration::from_millis(500)).await;
                "done"
            }
        })
    };
    let addr = serve(Router::new().route("/verify", route(handler))).await;
    let clients: Vec<_> = (0..3)
        .map(|_| tokio::spawn(async move { Client::open(addr).await.get("/verify").await }))
        .collect();
    let (mut queued, mut active) = (0, 0);
    eventually("all three end", || {
        queued = queued.max(telemetry.live_value(QUEUED_INSTRUMENT, &VERIFY));
        active = active.max(telemetry.live_value(ACTIVE_INSTRUMENT, &VERIFY));
        telemetry.outcomes(&VERIFY).get("ok") == Some(&3)
    })
    .await;
    for client in clients {
        let (status, _) = tokio::time::timeout(DEADLINE, client)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(status, 200);
    }
    (load.max(), queued, active)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn towers_limit_outside_the_layer_hides_the_queue_in_front_of_it() {
    let telemetry = Telemetry::new();
    let ours = ours(&telemetry);
    let (ran, queued, active) = three_at_once(&telemetry, |handler| {
        handler
            .layer::<_, Infallible>(ours)
            .layer::<_, Infallible>(GlobalConcurrencyLimitLayer::new(1))
    })
    .await;
    // tower's limit of 1 lets one at a time through to the layer: nothing ever waits for the
    // layer's limit, so queue time is 0 although two callers waited.
    assert_eq!((ran, queued, active), (1, 0, 1));
    let queue = telemetry.points(QUEUE_DURATION_INSTRUMENT, &VERIFY);
    let waited: f64 = queue.iter().map(|point| point.sum).sum();
    assert_eq!(waited, 0.0, "{queue:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn towers_limit_inside_the_layer_counts_its_queue_as_run_time() {
    let telemetry = Telemetry::new();
    let ours = ours(&telemetry);
    let (ran, queued, active) = three_at_once(&telemetry, |handler| {
        handler
            .layer::<_, Infallible>(GlobalConcurrencyLimitLayer::new(1))
            .layer::<_, Infallible>(ours)
    })
    .await;
    // The layer admits all three (its limit is 4) and reports them active, while tower's limit
    // runs them one at a time: the last one's "run time" includes two waits.
    assert_eq!((ran, queued, active), (1, 0, 3));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn towers_per_service_limit_under_axum_limits_each_connection_not_the_route() {
    let telemetry = Telemetry::new();
    let ours = ours(&telemetry);
    let (ran, _, _) = three_at_once(&telemetry, |handler| {
        handler
            .layer::<_, Infallible>(ConcurrencyLimitLayer::new(1))
            .layer::<_, Infallible>(ours)
    })
    .await;
    // axum makes the route's service per connection, and tower's `ConcurrencyLimitLayer` a
    // semaphore per service it makes: three connections, three at once. This crate's layer
    // shares one limit however many services it makes; so does tower's
    // `GlobalConcurrencyLimitLayer`.
    assert_eq!(ran, 3);
}

/// The server's deadline in the tests of work dropped in the queue.
const DEADLINE_OF_SERVER: Duration = Duration::from_secs(1);

const JUDGE: [(&str, &str); 1] = [(OPERATION_ATTRIBUTE, "judge")];

/// Serves `/verify` (the slow handler) inside a Router-wide `TimeoutLayer` of
/// [`DEADLINE_OF_SERVER`], the layer told of it if `told`, and `/hold`, tagged `judge`, outside
/// it, both on one limit of 1. Holds the place with `/hold`, sends `waiting` requests to
/// `/verify`, and returns their statuses once each has its answer and the place is released.
///
/// Held from outside the timeout, the place never frees while they wait, so each queued request
/// reaches its own deadline still waiting. (Behind a request that runs, the next one is admitted
/// in the milliseconds between that one's deadline and its own, on a machine slow enough to
/// spread their arrivals.)
async fn dropped_behind_a_held_place(telemetry: &Telemetry, told: bool, waiting: i64) -> Vec<u16> {
    let limit = Limit::new(1);
    let layer = |operation| {
        ResourcesOperationLayer::new_for_http(limit.clone())
            .operation(operation)
            .metrics(telemetry.metrics.clone())
    };
    let verify_layer = match told {
        true => layer(Operation::Verify).server_timeout(DEADLINE_OF_SERVER),
        false => layer(Operation::Verify),
    };
    let release = Arc::new(Notify::new());
    let held = Arc::clone(&release);
    let hold = get(move || async move {
        held.notified().await;
        "released"
    })
    .layer::<_, Infallible>(layer(Operation::Judge));
    let verify = Router::new()
        .route("/verify", slow().layer::<_, Infallible>(verify_layer))
        .layer(TimeoutLayer::with_status_code(
            StatusCode::REQUEST_TIMEOUT,
            DEADLINE_OF_SERVER,
        ));
    let addr = serve(Router::new().route("/hold", hold).merge(verify)).await;
    let holder = tokio::spawn(async move { Client::open(addr).await.get("/hold").await.0 });
    eventually("the place is held", || {
        telemetry.live_value(ACTIVE_INSTRUMENT, &JUDGE) == 1
    })
    .await;
    let clients: Vec<_> = (0..waiting)
        .map(|_| tokio::spawn(async move { Client::open(addr).await.get("/verify").await.0 }))
        .collect();
    eventually("they all wait", || {
        telemetry.live_value(QUEUED_INSTRUMENT, &VERIFY) == waiting
    })
    .await;
    let mut statuses = Vec::new();
    for client in clients {
        statuses.push(client.await.unwrap());
    }
    release.notify_one();
    assert_eq!(holder.await.unwrap(), 200);
    eventually("the held operation ends", || {
        telemetry.outcomes(&JUDGE).values().sum::<u64>() == 1
    })
    .await;
    assert_eq!(telemetry.outcomes(&JUDGE), only("ok"));
    statuses
}

/// The setup: a Router-wide `TimeoutLayer` of 1 s that the layer is told of, and a
/// capacity of 1 that keeps 7 requests waiting past it. Nobody hangs up: the server drops them at
/// its deadline before they ever ran, and they are `rejected{rejection="deadline"}`, not callers
/// who left. (The one it drops while it runs is `timeout`:
/// `a_timeout_outside_the_layer_told_with_server_timeout_is_recorded_as_timeout`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn work_dropped_in_the_queue_at_the_servers_deadline_is_a_deadline_rejection() {
    let telemetry = Telemetry::new();
    let statuses = dropped_behind_a_held_place(&telemetry, true, 7).await;
    assert_eq!(statuses, [408; 7]);
    let deadline = [
        (OPERATION_ATTRIBUTE, "verify"),
        (REJECTION_ATTRIBUTE, "deadline"),
    ];
    eventually("every drop is counted", || {
        telemetry.live_value(REJECTED_INSTRUMENT, &deadline) == 7
    })
    .await;
    assert_eq!(telemetry.live_value(ABANDONED_INSTRUMENT, &VERIFY), 0);
    assert!(telemetry.outcomes(&VERIFY).is_empty(), "none of them ran");
    assert_eq!(telemetry.live_value(QUEUED_INSTRUMENT, &VERIFY), 0);
}

/// Without the server's timeout told, the layer cannot explain the drop: it stays abandoned.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drop_in_the_queue_the_layer_cannot_explain_stays_abandoned() {
    let telemetry = Telemetry::new();
    let statuses = dropped_behind_a_held_place(&telemetry, false, 2).await;
    assert_eq!(statuses, [408; 2]);
    eventually("every drop is counted", || {
        telemetry.live_value(ABANDONED_INSTRUMENT, &VERIFY) == 2
    })
    .await;
    let deadline = [(REJECTION_ATTRIBUTE, "deadline")];
    assert_eq!(telemetry.live_value(REJECTED_INSTRUMENT, &deadline), 0);
    assert!(telemetry.outcomes(&VERIFY).is_empty(), "none of them ran");
    assert_eq!(telemetry.live_value(QUEUED_INSTRUMENT, &VERIFY), 0);
}
