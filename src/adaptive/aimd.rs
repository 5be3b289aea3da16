//! [`Aimd`]: additive increase, multiplicative decrease.

use std::time::Duration;

use super::baseline::Baseline;
use super::{in_range, Algorithm, Average, Sample};

#[cfg(doc)]
use super::Adaptive;

/// Additive increase, multiplicative decrease, as TCP's congestion window: a slow start that
/// grows the capacity by half each round trip until the first sign of congestion, then one more
/// place after each round trip without congestion in which the load filled the limit, and
/// `backoff` times the capacity after one with congestion.
///
/// Congestion is an operation that ended `timeout`, `error` or `crashed` (a server that answers
/// `503` above some load, a judge that times out; see [`Adaptive::tolerance`]), or a round trip
/// whose mean run time is above [`run_time_ratio`](Self::run_time_ratio) times the baseline (by
/// default twice the run time at low load), or above
/// [`run_time_threshold`](Self::run_time_threshold) if you set one. So a server that slows down
/// steeply is seen, but one whose run time climbs slowly with load lets it grow toward its
/// `max` ([`Vegas`](super::Vegas) holds those at the knee).
///
/// The controller lowers the capacity at most once per round trip: failures of operations
/// admitted before the last decrease are not counted again.
///
/// ```
/// use std::time::Duration;
/// use tower_resources_operation::adaptive::{Adaptive, Aimd};
/// use tower_resources_operation::Limit;
///
/// let judges = Limit::builder(1)
///     .name("judges")
///     .adaptive(Adaptive::new(
///         Aimd::default().run_time_threshold(Duration::from_secs(2)),
///         1..=64,
///     ))
///     .build();
/// # drop(judges);
/// ```
#[derive(Clone, Debug)]
pub struct Aimd {
    step: usize,
    backoff: f64,
    threshold: Option<Duration>,
    ratio: f64,
    /// Until the first congestion.
    slow_start: bool,
    /// The mean run time of recent round trips, and the run time at low load.
    recent: Average,
    baseline: Baseline,
}

impl Default for Aimd {
    /// One more place per round trip after the slow start, 0.9 times the capacity on
    /// congestion, a run time twice the baseline counted as congestion, no absolute threshold.
    fn default() -> Self {
        Self {
            step: 1,
            backoff: 0.9,
            threshold: None,
            ratio: 2.0,
            slow_start: true,
            recent: Average::default(),
            baseline: Baseline::default(),
        }
    }
}

impl Aimd {
    /// Places added after a round trip without congestion, once the slow start is over, at
    /// least 1. Defaults to 1.
    ///
    /// # Panics
    ///
    /// If `step` is 0 (the capacity could then never grow back), with a message that says so.
    #[track_caller]
    pub fn step(mut self, step: usize) -> Self {
        assert!(
            step > 0,
            "tower-resources-operation: Aimd::step must be at least 1; got 0"
        );
        self.step = step;
        self
    }

    /// What the capacity is multiplied by after a window with congestion, in `(0, 1)`; it
    /// drops by at least one place. Defaults to 0.9.
    ///
    /// # Panics
    ///
    /// If `backoff` is outside `(0, 1)` or not a number, with a message that names it.
    #[track_caller]
    pub fn backoff(mut self, backoff: f64) -> Self {
        let below_one = 1.0 - f64::EPSILON;
        self.backoff = in_range("Aimd::backoff", backoff, f64::MIN_POSITIVE..=below_one);
        self
    }

    /// A window whose mean run time is above `threshold` counts as congested (Netflix's AIMD
    /// calls it the timeout). Defaults to none.
    pub fn run_time_threshold(mut self, threshold: Duration) -> Self {
        self.threshold = Some(threshold);
        self
    }

    /// A round trip whose mean run time is above `ratio` times the baseline (the run time at
    /// low load) counts as congested, at least 1; `f64::INFINITY` for never. Defaults to 2.
    ///
    /// # Panics
    ///
    /// If `ratio` is below 1 or not a number, with a message that names it.
    #[track_caller]
    pub fn run_time_ratio(mut self, ratio: f64) -> Self {
        self.ratio = in_range("Aimd::run_time_ratio", ratio, 1.0..=f64::INFINITY);
        self
    }
}

