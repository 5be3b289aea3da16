#![cfg(feature = "axum")]
//! Named limits, over real axum servers on 127.0.0.1: a limit shared by two routes reports its
//! own `gym.resources.limit.*` series, which add up what NeMo Gym's per-series gauges split; a
//! Router-wide per-request layer caps each route by the limit its choice names; and the series
//! that a chooser's rules name report 0 before any request chooses them.

mod support;

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::routing::{get, MethodRouter};
use axum::Router;
use http::Request;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use support::http::{serve, Client};
use support::{eventually, Load, Telemetry, DEADLINE};
use tower_resources_operation::names::{
    ACTIVE_INSTRUMENT, EXECUTOR_ATTRIBUTE, LIMIT_ACTIVE_INSTRUMENT, LIMIT_ATTRIBUTE,
    LIMIT_CAPACITY_INSTRUMENT, LIMIT_INSTRUMENT, LIMIT_QUEUED_INSTRUMENT, OPERATION_ATTRIBUTE,
    QUEUED_INSTRUMENT, REJECTED_INSTRUMENT,
};
use tower_resources_operation::per_request::{ByRoute, Choice, ChooseFn};
use tower_resources_operation::{Executor, Limit, Operation, ResourcesOperationLayer};

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

    /// A GET route that counts itself in `load` and waits for the gate.
    fn route(&self, load: &Arc<Load>) -> MethodRouter {
        let open = self.open.subscribe();
        let load = Arc::clone(load);
        get(move || {
            let mut open = open.clone();
            let load = Arc::clone(&load);
            async move {
                load.enter();
                open.wait_for(|open| *open).await.unwrap();
                load.leave();
                "done"
            }
        })
    }

    fn open(&self) {
        self.open.send_replace(true);
    }
}

/// Starts a GET of `path` on its own connection.
fn spawn_get(addr: std::net::SocketAddr, path: &'static str) -> JoinHandle<(u16, String)> {
    tokio::spawn(async move { Client::open(addr).await.get(path).await })
}

async fn join(task: JoinHandle<(u16, String)>) -> (u16, String) {
    tokio::time::timeout(DEADLINE, task)
        .await
        .expect("a client hung")
        .unwrap()
}

fn named(telemetry: &Telemetry, instrument: &str, limit: &str) -> i64 {
    telemetry.live_value(instrument, &[(LIMIT_ATTRIBUTE, limit)])
}

fn of(operation: Operation) -> [(&'static str, &'static str); 1] {
    [(OPERATION_ATTRIBUTE, operation.as_str())]
}

