//! [`Aimd`]: additive increase, multiplicative decrease.

use std::time::Duration;

use super::baseline::Baselines;
use super::served::{decrease, Occupancy, Retiring, Served};
use super::{in_range, Algorithm, Average, Handover, Sample};

#[cfg(doc)]
use super::Adaptive;

/// Additive increase, multiplicative decrease, as TCP's congestion window: a slow start that
/// grows the capacity by half each round trip until the first sign of congestion, then one more
/// place after each round trip without congestion in which the load filled the limit, and a
/// decrease after one with congestion.
///
/// **What it reacts to.** Congestion is an operation that ended `timeout`, `error` or `crashed`
/// (a server that answers `503` above some load, a judge that times out; see
/// [`Adaptive::tolerance`]). By default that is all: a backend whose run time climbs without
/// failing lets it grow to its `max`, and so does one whose callers never give up. Give it a
/// [`run_time_ratio`](Self::run_time_ratio) (a round trip whose run times are more than that
/// many times their baseline, each kind of work against its own) or a
/// [`run_time_threshold`](Self::run_time_threshold) (a round trip whose mean run time is above
/// it) and a slow round trip counts as congestion too. [`Vegas`](super::Vegas) holds a knee
/// with nothing to set.
///
/// **Decrease.** `backoff` times the capacity (at least one place less), and further toward
/// what the backend served over the last round trip (the operations that ended `ok`), by half
/// at most: the places beyond `backoff` go as the operations admitted before the decrease
/// fail. Their failures are not news, so cuts never compound: one decrease per round trip, and
/// a capacity that fell from 24 to 8 is followed in two.
///
/// **Recovery.** Once the capacity is back where operations last failed, for a whole round trip
/// without congestion, the backend has room again: it slow-starts again, rather than climbing
/// one place per round trip. (Not after a decrease for a slow round trip: that is a knee, past
/// which a slow start only overshoots.)
///
/// ```
/// use std::time::Duration;
/// use tower_resources_operation::adaptive::{Adaptive, Aimd};
/// use tower_resources_operation::Limit;
///
/// // Failures only.
/// let verifiers = Limit::builder(1)
///     .adaptive(Adaptive::new(Aimd::default(), 1..=64))
///     .build();
/// // A round trip slower than 2 s counts as congestion too.
/// let judges = Limit::builder(1)
///     .name("judges")
///     .adaptive(Adaptive::new(
///         Aimd::default().run_time_threshold(Duration::from_secs(2)),
///         1..=64,
///     ))
///     .build();
/// # drop((verifiers, judges));
/// ```
#[derive(Clone, Debug)]
pub struct Aimd {
    step: usize,
    backoff: f64,
    threshold: Option<Duration>,
    ratio: f64,
    /// Until the first congestion, and again once past `ceiling`.
    slow_start: bool,
    /// The capacity at the last decrease for failures.
    ceiling: Option<usize>,
    /// The last round trip was past the ceiling already.
    past: bool,
    /// The last window decreased it for failures: a decrease that follows belongs to the same
    /// run, whose ceiling is where it began.
    cutting: bool,
    /// The mean run time of recent round trips, and the run time at low load.
    recent: Average,
    baseline: Baselines,
    served: Served,
    occupancy: Occupancy,
    retiring: Retiring,
}

