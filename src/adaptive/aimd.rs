//! [`Aimd`]: additive increase, multiplicative decrease.

use std::time::Duration;

use super::{in_range, Algorithm, Average, Sample};

#[cfg(doc)]
use super::Adaptive;

/// Additive increase, multiplicative decrease, as TCP's congestion window: one more place after
/// each window without congestion in which the load filled the limit, and `backoff` times the
/// capacity after a window with congestion.
///
/// Congestion is an operation that ended `timeout`, `error` or `crashed` (a server that answers
/// `503` above some load, a judge that times out; see [`Adaptive::tolerance`]), and, if you set
/// [`run_time_threshold`](Self::run_time_threshold), a window whose mean run time is above it.
/// Without a threshold it does not see latency: a server that only slows down lets it grow to
/// its `max` (use [`Gradient`](super::Gradient) for those).
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
    /// The mean run time of recent windows, and the lowest it has been.
    recent: Average,
    lowest: Option<f64>,
}

impl Default for Aimd {
    /// One more place per window, 0.9 times the capacity on congestion, no run-time
    /// threshold.
    fn default() -> Self {
        Self {
            step: 1,
            backoff: 0.9,
            threshold: None,
            recent: Average::default(),
            lowest: None,
        }
    }
}

impl Aimd {
    /// Places added after a window without congestion. Defaults to 1.
    pub fn step(mut self, step: usize) -> Self {
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
}

impl Algorithm for Aimd {
    fn update(&mut self, sample: &Sample) -> usize {
        if let Some(mean) = sample.mean_run_time {
            let recent = self.recent.add(mean.as_secs_f64(), 0.5);
            self.lowest = Some(self.lowest.map_or(recent, |lowest| lowest.min(recent)));
        }
        let capacity = sample.capacity;
        let slow = match (self.threshold, sample.mean_run_time) {
            (Some(threshold), Some(mean)) => mean > threshold,
            _ => false,
        };
        if sample.is_congested() || slow {
            let lower = (capacity as f64 * self.backoff).floor() as usize;
            lower.min(capacity.saturating_sub(1))
        } else if sample.peak_in_flight >= capacity {
            capacity.saturating_add(self.step)
        } else {
            capacity
        }
    }

    /// The lowest mean run time of recent windows: the run time at the least load it saw.
    fn baseline(&self) -> Option<Duration> {
        self.lowest.map(Duration::from_secs_f64)
    }

    /// The mean run time of recent windows.
    fn estimate(&self) -> Option<Duration> {
        self.recent.duration()
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::sample;
    use super::*;

    #[test]
    fn grows_by_its_step_when_used_and_nothing_fails() {
        let mut aimd = Aimd::default().step(2);
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
        assert_eq!(aimd.update(&s), 101, "3 of 20 is within 20%");
    }

    #[test]
    fn a_slow_window_is_congestion_once_there_is_a_threshold() {
        let mut s = sample(10);
        s.mean_run_time = Some(Duration::from_secs(3));
        assert_eq!(Aimd::default().update(&s), 11);
        let mut aimd = Aimd::default().run_time_threshold(Duration::from_secs(2));
        assert_eq!(aimd.update(&s), 9);
    }
}
