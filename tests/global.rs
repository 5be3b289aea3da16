//! Metrics that fall back to the global meter provider: which provider they report to, and when
//! that is decided. In a test binary of its own, as the global provider is process-wide; the
//! tests take turns installing theirs.
//!
//! OpenTelemetry's global meter is a snapshot of the provider installed when it is taken. A
//! layer left on the default takes it when it first serves, the free `resources_operation` on
//! every call, and a layer given metrics of its own never consults it.

mod support;

use std::convert::Infallible;

use tokio::sync::{Mutex, MutexGuard};

use tower::{service_fn, Layer, ServiceExt};
use tower_resources_operation::names::{
    ACTIVE_INSTRUMENT, DURATION_INSTRUMENT, EXECUTOR_ATTRIBUTE, OPERATION_ATTRIBUTE,
    QUEUE_DURATION_INSTRUMENT,
};
use tower_resources_operation::per_request::{ByRoute, Choice};
use tower_resources_operation::{
    resources_operation, Executor, Limit, Operation, OperationMetrics, ResourcesOperationLayer,
};

use support::{pipeline, Telemetry};

/// One test at a time installs the global provider, and holds its turn across its awaits.
async fn global_provider_turn() -> MutexGuard<'static, ()> {
    static TURN: Mutex<()> = Mutex::const_new(());
    TURN.lock().await
}

/// A fresh provider with an in-memory exporter, not installed anywhere yet.
fn provider() -> Telemetry {
    let (provider, exporter) = pipeline();
    Telemetry {
        // Only for `collect`; the global metrics are made from the provider itself.
        metrics: OperationMetrics::disabled(),
        provider,
        exporter,
    }
}

fn install(telemetry: &Telemetry) {
    opentelemetry::global::set_meter_provider(telemetry.provider.clone());
}

fn operations(telemetry: &Telemetry, operation: &str) -> u64 {
    telemetry.count(DURATION_INSTRUMENT, &[(OPERATION_ATTRIBUTE, operation)])
}

/// One operation through a service of `layer`.
async fn serve_once(layer: &ResourcesOperationLayer, n: u32) {
    let service = layer.layer(service_fn(|n: u32| async move { Ok::<_, Infallible>(n) }));
    assert_eq!(service.oneshot(n).await.unwrap(), n);
}

#[tokio::test]
async fn the_common_order_build_then_install_then_serve_reports_to_the_installed_provider() {
    let _turn = global_provider_turn().await;
    let own = Telemetry::new();
    // Built before any provider is installed: a default layer, and one with metrics of its own
    // (which used to snapshot the global meter, a no-op then, for the life of the process).
    let default = ResourcesOperationLayer::new(1).operation(Operation::Verify);
    let explicit = ResourcesOperationLayer::new(1)
        .operation(Operation::Judge)
        .metrics(own.metrics.clone());

    let global = provider();
    install(&global);
    serve_once(&default, 1).await;
    serve_once(&explicit, 2).await;
    resources_operation(&Limit::new(1), Operation::Tool, Executor::Inline, async {
        Ok::<_, Infallible>(())
    })
    .await
    .unwrap()
    .unwrap();

    assert_eq!(operations(&global, "verify"), 1, "the default layer");
    assert_eq!(operations(&global, "tool"), 1, "the free function");
    assert_eq!(
        operations(&global, "judge"),
        0,
        "explicit metrics never reach the global provider"
    );
    assert_eq!(operations(&own, "judge"), 1);
    assert_eq!(operations(&own, "verify") + operations(&own, "tool"), 0);
}

#[tokio::test]
async fn a_default_layer_keeps_the_provider_it_first_served_with() {
    let _turn = global_provider_turn().await;
    let layer = ResourcesOperationLayer::new(1).operation(Operation::Verify);
    let service = layer.layer(service_fn(|n: u32| async move { Ok::<_, Infallible>(n) }));

    let first = provider();
    install(&first);
    service.clone().oneshot(1).await.unwrap();
    let second = provider();
    install(&second);
    service.clone().oneshot(2).await.unwrap();

    assert_eq!(operations(&first, "verify"), 2);
    assert_eq!(operations(&second, "verify"), 0);
    // A layer that has not served yet decides now, for the provider installed now.
    serve_once(
        &ResourcesOperationLayer::new(1).operation(Operation::Judge),
        3,
    )
    .await;
    assert_eq!(operations(&second, "judge"), 1);
    assert_eq!(operations(&first, "judge"), 0);
}

