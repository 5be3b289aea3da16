//! [`Tally`]: what the ends of an adaptive limit's current window add up to, lock-free, and the
//! plain numbers it is taken as ([`Counts`]), which add up across processes.
//!
//! Every count is an atomic that an end adds to and [`Tally::take`] swaps for 0, so whatever
//! the interleaving each end's every count lands in exactly one take: over the takes, nothing
//! is lost and nothing counted twice (an end racing a take may land some counts in one window
//! and the rest in the next). The loom model below checks every interleaving of two ends and a
//! take:
//!
//! ```text
//! RUSTFLAGS="--cfg tro_loom" cargo test --release --lib adaptive::tally::loom_tests
//! ```

use std::fmt;
use std::ops::AddAssign;
use std::time::Duration;

#[cfg(not(all(test, tro_loom)))]
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};

#[cfg(all(test, tro_loom))]
use loom::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};

use super::algorithm::{BySeries, Sample, SeriesSample};
use super::config::Adaptive;
use super::news::{is_congestion, is_given_up};
use crate::attributes::{Executor, Operation, Outcome, SeriesKey};
use crate::limit::Ended;

/// Ends a window counts at most, so that its three counts fit one word.
pub(super) const WINDOW_CAP: u64 = 1 << 20;
const COUNT_BITS: u32 = 21;
const COUNT_MASK: u64 = (1 << COUNT_BITS) - 1;
/// One more of the window's own operations ended, in the word of counts.
const ENDED: u64 = 1;
/// One more sign of congestion that is news.
const CONGESTED: u64 = 1 << COUNT_BITS;
/// One more that is not.
const STALE: u64 = 1 << (2 * COUNT_BITS);
// Three counts of one word, with as much again for the ends that race a window's close.
const _: () = assert!(3 * COUNT_BITS <= 64 && WINDOW_CAP < COUNT_MASK);
/// A series' ends, its `ok` ends and its own `ok` ends, in one word, `COUNT_BITS` each.
const SERIES_ENDED: u64 = 1;
const SERIES_OK: u64 = 1 << COUNT_BITS;
const SERIES_TIMED: u64 = 1 << (2 * COUNT_BITS);
/// An atomic duration's "none".
pub(super) const NONE: u64 = u64::MAX;

/// What the ends of one window of an adaptive limit add up to, as they happen: a handful of
/// relaxed atomics per end, no lock, no allocation. [`take`](Tally::take) reads it as plain
/// numbers ([`Counts`]) and starts it again from nothing.
///
/// It is the one thing an operation's end touches: a [`Limit`](crate::Limit)'s controller
/// closes its window in the process. (A window kept outside the process is a
/// [`Window`](super::Window).)
///
/// Run times are kept per series (an [`Operation`] on an [`Executor`], 20 of them at most, in
/// a table of fixed size), so that an [`Algorithm`](super::Algorithm) can compare an
/// operation's run time with what is normal for its kind: a verify of 100 ms and a judge of
/// 1 s that share a limit are two series, not one mean.
///
#[repr(align(64))]
pub(crate) struct Tally {
    /// The window's own ends, and its signs of congestion that are news and that are not,
    /// `COUNT_BITS` each.
    counts: AtomicU64,
    /// Sum of the operations in flight that its own ends saw.
    in_flight: AtomicU64,
    /// The most that an end saw.
    peak: AtomicUsize,
    rejected: AtomicU64,
    series: [SeriesCell; SeriesKey::COUNT],
}

/// One series' share of a window, on a cache line of its own.
#[derive(Debug)]
#[repr(align(64))]
struct SeriesCell {
    /// Its ends, its `ok` ends, and its own `ok` ends, `COUNT_BITS` each.
    ends: AtomicU64,
    /// The run times of its operations that ended `ok`, whenever admitted, summed (µs).
    served_us: AtomicU64,
    /// The run times of its own `ok` ends: their sum (µs), the sum of their squares
    /// (µs² / 1024), the shortest (`NONE` for none).
    sum_us: AtomicU64,
    squares: AtomicU64,
    min_us: AtomicU64,
    /// Its operations that their callers gave up on (`timeout`, `cancelled`), whenever
    /// admitted: how many, and their run times summed (µs).
    given_up: AtomicU64,
    given_up_us: AtomicU64,
}

