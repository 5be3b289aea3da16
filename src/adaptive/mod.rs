//! A [`Limit`] that finds its own capacity: a controller that raises or lowers it from the run
//! times and outcomes of the operations it admits.
//!
//! A verifier pool that is CPU-bound should run about as many operations as there are cores; a
//! judge endpoint as many as it can serve before its latency climbs. Both figures change while
//! the server runs. Give a limit an [`Adaptive`] controller and it looks for them:
//!
//! ```
//! use tower_resources_operation::adaptive::{Adaptive, Gradient};
//! use tower_resources_operation::Limit;
//!
//! // Starts at 1 and goes where the run times say, between 1 and 64.
//! let verifiers = Limit::builder(1)
//!     .name("verifiers")
//!     .adaptive(Adaptive::new(Gradient::default(), 1..=64))
//!     .build();
//! assert_eq!(verifiers.capacity(), 1);
//! ```
//!
//! # How it decides
//!
//! Each operation that ends feeds the controller its run time and whether its outcome is a sign
//! of congestion (`timeout`, `error`, `crashed`; not `ok`, nor `cancelled`, whose caller went
//! away). The controller adds them to the current *window*, which closes:
//!
//! - once `max(operations, 2 × capacity)` operations have ended in it;
//! - once it is `interval` old and `capacity` operations have ended in it (one turnover of the
//!   limit: the run times it saw then reflect its capacity, however slow the operations);
//! - at once when its signs of congestion pass the tolerance (by default, at the first one), so
//!   that a probe above what the server takes costs one failure rather than a window of them.
//!
//! (See [`Adaptive::window`] and [`Adaptive::tolerance`].) The [`Algorithm`] then reads what the
//! window saw (a [`Sample`]) and names the next capacity, which the controller clamps to
//! `[min, max]` and sets with [`Limit::set_capacity`]. Lowering revokes nobody: running
//! operations finish, and the places above the new capacity are taken out as they do.
//!
//! - [`Aimd`]: additive increase on a window without congestion in which the limit was used,
//!   multiplicative decrease on congestion (or on a run time above a threshold you give). It
//!   finds a server that fails, times out or answers 503 above some load.
//! - [`Gradient`]: compares the recent run time with a baseline (the run time at low load) and
//!   shrinks the limit by their ratio when the run time climbs past a tolerance; grows by a
//!   headroom of `√capacity` while it does not. It finds a server that slows down above some
//!   load, a CPU-bound pool among them, without any failure.
//! - [`Algorithm`]: your own.
//!
//! The limit's own rejections (a full queue, a queue timeout) are counted in the sample, but the
//! built-in algorithms do not shrink for them: they say the limit is too small for the demand,
//! not that what it guards is overloaded, and shrinking would turn more away. A rejection from
//! *downstream* (a `503`, RESOURCE_EXHAUSTED) reaches the controller as the `error` the
//! classifier makes of it.
//!
//! # Every form
//!
//! A controller belongs to its limit, and hears each operation's end from the limit itself
//! ([`Acquire::ended`](crate::limit::Acquire::ended)), not through the metrics: the layer,
//! [`resources_operation`](crate::resources_operation), several routes' layers on clones of one
//! limit, and a per-request layer's named limits all feed the same one, with metrics on or
//! [off](crate::OperationMetrics::disabled). A limit of your own that can
//! [`Resize`](crate::limit::Resize) is adapted the same way: [`Adaptive`] is a
//! [`MakeControl`](crate::limit::MakeControl).
//!
//! # What it decided, in the metrics
//!
//! `gym.resources.operation.limit` and, for a named limit, `gym.resources.limit.capacity`
//! follow the capacity it sets. A named adaptive limit also reports what its algorithm measured:
//! [`LIMIT_BASELINE_INSTRUMENT`](crate::metrics::LIMIT_BASELINE_INSTRUMENT) (the run time it
//! takes as normal) and [`LIMIT_ESTIMATE_INSTRUMENT`](crate::metrics::LIMIT_ESTIMATE_INSTRUMENT)
//! (the recent run time it compares with it), in milliseconds, with the limit's name as their
//! only attribute.
//!
//! # Cost
//!
//! No lock on an operation's path: an end adds to two atomics of the window, and the operation
//! reads the clock twice for its run time (which it reads anyway with metrics on). The thread
//! whose operation closes a window wins an atomic flag and runs the algorithm, once per window.
//! A limit without a controller pays one `Option` check per end.

mod aimd;
mod algorithm;
mod config;
mod controller;
mod gradient;

pub use aimd::Aimd;
pub use algorithm::{Algorithm, Sample};
pub use config::Adaptive;
pub use gradient::Gradient;

#[cfg(doc)]
use crate::limit::Limit;
use std::time::Duration;

/// `value`, if it is within `range`; otherwise a panic that names the setting and the value
/// (every configuration value of the crate is checked when it is given, as tower does).
#[track_caller]
fn in_range(setting: &str, value: f64, range: std::ops::RangeInclusive<f64>) -> f64 {
    if range.contains(&value) {
        return value;
    }
    panic!(
        "tower-resources-operation: {setting} must be within {:?}..={:?}; got {value:?}",
        range.start(),
        range.end()
    )
}

/// An exponentially weighted moving average of run times, in seconds.
#[derive(Clone, Copy, Debug, Default)]
struct Average {
    value: Option<f64>,
}

impl Average {
    /// Moves `weight` of the way toward `sample` (all the way for the first one).
    fn add(&mut self, sample: f64, weight: f64) -> f64 {
        let next = match self.value {
            None => sample,
            Some(value) => value + weight * (sample - value),
        };
        self.value = Some(next);
        next
    }

    fn duration(self) -> Option<Duration> {
        self.value.map(Duration::from_secs_f64)
    }
}

/// The capacity an algorithm works from: its own fractional estimate while the limit still has
/// it, or the limit's capacity once something else changed it (a clamp, `set_capacity`).
fn working(estimate: &mut Option<f64>, capacity: usize) -> f64 {
    let capacity_f = capacity as f64;
    match *estimate {
        Some(value) if (value.round() - capacity_f).abs() < 1.0 => value,
        _ => {
            *estimate = Some(capacity_f);
            capacity_f
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    pub(super) fn sample(capacity: usize) -> Sample {
        Sample {
            capacity,
            min_capacity: 1,
            max_capacity: 100,
            ended: 20,
            congested: 0,
            tolerance: 0.0,
            rejected: 0,
            mean_run_time: Some(Duration::from_millis(100)),
            min_run_time: Some(Duration::from_millis(90)),
            peak_in_flight: capacity,
            elapsed: Duration::from_secs(1),
        }
    }

    #[test]
    fn a_sample_is_used_from_half_its_capacity() {
        let mut s = sample(10);
        s.peak_in_flight = 5;
        assert!(s.is_used());
        s.peak_in_flight = 4;
        assert!(!s.is_used());
    }

    #[test]
    #[should_panic(expected = "non-empty range")]
    fn bounds_starting_at_zero_are_refused() {
        let _ = Adaptive::new(Aimd::default(), 0..=4);
    }
}
