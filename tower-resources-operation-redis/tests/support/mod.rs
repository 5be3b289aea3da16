//! What the fleet limit's tests share: a real OpenTelemetry SDK pipeline (an in-memory exporter
//! behind a periodic reader that never fires on its own, read back with `force_flush`), waits
//! with a safety net, a real `redis-server` (`redis_server`), and a `tracing` subscriber that
//! keeps what it hears (`captured`). The pipeline and the waits are the core crate's own
//! (`tests/support/telemetry.rs` at the repository's root), included here.
#![allow(dead_code, unreachable_pub)]

#[cfg(feature = "tracing")]
pub mod captured;
pub mod observer;
pub mod redis_cluster;
pub mod redis_server;
pub mod replicas;

use opentelemetry::metrics::MeterProvider as _;
use tower_resources_operation::names::{ACTIVE_INSTRUMENT, QUEUED_INSTRUMENT};

#[path = "../../../tests/support/telemetry.rs"]
mod telemetry;

pub use telemetry::*;

/// `(queued, active)` over every series.
pub fn live(t: &Telemetry) -> (i64, i64) {
    (
        t.live_value(QUEUED_INSTRUMENT, &[]),
        t.live_value(ACTIVE_INSTRUMENT, &[]),
    )
}

impl Telemetry {
    /// A meter of the provider, for instruments registered outside `OperationMetrics`.
    pub fn meter(&self) -> opentelemetry::metrics::Meter {
        self.provider.meter("tests")
    }

    /// The instrument `name` as exported now, if it exported anything.
    pub fn exported(&self, name: &str) -> Option<Exported> {
        self.collect().into_iter().find(|m| m.name == name)
    }
}