/// How a window counts one end: what its controller knows of it that the end does not say.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Counted {
    /// The operation was admitted after the window opened, so it ran at the capacity the
    /// window opened with: its run time measures that capacity. An operation admitted earlier
    /// counts only as an end of its series and, if it failed, as a sign of congestion.
    pub(crate) own: bool,
    /// Its failure (if it is a sign of congestion: see [`is_congestion`]) is news: see
    /// [`News`](super::News). Ignored for other outcomes.
    pub(crate) news: bool,
    /// The operations of the limit holding a place as it ended, itself included; 0 where a
    /// controller measures the load otherwise (a fleet samples its leases held).
    pub(crate) in_flight: usize,
}

/// What a window adds up to after an end: what tells whether it is due to close.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub(crate) struct Running {
    /// Its own operations that ended.
    pub(crate) ended: u64,
    /// Its signs of congestion that are news.
    pub(crate) congested: u64,
    /// Its signs of congestion that are not.
    pub(crate) stale: u64,
}

impl Running {
    fn of(counts: u64) -> Self {
        Self {
            ended: counts & COUNT_MASK,
            congested: (counts >> COUNT_BITS) & COUNT_MASK,
            stale: (counts >> (2 * COUNT_BITS)) & COUNT_MASK,
        }
    }
}

impl Tally {
    /// A window with nothing in it.
    pub(crate) fn new() -> Self {
        Self {
            counts: AtomicU64::new(0),
            in_flight: AtomicU64::new(0),
            peak: AtomicUsize::new(0),
            rejected: AtomicU64::new(0),
            series: std::array::from_fn(|_| SeriesCell {
                ends: AtomicU64::new(0),
                served_us: AtomicU64::new(0),
                sum_us: AtomicU64::new(0),
                squares: AtomicU64::new(0),
                min_us: AtomicU64::new(NONE),
                given_up: AtomicU64::new(0),
                given_up_us: AtomicU64::new(0),
            }),
        }
    }

    /// Adds the end of an operation, `counted` so; returns what the window adds up to now.
    #[inline]
    pub(crate) fn add(&self, ended: &Ended, counted: Counted) -> Running {
        let outcome = ended.outcome();
        let ok = outcome == Outcome::Ok;
        let cell = &self.series[ended.series().index()];
        if counted.in_flight > self.peak.load(Relaxed) {
            self.peak.fetch_max(counted.in_flight, Relaxed);
        }
        let us = u64::try_from(ended.run_time().as_micros()).unwrap_or(NONE - 1);
        let timed = counted.own && ok;
        let ends = match (ok, timed) {
            (false, _) => SERIES_ENDED,
            (true, false) => SERIES_ENDED + SERIES_OK,
            (true, true) => SERIES_ENDED + SERIES_OK + SERIES_TIMED,
        };
        cell.ends.fetch_add(ends, Relaxed);
        if ok {
            cell.served_us.fetch_add(us, Relaxed);
        }
        if is_given_up(outcome) {
            cell.given_up.fetch_add(1, Relaxed);
            cell.given_up_us.fetch_add(us, Relaxed);
        }
        if timed {
            cell.sum_us.fetch_add(us, Relaxed);
            cell.squares.fetch_add(us.saturating_mul(us) >> 10, Relaxed);
            if us < cell.min_us.load(Relaxed) {
                cell.min_us.fetch_min(us, Relaxed);
            }
        }
        let mut add = 0;
        if counted.own {
            add += ENDED;
            let in_flight = u64::try_from(counted.in_flight).unwrap_or(u64::MAX);
            self.in_flight.fetch_add(in_flight, Relaxed);
        }
        if is_congestion(outcome) {
            add += if counted.news { CONGESTED } else { STALE };
        }
        Running::of(match add {
            0 => self.counts.load(Relaxed),
            add => self.counts.fetch_add(add, Relaxed) + add,
        })
    }

    /// The limit turned an operation away by a rule of its own (a full queue).
    pub(crate) fn rejected(&self) {
        self.rejected.fetch_add(1, Relaxed);
    }

    /// What it adds up to now.
    pub(crate) fn running(&self) -> Running {
        Running::of(self.counts.load(Relaxed))
    }

