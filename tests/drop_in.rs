//! Places where tower's `ConcurrencyLimit` compiles and works, and how this layer does there.
//!
//! A spawned task must be `Send`. With `BoxError` (`dyn Error + 'static` inside), rustc has to
//! prove that inside an async block, and cannot when a bound on the service needs the error to
//! be `'static` (rust-lang/rust#110338: "higher-ranked lifetime error"), or when tower's
//! `Timeout` is in the stack ("implementation of `From` is not general enough", with tower's own
//! limit too). The default layer puts no bound on the error, so it compiles wherever tower's
//! limit does; these tests pin that down, and the two ways around the errors that the README
//! gives for the opt-in `TimeoutClassifier` and for tower's `Timeout`.

mod support;

use std::convert::Infallible;
use std::time::Duration;

use tower::util::BoxCloneService;
use tower::{service_fn, BoxError, Layer, Service, ServiceBuilder, ServiceExt};
use tower_resources_operation::classify::TimeoutClassifier;
use tower_resources_operation::names::{DURATION_INSTRUMENT, OUTCOME_ATTRIBUTE};
use tower_resources_operation::{Limit, ResourcesOperation, ResourcesOperationLayer};

/// The inner service of these tests: echoes its request, and fails with a `BoxError` on 0.
async fn zero_fails(n: u32) -> Result<u32, BoxError> {
    if n == 0 {
        Err("zero".into())
    } else {
        Ok(n)
    }
}

/// Answers after a long sleep: under a short `Timeout` it always times out.
async fn slow(n: u32) -> Result<u32, BoxError> {
    tokio::time::sleep(Duration::from_secs(5)).await;
    Ok(n)
}

fn count(telemetry: &support::Telemetry, outcome: &str) -> u64 {
    telemetry.count(DURATION_INSTRUMENT, &[(OUTCOME_ATTRIBUTE, outcome)])
}

#[tokio::test]
async fn the_default_layer_compiles_inside_spawned_async_blocks_with_boxed_errors() {
    let telemetry = support::Telemetry::new();
    let service = ResourcesOperationLayer::new(1)
        .metrics(telemetry.metrics.clone())
        .layer(service_fn(zero_fails));
    // What compiled with tower's limit, the same way, compiles with this one.
    let tower = tower::limit::ConcurrencyLimitLayer::new(1).layer(service_fn(zero_fails));
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

/// The `TimeoutClassifier` needs `'static` errors: inside `tokio::spawn(async move { .. })`
/// that is "higher-ranked lifetime error". Spawning the `oneshot` future itself, or boxing the
/// service, compiles, and keeps the timeouts.
#[tokio::test(start_paused = true)]
async fn the_timeout_classifier_with_boxed_errors_runs_spawned_directly_or_boxed() {
    let telemetry = support::Telemetry::new();
    let layer = ResourcesOperationLayer::new(2)
        .classifier(TimeoutClassifier::new())
        .metrics(telemetry.metrics.clone());
    let stack = ServiceBuilder::new()
        .layer(layer)
        .timeout(Duration::from_millis(5))
        .service(service_fn(slow));

    let direct = tokio::spawn(stack.clone().oneshot(1));
    let boxed: BoxCloneService<u32, u32, BoxError> = BoxCloneService::new(stack);
    let in_block = tokio::spawn(async move { boxed.oneshot(2).await });
    assert!(direct.await.unwrap().is_err());
    assert!(in_block.await.unwrap().is_err());
    assert_eq!(count(&telemetry, "timeout"), 2);
}

/// tower's `Timeout` in the stack is "implementation of `From` is not general enough" inside a
/// spawned async block, with tower's own limit as with this one; the same two ways out work.
#[tokio::test(start_paused = true)]
async fn a_stack_with_towers_timeout_runs_spawned_directly_or_boxed() {
    let telemetry = support::Telemetry::new();
    let stack = ServiceBuilder::new()
        .layer(ResourcesOperationLayer::new(2).metrics(telemetry.metrics.clone()))
        .timeout(Duration::from_secs(1))
        .service(service_fn(zero_fails));
    let direct = tokio::spawn(stack.clone().oneshot(3));
    let boxed: BoxCloneService<u32, u32, BoxError> = BoxCloneService::new(stack);
    let in_block = tokio::spawn(async move { boxed.oneshot(4).await });
    assert_eq!(direct.await.unwrap().unwrap(), 3);
    assert_eq!(in_block.await.unwrap().unwrap(), 4);
    assert_eq!(count(&telemetry, "ok"), 2);
}

#[cfg(feature = "load")]
#[tokio::test]
async fn the_service_forwards_the_inner_services_load() {
    use tower::load::{Constant, Load};

    let inner = Constant::new(
        service_fn(|n: u32| async move { Ok::<_, Infallible>(n) }),
        7,
    );
    let service = ResourcesOperationLayer::new(1).layer(inner);
    assert_eq!(service.load(), 7);
    assert_eq!(service.oneshot(1).await.unwrap(), 1);
}

#[tokio::test]
async fn the_service_is_made_without_the_layer_as_towers_is() {
    let echo = service_fn(|n: u32| async move { Ok::<_, Infallible>(n) });
    let mut ours = ResourcesOperation::new(echo, 1);
    let mut theirs = tower::limit::ConcurrencyLimit::new(echo, 1);
    assert_eq!(ours.ready().await.unwrap().call(5).await.unwrap(), 5);
    assert_eq!(theirs.ready().await.unwrap().call(5).await.unwrap(), 5);
    assert_eq!(ours.limit().capacity(), 1);

    let limit = Limit::new(2);
    let shared = ResourcesOperation::new(echo, limit.clone());
    let mut held = shared.clone();
    held.ready().await.unwrap();
    assert_eq!(limit.available(), 1, "a permit taken through the service");
    drop(held);
    assert_eq!(limit.available(), 2);
    assert_eq!(shared.oneshot(9).await.unwrap(), 9);
}
