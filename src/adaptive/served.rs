//! [`Served`]: how many operations at once the backend served lately; [`decrease`], which goes
//! toward it; and [`Occupancy`], how many of each kind of work it normally holds.

use super::Sample;
use crate::attributes::SeriesKey;

/// How many operations at once the backend served over the last round trip or more: the run
/// times of the operations that ended `ok`, over the time they ended in (Little's law), read
/// from the last windows.
///
/// A backend that serves 8 at once answers 8 operations `ok` per round trip, however many more
/// the limit lets through, and whatever it does with those (fails them at once, or keeps them
/// until their callers give up). Each series counts its own: a judge of 1 s that ends in a
/// window of 200 ms served one place for a second, not five for the window; so the windows read
/// span the longest run time of the work that ended `ok` in them.
#[derive(Clone, Debug, Default)]
pub(super) struct Served {
    /// Of the last windows, the newest last: the run time served, the window's length, and the
    /// longest mean run time of a series that ended `ok` in it, in seconds.
    windows: [(f64, f64, f64); Self::KEPT],
    len: usize,
}

impl Served {
    /// Windows kept: enough for a round trip of the slowest work while the fastest closes
    /// windows ten times as often.
    const KEPT: usize = 32;

    /// Takes in a window.
    pub(super) fn add(&mut self, sample: &Sample) {
        let longest = sample
            .series
            .iter()
            .filter_map(|series| series.served_run_time())
            .map(|run_time| run_time.as_secs_f64())
            .fold(0.0, f64::max);
        let window = (
            sample.served.as_secs_f64(),
            sample.elapsed.as_secs_f64(),
            longest,
        );
        if self.len == Self::KEPT {
            self.windows.copy_within(1.., 0);
            self.len -= 1;
        }
        self.windows[self.len] = window;
        self.len += 1;
    }

    /// How many operations at once it served over the newest windows that span at least the
    /// longest run time among them (or all it keeps); `None` before a window of some length.
    pub(super) fn in_flight(&self) -> Option<f64> {
        let (mut served, mut elapsed, mut longest) = (0.0, 0.0, 0.0_f64);
        for &(window_served, window_elapsed, window_longest) in
            self.windows[..self.len].iter().rev()
        {
            served += window_served;
            elapsed += window_elapsed;
            longest = longest.max(window_longest);
            if elapsed >= longest && elapsed > 0.0 {
                break;
            }
        }
        (elapsed > 0.0).then(|| served / elapsed)
    }
}

/// How many operations of each series a backend holds at once, normally: each series' run
/// time and its share of the load, averaged over about two of its run times (so a judge of a
/// second is averaged over two seconds, not over a window of 200 ms that one of them ended in).
///
/// What it is for: an operation admitted before a window opened and still running when it
/// closes ([`Sample::overdue`]) is one that does not answer, unless its kind runs longer than a
/// window does. This says how many of those its kind explains.
#[derive(Clone, Debug, Default)]
pub(super) struct Occupancy {
    /// Per series: its operations in flight (served run time over time), and their run time in
    /// seconds.
    series: [Option<(f64, f64)>; SeriesKey::COUNT],
}

impl Occupancy {
    /// Takes in a window.
    pub(super) fn add(&mut self, sample: &Sample) {
        let elapsed = sample.elapsed.as_secs_f64();
        if elapsed <= 0.0 {
            return;
        }
        for series in sample.series.iter() {
            let entry = &mut self.series[series.key().index()];
            let served = series.served.as_secs_f64() / elapsed;
            let run_time = series.served_run_time().map(|r| r.as_secs_f64());
            let (in_flight, typical) = match (*entry, run_time) {
                (Some(old), _) => old,
                (None, Some(run_time)) => (served, run_time),
                (None, None) => continue,
            };
            let typical = run_time.map_or(typical, |r| typical + 0.5 * (r - typical));
            // Over about two run times of the series.
            let weight = (elapsed / (2.0 * typical.max(elapsed))).min(1.0);
            *entry = Some((in_flight + weight * (served - in_flight), typical));
        }
    }

    /// Of the window's [overdue](Sample::overdue) operations (admitted before it opened, still
    /// running when it closed), how many hold a place without answering: those beyond what a
    /// kind of work slower than a window explains, and beyond its noise. Takes the window in.
    pub(super) fn unanswered(&mut self, sample: &Sample) -> f64 {
        self.add(sample);
        let explained = self.still_running(sample.elapsed.as_secs_f64());
        (sample.overdue as f64 - explained - explained.sqrt())
            .max(0.0)
            .floor()
    }

    /// How many of the operations admitted before a window that lasted `age` would still run
    /// when it closed, normally: of each series, its operations in flight less those that
    /// end within `age` (`L × (1 − age / r)` for a series of `L` in flight taking `r` each).
    pub(super) fn still_running(&self, age: f64) -> f64 {
        self.series
            .iter()
            .flatten()
            .map(|&(in_flight, run_time)| in_flight * (1.0 - age / run_time).max(0.0))
            .sum()
    }
}