    /// Takes what it added up to, and starts again from nothing. An end racing this may land
    /// some of its counts in these and the rest in the next: a small error, once in a while,
    /// for no lock on the operations' path. Nothing is counted twice, and nothing is lost.
    pub(crate) fn take(&self) -> Counts {
        let mut counts = Counts {
            in_flight_sum: self.in_flight.swap(0, Relaxed),
            peak: self.peak.swap(0, Relaxed) as u64,
            rejected: self.rejected.swap(0, Relaxed),
            ..Counts::default()
        };
        for (cell, series) in self.series.iter().zip(&mut counts.series) {
            if cell.is_empty() {
                // Left alone: its line stays shared with the cores that read it, rather than
                // pulled to this one for nothing. An end adding to it meanwhile is taken next.
                continue;
            }
            let ends = cell.ends.swap(0, Relaxed);
            *series = SeriesCounts {
                ended: ends & COUNT_MASK,
                ok: (ends >> COUNT_BITS) & COUNT_MASK,
                timed: (ends >> (2 * COUNT_BITS)) & COUNT_MASK,
                served_us: cell.served_us.swap(0, Relaxed),
                sum_us: cell.sum_us.swap(0, Relaxed),
                squares: cell.squares.swap(0, Relaxed),
                min_us: match cell.min_us.swap(NONE, Relaxed) {
                    NONE => None,
                    us => Some(us),
                },
                given_up: cell.given_up.swap(0, Relaxed),
                given_up_us: cell.given_up_us.swap(0, Relaxed),
            };
        }
        let running = Running::of(self.counts.swap(0, Relaxed));
        (counts.ended, counts.congested, counts.stale) =
            (running.ended, running.congested, running.stale);
        counts
    }
}

impl SeriesCell {
    /// Whether nothing is in it (plain loads: an untouched cell is never written).
    fn is_empty(&self) -> bool {
        self.ends.load(Relaxed) == 0
            && self.served_us.load(Relaxed) == 0
            && self.sum_us.load(Relaxed) == 0
            && self.squares.load(Relaxed) == 0
            && self.min_us.load(Relaxed) == NONE
            && self.given_up.load(Relaxed) == 0
            && self.given_up_us.load(Relaxed) == 0
    }
}

impl Default for Tally {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for Tally {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tally")
            .field("running", &self.running())
            .finish_non_exhaustive()
    }
}

/// What a window added up to, as plain numbers: taken from a [`Tally`], added up across the
/// processes of a fleet (`+=`: counts and sums add, the shortest run times and the peak keep
/// the extreme), and turned into the [`Sample`] an algorithm reads with
/// [`sample`](Counts::sample).
///
/// A store keeps them as integers: each field, and each series'
/// ([`series`](Counts::series)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Counts {
    /// The window's own operations that ended, whatever their outcome.
    pub(crate) ended: u64,
    /// Signs of congestion that were news.
    pub(crate) congested: u64,
    /// Signs of congestion that were not.
    pub(crate) stale: u64,
    /// The operations in flight that the window's own ends saw, summed (0 where the load is
    /// measured otherwise).
    pub(crate) in_flight_sum: u64,
    /// The most operations in flight that an end saw.
    pub(crate) peak: u64,
    /// Operations the limit turned away by a rule of its own.
    pub(crate) rejected: u64,
    pub(super) series: [SeriesCounts; SeriesKey::COUNT],
}

/// One series' counts in a window.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct SeriesCounts {
    /// Its operations that ended in the window, whenever admitted, whatever their outcome.
    pub(crate) ended: u64,
    /// Those of them that ended `ok`.
    pub(crate) ok: u64,
    /// The run times of those, summed, in microseconds: what the backend served of it.
    pub(crate) served_us: u64,
    /// Those of its own operations (admitted in the window) that ended `ok`: the ones timed.
    pub(crate) timed: u64,
    /// Their run times summed, in microseconds.
    pub(crate) sum_us: u64,
    /// The squares of their run times in µs², divided by 1024, summed.
    pub(crate) squares: u64,
    /// The shortest of them, in microseconds.
    pub(crate) min_us: Option<u64>,
    /// Its operations that ended in the window, whenever admitted, that their callers gave up
    /// on (`timeout`, `cancelled`).
    pub(crate) given_up: u64,
    /// Their run times summed, in microseconds: how long those callers waited.
    pub(crate) given_up_us: u64,
}

