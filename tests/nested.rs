#![cfg(feature = "tracing")]
//! One limit applied twice on a request's path, as a user wrote it: a route's layer and the
//! Router's, both on clones of one `Limit` of 2, under `axum::serve` on 127.0.0.1. Each request
//! is admitted once, on the place the outer layer took, so the limit is neither halved nor
//! deadlocked, and the crate says so once, naming the limit.
//!
//! One test, alone in its binary: the warning is once per process, and the test installs the
//! process's subscriber. The generic and scoped forms are in `tests/limit.rs` and
//! `tests/scoped.rs`.

mod support;

use std::sync::Arc;
use std::time::Duration;

use axum::routing::get;
use axum::Router;
use support::captured::Captured;
use support::http::{serve, Client};
use support::{Load, Telemetry};
use tower_resources_operation::names::{DURATION_INSTRUMENT, OPERATION_ATTRIBUTE};
use tower_resources_operation::{Executor, Limit, Operation, ResourcesOperationLayer};

/// How long each handler holds its place.
const WORK: Duration = Duration::from_millis(150);

/// Six concurrent requests hang until their clients give up, without the fix: a short net.
const PATIENCE: Duration = Duration::from_secs(10);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_limit_on_a_route_and_on_the_router_admits_each_request_once_and_says_so_once() {
    let captured = Captured::install();
    let t = Telemetry::new();
    let workers = Limit::builder(2).name("workers").build();
    let load = Arc::new(Load::default());
    let verify = {
        let load = Arc::clone(&load);
        get(move || {
            let load = Arc::clone(&load);
            async move {
                load.work(WORK).await;
                "verified"
            }
        })
    };
    let app = Router::new()
        .route(
            "/verify",
            verify.layer(
                ResourcesOperationLayer::new_for_http(workers.clone())
                    .operation(Operation::Verify)
                    .executor(Executor::Subprocess)
                    .metrics(t.metrics.clone()),
            ),
        )
        .layer(ResourcesOperationLayer::new_for_http(workers.clone()).metrics(t.metrics.clone()));
    let addr = serve(app).await;

    // Two, one after the other, then six at once, each on a connection of its own.
    for _ in 0..2 {
        let (status, body) = Client::open(addr).await.get("/verify").await;
        assert_eq!((status, body.as_str()), (200, "verified"));
    }
    let clients =
        (0..6).map(|_| tokio::spawn(async move { Client::open(addr).await.get("/verify").await }));
    let answered = tokio::time::timeout(PATIENCE, futures_util::future::join_all(clients))
        .await
        .expect("six concurrent requests through one limit applied twice are all answered");
    for answer in answered {
        assert_eq!(answer.unwrap(), (200, "verified".to_owned()));
    }

    // At most 2 ran at once, and 2 did: the limit is not halved.
    assert_eq!(load.max(), 2, "the most handlers that ran at once");
    assert_eq!((workers.available(), workers.queued()), (2, 0));

    // Said once, naming the limit.
    let said = captured.warnings("already holds");
    assert_eq!(said.len(), 1, "{said:?}");
    assert!(said[0].contains("\"workers\""), "{}", said[0]);

    // The outer layer's operation is the one recorded: 8, as `other`; none as the route's.
    assert_eq!(
        t.count(DURATION_INSTRUMENT, &[(OPERATION_ATTRIBUTE, "other")]),
        8
    );
    assert_eq!(
        t.count(DURATION_INSTRUMENT, &[(OPERATION_ATTRIBUTE, "verify")]),
        0
    );
}
