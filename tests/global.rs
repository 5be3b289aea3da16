//! `OperationMetrics::global()`, in a test binary of its own: the global meter provider is
//! process-wide, and must be installed before anything first calls `global()`.

mod support;

use std::convert::Infallible;
use std::sync::{Mutex, MutexGuard, OnceLock};

use tokio::sync::Semaphore;
use tokio_test::{assert_pending, assert_ready, task};
use tower::{service_fn, Layer, ServiceExt};
use tower_resources_operation::{
    resources_operation, Executor, Operation, OperationMetrics, ResourcesOperationLayer,
    ACTIVE_INSTRUMENT, DURATION_INSTRUMENT, EXECUTOR_ATTRIBUTE, OPERATION_ATTRIBUTE,
    OUTCOME_ATTRIBUTE, QUEUED_INSTRUMENT, QUEUE_DURATION_INSTRUMENT,
};

use support::{pipeline, Telemetry};

/// The telemetry behind the global meter provider, installed once, before the first `global()`.
/// Tests read it one at a time, as `collect` resets the shared exporter.
fn global() -> MutexGuard<'static, Telemetry> {
    static GLOBAL: OnceLock<Mutex<Telemetry>> = OnceLock::new();
    GLOBAL
        .get_or_init(|| {
            let (provider, exporter) = pipeline();
            opentelemetry::global::set_meter_provider(provider.clone());
            Mutex::new(Telemetry {
                provider,
                exporter,
                metrics: OperationMetrics::global(),
            })
        })
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[tokio::test]
async fn default_layer_reports_through_the_global_provider_installed_before_first_use() {
    drop(global());
    assert!(
        std::env::var("OTEL_SDK_DISABLED").is_err(),
        "run without OTEL_SDK_DISABLED"
    );
    assert!(OperationMetrics::global().is_enabled());

    // No `.metrics(...)`: the layer defaults to the global metrics.
    let layer = ResourcesOperationLayer::new(1);
    let svc = layer.layer(service_fn(
        |n: u32| async move { Ok::<_, Infallible>(n * 2) },
    ));
    assert_eq!(svc.clone().oneshot(21).await.unwrap(), 42);
    assert_eq!(svc.oneshot(1).await.unwrap(), 2);

    let other_other = [
        (OPERATION_ATTRIBUTE, "other"),
        (EXECUTOR_ATTRIBUTE, "other"),
    ];
    let t = global();
    let exported = t.collect();
    assert!(
        exported
            .iter()
            .all(|m| m.name.starts_with("gym.resources.")),
        "only the crate's instruments: {exported:?}"
    );
    assert_eq!(t.count(QUEUE_DURATION_INSTRUMENT, &other_other), 2);
    let ok = [
        (OPERATION_ATTRIBUTE, "other"),
        (EXECUTOR_ATTRIBUTE, "other"),
        (OUTCOME_ATTRIBUTE, "ok"),
    ];
    assert_eq!(t.count(DURATION_INSTRUMENT, &ok), 2);
    assert_eq!(t.live_value(ACTIVE_INSTRUMENT, &other_other), 0);
    assert_eq!(t.live_value(QUEUED_INSTRUMENT, &other_other), 0);
}

#[tokio::test]
async fn free_function_reports_through_the_global_provider_and_limits() {
    drop(global());
    let limit = Semaphore::new(1);
    let (release, rx) = tokio::sync::oneshot::channel::<()>();

    let mut first = task::spawn(resources_operation(
        &limit,
        Operation::Verify,
        Executor::Thread,
        async {
            rx.await.unwrap();
            Ok::<_, Infallible>(1)
        },
    ));
    let mut second = task::spawn(resources_operation(
        &limit,
        Operation::Verify,
        Executor::Thread,
        async { Ok::<_, Infallible>(2) },
    ));
    assert_pending!(first.poll());
    assert_pending!(second.poll());

    let verify_thread = [
        (OPERATION_ATTRIBUTE, "verify"),
        (EXECUTOR_ATTRIBUTE, "thread"),
    ];
    {
        let t = global();
        assert_eq!(t.live_value(ACTIVE_INSTRUMENT, &verify_thread), 1);
        assert_eq!(t.live_value(QUEUED_INSTRUMENT, &verify_thread), 1);
    }

    release.send(()).unwrap();
    assert_eq!(assert_ready!(first.poll()), Ok(Ok(1)));
    assert!(second.is_woken());
    assert_eq!(assert_ready!(second.poll()), Ok(Ok(2)));

    let t = global();
    assert_eq!(t.count(QUEUE_DURATION_INSTRUMENT, &verify_thread), 2);
    assert_eq!(t.count(DURATION_INSTRUMENT, &verify_thread), 2);
    assert_eq!(t.live_value(ACTIVE_INSTRUMENT, &verify_thread), 0);
    assert_eq!(t.live_value(QUEUED_INSTRUMENT, &verify_thread), 0);
}
