//! The observable instruments: one callback each, over every reported series or named limit.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use opentelemetry::metrics::Meter;
use opentelemetry::KeyValue;

use super::instruments::{millis, Cell, Shared};
use crate::limit::Reading;
use crate::names::{
    ABANDONED_INSTRUMENT, ACTIVE_INSTRUMENT, LIMIT_ACTIVE_INSTRUMENT, LIMIT_ATTRIBUTE,
    LIMIT_BASELINE_INSTRUMENT, LIMIT_CAPACITY_INSTRUMENT, LIMIT_ESTIMATE_INSTRUMENT,
    LIMIT_INSTRUMENT, LIMIT_QUEUED_INSTRUMENT, LIMIT_SCOPE_ATTRIBUTE, QUEUED_INSTRUMENT,
    REJECTED_INSTRUMENT,
};

/// Registers the observable instruments, each read by one callback over every reported series.
pub(super) fn register_callbacks(meter: &Meter, shared: &Arc<Shared>) {
    let live = |name: &'static str, description: &'static str, count: fn(&Cell) -> &AtomicI64| {
        let shared = Arc::clone(shared);
        meter
            .i64_observable_up_down_counter(name)
            .with_unit("{operation}")
            .with_description(description)
            .with_callback(move |observer| {
                shared.observe_series(
                    |cell| count(cell).load(Ordering::Relaxed),
                    |value, attributes| observer.observe(value, attributes),
                )
            })
            .build();
    };
    live(
        QUEUED_INSTRUMENT,
        "Operations waiting for the concurrency limit right now.",
        |cell| &cell.queued,
    );
    live(
        ACTIVE_INSTRUMENT,
        "Operations holding a permit of the concurrency limit right now.",
        |cell| &cell.active,
    );

    let limits = Arc::clone(shared);
    meter
        .i64_observable_gauge(LIMIT_INSTRUMENT)
        .with_unit("{operation}")
        .with_description(
            "Operations that could hold a permit at once: the capacities of the limits the series draws from.",
        )
        .with_callback(move |observer| {
            limits.observe_limits(|value, attributes| observer.observe(value, attributes))
        })
        .build();

    let named = |name: &'static str, description: &'static str, value: fn(&Reading) -> usize| {
        let shared = Arc::clone(shared);
        let callback = move |observer: &dyn opentelemetry::metrics::AsyncInstrument<i64>| {
            for (limit, reading) in shared.limits.named() {
                let value = i64::try_from(value(&reading)).unwrap_or(i64::MAX);
                observer.observe(value, &named_attributes(limit, &reading));
            }
        };
        (name, description, callback)
    };
    let (name, description, callback) = named(
        LIMIT_CAPACITY_INSTRUMENT,
        "Operations a named limit admits at once.",
        |reading| reading.capacity,
    );
    meter
        .i64_observable_gauge(name)
        .with_unit("{operation}")
        .with_description(description)
        .with_callback(callback)
        .build();
    for (name, description, value) in [
        (
            LIMIT_ACTIVE_INSTRUMENT,
            "Operations holding a place of a named limit right now.",
            (|reading| reading.active) as fn(&Reading) -> usize,
        ),
        (
            LIMIT_QUEUED_INSTRUMENT,
            "Operations waiting for a named limit right now.",
            |reading| reading.queued,
        ),
    ] {
        let (name, description, callback) = named(name, description, value);
        meter
            .i64_observable_up_down_counter(name)
            .with_unit("{operation}")
            .with_description(description)
            .with_callback(callback)
            .build();
    }

    for (name, description, value) in [
        (
            LIMIT_BASELINE_INSTRUMENT,
            "The run time a named adaptive limit takes as normal, at low load.",
            (|reading| reading.baseline) as fn(&Reading) -> Option<Duration>,
        ),
        (
            LIMIT_ESTIMATE_INSTRUMENT,
            "The recent run time a named adaptive limit compares with its baseline.",
            |reading| reading.estimate,
        ),
    ] {
        let shared = Arc::clone(shared);
        meter
            .f64_observable_gauge(name)
            .with_unit("ms")
            .with_description(description)
            .with_callback(move |observer| {
                for (limit, reading) in shared.limits.named() {
                    if let Some(run_time) = value(&reading) {
                        observer.observe(millis(run_time), &named_attributes(limit, &reading));
                    }
                }
            })
            .build();
    }

    let rejected = Arc::clone(shared);
    meter
        .u64_observable_counter(REJECTED_INSTRUMENT)
        .with_unit("{operation}")
        .with_description("Operations turned away without a permit, by reason.")
        .with_callback(move |observer| {
            rejected.observe_rejections(|value, attributes| observer.observe(value, attributes))
        })
        .build();

    let abandoned = Arc::clone(shared);
    meter
        .u64_observable_counter(ABANDONED_INSTRUMENT)
        .with_unit("{operation}")
        .with_description("Operations whose caller went away while they waited for a permit.")
        .with_callback(move |observer| {
            abandoned.observe_series(
                |cell| cell.abandoned.load(Ordering::Relaxed),
                |value, attributes| observer.observe(value, attributes),
            )
        })
        .build();
}

/// A named limit's attributes: its name and its scope (built at collection, not per operation).
fn named_attributes(limit: Arc<str>, reading: &Reading) -> [KeyValue; 2] {
    [
        KeyValue::new(LIMIT_ATTRIBUTE, limit),
        KeyValue::new(LIMIT_SCOPE_ATTRIBUTE, reading.scope.as_str()),
    ]
}