/// The Getting-started setup: one limit of 2 with room for 8 to wait, named, shared by
/// `/verify` and `/judge`, and 14 clients.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_named_limit_reports_itself_full_where_each_series_looks_half_used() {
    let telemetry = Telemetry::new();
    let limit = Limit::builder(2).max_queued(8).name("gym").build();
    let layer = |operation| {
        ResourcesOperationLayer::new_for_http(limit.clone())
            .operation(operation)
            .executor(Executor::Subprocess)
            .metrics(telemetry.metrics.clone())
    };
    let gate = Gate::new();
    let load = Arc::new(Load::default());
    let router = Router::new()
        .route("/verify", gate.route(&load).layer(layer(Operation::Verify)))
        .route("/judge", gate.route(&load).layer(layer(Operation::Judge)));
    let addr = serve(router).await;

    // One of each runs, then twelve more arrive: eight wait, four are turned away.
    let mut clients = vec![spawn_get(addr, "/verify")];
    eventually("the first verify runs", || load.now() == 1).await;
    clients.push(spawn_get(addr, "/judge"));
    eventually("a judge runs next to it", || load.now() == 2).await;
    for i in 0..12 {
        clients.push(spawn_get(
            addr,
            if i % 2 == 0 { "/verify" } else { "/judge" },
        ));
    }
    eventually("eight wait and four are turned away", || {
        limit.queued() == 8 && telemetry.live_value(REJECTED_INSTRUMENT, &[]) == 4
    })
    .await;

    // NeMo Gym's series, per (operation, executor): each sees one of the two places used.
    for operation in [Operation::Verify, Operation::Judge] {
        assert_eq!(telemetry.live_value(ACTIVE_INSTRUMENT, &of(operation)), 1);
        assert_eq!(telemetry.live_value(LIMIT_INSTRUMENT, &of(operation)), 2);
    }
    assert_eq!(
        telemetry.live_value(QUEUED_INSTRUMENT, &of(Operation::Verify))
            + telemetry.live_value(QUEUED_INSTRUMENT, &of(Operation::Judge)),
        8
    );
    // The limit's own series: full, with its whole queue, whichever route holds its places.
    assert_eq!(named(&telemetry, LIMIT_CAPACITY_INSTRUMENT, "gym"), 2);
    assert_eq!(named(&telemetry, LIMIT_ACTIVE_INSTRUMENT, "gym"), 2);
    assert_eq!(named(&telemetry, LIMIT_QUEUED_INSTRUMENT, "gym"), 8);
    let limit_points = telemetry.live(LIMIT_CAPACITY_INSTRUMENT);
    assert_eq!(
        limit_points.len(),
        1,
        "one series per limit: {limit_points:?}"
    );

    gate.open();
    let mut served = 0;
    for client in clients {
        let (status, _) = join(client).await;
        assert!(status == 200 || status == 503, "status {status}");
        served += usize::from(status == 200);
    }
    assert_eq!(served, 10);
    assert_eq!(load.max(), 2);
    assert_eq!(named(&telemetry, LIMIT_ACTIVE_INSTRUMENT, "gym"), 0);
    assert_eq!(named(&telemetry, LIMIT_QUEUED_INSTRUMENT, "gym"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unnamed_limit_reports_no_limit_series_and_a_resize_shows_in_the_named_one() {
    let telemetry = Telemetry::new();
    let unnamed = Limit::new(3);
    let named_limit = Limit::builder(3).name("judges").build();
    let _unnamed_service = tower::Layer::layer(
        &ResourcesOperationLayer::new(unnamed.clone()).metrics(telemetry.metrics.clone()),
        tower::service_fn(|()| async { Ok::<_, std::convert::Infallible>(()) }),
    );
    let _named_service = tower::Layer::layer(
        &ResourcesOperationLayer::new(named_limit.clone())
            .operation(Operation::Judge)
            .metrics(telemetry.metrics.clone()),
        tower::service_fn(|()| async { Ok::<_, std::convert::Infallible>(()) }),
    );
    let points = telemetry.live(LIMIT_CAPACITY_INSTRUMENT);
    assert_eq!(points.len(), 1, "only the named limit: {points:?}");
    assert_eq!(named(&telemetry, LIMIT_CAPACITY_INSTRUMENT, "judges"), 3);

    named_limit.set_capacity(5).unwrap();
    assert_eq!(named(&telemetry, LIMIT_CAPACITY_INSTRUMENT, "judges"), 5);
    assert_eq!(
        telemetry.live_value(LIMIT_INSTRUMENT, &of(Operation::Judge)),
        5
    );
}

/// One Router-wide layer, each route under the limit its choice names.
fn capped_router(
    gate: &Gate,
    verify: &Arc<Load>,
    judge: &Arc<Load>,
    telemetry: &Telemetry,
) -> Router {
    let chooser = ByRoute::new()
        .route(
            "/verify",
            Choice::limited(Operation::Verify, Executor::Subprocess).on("verifiers"),
        )
        .route(
            "/judge",
            Choice::limited(Operation::Judge, Executor::Inline).on("judges"),
        )
        .route("/tool", Choice::limited(Operation::Tool, Executor::Thread))
        .otherwise(Choice::Unlimited);
    Router::new()
        .route("/verify", gate.route(verify))
        .route("/judge", gate.route(judge))
        .route("/tool", get(|| async { "tool" }))
        .layer(
            ResourcesOperationLayer::new_for_http(1)
                .metrics(telemetry.metrics.clone())
                .per_request(chooser)
                .limits([
                    Limit::builder(4).name("verifiers").build(),
                    Limit::builder(8).name("judges").build(),
                ]),
        )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_router_wide_layer_caps_verify_at_four_and_judge_at_eight() {
    let telemetry = Telemetry::new();
    let gate = Gate::new();
    let (verify, judge) = (Arc::new(Load::default()), Arc::new(Load::default()));
    let addr = serve(capped_router(&gate, &verify, &judge, &telemetry)).await;

    let mut clients = Vec::new();
    for _ in 0..12 {
        clients.push(spawn_get(addr, "/verify"));
        clients.push(spawn_get(addr, "/judge"));
    }
    eventually("four verify and eight judge", || {
        verify.now() == 4 && judge.now() == 8
    })
    .await;
    eventually("the rest wait, each for its own limit", || {
        named(&telemetry, LIMIT_QUEUED_INSTRUMENT, "verifiers") == 8
            && named(&telemetry, LIMIT_QUEUED_INSTRUMENT, "judges") == 4
    })
    .await;
    assert_eq!(named(&telemetry, LIMIT_ACTIVE_INSTRUMENT, "verifiers"), 4);
    assert_eq!(named(&telemetry, LIMIT_ACTIVE_INSTRUMENT, "judges"), 8);
    assert_eq!(
        telemetry.live_value(LIMIT_INSTRUMENT, &of(Operation::Verify)),
        4
    );
    assert_eq!(
        telemetry.live_value(LIMIT_INSTRUMENT, &of(Operation::Judge)),
        8
    );
    // The layer's own limit of 1 is not in the way of either.
    let (status, body) = Client::open(addr).await.get("/tool").await;
    assert_eq!((status, body.as_str()), (200, "tool"));

    gate.open();
    for client in clients {
        assert_eq!(join(client).await.0, 200);
    }
    assert_eq!((verify.max(), judge.max()), (4, 8));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_series_that_rules_name_report_zero_before_any_request() {
    let telemetry = Telemetry::new();
    let gate = Gate::new();
    let (verify, judge) = (Arc::new(Load::default()), Arc::new(Load::default()));
    let _router = capped_router(&gate, &verify, &judge, &telemetry);

    let series: Vec<(String, String)> = telemetry
        .live(ACTIVE_INSTRUMENT)
        .into_iter()
        .map(|point| {
            assert_eq!(point.value, 0);
            let get = |key| point.attributes.get(key).cloned().unwrap_or_default();
            (get(OPERATION_ATTRIBUTE), get(EXECUTOR_ATTRIBUTE))
        })
        .collect();
    for expected in [
        ("verify", "subprocess"),
        ("judge", "inline"),
        ("tool", "thread"),
    ] {
        assert!(
            series.contains(&(expected.0.to_owned(), expected.1.to_owned())),
            "{expected:?} missing from {series:?}"
        );
    }
    assert_eq!(
        telemetry.live_value(LIMIT_INSTRUMENT, &of(Operation::Verify)),
        4
    );
    assert_eq!(
        telemetry.live_value(LIMIT_INSTRUMENT, &of(Operation::Tool)),
        1
    );
    assert_eq!(named(&telemetry, LIMIT_CAPACITY_INSTRUMENT, "judges"), 8);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_choice_naming_an_unknown_limit_takes_the_layers_own() {
    let telemetry = Telemetry::new();
    let load = Arc::new(Load::default());
    let gate = Gate::new();
    let chooser = move |_: &Request<Body>| {
        Choice::limited(Operation::Verify, Executor::Subprocess).on("no-such-limit")
    };
    let router = Router::new().route("/verify", gate.route(&load)).layer(
        ResourcesOperationLayer::new_for_http(2)
            .metrics(telemetry.metrics.clone())
            .per_request(ChooseFn::new(chooser))
            .limits([Limit::builder(4).name("verifiers").build()]),
    );
    let addr = serve(router).await;
    let clients: Vec<_> = (0..3).map(|_| spawn_get(addr, "/verify")).collect();
    eventually("two run under the layer's own limit", || load.now() == 2).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(
        load.now(),
        2,
        "the unknown name did not take the limit of 4"
    );
    gate.open();
    for client in clients {
        assert_eq!(join(client).await.0, 200);
    }
}

#[test]
#[should_panic(expected = "chosen by name")]
fn a_per_request_layer_refuses_an_unnamed_limit() {
    let _ = ResourcesOperationLayer::new(1)
        .per_request(ChooseFn::new(|_: &()| Choice::Unlimited))
        .limits([Limit::new(2)]);
}

#[test]
#[should_panic(expected = "named \"a\"")]
fn a_per_request_layer_refuses_two_limits_of_one_name() {
    let _ = ResourcesOperationLayer::new(1)
        .per_request(ChooseFn::new(|_: &()| Choice::Unlimited))
        .limits([
            Limit::builder(1).name("a").build(),
            Limit::builder(2).name("a").build(),
        ]);
}

#[test]
fn a_limit_name_outside_the_bounded_alphabet_is_refused() {
    for bad in [
        "",
        "1st",
        "has space",
        "x".repeat(65).leak(),
        "tab\t",
        "ünïcode",
    ] {
        let built = std::panic::catch_unwind(|| Limit::builder(1).name(bad).build());
        assert!(built.is_err(), "{bad:?} was accepted");
    }
    for good in ["verifiers", "judge.gpu-pool/a:b_c", "x"] {
        assert_eq!(Limit::builder(1).name(good).build().name(), Some(good));
    }
}

/// A name read from configuration needs no check first: `try_build` returns a bad one as an
/// error, whichever of the capacity and the name is wrong, and never panics.
#[test]
fn try_build_returns_a_bad_name_as_an_error_never_a_panic() {
    let built = std::panic::catch_unwind(|| Limit::builder(0).name("my workers").try_build());
    let refused = built.expect("try_build does not panic").unwrap_err();
    assert_eq!(refused.setting(), "capacity", "{refused:?}");

    let from_config = String::from("my workers");
    let built = std::panic::catch_unwind(|| Limit::builder(2).name(from_config).try_build());
    let refused = built.expect("try_build does not panic").unwrap_err();
    assert_eq!(refused.setting(), "name", "{refused:?}");
    assert!(refused.to_string().contains("\"my workers\""), "{refused}");

    let named = Limit::builder(2).name(String::from("workers")).try_build();
    assert_eq!(named.unwrap().name(), Some("workers"));
}
