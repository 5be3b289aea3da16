#![cfg(feature = "tracing")]
//! The mistakes that would record nothing, or the wrong thing, without a word are each reported
//! once, as a `tracing` warning: no meter provider installed, two `OperationMetrics` alive at
//! once, and a per-request choice that names a limit its layer was not given.
//!
//! One test, alone in its binary: the warnings are once per process, and the test installs the
//! process's subscriber.

use std::convert::Infallible;
use std::fmt::Debug;
use std::sync::{Arc, Mutex};

use opentelemetry::metrics::MeterProvider as _;
use opentelemetry_sdk::metrics::SdkMeterProvider;
use tower::{service_fn, Layer, ServiceExt};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Level, Metadata, Subscriber};

use tower_resources_operation::per_request::{choose_fn, Choice};
use tower_resources_operation::{
    resources_operation, Executor, Limit, Operation, OperationMetrics, ResourcesOperationLayer,
};

/// A subscriber that keeps each event's level, target and message.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<(Level, String, String)>>>);

impl Captured {
    /// The warnings so far that contain `text`.
    fn warnings(&self, text: &str) -> usize {
        let events = self.0.lock().unwrap();
        events
            .iter()
            .filter(|(level, target, message)| {
                *level == Level::WARN
                    && target == "tower_resources_operation"
                    && message.contains(text)
            })
            .count()
    }
}

struct Message(String);

impl Visit for Message {
    fn record_debug(&mut self, field: &Field, value: &dyn Debug) {
        if field.name() == "message" {
            self.0 = format!("{value:?}");
        }
    }
}

impl Subscriber for Captured {
    fn enabled(&self, _: &Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &Attributes<'_>) -> Id {
        Id::from_u64(1)
    }
    fn record(&self, _: &Id, _: &Record<'_>) {}
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, event: &Event<'_>) {
        let mut message = Message(String::new());
        event.record(&mut message);
        let metadata = event.metadata();
        self.0
            .lock()
            .unwrap()
            .push((*metadata.level(), metadata.target().to_owned(), message.0));
    }
    fn enter(&self, _: &Id) {}
    fn exit(&self, _: &Id) {}
}

#[tokio::test]
async fn each_silent_mistake_is_reported_once() {
    let captured = Captured::default();
    tracing::subscriber::set_global_default(captured.clone()).unwrap();

    // No provider installed: the global metrics record nothing, and say so, once.
    assert!(!OperationMetrics::global().is_enabled());
    assert_eq!(captured.warnings("no OpenTelemetry meter provider"), 1);
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
    assert_eq!(captured.warnings("no OpenTelemetry meter provider"), 1);

    // One OperationMetrics alive: fine. A second one while the first lives: a warning, once.
    let provider = SdkMeterProvider::builder().build();
    let first = OperationMetrics::new(&provider.meter("first"));
    assert_eq!(captured.warnings("second OperationMetrics"), 0);
    let second = OperationMetrics::new(&provider.meter("second"));
    let third = OperationMetrics::new(&provider.meter("third"));
    assert_eq!(captured.warnings("second OperationMetrics"), 1);
    drop((second, third));

    // A choice naming a limit the layer does not have: served under the layer's own, and
    // reported once.
    let layer = ResourcesOperationLayer::new(1)
        .metrics(first)
        .per_request(choose_fn(|_: &u32| {
            Choice::limited(Operation::Tool, Executor::Thread).on("missing")
        }))
        .limits([Limit::builder(2).name("present").build()]);
    let service = layer.layer(service_fn(|n: u32| async move { Ok::<_, Infallible>(n) }));
    for n in 0..3 {
        assert_eq!(service.clone().oneshot(n).await.unwrap(), n);
    }
    assert_eq!(captured.warnings("\"missing\""), 1);
    assert_eq!(captured.warnings("not given"), 1);
}