/// A decrease after a window with congestion at `limit`: the capacity now, `backoff` times it
/// (at least one place less), and how many more places to take out as the operations admitted
/// before the decrease fail (their failures are not news, since the decrease answered them, so
/// they cut nothing more), so that it goes toward what the backend served lately (`served`), by
/// half at most.
///
/// So a capacity that fell from 24 to 8 is followed in two decreases, not one of ×0.9 per
/// round trip; a probe one above what the backend takes costs one place, as before; and the
/// places taken out beyond ×0.9 are those of operations that fail, not those of the operations
/// that still deliver (lowering the capacity at once would take the first places to come
/// back, theirs, while the doomed ones still hold theirs).
pub(super) fn decrease(limit: f64, backoff: f64, served: Option<f64>) -> (f64, f64) {
    let now = (limit * backoff).min(limit - 1.0).floor();
    let goal = served.map_or(now, |served| served.max(limit / 2.0).floor().min(now));
    (now, now - goal)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::super::tests::sample;
    use super::*;
    use crate::adaptive::SeriesSample;
    use crate::attributes::{Executor, Operation};

    fn window(served_ms: u64, elapsed_ms: u64, run_time_ms: u64) -> Sample {
        let mut sample = sample(24);
        sample.served = Duration::from_millis(served_ms);
        sample.elapsed = Duration::from_millis(elapsed_ms);
        let mut series = SeriesSample::new(Operation::Judge, Executor::Inline);
        series.ok = 1;
        series.served = Duration::from_millis(run_time_ms);
        sample.series.insert(series);
        sample
    }

    #[test]
    fn reads_what_ended_ok_over_the_longest_run_time() {
        let mut served = Served::default();
        assert_eq!(served.in_flight(), None);
        // 24 at once for a while, then 8: the newest round trip (100 ms) says 8.
        for _ in 0..10 {
            served.add(&window(2_400, 100, 100));
        }
        served.add(&window(800, 100, 100));
        assert_eq!(served.in_flight(), Some(8.0));
        // A judge of a second ended in a window of 100 ms: read over a second of windows.
        let mut mixed = Served::default();
        for _ in 0..9 {
            mixed.add(&window(600, 100, 100));
        }
        mixed.add(&window(1_600, 100, 1_000));
        let in_flight = mixed.in_flight().unwrap();
        assert!((in_flight - 7.0).abs() < 1e-9, "{in_flight}");
    }

    #[test]
    fn a_slow_kind_explains_its_operations_still_running_across_windows() {
        let mut occupancy = Occupancy::default();
        // Windows of 250 ms: 6 verifies of 100 ms in flight, and 6 judges of a second, of
        // which one or two end in a window.
        for judges in [1, 2, 1, 2, 1, 2, 1, 2, 1, 2, 1, 2] {
            let mut sample = sample(12);
            sample.elapsed = Duration::from_millis(250);
            let mut verify = SeriesSample::new(Operation::Verify, Executor::Subprocess);
            (verify.ok, verify.served) = (15, Duration::from_millis(1_500));
            let mut judge = SeriesSample::new(Operation::Judge, Executor::Inline);
            (judge.ok, judge.served) = (judges, Duration::from_millis(1_000 * judges));
            sample.series.insert(verify);
            sample.series.insert(judge);
            occupancy.add(&sample);
        }
        // Of the 6 judges, those admitted more than 250 ms before a window closes: 4.5.
        let still = occupancy.still_running(0.25);
        assert!((3.5..=5.5).contains(&still), "{still}");
        // A kind faster than the window explains none.
        let mut fast = Occupancy::default();
        let mut sample = sample(6);
        sample.elapsed = Duration::from_millis(200);
        let mut verify = SeriesSample::new(Operation::Verify, Executor::Subprocess);
        (verify.ok, verify.served) = (12, Duration::from_millis(1_200));
        sample.series.insert(verify);
        fast.add(&sample);
        assert_eq!(fast.still_running(0.2), 0.0);
    }

    #[test]
    fn a_decrease_goes_toward_what_was_served_by_half_at_most() {
        assert_eq!(
            decrease(24.0, 0.9, Some(8.0)),
            (21.0, 9.0),
            "toward 12, half of 24"
        );
        assert_eq!(decrease(12.0, 0.9, Some(8.0)), (10.0, 2.0));
        // A probe one above: one place, as without.
        assert_eq!(decrease(6.0, 0.9, Some(5.0)), (5.0, 0.0));
        assert_eq!(decrease(20.0, 0.9, Some(20.0)), (18.0, 0.0));
        assert_eq!(decrease(20.0, 0.9, None), (18.0, 0.0));
    }
}