impl AddAssign for SeriesCounts {
    fn add_assign(&mut self, other: Self) {
        self.ended += other.ended;
        self.ok += other.ok;
        self.served_us += other.served_us;
        self.timed += other.timed;
        self.sum_us += other.sum_us;
        self.squares += other.squares;
        self.min_us = match (self.min_us, other.min_us) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        self.given_up += other.given_up;
        self.given_up_us += other.given_up_us;
    }
}

impl AddAssign for Counts {
    fn add_assign(&mut self, other: Self) {
        self.ended += other.ended;
        self.congested += other.congested;
        self.stale += other.stale;
        self.in_flight_sum += other.in_flight_sum;
        self.peak = self.peak.max(other.peak);
        self.rejected += other.rejected;
        for (series, other) in self.series.iter_mut().zip(other.series) {
            *series += other;
        }
    }
}

impl Counts {
    /// The series with an end in the window, and their counts.
    pub(crate) fn series(&self) -> impl Iterator<Item = (Operation, Executor, &SeriesCounts)> + '_ {
        self.series
            .iter()
            .enumerate()
            .filter(|(_, counts)| counts.ended > 0)
            .filter_map(|(index, counts)| {
                let key = SeriesKey::from_index(index)?;
                Some((key.operation(), key.executor(), counts))
            })
    }

    /// These counts, added to a window after the one they were taken in: what any window
    /// counts of an end whenever its operation was admitted (each series' ends, `ok` ends, what
    /// was served and what was given up, the signs of congestion, the limit's rejections, the
    /// load), without
    /// what only the window the operations were admitted in counts (its own ends, and their run
    /// times). For a fleet whose process took its counts just as the fleet's window changed.
    pub(crate) fn into_next_window(mut self) -> Self {
        self.ended = 0;
        self.in_flight_sum = 0;
        for series in &mut self.series {
            (series.timed, series.sum_us, series.squares, series.min_us) = (0, 0, 0, None);
        }
        self
    }

    /// The counts of a window that heard one in `scale` of its operations (a busy limit's
    /// controller hears a sample), scaled back up: every count and sum times `scale` (the
    /// limit's rejections, counted whatever the sample, aside).
    pub(super) fn scaled(mut self, scale: u64) -> Self {
        let times = |count: &mut u64| *count = count.saturating_mul(scale);
        for count in [
            &mut self.ended,
            &mut self.congested,
            &mut self.stale,
            &mut self.in_flight_sum,
        ] {
            times(count);
        }
        for series in &mut self.series {
            for count in [
                &mut series.ended,
                &mut series.ok,
                &mut series.served_us,
                &mut series.timed,
                &mut series.sum_us,
                &mut series.squares,
                &mut series.given_up,
                &mut series.given_up_us,
            ] {
                times(count);
            }
        }
        self
    }

    /// The [`Sample`] of a window that added up to these counts, closed at `capacity`, under
    /// `adaptive`'s bounds and tolerance: its counts, its run times (each series' and all of
    /// them together), the load its own ends saw, what the backend served, and whether it ran
    /// its course ([`Sample::round_trip`]: its signs of congestion, news or not, within the
    /// tolerance).
    ///
    /// Left for the caller, who knows them: [`elapsed`](Sample::elapsed) and
    /// [`overdue`](Sample::overdue) (0), and, where the load was not counted with each end
    /// ([`Counted::in_flight`] 0), [`in_flight`](Sample::in_flight) and
    /// [`peak_in_flight`](Sample::peak_in_flight).
    pub(crate) fn sample(&self, capacity: usize, adaptive: &Adaptive) -> Sample {
        let bounds = adaptive.bounds();
        let mut sample = Sample::new(capacity, *bounds.start(), *bounds.end());
        let tolerance = adaptive.tolerated_share();
        let tolerated = (tolerance * self.ended.max(capacity as u64) as f64) as u64;
        sample.ended = self.ended;
        sample.congested = self.congested;
        sample.stale_congested = self.stale;
        sample.tolerance = tolerance;
        sample.rejected = self.rejected;
        sample.peak_in_flight = usize::try_from(self.peak).unwrap_or(usize::MAX);
        sample.in_flight = match self.ended {
            0 => self.peak as f64,
            ended => self.in_flight_sum as f64 / ended as f64,
        };
        sample.round_trip = self.congested <= tolerated && self.stale <= tolerated;
        let mut all = SeriesCounts::default();
        let mut series = BySeries::default();
        for (operation, executor, counts) in self.series() {
            all += *counts;
            series.insert(counts.sample(operation, executor));
        }
        let overall = all.sample(Operation::Other, Executor::Other);
        sample.served = overall.served;
        sample.mean_run_time = overall.mean_run_time;
        sample.min_run_time = overall.min_run_time;
        sample.run_time_deviation = overall.run_time_deviation;
        sample.series = series;
        sample
    }
}

