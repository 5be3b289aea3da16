//! [`Gradient`]: shrinks the limit when the run time climbs above its baseline.

use std::time::Duration;

use super::baseline::Baselines;
use super::served::{decrease, Occupancy, Retiring, Served};
use super::{in_range, working, Algorithm, Average, Handover, Sample};

/// A latency gradient, in the manner of Netflix's Gradient2 and Envoy's adaptive concurrency:
/// the capacity follows the ratio of the recent run time to the run time at low load (the
/// *baseline*), each kind of work compared with its own.
///
/// After each round trip (see [`Adaptive::window`](super::Adaptive::window)) in which the limit
/// was used:
///
/// - **Slow start.** The capacity grows by half each round trip, as [`Vegas`](super::Vegas)'s
///   does, until the run time rises by more than chance (it is then judged a round trip later,
///   where it is) or past the tolerance (it then shrinks by the ratio), or an operation fails.
/// - **Gradient.** While the run time, averaged over the last round trips, stays within
///   `tolerance` × the baseline, the capacity grows by a headroom of `√capacity`, less as the run
///   time nears the tolerance (so that it slows down before a knee rather than past it); once it
///   climbs past it, the capacity is multiplied by `tolerance × baseline / run time` (at least
///   0.5). Each of these steps is smoothed: the capacity moves `smoothing` of the way to where the
///   step points.
/// - **Decrease.** A window with congestion (`timeout`, `error`, `crashed`) takes `backoff`
///   times the capacity at once (at least one place), and further toward what the backend served
///   over the last round trip, by half at most, as the operations admitted before the decrease
///   fail; the controller does so at most once per round trip. It then approaches where it
///   failed one place at a time, each probe judged a round trip later.
/// - **Recovery.** Back where it had to shrink without a failure or a climb: the backend has
///   room again, and it slow-starts again.
///
/// The run time is compared with the baseline window by window, each kind of work with its own
/// (a verify of 100 ms and a judge of 1 s on one limit are each measured against their own), and
/// the ratio is averaged over the round trips, so one slow operation, or a jittery link, does not
/// move it much. The baseline follows what it measures (see [`Vegas`](super::Vegas)): a round
/// trip at no more load than the baseline was taken at measures it again, up or down.
///
/// It grows toward `max` on a server whose run time does not depend on the load, settles where
/// the run time reaches the tolerance (10% above the baseline by default: at the top of a shallow
/// knee, and at 11 on a backend whose run time rises 1% per operation), and follows that load
/// down and up as it changes. [`Vegas`](super::Vegas) reads the queue itself, and holds a knee
/// however shallow without a tolerance to choose.
///
/// ```
/// use tower_resources_operation::adaptive::{Adaptive, Gradient};
/// use tower_resources_operation::Limit;
///
/// let verifiers = Limit::builder(1)
///     .name("verifiers")
///     .adaptive(Adaptive::new(Gradient::default().tolerance(1.5), 1..=32))
///     .build();
/// # drop(verifiers);
/// ```
#[derive(Clone, Debug)]
pub struct Gradient {
    tolerance: f64,
    smoothing: f64,
    backoff: f64,
    /// How far a round trip's ratio moves the average.
    weight: f64,
    /// The recent run time over the baseline, averaged over the round trips.
    ratio: Average,
    /// The last baseline times that: the gauge's estimate, in seconds.
    estimate: Option<f64>,
    baseline: Baselines,
    served: Served,
    occupancy: Occupancy,
    retiring: Retiring,
    /// The fractional capacity, kept between windows.
    limit: Option<f64>,
    /// Until the first rise, climb or congestion; again once back at the ceiling without one.
    slow_start: bool,
    /// The capacity where it last had to shrink: approached one place at a time, each probe up
    /// to it judged a round trip later.
    ceiling: Option<f64>,
    probed: bool,
    /// What the backend served at the last decrease: above it, one place at a time.
    careful: Option<f64>,
}

impl Default for Gradient {
    /// A tolerance of 1.1, smoothing 0.5, a backoff of 0.9 on congestion.
    fn default() -> Self {
        Self {
            tolerance: 1.1,
            smoothing: 0.5,
            backoff: 0.9,
            weight: 0.3,
            ratio: Average::default(),
            estimate: None,
            baseline: Baselines::default(),
            served: Served::default(),
            occupancy: Occupancy::default(),
            retiring: Retiring::default(),
            limit: None,
            slow_start: true,
            ceiling: None,
            probed: false,
            careful: None,
        }
    }
}

