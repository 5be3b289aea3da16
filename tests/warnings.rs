#![cfg(feature = "tracing")]
//! The mistakes that would record nothing, or the wrong thing, without a word are each reported
//! once, as a `tracing` warning: no meter provider installed, two `OperationMetrics` alive at
//! once, and a per-request choice that names a limit its layer was not given.
//!
//! One test, alone in its binary: the warnings are once per process, and the test installs the
//! process's subscriber.

mod support;

use std::convert::Infallible;

use opentelemetry::metrics::MeterProvider as _;
use opentelemetry_sdk::metrics::SdkMeterProvider;
use support::captured::Captured;
use tower::{service_fn, Layer, ServiceExt};

use tower_resources_operation::per_request::{Choice, ChooseFn};
use tower_resources_operation::{
    resources_operation, Executor, Limit, Operation, OperationMetrics, ResourcesOperationLayer,
};

#[tokio::test]
async fn each_silent_mistake_is_reported_once() {
    let captured = Captured::install();

    // No provider installed: the global metrics record nothing, and say so, once.
    assert!(!OperationMetrics::global().is_enabled());
    assert_eq!(
        captured.warnings("no OpenTelemetry meter provider").len(),
        1
    );
    for _ in 0..3 {
        let answer =
            resources_operation(&Limit::new(1), Operation::Verify, Executor::Inline, async {
                Ok::<u32, Infallible>(42)
            })
            .await
            .unwrap()
            .unwrap();
        assert_eq!(answer, 42, "the operation still runs");
    }
    assert_eq!(
        captured.warnings("no OpenTelemetry meter provider").len(),
        1
    );

    // One OperationMetrics alive: fine. A second one while the first lives: a warning, once.
    let provider = SdkMeterProvider::builder().build();
    let first = OperationMetrics::new(&provider.meter("first"));
    assert_eq!(captured.warnings("second OperationMetrics").len(), 0);
    let second = OperationMetrics::new(&provider.meter("second"));
    let third = OperationMetrics::new(&provider.meter("third"));
    assert_eq!(captured.warnings("second OperationMetrics").len(), 1);
    drop((second, third));

    // A choice naming a limit the layer does not have: served under the layer's own, and
    // reported once.
    let layer = ResourcesOperationLayer::new(1)
        .metrics(first)
        .per_request(ChooseFn::new(|_: &u32| {
            Choice::limited(Operation::Tool, Executor::Thread).on("missing")
        }))
        .limits([Limit::builder(2).name("present").build()]);
    let service = layer.layer(service_fn(|n: u32| async move { Ok::<_, Infallible>(n) }));
    for n in 0..3 {
        assert_eq!(service.clone().oneshot(n).await.unwrap(), n);
    }
    assert_eq!(captured.warnings("\"missing\"").len(), 1);
    assert_eq!(captured.warnings("not given").len(), 1);
}