impl Algorithm for Aimd {
    fn update(&mut self, sample: &Sample) -> usize {
        let mut slow = false;
        if let Some(measured) = self.baseline.measure(sample) {
            let mean = measured.run_time;
            self.recent.add(mean, 0.5);
            slow = self
                .threshold
                .is_some_and(|threshold| mean > threshold.as_secs_f64())
                || mean > self.ratio * measured.baseline;
        }
        let capacity = sample.capacity;
        if sample.is_congested() || slow {
            self.slow_start = false;
            let lower = (capacity as f64 * self.backoff).floor() as usize;
            lower.min(capacity.saturating_sub(1))
        } else if !sample.round_trip
            || sample.peak_in_flight < capacity
            || sample.stale_congested > 0
        {
            // Cut short, not filled, or operations from before the last decrease still failed:
            // no room to grow into.
            capacity
        } else if self.slow_start {
            capacity.saturating_add(capacity.div_ceil(2))
        } else {
            capacity.saturating_add(self.step)
        }
    }

    /// The run time at low load (see [`Vegas`](super::Vegas) for how it follows the server).
    fn baseline(&self) -> Option<Duration> {
        self.baseline.get().map(Duration::from_secs_f64)
    }

    /// The mean run time of recent round trips.
    fn estimate(&self) -> Option<Duration> {
        self.recent.duration()
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::sample;
    use super::*;

    /// Ends the slow start, with a congested window at 11 whose run time is `ms`.
    fn after_slow_start(aimd: Aimd, ms: u64) -> Aimd {
        let mut aimd = aimd;
        let mut failed = sample(11);
        failed.congested = 1;
        failed.mean_run_time = Some(Duration::from_millis(ms));
        assert_eq!(aimd.update(&failed), 9);
        aimd
    }

    #[test]
    fn slow_starts_by_half_until_the_first_congestion() {
        let mut aimd = Aimd::default();
        assert_eq!(aimd.update(&sample(1)), 2);
        assert_eq!(aimd.update(&sample(2)), 3);
        assert_eq!(aimd.update(&sample(3)), 5);
        assert_eq!(aimd.update(&sample(10)), 15);
    }

    #[test]
    fn grows_by_its_step_when_used_and_nothing_fails() {
        let mut aimd = after_slow_start(Aimd::default().step(2), 100);
        assert_eq!(aimd.update(&sample(10)), 12);
    }

    #[test]
    fn does_not_grow_a_limit_the_load_never_filled() {
        let mut aimd = Aimd::default();
        let mut s = sample(10);
        s.peak_in_flight = 9;
        assert_eq!(aimd.update(&s), 10);
    }

    #[test]
    fn backs_off_on_congestion_by_at_least_one() {
        let mut aimd = Aimd::default();
        let mut s = sample(10);
        s.congested = 1;
        assert_eq!(aimd.update(&s), 9);
        let mut s = sample(100);
        s.congested = 3;
        assert_eq!(aimd.update(&s), 90);
        s.tolerance = 0.2;
        // The slow start ended at the first congestion.
        assert_eq!(aimd.update(&s), 101, "3 of 20 is within 20%");
    }

    #[test]
    fn a_slow_window_is_congestion_once_there_is_a_threshold() {
        let mut s = sample(10);
        s.mean_run_time = Some(Duration::from_secs(3));
        let mut aimd = after_slow_start(Aimd::default(), 3000);
        assert_eq!(aimd.update(&s), 11, "the baseline is 3 s: not slow");
        let threshold = Aimd::default().run_time_threshold(Duration::from_secs(2));
        let mut aimd = after_slow_start(threshold, 3000);
        assert_eq!(aimd.update(&s), 9);
    }

    #[test]
    fn a_round_trip_twice_as_slow_as_the_baseline_is_congestion() {
        let mut aimd = after_slow_start(Aimd::default(), 100);
        assert_eq!(aimd.update(&sample(9)), 10);
        let mut slow = sample(10);
        slow.mean_run_time = Some(Duration::from_millis(210));
        assert_eq!(aimd.update(&slow), 9);
        let mut aimd = after_slow_start(Aimd::default().run_time_ratio(f64::INFINITY), 100);
        aimd.update(&sample(9));
        assert_eq!(aimd.update(&slow), 11);
    }
}