impl Gradient {
    /// How much above its baseline the run time may climb before the limit shrinks, as a
    /// ratio (at least 1). Higher lets more run at once on a server whose run time grows
    /// slowly with load, and rides out more jitter. Defaults to 1.1.
    ///
    /// # Panics
    ///
    /// If `tolerance` is below 1 or not a number, with a message that names it.
    #[track_caller]
    pub fn tolerance(mut self, tolerance: f64) -> Self {
        self.tolerance = in_range("Gradient::tolerance", tolerance, 1.0..=f64::MAX);
        self
    }

    /// How much of each step the capacity takes, in `(0, 1]`: lower moves it more slowly and
    /// more steadily. Defaults to 0.5.
    ///
    /// # Panics
    ///
    /// If `smoothing` is outside `(0, 1]`.
    #[track_caller]
    pub fn smoothing(mut self, smoothing: f64) -> Self {
        self.smoothing = in_range("Gradient::smoothing", smoothing, f64::MIN_POSITIVE..=1.0);
        self
    }

    /// What the capacity is multiplied by after a window with congestion, in `(0, 1]`; it
    /// drops by at least one place. Defaults to 0.9.
    ///
    /// # Panics
    ///
    /// If `backoff` is outside `(0, 1]`.
    #[track_caller]
    pub fn backoff(mut self, backoff: f64) -> Self {
        self.backoff = in_range("Gradient::backoff", backoff, f64::MIN_POSITIVE..=1.0);
        self
    }

    /// The capacity after a round trip at `limit` whose run times were `ratio` times their
    /// baseline, on average over the last round trips (`now` in this one), that `rose` by more
    /// than chance, and whether something `held` it (see [`Algorithm::update`]).
    fn step(&mut self, limit: f64, now: f64, ratio: f64, rose: bool, held: bool) -> f64 {
        if self.slow_start {
            if now <= self.tolerance && !rose && !held {
                return limit + (limit / 2.0).round().max(1.0);
            }
            self.slow_start = false;
            self.ceiling = Some(limit.round());
            if now > self.tolerance {
                // Past the knee: back by the ratio, as the gradient does.
                return limit * (self.tolerance / now).max(0.5);
            }
            // A rise, not past the tolerance: the round trip after a step still mixes
            // operations admitted at the lower capacity; this one is judged on the next.
            return limit;
        }
        let target = if ratio > self.tolerance {
            limit * (self.tolerance / ratio).max(0.5)
        } else if held {
            limit
        } else {
            // The share of the tolerance still unused: all of it at the baseline, none at the
            // tolerance.
            let slack = if self.tolerance > 1.0 {
                ((self.tolerance - ratio) / (self.tolerance - 1.0)).clamp(0.0, 1.0)
            } else {
                1.0
            };
            limit + slack * limit.sqrt()
        };
        let mut next = limit + self.smoothing * (target - limit);
        if let Some(ceiling) = self.ceiling.filter(|_| next > limit) {
            if std::mem::take(&mut self.probed) {
                // The last step probed up to the ceiling: judge it first.
                next = limit;
            } else if limit.round() >= ceiling {
                // Back at the ceiling without a failure or a climb: the backend has room again.
                (self.ceiling, self.careful, self.slow_start) = (None, None, true);
            } else if next.round() >= ceiling - 1.0 {
                // Near where it had to shrink: one place at a time.
                next = next.min(limit.round() + 1.0);
                self.probed = next.round() >= ceiling;
            } else if self.careful.is_some_and(|careful| next.round() > careful) {
                next = next.min(limit.round() + 1.0);
            }
        }
        next
    }
}

