//! In the default setup (the `tracing` feature on, and no subscriber installed, as in the
//! README's Getting started), each warning still reaches a person: on standard error, once.
//!
//! The warnings are once per process, so the mistakes are made in a child process (this test
//! binary, run again for the one test below that makes them), whose standard error is read.

use std::convert::Infallible;
use std::process::Command;

use opentelemetry::metrics::MeterProvider as _;
use opentelemetry_sdk::metrics::SdkMeterProvider;
use tower_resources_operation::{
    resources_operation, Executor, Limit, Operation, OperationMetrics,
};

const CHILD: &str = "TRO_WARNINGS_CHILD";

/// Runs the child test in `mode`; its standard error.
fn child(mode: &str) -> String {
    let output = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "mistakes_made_in_the_child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, mode)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(output.status.success(), "the child failed: {stderr}");
    stderr
}

#[test]
fn without_a_subscriber_each_warning_goes_to_standard_error_once() {
    let stderr = child("mistakes");
    assert_eq!(
        stderr.matches("no OpenTelemetry meter provider").count(),
        1,
        "{stderr}"
    );
    assert_eq!(
        stderr.matches("second OperationMetrics").count(),
        1,
        "{stderr}"
    );
    assert!(
        stderr.contains("WARN tower_resources_operation"),
        "{stderr}"
    );
    #[cfg(feature = "axum")]
    assert_eq!(
        stderr.matches("matched no route").count(),
        1,
        "a layer over the whole Router is named once: {stderr}"
    );
}

/// Makes each mistake twice, with no `tracing` subscriber; does nothing unless run as the
/// child of the test above.
#[test]
fn mistakes_made_in_the_child() {
    let Some(mode) = std::env::var_os(CHILD) else {
        return;
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    #[cfg(feature = "axum")]
    if mode == "plain" {
        let provider = SdkMeterProvider::builder().build();
        let metrics = OperationMetrics::new(&provider.meter("plain"));
        runtime.block_on(plain_service_serves_two_requests_without_a_route(metrics));
        return;
    }
    #[cfg(feature = "axum")]
    if mode == "per_request" {
        let provider = SdkMeterProvider::builder().build();
        let metrics = OperationMetrics::new(&provider.meter("chosen"));
        runtime.block_on(per_request_layer_places_two_404s(metrics));
        return;
    }
    let _ = mode;
    for _ in 0..2 {
        // No provider installed: recorded nowhere.
        let answer = runtime.block_on(resources_operation(
            &Limit::new(1),
            Operation::Verify,
            Executor::Inline,
            async { Ok::<u32, Infallible>(7) },
        ));
        assert_eq!(answer.unwrap().unwrap(), 7);
    }
    let provider = SdkMeterProvider::builder().build();
    let first = OperationMetrics::new(&provider.meter("first"));
    for _ in 0..2 {
        let _second = OperationMetrics::new(&provider.meter("second"));
    }
    #[cfg(feature = "axum")]
    runtime.block_on(router_wide_layer_counts_two_404s(first.clone()));
    drop(first);
}

#[cfg(feature = "axum")]
fn unrouted() -> http::Request<axum::body::Body> {
    http::Request::get("/nowhere")
        .body(axum::body::Body::empty())
        .unwrap()
}

/// A layer of one operation over a whole Router: its fallback's 404s count as the operation.
#[cfg(feature = "axum")]
async fn router_wide_layer_counts_two_404s(metrics: OperationMetrics) {
    use axum::{routing::get, Router};
    use tower::ServiceExt as _;
    use tower_resources_operation::ResourcesOperationLayer;

    let router_wide = Router::new()
        .route("/verify", get(|| async { "ok" }))
        .layer(ResourcesOperationLayer::new_for_http(2).metrics(metrics));
    for _ in 0..2 {
        let answer = router_wide.clone().oneshot(unrouted()).await.unwrap();
        assert_eq!(answer.status(), 404);
    }
}

/// A per-request layer over the same Router, whose chooser limits what matched no route.
#[cfg(feature = "axum")]
async fn per_request_layer_places_two_404s(metrics: OperationMetrics) {
    use axum::{routing::get, Router};
    use tower::ServiceExt as _;
    use tower_resources_operation::per_request::{ByRoute, Choice};
    use tower_resources_operation::ResourcesOperationLayer;

    let chosen = Router::new()
        .route("/verify", get(|| async { "ok" }))
        .layer(
            ResourcesOperationLayer::new_for_http(2)
                .metrics(metrics)
                .per_request(ByRoute::new().otherwise(Choice::OTHER)),
        );
    for _ in 0..2 {
        let answer = chosen.clone().oneshot(unrouted()).await.unwrap();
        assert_eq!(answer.status(), 404);
    }
}

/// A per-request layer over a whole Router places the requests that matched no route with its
/// chooser: nothing to warn about.
#[cfg(feature = "axum")]
#[test]
fn a_per_request_layer_over_the_router_is_not_warned_about() {
    let stderr = child("per_request");
    assert_eq!(stderr.matches("matched no route").count(), 0, "{stderr}");
}

/// A layer of one operation on a plain service (hyper's `service_fn`, a test, a fleet replica),
/// whose requests never went through an axum Router: they carry no route, and that is no
/// mistake.
#[cfg(feature = "axum")]
async fn plain_service_serves_two_requests_without_a_route(metrics: OperationMetrics) {
    use tower::{Layer as _, ServiceExt as _};
    use tower_resources_operation::ResourcesOperationLayer;

    let plain = ResourcesOperationLayer::new_for_http(2)
        .metrics(metrics)
        .layer(tower::service_fn(|_: http::Request<()>| async {
            Ok::<_, Infallible>(http::Response::new(()))
        }));
    for _ in 0..2 {
        let request = http::Request::get("/verify").body(()).unwrap();
        let answer = plain.clone().oneshot(request).await.unwrap();
        assert_eq!(answer.status(), 200);
    }
}

/// The Router warning is for requests that went through an axum Router: a layer on a plain
/// service is not warned about.
#[cfg(feature = "axum")]
#[test]
fn a_layer_on_a_plain_service_is_not_warned_about() {
    let stderr = child("plain");
    assert_eq!(stderr.matches("matched no route").count(), 0, "{stderr}");
}