impl Default for Aimd {
    /// One more place per round trip after the slow start, 0.9 times the capacity on
    /// congestion (or toward what was served), failures only: no run-time ratio, no threshold.
    fn default() -> Self {
        Self {
            step: 1,
            backoff: 0.9,
            threshold: None,
            ratio: f64::INFINITY,
            slow_start: true,
            ceiling: None,
            past: false,
            cutting: false,
            recent: Average::default(),
            baseline: Baselines::default(),
            served: Served::default(),
            occupancy: Occupancy::default(),
            retiring: Retiring::default(),
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

    /// A round trip whose mean run time is above `threshold` counts as congested (Netflix's AIMD
    /// calls it the timeout). Defaults to none.
    pub fn run_time_threshold(mut self, threshold: Duration) -> Self {
        self.threshold = Some(threshold);
        self
    }

    /// A round trip whose run times are more than `ratio` times their baseline (the run time at
    /// low load of each kind of work, each against its own) counts as congested, at least 1.
    /// Defaults to `f64::INFINITY`: never.
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
        self.served.add(sample);
        let unanswered = self.occupancy.unanswered(sample);
        let mut slow = false;
        if let Some(measured) = self.baseline.measure(sample) {
            let mean = measured.run_time;
            self.recent.add(mean, 0.5);
            // Above the threshold; or above the ratio to the baseline, if slower by more than
            // chance (a few operations of a jittery kind of work are no sign of congestion).
            slow = self
                .threshold
                .is_some_and(|threshold| mean > threshold.as_secs_f64())
                || (measured.rose && mean > self.ratio * measured.baseline);
        }
        // The rest of the last decrease, as the operations from before it fail.
        let retired = self.retiring.retire(sample.stale_congested) as usize;
        let capacity = sample.capacity.saturating_sub(retired);
        if sample.is_congested() && self.retiring.covers(sample.congested) {
            // Operations admitted while the last decrease was under way: their places go.
            let failed = sample.congested;
            self.retiring.retire(failed);
            return capacity.saturating_sub(failed as usize);
        }
        if sample.is_congested() || slow {
            (self.slow_start, self.past) = (false, false);
            if sample.is_congested() {
                // Where it failed (where a run of decreases began). Not where it was slow:
                // that is a knee, past which a slow start only overshoots.
                self.ceiling = match (self.cutting, self.ceiling) {
                    (true, Some(ceiling)) => Some(ceiling.max(capacity)),
                    _ => Some(capacity),
                };
                self.cutting = true;
            }
            let served = self.served.in_flight();
            let (now, rest) = decrease(capacity as f64, self.backoff, served);
            self.retiring = rest;
            return now.max(0.0) as usize;
        }
        if !sample.round_trip
            || sample.peak_in_flight < capacity
            || sample.stale_congested > 0
            || unanswered > 0.0
        {
            // Cut short, not filled, operations from before the last decrease still failed, or
            // places held by operations that do not answer: no room to grow into.
            return capacity;
        }
        self.retiring = Retiring::default();
        self.cutting = false;
        if self.ceiling.is_some_and(|ceiling| capacity >= ceiling) {
            // A whole round trip at where it last had to decrease, without congestion (the
            // round trip after a step still mixes operations admitted before it): the backend
            // has room again.
            if !std::mem::replace(&mut self.past, true) {
                return capacity;
            }
            (self.slow_start, self.ceiling, self.past) = (true, None, false);
        }
        match self.slow_start {
            true => capacity.saturating_add(capacity.div_ceil(2)),
            false => capacity.saturating_add(self.step),
        }
    }

    /// The run time at low load of the last round trip's operations (see
    /// [`Vegas`](super::Vegas) for how it follows the server).
    fn baseline(&self) -> Option<Duration> {
        self.baseline.get().map(Duration::from_secs_f64)
    }

    /// The mean run time of recent round trips.
    fn estimate(&self) -> Option<Duration> {
        self.recent.duration()
    }

    fn handover(&self) -> String {
        Handover {
            capacity: 0,
            baselines: self.baseline.handover(),
            estimate: self.estimate(),
        }
        .encode()
    }

    /// Past the slow start: one step per round trip from the capacity. A ratio to the
    /// baseline is read against the handed baselines from the first window.
    fn resume(&mut self, capacity: usize, handover: &str) {
        let handover = &Handover::parse(capacity, handover);
        self.slow_start = false;
        self.baseline.resume(&handover.baselines);
        self.recent = Average {
            value: handover.estimate.map(|estimate| estimate.as_secs_f64()),
        };
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
        assert_eq!(aimd.update(&sample(9)), 11);
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
        // 3 of 20 is within 20%: no congestion. At 100, where it failed last, the round trip
        // is judged first (the slow start ended at the first congestion).
        assert_eq!(aimd.update(&s), 100);
        assert_eq!(aimd.update(&s), 150, "a whole round trip there: room again");
    }

    /// What the docs say it reacts to: failures only, unless given a ratio or a threshold.
    #[test]
    fn by_default_only_failures_are_congestion_and_a_ratio_or_a_threshold_adds_slow_round_trips() {
        let mut slow = sample(10);
        slow.mean_run_time = Some(Duration::from_secs(3));
        // Thirty times its baseline of 100 ms: no failure, so no congestion by default.
        let mut aimd = after_slow_start(Aimd::default(), 100);
        assert_eq!(aimd.update(&sample(9)), 10);
        assert_eq!(aimd.update(&slow), 11);
        // With a ratio of 2 it is.
        let mut aimd = after_slow_start(Aimd::default().run_time_ratio(2.0), 100);
        assert_eq!(aimd.update(&sample(9)), 10);
        assert_eq!(aimd.update(&slow), 9);
        // And with a threshold of 2 s.
        let mut aimd = after_slow_start(
            Aimd::default().run_time_threshold(Duration::from_secs(2)),
            100,
        );
        assert_eq!(aimd.update(&sample(9)), 10);
        assert_eq!(aimd.update(&slow), 9);
    }

    #[test]
    fn slow_starts_again_once_past_where_it_last_had_to_decrease() {
        let mut aimd = after_slow_start(Aimd::default(), 100);
        // It decreased at 11 (to 9): one place per round trip up to 11, then, once a whole
        // round trip at 11 had no congestion, by half.
        assert_eq!(aimd.update(&sample(9)), 10);
        assert_eq!(aimd.update(&sample(10)), 11);
        assert_eq!(
            aimd.update(&sample(11)),
            11,
            "the round trip after the step"
        );
        assert_eq!(aimd.update(&sample(11)), 17);
        assert_eq!(aimd.update(&sample(17)), 26);
    }

    #[test]
    fn a_decrease_goes_toward_what_was_served_as_operations_from_before_fail() {
        let mut aimd = Aimd::default();
        assert_eq!(aimd.update(&sample(24)), 36);
        // The backend now serves 8 at once: of 24 in flight, 16 fail.
        let mut failed = sample(24);
        (failed.congested, failed.served) = (1, Duration::from_millis(800));
        failed.elapsed = Duration::from_millis(100);
        assert_eq!(aimd.update(&failed), 21);
        // The others admitted before the decrease fail too: not news, but their places go,
        // down to 12 (half of 24: by half at most).
        let mut stale = sample(21);
        (stale.stale_congested, stale.round_trip) = (15, false);
        assert_eq!(aimd.update(&stale), 12);
    }
}