impl Algorithm for Gradient {
    fn update(&mut self, sample: &Sample) -> usize {
        let mut limit = working(&mut self.limit, sample.capacity);
        self.served.add(sample);
        let unanswered = self.occupancy.unanswered(sample);
        // The rest of the last decrease, as the operations from before it fail.
        limit -= self.retiring.retire(sample.stale_congested);
        let measured = self.baseline.measure(sample);
        let averaged = measured.map(|m| {
            let ratio = self.ratio.add(m.run_time / m.baseline, self.weight);
            self.estimate = Some(m.baseline * ratio);
            ratio
        });
        let next = if sample.is_congested() && self.retiring.covers(sample.congested) {
            // Operations admitted while the last decrease was under way: their places go.
            limit - self.retiring.retire(sample.congested)
        } else if sample.is_congested() {
            // Not smoothed: a server that fails wants less at once.
            self.slow_start = false;
            self.probed = false;
            let (next, rest) = decrease(limit, self.backoff, self.served.in_flight());
            self.retiring = rest;
            self.ceiling = Some(limit.round());
            // Above what the backend served, one place at a time: a slow start that went past a
            // cliff failed well above where the cliff is.
            self.careful = Some(next - rest.0);
            next
        } else {
            match (measured, averaged) {
                (Some(measured), Some(ratio)) if sample.is_used() => {
                    let now = measured.run_time / measured.baseline;
                    if sample.stale_congested == 0 {
                        self.retiring = Retiring::default();
                    }
                    // Operations from before the last decrease still failed, or places are held
                    // by operations that do not answer (a backend that drops what is above its
                    // capacity): no room to grow into.
                    let held = sample.stale_congested > 0 || unanswered > 0.0;
                    self.step(limit, now, ratio, measured.rose, held)
                }
                // Cut short, or the load did not come near the limit: nothing to learn about
                // what it can take.
                _ => limit,
            }
        };
        let next = next.clamp(sample.min_capacity as f64, sample.max_capacity as f64);
        self.limit = Some(next);
        next.round() as usize
    }

    /// The run time at low load of the last round trip's operations.
    fn baseline(&self) -> Option<Duration> {
        self.baseline.get().map(Duration::from_secs_f64)
    }

    /// The baseline times the recent ratio to it: the run time it compares with the baseline.
    fn estimate(&self) -> Option<Duration> {
        self.estimate.map(Duration::from_secs_f64)
    }

    fn handover(&self) -> String {
        Handover {
            capacity: 0,
            baselines: self.baseline.handover(),
            estimate: self.estimate(),
        }
        .encode()
    }

