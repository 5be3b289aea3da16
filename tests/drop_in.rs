//! Places where tower's `ConcurrencyLimit` compiles and works, and how this layer does there.
//!
//! A spawned task must be `Send`. With `BoxError` (`dyn Error + 'static` inside), rustc has to
//! prove that inside an async block, and cannot when a bound on the service needs the error to
//! be `'static`, as the `DefaultClassifier` does (rust-lang/rust#110338). These tests pin down
//! the ways that do compile, so the documented workarounds stay true.

mod support;

use std::time::Duration;

use tower::util::BoxCloneService;
use tower::{service_fn, BoxError, Layer, ServiceBuilder, ServiceExt};
use tower_resources_operation::{
    ResourcesOperationLayer, TimeoutClassifier, DURATION_INSTRUMENT, OUTCOME_ATTRIBUTE,
};

/// The inner service of these tests: echoes its request, and fails with a `BoxError` on 0.
async fn zero_fails(n: u32) -> Result<u32, BoxError> {
    if n == 0 {
        Err("zero".into())
    } else {
        Ok(n)
    }
}

fn count(telemetry: &support::Telemetry, outcome: &str) -> u64 {
    telemetry.count(DURATION_INSTRUMENT, &[(OUTCOME_ATTRIBUTE, outcome)])
}

#[tokio::test]
async fn a_default_classified_service_with_boxed_errors_can_be_spawned_directly() {
    let telemetry = support::Telemetry::new();
    let service = ResourcesOperationLayer::new(1)
        .metrics(telemetry.metrics.clone())
        .layer(service_fn(zero_fails));
    let ok = tokio::spawn(service.clone().oneshot(5));
    let err = tokio::spawn(service.oneshot(0));
    assert_eq!(ok.await.unwrap().unwrap(), 5);
    assert!(err.await.unwrap().is_err());
    assert_eq!(
        (count(&telemetry, "ok"), count(&telemetry, "error")),
        (1, 1)
    );
}

#[tokio::test]
async fn the_default_layer_compiles_inside_spawned_async_blocks_with_boxed_errors() {
    let telemetry = support::Telemetry::new();
    let service = ResourcesOperationLayer::new(1)
        .metrics(telemetry.metrics.clone())
        .layer(service_fn(zero_fails));
    let tower = tower::limit::ConcurrencyLimitLayer::new(1)
        .layer(service_fn(|n: u32| async move { Ok::<_, BoxError>(n) }));
    let ours = service.clone();
    let ours = tokio::spawn(async move { ours.oneshot(7).await });
    let theirs = tokio::spawn(async move { tower.oneshot(7).await });
    assert_eq!(ours.await.unwrap().unwrap(), theirs.await.unwrap().unwrap());
    let err = tokio::spawn(async move { service.oneshot(0).await });
    assert!(err.await.unwrap().is_err());
    assert_eq!(
        (count(&telemetry, "ok"), count(&telemetry, "error")),
        (1, 1)
    );
}

#[tokio::test]
async fn a_boxed_service_keeps_timeout_detection_inside_spawned_async_blocks() {
    let telemetry = support::Telemetry::new();
    let service: BoxCloneService<(), http::Response<()>, BoxError> = BoxCloneService::new(
        ServiceBuilder::new()
            .layer(
                ResourcesOperationLayer::new(1)
                    .classifier(TimeoutClassifier::wrap(
                        tower_resources_operation::HttpClassifier::new(),
                    ))
                    .metrics(telemetry.metrics.clone()),
            )
            .timeout(Duration::from_millis(5))
            .service(service_fn(|_: ()| async {
                tokio::time::sleep(Duration::from_secs(5)).await;
                Ok::<_, BoxError>(http::Response::new(()))
            })),
    );
    let result = tokio::spawn(async move { service.oneshot(()).await }).await;
    assert!(result.unwrap().is_err());
    assert_eq!(count(&telemetry, "timeout"), 1);
}