impl SeriesCounts {
    /// What these counts say of `operation` on `executor`.
    fn sample(&self, operation: Operation, executor: Executor) -> SeriesSample {
        let timed = self.timed;
        let mean = (timed > 0).then(|| self.sum_us as f64 / timed as f64);
        SeriesSample {
            operation,
            executor,
            ended: self.ended,
            ok: self.ok,
            served: Duration::from_micros(self.served_us),
            timed,
            mean_run_time: mean.map(|mean| Duration::from_micros(mean as u64)),
            min_run_time: self.min_us.map(Duration::from_micros),
            run_time_deviation: mean.filter(|_| timed > 1).map(|mean| {
                let squares = self.squares as f64 * 1024.0 / timed as f64;
                Duration::from_micros((squares - mean * mean).max(0.0).sqrt() as u64)
            }),
            given_up: self.given_up,
            given_up_after: Duration::from_micros(self.given_up_us),
        }
    }
}

#[cfg(all(test, tro_loom))]
mod loom_tests {
    use loom::sync::Arc;
    use loom::thread;

    use super::*;

    #[test]
    fn ends_racing_a_take_are_each_counted_once() {
        loom::model(|| {
            let tally = Arc::new(Tally::new());
            let ms = Duration::from_millis;
            let ends = [
                (Outcome::Ok, Operation::Verify, true, ms(100)),
                (Outcome::Timeout, Operation::Judge, false, ms(1_000)),
            ];
            let adders: Vec<_> = ends
                .into_iter()
                .map(|(outcome, operation, own, ran)| {
                    let tally = Arc::clone(&tally);
                    thread::spawn(move || {
                        let ended =
                            Ended::new(outcome, ran, None).with_series(operation, Executor::Inline);
                        let counted = Counted {
                            own,
                            news: true,
                            in_flight: 2,
                        };
                        tally.add(&ended, counted);
                    })
                })
                .collect();
            let mut counts = tally.take();
            for adder in adders {
                adder.join().unwrap();
            }
            counts += tally.take();
            assert_eq!((counts.ended, counts.congested, counts.stale), (1, 1, 0));
            assert_eq!((counts.in_flight_sum, counts.peak), (2, 2));
            let of = |operation| {
                counts
                    .series()
                    .find(|&(o, e, _)| (o, e) == (operation, Executor::Inline))
                    .map(|(_, _, series)| series)
                    .expect("the series")
            };
            let verify = of(Operation::Verify);
            assert_eq!((verify.ended, verify.ok, verify.timed), (1, 1, 1));
            assert_eq!(
                (verify.sum_us, verify.served_us, verify.min_us),
                (100_000, 100_000, Some(100_000))
            );
            let judge = of(Operation::Judge);
            assert_eq!(
                (judge.ended, judge.ok, judge.timed, judge.served_us),
                (1, 0, 0, 0)
            );
        });
    }
}

// Not under loom: a tally's atomics are loom's there, which run only in a model.
#[cfg(all(test, not(tro_loom)))]
mod tests {
    use super::*;
    use crate::adaptive::Vegas;

    fn ended(outcome: Outcome, ms: u64, operation: Operation) -> Ended {
        Ended::new(outcome, Duration::from_millis(ms), None).with_series(operation, Executor::Other)
    }

    fn counted(own: bool, news: bool, in_flight: usize) -> Counted {
        Counted {
            own,
            news,
            in_flight,
        }
    }