    /// Past the slow start, from the capacity: above it, one place at a time, until a decrease
    /// says where the backend's room ends (no ceiling to reach, whose passing would start a
    /// slow start again). Its first window is read against the handed baselines, and its
    /// average ratio starts from the handed estimate over them.
    fn resume(&mut self, capacity: usize, handover: &str) {
        let handover = &Handover::parse(capacity, handover);
        let capacity = handover.capacity as f64;
        self.limit = Some(capacity);
        self.slow_start = false;
        (self.ceiling, self.careful) = (Some(f64::INFINITY), Some(capacity));
        self.baseline.resume(&handover.baselines);
        if let (Some(estimate), Some(baseline)) = (handover.estimate, self.baseline.get()) {
            let estimate = estimate.as_secs_f64();
            self.ratio = Average {
                value: Some(estimate / baseline),
            };
            self.estimate = Some(estimate);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::sample;
    use super::*;

    fn ms(ms: u64) -> Option<Duration> {
        Some(Duration::from_millis(ms))
    }

    /// A gradient past its slow start: a window at 16 with a failure, served 16 at once.
    fn past_slow_start(gradient: Gradient) -> Gradient {
        let mut gradient = gradient;
        let mut failed = sample(16);
        failed.congested = 1;
        assert_eq!(gradient.update(&failed), 14);
        gradient
    }

    #[test]
    fn slow_starts_by_half_until_the_run_time_rises() {
        let mut gradient = Gradient::default();
        let mut capacities = Vec::new();
        let mut capacity = 1;
        for _ in 0..6 {
            capacity = gradient.update(&sample(capacity));
            capacities.push(capacity);
        }
        assert_eq!(capacities, [2, 3, 5, 8, 12, 18]);
        // 3% slower at 18, without jitter: more than chance, within the tolerance. The round
        // trip after a step still mixes operations admitted at 12: 18 is judged on the next.
        let mut rose = sample(18);
        (rose.mean_run_time, rose.in_flight) = (ms(103), 18.0);
        assert_eq!(gradient.update(&rose), 18);
    }

    #[test]
    fn a_slow_start_past_the_tolerance_goes_back_by_the_ratio() {
        let mut gradient = Gradient::default();
        for capacity in [1, 2, 3, 5, 8] {
            gradient.update(&sample(capacity));
        }
        // At 12, 21% slower (a shallow knee: ×1.1 for each one past 10): back to where the
        // tolerance of 10% is, 12 × 1.1 / 1.21.
        let mut knee = sample(12);
        knee.mean_run_time = ms(121);
        assert_eq!(gradient.update(&knee), 11);
    }

    #[test]
    fn grows_by_its_headroom_less_as_the_run_time_nears_the_tolerance() {
        // At the baseline, well above where it failed: √30, half of it (the smoothing).
        let mut gradient = past_slow_start(Gradient::default());
        assert_eq!(gradient.update(&sample(30)), 33);
        // 8% above it (the average moves 0.3 of the way: 2.4%): a quarter of the tolerance
        // used, three quarters of the headroom.
        let mut gradient = past_slow_start(Gradient::default());
        let mut nearer = sample(30);
        nearer.mean_run_time = ms(108);
        assert_eq!(gradient.update(&nearer), 32);
        // Near where it failed (16; it served 14): one place at a time.
        let mut gradient = past_slow_start(Gradient::default());
        assert_eq!(gradient.update(&sample(14)), 15);
    }

    #[test]
    fn shrinks_by_the_ratio_once_the_run_time_climbs_past_the_tolerance() {
        let mut gradient = past_slow_start(Gradient::default().smoothing(1.0).tolerance(1.0));
        let mut slow = sample(20);
        slow.mean_run_time = ms(200);
        // The average moves 0.3 of the way: 1.3 times the baseline of 100 ms.
        assert_eq!(gradient.update(&slow), 15);
    }

    #[test]
    fn after_a_decrease_it_probes_one_place_at_a_time_above_what_was_served() {
        let mut gradient = Gradient::default();
        for capacity in [1, 2, 3, 5, 8, 12] {
            gradient.update(&sample(capacity));
        }
        // A slow start to 18 went past a cliff: everything above 12 fails.
        let mut failed = sample(18);
        failed.congested = 1;
        (failed.served, failed.elapsed) = (Duration::from_millis(1_200), ms(100).unwrap());
        assert_eq!(
            gradient.update(&failed),
            16,
            "0.9 now, toward 12 as they fail"
        );
        let mut stale = sample(16);
        (stale.stale_congested, stale.round_trip) = (4, false);
        assert_eq!(gradient.update(&stale), 12);
        // Then one place at a time, however much headroom the gradient sees.
        assert_eq!(gradient.update(&sample(12)), 13);
        assert_eq!(gradient.update(&sample(13)), 14);
    }

    #[test]
    fn the_baseline_rises_when_measured_again_at_low_load() {
        let mut gradient = Gradient::default();
        let mut low = sample(4);
        (low.in_flight, low.peak_in_flight) = (1.0, 1);
        gradient.update(&low);
        // Slower at 4 in flight: a queue, not a new normal.
        let mut slower = sample(4);
        slower.mean_run_time = ms(300);
        gradient.update(&slower);
        assert_eq!(gradient.baseline(), ms(100));
        // As slow at 1 in flight: the server is slower now.
        (slower.in_flight, slower.peak_in_flight) = (1.0, 1);
        gradient.update(&slower);
        let baseline = gradient.baseline().unwrap().as_secs_f64();
        assert!(
            (baseline - 0.2).abs() < 1e-6,
            "half-way to 300 ms: {baseline}"
        );
    }

    #[test]
    fn leaves_a_limit_the_load_never_came_near() {
        let mut gradient = Gradient::default();
        let mut idle = sample(16);
        idle.peak_in_flight = 3;
        assert_eq!(gradient.update(&idle), 16);
    }

    #[test]
    fn follows_a_capacity_set_from_outside() {
        let mut gradient = past_slow_start(Gradient::default().smoothing(1.0));
        // Someone set 4.
        assert_eq!(gradient.update(&sample(4)), 6);
    }
}