#[tokio::test]
async fn the_free_function_reports_to_the_provider_installed_when_it_is_called() {
    let _turn = global_provider_turn().await;
    let limit = Limit::new(1);
    let first = provider();
    install(&first);
    resources_operation(&limit, Operation::Verify, Executor::Thread, async {})
        .await
        .unwrap();
    let second = provider();
    install(&second);
    resources_operation(&limit, Operation::Judge, Executor::Thread, async {})
        .await
        .unwrap();

    assert_eq!(
        (operations(&first, "verify"), operations(&first, "judge")),
        (1, 0)
    );
    assert_eq!(
        (operations(&second, "verify"), operations(&second, "judge")),
        (0, 1)
    );
}

#[tokio::test]
async fn global_metrics_are_one_set_per_provider_so_live_counts_are_not_hidden() {
    let _turn = global_provider_turn().await;
    let global = provider();
    install(&global);
    // Two calls under one provider share the instruments: one callback per series, not two
    // (two would each report the same series, and OpenTelemetry keeps only the last).
    let (a, b) = (OperationMetrics::global(), OperationMetrics::global());
    let limit = Limit::new(2);
    let verify_thread = [
        (OPERATION_ATTRIBUTE, "verify"),
        (EXECUTOR_ATTRIBUTE, "thread"),
    ];
    let (release, wait) = tokio::sync::oneshot::channel::<()>();
    let held = tokio::spawn({
        let limit = limit.clone();
        async move {
            a.resources_operation(&limit, Operation::Verify, Executor::Thread, async {
                wait.await.unwrap();
            })
            .await
            .unwrap()
        }
    });
    support::settle().await;
    b.resources_operation(&limit, Operation::Verify, Executor::Thread, async {})
        .await
        .unwrap();
    assert_eq!(
        global.live_value(ACTIVE_INSTRUMENT, &verify_thread),
        1,
        "the running operation of `a`, seen through the one callback"
    );
    release.send(()).unwrap();
    held.await.unwrap();
    assert_eq!(global.count(QUEUE_DURATION_INSTRUMENT, &verify_thread), 2);
}

#[tokio::test]
async fn a_per_request_layer_on_the_default_resolves_the_provider_when_it_first_serves() {
    let _turn = global_provider_turn().await;
    let layer = ResourcesOperationLayer::new_for_http(2).per_request(ByRoute::new().service(
        "pkg.Verifier",
        Choice::limited(Operation::Verify, Executor::Process),
    ));
    let service = layer.layer(service_fn(|_: http::Request<()>| async {
        Ok::<_, Infallible>(http::Response::new(()))
    }));
    let global = provider();
    install(&global);
    let request = http::Request::post("/pkg.Verifier/Check").body(()).unwrap();
    service.oneshot(request).await.unwrap();
    assert_eq!(operations(&global, "verify"), 1);
}

#[tokio::test]
async fn a_default_layer_reports_its_series_from_the_first_request_a_service_serves() {
    let _turn = global_provider_turn().await;
    let global = provider();
    install(&global);
    let layer = ResourcesOperationLayer::new(1)
        .operation(Operation::Judge)
        .executor(Executor::Thread);
    let service = layer.layer(service_fn(|n: u32| async move { Ok::<_, Infallible>(n) }));
    let judge_thread = [
        (OPERATION_ATTRIBUTE, "judge"),
        (EXECUTOR_ATTRIBUTE, "thread"),
    ];
    let reported = |global: &Telemetry| {
        global
            .live(ACTIVE_INSTRUMENT)
            .iter()
            .filter(|point| support::matches(&point.attributes, &judge_thread))
            .map(|point| point.value)
            .collect::<Vec<_>>()
    };

    assert_eq!(
        reported(&global),
        Vec::<i64>::new(),
        "a service that has not served yet decided no metrics, so reports no series"
    );
    service.oneshot(1).await.unwrap();
    assert_eq!(
        reported(&global),
        [0],
        "from its first request on, it reports 0"
    );
}

/// The global metrics are kept per provider only while the provider is the global one (or
/// otherwise alive): a provider replaced by another is let go, so the registry does not grow
/// with every provider a process installs.
#[tokio::test]
async fn a_replaced_global_provider_is_let_go() {
    let _turn = global_provider_turn().await;
    let first = provider();
    install(&first);
    let installed = std::sync::Arc::downgrade(&opentelemetry::global::meter_provider());
    assert!(OperationMetrics::global().is_enabled());

    let second = provider();
    install(&second);
    assert!(OperationMetrics::global().is_enabled());
    assert!(
        installed.upgrade().is_none(),
        "the replaced provider is still held"
    );
}