    #[test]
    fn sums_its_own_operations_by_series_and_counts_the_others() {
        let tally = Tally::new();
        let ms = Duration::from_millis;
        tally.add(
            &ended(Outcome::Ok, 100, Operation::Verify),
            counted(true, false, 4),
        );
        tally.add(
            &ended(Outcome::Ok, 120, Operation::Verify),
            counted(true, false, 3),
        );
        tally.add(
            &ended(Outcome::Ok, 1000, Operation::Judge),
            counted(true, false, 3),
        );
        // Admitted before the window: served, but not timed.
        tally.add(
            &ended(Outcome::Ok, 900, Operation::Judge),
            counted(false, false, 2),
        );
        let running = tally.add(
            &ended(Outcome::Timeout, 5, Operation::Judge),
            counted(false, false, 2),
        );
        assert_eq!((running.ended, running.congested, running.stale), (3, 0, 1));
        let counts = tally.take();
        assert_eq!((counts.ended, counts.peak), (3, 4));
        let sample = counts.sample(4, &Adaptive::new(Vegas::default(), 1..=8));
        assert_eq!(sample.in_flight, 10.0 / 3.0);
        let mean = Duration::from_micros(406_666);
        assert_eq!(sample.mean_run_time, Some(mean), "(100 + 120 + 1000) / 3");
        let verify = sample
            .series
            .get(Operation::Verify, Executor::Other)
            .unwrap();
        assert_eq!((verify.ended, verify.ok, verify.timed), (2, 2, 2));
        assert_eq!(verify.mean_run_time, Some(ms(110)));
        assert_eq!(verify.min_run_time, Some(ms(100)));
        let deviation = verify.run_time_deviation.unwrap().as_secs_f64();
        assert!((deviation - 0.010).abs() < 1e-3, "{deviation}");
        let judge = sample
            .series
            .get(Operation::Judge, Executor::Other)
            .unwrap();
        assert_eq!((judge.ended, judge.ok, judge.timed), (3, 2, 1));
        assert_eq!(judge.served, ms(1_900));
        assert_eq!(judge.served_run_time(), Some(ms(950)));
        assert_eq!(sample.served, ms(2_120), "every ok end's run time");
        assert_eq!(judge.mean_run_time, Some(ms(1000)));
        // The timeout: its caller gave up after 5 ms.
        assert_eq!(
            (judge.given_up, judge.given_up_run_time()),
            (1, Some(ms(5)))
        );
        assert_eq!(verify.given_up_run_time(), None);
        assert_eq!(sample.series.iter().count(), 2);
        assert!(!sample.round_trip, "a stale failure, with a tolerance of 0");
        assert_eq!(tally.take(), Counts::default(), "taken");
    }

    #[test]
    fn counts_add_up_across_processes() {
        let (one, two) = (Tally::new(), Tally::new());
        one.add(
            &ended(Outcome::Ok, 100, Operation::Verify),
            counted(true, false, 2),
        );
        one.add(
            &ended(Outcome::Error, 5, Operation::Verify),
            counted(true, true, 2),
        );
        two.add(
            &ended(Outcome::Ok, 80, Operation::Verify),
            counted(true, false, 5),
        );
        two.rejected();
        let mut sum = one.take();
        sum += two.take();
        assert_eq!(
            (sum.ended, sum.congested, sum.rejected, sum.peak),
            (3, 1, 1, 5)
        );
        let verify = sum.series().map(|(_, _, counts)| *counts).next().unwrap();
        assert_eq!((verify.ended, verify.ok, verify.timed), (3, 2, 2));
        assert_eq!((verify.sum_us, verify.served_us), (180_000, 180_000));
        assert_eq!(verify.min_us, Some(80_000));
        // As a store would keep them: field by field.
        let mut rebuilt = Counts {
            ended: 3,
            congested: 1,
            rejected: 1,
            peak: 5,
            in_flight_sum: sum.in_flight_sum,
            ..Counts::default()
        };
        rebuilt.series[SeriesKey::new(Operation::Verify, Executor::Other).index()] = verify;
        assert_eq!(rebuilt, sum);
        // Taken as the window changed: its own operations' counts stay with it.
        let late = sum.into_next_window();
        assert_eq!((late.ended, late.congested, late.rejected), (0, 1, 1));
        let (_, _, verify) = late.series().next().unwrap();
        assert_eq!((verify.ended, verify.ok, verify.timed), (3, 2, 0));
        assert_eq!(
            (verify.served_us, verify.sum_us, verify.min_us),
            (180_000, 0, None)
        );
    }
}
