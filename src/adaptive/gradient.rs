//! [`Gradient`]: shrinks the limit when the run time climbs above its baseline.

use std::time::Duration;

use super::baseline::Baseline;
use super::{in_range, working, Algorithm, Average, Sample};

/// A latency gradient, in the manner of Netflix's Gradient2 and Envoy's adaptive concurrency:
/// the capacity follows the ratio of the run time at low load (the *baseline*) to the recent
/// run time (the *estimate*).
///
/// After each round trip (see [`Adaptive::window`](super::Adaptive::window)) in which the limit
/// was used:
///
/// - while the estimate stays within `tolerance` × the baseline, the capacity grows by a
///   headroom of `√capacity`, less as the estimate nears the tolerance (so that it slows down
///   before a knee rather than past it);
/// - once it climbs past that, the capacity is multiplied by `tolerance × baseline / estimate`
///   (at least 0.5): a server whose run time doubled under the load gets about half of it;
/// - each of these steps is smoothed: the capacity moves `smoothing` of the way to where the
///   step points;
/// - a window with congestion (`timeout`, `error`, `crashed`) multiplies it by `backoff` at
///   once (and takes at least one place away); the controller does so at most once per round
///   trip.
///
/// The estimate is a moving average of the round trips' mean run times, so one slow operation,
/// or a jittery link, does not move it much. The baseline follows what it measures (see
/// [`Vegas`](super::Vegas)): a round trip at no more load than the baseline was taken at
/// measures it again, up or down, so a server that became slower is found out once the load
/// falls back, and the baseline is never a lagging average.
///
/// It grows toward `max` on a server whose run time does not depend on the load, settles a
/// little below the load at which the run time passes the tolerance, and follows that load
/// down and up as it changes. [`Vegas`](super::Vegas) holds closer to a knee.
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
    /// How far a window's mean run time moves the estimate.
    weight: f64,
    estimate: Average,
    baseline: Baseline,
    /// The fractional capacity, kept between windows.
    limit: Option<f64>,
    /// The capacity at the last congestion: approached one place at a time, each probe up to
    /// it judged a round trip later.
    ceiling: Option<f64>,
    probed: bool,
}

impl Default for Gradient {
    /// A tolerance of 1.25, smoothing 0.5, a backoff of 0.9 on congestion.
    fn default() -> Self {
        Self {
            tolerance: 1.25,
            smoothing: 0.5,
            backoff: 0.9,
            weight: 0.3,
            estimate: Average::default(),
            baseline: Baseline::default(),
            limit: None,
            ceiling: None,
            probed: false,
        }
    }
}

impl Gradient {
    /// How much above its baseline the run time may climb before the limit shrinks, as a
    /// ratio (at least 1). Higher lets more run at once on a server whose run time grows
    /// slowly with load, and rides out more jitter. Defaults to 1.25.
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

    /// What the capacity is multiplied by after a window with congestion, in `(0, 1]`.
    /// Defaults to 0.9.
    ///
    /// # Panics
    ///
    /// If `backoff` is outside `(0, 1]`.
    #[track_caller]
    pub fn backoff(mut self, backoff: f64) -> Self {
        self.backoff = in_range("Gradient::backoff", backoff, f64::MIN_POSITIVE..=1.0);
        self
    }
}

impl Algorithm for Gradient {
    fn update(&mut self, sample: &Sample) -> usize {
        let limit = working(&mut self.limit, sample.capacity);
        let measured = self
            .baseline
            .measure(sample)
            .map(|m| (m.baseline, self.estimate.add(m.run_time, self.weight)));
        if sample.is_congested() {
            // Not smoothed: a server that fails wants less at once.
            self.ceiling = Some(limit.round());
            self.probed = false;
            let next = (limit * self.backoff).min(limit - 1.0);
            let next = next.clamp(sample.min_capacity as f64, sample.max_capacity as f64);
            self.limit = Some(next);
            return next.round() as usize;
        }
        let Some((baseline, estimate)) = measured.filter(|_| sample.is_used()) else {
            // Cut short, or the load did not come near the limit: nothing to learn about what
            // it can take.
            return sample.capacity;
        };
        let allowed = self.tolerance * baseline;
        let target = if estimate > allowed {
            limit * (allowed / estimate).max(0.5)
        } else if sample.stale_congested > 0 {
            // Operations from before the last decrease still failed: no room to grow into.
            limit
        } else {
            // The share of the tolerance still unused: all of it at the baseline, none at the
            // tolerance.
            let slack = if self.tolerance > 1.0 {
                ((allowed - estimate) / (allowed - baseline)).clamp(0.0, 1.0)
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
                // Back at the ceiling without a failure: the server has room again.
                self.ceiling = None;
            } else if next.round() >= ceiling - 1.0 {
                // Near where it failed: one place at a time.
                next = next.min(limit.round() + 1.0);
                self.probed = next.round() >= ceiling;
            }
        }
        let next = next.clamp(sample.min_capacity as f64, sample.max_capacity as f64);
        self.limit = Some(next);
        next.round() as usize
    }

    /// The run time at low load.
    fn baseline(&self) -> Option<Duration> {
        self.baseline.get().map(Duration::from_secs_f64)
    }

    /// A moving average of the round trips' mean run times.
    fn estimate(&self) -> Option<Duration> {
        self.estimate.duration()
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::sample;
    use super::*;

    fn ms(ms: u64) -> Option<Duration> {
        Some(Duration::from_millis(ms))
    }

    #[test]
    fn grows_by_its_headroom_while_the_run_time_holds() {
        let mut gradient = Gradient::default().smoothing(1.0);
        assert_eq!(gradient.update(&sample(16)), 20);
        assert_eq!(gradient.update(&sample(20)), 24);
    }

    #[test]
    fn shrinks_by_the_ratio_once_the_run_time_climbs_past_the_tolerance() {
        let mut gradient = Gradient::default().smoothing(1.0).tolerance(1.0);
        gradient.update(&sample(16));
        let mut slow = sample(20);
        slow.mean_run_time = ms(200);
        // The estimate moves 0.3 of the way: 130 ms against a baseline of 100 ms.
        assert_eq!(gradient.update(&slow), 15);
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
    fn slows_its_growth_as_the_run_time_nears_the_tolerance() {
        let mut gradient = Gradient::default().smoothing(1.0).tolerance(1.5);
        gradient.update(&sample(16));
        let mut nearer = sample(20);
        nearer.in_flight = 20.0;
        nearer.mean_run_time = ms(200);
        // The estimate moves 0.3 of the way: 130 ms, 60% of the tolerance used.
        assert_eq!(gradient.update(&nearer), 22);
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
        let mut gradient = Gradient::default().smoothing(1.0);
        gradient.update(&sample(16));
        // Someone set 4.
        assert_eq!(gradient.update(&sample(4)), 6);
    }
}
