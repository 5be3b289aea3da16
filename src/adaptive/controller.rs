//! [`WindowControl`]: which window each end of an adaptive limit's operations belongs to, when a
//! window closes, and the close that runs the algorithm once per window: a [`Tally`] that each
//! end adds to, the [`News`] rule, and [`Counts::sample`]. [`Controller`](super::Controller) is
//! the same for a limit of your own.
//!
//! A window lasts one round trip: it measures the operations admitted after it opened (an
//! operation's admission is its end less its run time, so nothing is tracked while it runs),
//! which ran at the capacity it opened with, and closes once as many of them as the capacity
//! have ended, or at the first sign of congestion. A failure of an operation admitted before the
//! last decrease is not news: that decrease already answered it, so it does not count as
//! congestion (it still closes the window, for the algorithm to see).
//!
//! A busy limit's controller hears a sample of its operations: once a window is at least
//! [`MIN_WINDOW`] long, the controller picks, as it opens the next, one in `2^k` operations
//! to hear so that a window still holds about [`SAMPLES`] of them. The others are not timed
//! for it, and cost no more than with a plain limit. Its counts are scaled back up for the
//! algorithm. A limit doing a few thousand operations a second or fewer hears every one.

use std::fmt;
use std::ops::RangeInclusive;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use tokio::time::Instant;

use super::algorithm::{Algorithm, Sample};
use super::config::{Adaptive, Windows};
use super::news::News;
use super::tally::{Counted, Counts, Running, Tally, NONE, WINDOW_CAP};
use crate::guard::guarded;
use crate::limit::{Control, Ended, MakeControl, Resize};

/// The shortest window that closes on its count of ends (not the first, and not for
/// congestion): what lets a busy limit's window hold enough operations to be sampled.
pub(super) const MIN_WINDOW: Duration = Duration::from_millis(2);
const MIN_WINDOW_NS: u64 = MIN_WINDOW.as_nanos() as u64;
/// About how many operations a sampled window hears.
pub(super) const SAMPLES: u64 = 32;
/// At most one in this many operations is left unheard.
const MAX_SCALE: u64 = 1 << 16;

/// One limit's controller: the window that operations add to, and the algorithm that reads it
/// when it closes.
pub(super) struct WindowControl {
    window: Tally,
    /// Whether a failure is news: marks are nanoseconds (see [`WindowControl::nanos`]).
    news: News,
    /// Which operations its limit lets it hear: one in `sampling + 1` (a power of two), at
    /// random ([`Resize::hear_one_in`]).
    sampling: AtomicU32,
    /// When the current window opened, in nanoseconds (see [`WindowControl::nanos`]); 0 for the
    /// first window, which every operation belongs to.
    opened: AtomicU64,
    /// Ends added to the current window that ended no later than it opened (at the same
    /// instant, on a link that answers a burst at once): not ends *since* it opened.
    early: AtomicU64,
    /// The last round trip's mean run time, in nanoseconds (`NONE` before the first).
    round_trip_ns: AtomicU64,
    /// How much the capacity changed as the current window opened (two's complement): places
    /// taken (or not taken again) at once, not for an end.
    resized: AtomicU64,
    /// Ends (of the window's own operations) after which it closes.
    due: AtomicU64,
    /// Signs of congestion the current window tolerates.
    tolerated: AtomicU64,
    /// Fixed windows: ends after which the current window closes once it is `interval` old
    /// (its capacity).
    turnover: AtomicU64,
    /// Held by the one thread closing a window.
    closing: AtomicBool,
    /// The first time an operation ended: the origin of the nanoseconds.
    epoch: OnceLock<Instant>,
    /// Locked only by the thread holding `closing`.
    algorithm: Mutex<Box<dyn Algorithm>>,
    /// What the algorithm measured, in microseconds, for the gauges (`NONE` for nothing).
    baseline_us: AtomicU64,
    estimate_us: AtomicU64,
    limit: Weak<dyn Resize>,
    settings: Adaptive,
    windows: Windows,
    interval_ns: u64,
    tolerance: f64,
}

impl WindowControl {
    /// The controller `adaptive` describes, for `limit`, which starts at `capacity`.
    pub(super) fn new(adaptive: &Adaptive, limit: Weak<dyn Resize>, capacity: usize) -> Self {
        let controller = Self {
            window: Tally::new(),
            news: News::new(),
            sampling: AtomicU32::new(0),
            opened: AtomicU64::new(0),
            early: AtomicU64::new(0),
            round_trip_ns: AtomicU64::new(NONE),
            // The first window's places were taken at once, with no window closing before it.
            resized: AtomicU64::new((capacity as u64).saturating_sub(1)),
            due: AtomicU64::new(0),
            tolerated: AtomicU64::new(0),
            turnover: AtomicU64::new(0),
            closing: AtomicBool::new(false),
            epoch: OnceLock::new(),
            algorithm: Mutex::new(adaptive.new_algorithm()),
            baseline_us: AtomicU64::new(NONE),
            estimate_us: AtomicU64::new(NONE),
            limit,
            settings: adaptive.clone(),
            windows: adaptive.windows(),
            interval_ns: u64::try_from(adaptive.interval().as_nanos()).unwrap_or(u64::MAX),
            tolerance: adaptive.tolerated_share(),
        };
        controller.open(capacity);
        controller
    }

    fn is_round_trip(&self) -> bool {
        matches!(self.windows, Windows::RoundTrip { .. })
    }

    /// One in how many operations the current window hears.
    fn scale(&self) -> u64 {
        u64::from(self.sampling.load(Relaxed)) + 1
    }

    /// Sets when the next window closes, at `capacity`, counted in the ends it hears.
    fn open(&self, capacity: usize) {
        let scale = self.scale() as usize;
        let due = match self.windows {
            // A turnover of operations admitted in the window: the first of them end one run
            // time after it opened, the rest within about one more. (Not fewer: the first to
            // end are the fastest, and a server that took a burst of them served the first few
            // at a lower load than the last.)
            Windows::RoundTrip { operations } => operations.max(capacity),
            Windows::Fixed { operations } => operations.max(capacity.saturating_mul(2)),
        };
        let count = |n: usize| {
            let heard = n.div_ceil(scale);
            u64::try_from(heard).unwrap_or(WINDOW_CAP).min(WINDOW_CAP)
        };
        let due = count(due);
        self.due.store(due, Relaxed);
        self.tolerated
            .store((self.tolerance * due as f64) as u64, Relaxed);
        self.turnover.store(count(capacity.max(1)), Relaxed);
    }

    /// Whether a window that adds up to `running`, `age` old in nanoseconds (if known), is due
    /// to close. The first window (opened at 0) has no shortest length.
    #[inline]
    fn is_due(&self, running: Running, age: Option<u64>, first: bool) -> bool {
        let tolerated = self.tolerated.load(Relaxed);
        if running.congested > tolerated {
            return true;
        }
        let long_enough = first || age.is_none_or(|age| age >= MIN_WINDOW_NS);
        if running.ended >= self.due.load(Relaxed) && long_enough {
            return true;
        }
        let Some(age) = age else {
            return false;
        };
        match self.windows {
            // A stale failure too: the place it frees is not taken again before the algorithm
            // has seen it, so an algorithm can take out the places of operations it knew would
            // fail. And once it is `interval` old with one of its own ended, or more than twice
            // the last round trip old with half of them (fewer would be the fastest only).
            Windows::RoundTrip { .. } => {
                let round_trip = self.round_trip_ns.load(Relaxed);
                running.stale > tolerated
                    || (running.ended >= 1
                        && age >= self.interval_ns
                        && (running.ended.saturating_mul(2) >= self.turnover.load(Relaxed)
                            || age >= self.interval_ns.saturating_add(self.interval_ns / 2)))
                    || (running.ended >= self.due.load(Relaxed).div_ceil(2)
                        && age > round_trip.saturating_mul(2)
                        && long_enough)
            }
            Windows::Fixed { .. } => {
                age >= self.interval_ns && running.ended >= self.turnover.load(Relaxed)
            }
        }
    }

    /// An admitted operation ended, at `at` nanoseconds (`None` without a clock), with
    /// `in_flight` operations holding a place; closes the window if this end completes it.
    #[inline]
    fn end(&self, ended: &Ended, at: Option<u64>, in_flight: usize) {
        let opened = self.opened.load(Relaxed);
        let ran = u64::try_from(ended.run_time().as_nanos()).unwrap_or(u64::MAX);
        // When it was admitted, as a mark; without a clock, after anything.
        let admitted = at.map_or(u64::MAX, |at| at.saturating_sub(ran));
        // Whether it was admitted after the window opened (0 being before anything), and so
        // ran at what was decided then. Not at the same instant: at that instant the
        // operations of a server that answered a burst at once are taken in order, the first at
        // a lower load.
        let own = !self.is_round_trip() || opened == 0 || admitted > opened;
        let counted = Counted {
            own,
            news: self.news.is_news(admitted),
            in_flight,
        };
        let running = self.window.add(ended, counted);
        if at.is_some_and(|at| at <= opened) {
            self.early.fetch_add(1, Relaxed);
        }
        let age = at.map(|at| at.saturating_sub(opened));
        if self.is_due(running, age, opened == 0) {
            self.close(at, in_flight);
        }
    }

    /// `now`, in nanoseconds since the controller's first end, plus one: 0 is before anything.
    fn nanos(&self, now: Instant) -> u64 {
        let epoch = *self.epoch.get_or_init(|| now);
        u64::try_from(now.saturating_duration_since(epoch).as_nanos())
            .unwrap_or(u64::MAX - 1)
            .saturating_add(1)
    }

    /// Closes the window, if no other thread is closing it and it is still due: reads it,
    /// opens the next, runs the algorithm and sets the capacity it names. `in_flight` is what
    /// the closing end saw.
    #[cold]
    #[inline(never)]
    fn close(&self, at: Option<u64>, in_flight: usize) {
        if self
            .closing
            .swap(true, std::sync::atomic::Ordering::Acquire)
        {
            return;
        }
        let _reopen = Reopen(&self.closing);
        let Some(limit) = self.limit.upgrade() else {
            return;
        };
        let capacity = limit.capacity();
        let opened = self.opened.load(Relaxed);
        let age = at.map(|at| at.saturating_sub(opened));
        // Another thread may have closed it between this end and the flag.
        if !self.is_due(self.window.running(), age, opened == 0) {
            return;
        }
        let counts = self.window.take();
        let early = self.early.swap(0, Relaxed);
        let scale = self.scale();
        if let Some(at) = at {
            self.opened.store(at, Relaxed);
        }
        let after = counts
            .series()
            .map(|(_, _, series)| series.ended)
            .sum::<u64>();
        let after = after.saturating_sub(early);
        let sample = self.sample(&counts, after, scale, capacity, in_flight, age);
        if let Some(mean) = sample.mean_run_time {
            let ns = u64::try_from(mean.as_nanos()).unwrap_or(NONE - 1);
            self.round_trip_ns.store(ns, Relaxed);
        }
        let one_in = limit.hear_one_in(one_in(after, scale, age));
        self.sampling.store(one_in.max(1) - 1, Relaxed);
        let mut algorithm = self.algorithm.lock().unwrap_or_else(|p| p.into_inner());
        let next = guarded(|| algorithm.update(&sample)).unwrap_or(capacity);
        let bounds = self.settings.bounds();
        let next = next.clamp(*bounds.start(), *bounds.end());
        self.resized
            .store((next as i64).wrapping_sub(capacity as i64) as u64, Relaxed);
        if next != capacity {
            if let (true, Some(at)) = (next < capacity, at) {
                self.news.decreased(at);
            }
            limit.resize(next);
        }
        self.open(next);
        let (baseline, estimate) =
            guarded(|| (algorithm.baseline(), algorithm.estimate())).unwrap_or_default();
        self.baseline_us.store(micros(baseline), Relaxed);
        self.estimate_us.store(micros(estimate), Relaxed);
    }

    /// What the window that adds up to `counts`, with `after` ends since it opened, heard one
    /// in `scale`, showed, closed `age` after it opened by an end that saw `in_flight`
    /// operations in flight, at `capacity`.
    fn sample(
        &self,
        counts: &Counts,
        after: u64,
        scale: u64,
        capacity: usize,
        in_flight: usize,
        age: Option<u64>,
    ) -> Sample {
        let tolerated = self.tolerated.load(Relaxed);
        let round_trip =
            counts.congested <= tolerated && (!self.is_round_trip() || counts.stale <= tolerated);
        // The operations admitted before the window and still running. While the limit is full,
        // each end's place is taken again at once, so the window's own operations are one for
        // each end since it opened (the last window's closing end included, whose place was
        // taken as this one opened; not this one's, not yet), plus the places the resize added
        // (less those it took out); those that ended are not running, and what else runs now
        // (the closing end aside) is from before.
        let resized = self.resized.load(Relaxed) as i64;
        let own_running = after as i64 + resized - counts.ended as i64;
        let overdue = (in_flight as i64 - 1 - own_running).max(0) as u64;
        let full = in_flight >= capacity;
        let mut sample = counts.scaled(scale).sample(capacity, &self.settings);
        // Counted from every end, so only while it hears every one.
        sample.overdue = match self.is_round_trip() && round_trip && full && scale == 1 {
            true => overdue,
            false => 0,
        };
        sample.round_trip = round_trip;
        sample.elapsed = Duration::from_nanos(age.unwrap_or(0));
        sample
    }
}

/// One in how many of the next window's operations to hear: about [`SAMPLES`] of the ends
/// that a window of [`MIN_WINDOW`] would see at the rate of the one that closed `age` after it
/// opened, having heard one in `scale` of its `totals`; at least half of `scale`, so that a
/// window open through an idle spell (which reads as a slow one) costs one window that hears
/// twice as many, and a rate that fell for good is followed within a few windows.
fn one_in(after: u64, scale: u64, age: Option<u64>) -> u32 {
    let floor = (scale / 2).max(1);
    // A shorter window (the first, one that closed for congestion) cannot tell a rate.
    let Some(age) = age.filter(|&age| age >= MIN_WINDOW_NS / 2) else {
        return floor as u32;
    };
    let ends = u128::from(after.saturating_mul(scale));
    let per_min_window = ends * u128::from(MIN_WINDOW_NS) / u128::from(age);
    let wanted = u64::try_from(per_min_window / u128::from(SAMPLES)).unwrap_or(MAX_SCALE);
    let wanted = wanted.clamp(floor, MAX_SCALE);
    // The largest power of two at most `wanted`.
    (1u64 << (63 - wanted.leading_zeros())) as u32
}

impl Control for WindowControl {
    #[inline]
    fn ended(&self, ended: &Ended, in_flight: usize) {
        let at = ended.at().map(|at| self.nanos(at));
        self.end(ended, at, in_flight);
    }

    fn rejected(&self) {
        self.window.rejected();
    }

    /// What the algorithm measured: its baseline and its estimate of the run time.
    fn measured(&self) -> (Option<Duration>, Option<Duration>) {
        let read = |us: &AtomicU64| match us.load(Relaxed) {
            NONE => None,
            us => Some(Duration::from_micros(us)),
        };
        (read(&self.baseline_us), read(&self.estimate_us))
    }
}

/// A duration for an atomic of microseconds (`NONE` for none).
fn micros(duration: Option<Duration>) -> u64 {
    duration.map_or(NONE, |d| {
        u64::try_from(d.as_micros())
            .unwrap_or(NONE - 1)
            .min(NONE - 1)
    })
}

/// Lets the next window close, however this close ends.
struct Reopen<'a>(&'a AtomicBool);

impl Drop for Reopen<'_> {
    fn drop(&mut self) {
        self.0.store(false, std::sync::atomic::Ordering::Release);
    }
}

impl fmt::Debug for WindowControl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (baseline, estimate) = self.measured();
        f.debug_struct("WindowControl")
            .field("bounds", &self.settings.bounds())
            .field("windows", &self.windows)
            .field("baseline", &baseline)
            .field("estimate", &estimate)
            .finish_non_exhaustive()
    }
}

/// Each limit an [`Adaptive`] is given to gets a controller of its own.
impl MakeControl for Adaptive {
    fn bounds(&self) -> RangeInclusive<usize> {
        Adaptive::bounds(self)
    }

    fn make(&self, limit: Weak<dyn Resize>, capacity: usize) -> Arc<dyn Control> {
        Arc::new(WindowControl::new(self, limit, capacity))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, AtomicUsize};

    use super::*;
    use crate::attributes::Outcome;

    /// Keeps every sample, and names the capacity it is told to.
    #[derive(Clone)]
    struct Recorder {
        samples: Arc<Mutex<Vec<Sample>>>,
        next: Arc<AtomicUsize>,
    }

    impl Algorithm for Recorder {
        fn update(&mut self, sample: &Sample) -> usize {
            self.samples.lock().unwrap().push(sample.clone());
            match self.next.load(Relaxed) {
                0 => sample.capacity,
                next => next,
            }
        }
    }

    struct Fixed(AtomicUsize);

    impl Resize for Fixed {
        fn capacity(&self) -> usize {
            self.0.load(Relaxed)
        }

        fn resize(&self, capacity: usize) {
            self.0.store(capacity, Relaxed);
        }
    }

    struct Harness {
        controller: WindowControl,
        limit: Arc<Fixed>,
        samples: Arc<Mutex<Vec<Sample>>>,
        next: Arc<AtomicUsize>,
        start: Instant,
    }

    impl Harness {
        fn new(capacity: usize) -> Self {
            let (samples, next) = (Arc::default(), Arc::new(AtomicUsize::new(0)));
            let recorder = Recorder {
                samples: Arc::clone(&samples),
                next: Arc::clone(&next),
            };
            let limit = Arc::new(Fixed(AtomicUsize::new(capacity)));
            let weak: Weak<dyn Resize> = Arc::downgrade(&limit) as Weak<dyn Resize>;
            let adaptive = Adaptive::new(recorder, 1..=100);
            let controller = WindowControl::new(&adaptive, weak, capacity);
            Self {
                controller,
                limit,
                samples,
                next,
                start: Instant::now(),
            }
        }

        /// An operation admitted at `admitted` ms ended `outcome` at `at` ms, with `in_flight`.
        fn end(&self, outcome: Outcome, admitted: u64, at: u64, in_flight: usize) {
            let ms = Duration::from_millis;
            let ended = Ended::new(outcome, ms(at - admitted), Some(self.start + ms(at)));
            self.controller.ended(&ended, in_flight);
        }

        fn samples(&self) -> Vec<Sample> {
            std::mem::take(&mut self.samples.lock().unwrap())
        }
    }

    #[test]
    fn a_round_trip_measures_the_operations_admitted_after_it_opened() {
        let harness = Harness::new(2);
        // The first window: everything is its own; it closes at 2 ends.
        harness.end(Outcome::Ok, 0, 100, 2);
        harness.end(Outcome::Ok, 0, 110, 2);
        assert_eq!(harness.samples().len(), 1);
        // Opened at 110 ms: an operation admitted before ends slow, and is not measured.
        harness.end(Outcome::Ok, 100, 400, 2);
        assert!(harness.samples().is_empty());
        harness.end(Outcome::Ok, 150, 250, 2);
        harness.end(Outcome::Ok, 160, 260, 2);
        let samples = harness.samples();
        assert_eq!(samples.len(), 1);
        let sample = &samples[0];
        assert_eq!(sample.ended, 2);
        assert_eq!(sample.mean_run_time, Some(Duration::from_millis(100)));
        assert!(sample.round_trip);
    }

    #[test]
    fn a_failure_admitted_before_a_decrease_is_no_news_however_late() {
        let harness = Harness::new(4);
        for at in [100, 101, 102, 103] {
            harness.end(Outcome::Ok, 0, at, 4);
        }
        assert_eq!(harness.samples().len(), 1, "a round trip of 100 ms");
        // A failure: news, closes at once; the algorithm lowers the capacity to 3.
        harness.next.store(3, Relaxed);
        harness.end(Outcome::Error, 100, 150, 4);
        let samples = harness.samples();
        assert_eq!((samples[0].congested, samples[0].round_trip), (1, false));
        assert_eq!(harness.limit.capacity(), 3);
        harness.next.store(0, Relaxed);
        // Another, admitted before the decrease: stale. It closes the window (for the
        // algorithm to see), not congested.
        harness.end(Outcome::Error, 120, 200, 3);
        let samples = harness.samples();
        assert_eq!((samples[0].congested, samples[0].stale_congested), (0, 1));
        // However long after the decrease it fails (a judge of a second, given up after three,
        // beside verifies of 100 ms): it ran from before it.
        harness.end(Outcome::Timeout, 140, 3140, 3);
        assert_eq!(harness.samples()[0].stale_congested, 1);
        // One admitted after the decrease fails: the decrease was not enough.
        harness.end(Outcome::Timeout, 151, 3151, 3);
        assert_eq!(harness.samples()[0].congested, 1);
    }

    #[test]
    fn operations_from_before_a_window_still_running_after_it_are_overdue() {
        let harness = Harness::new(4);
        // 4 places: one holds an operation that never answers; the other 3 take 100 ms each,
        // their next admitted 1 ms after each end (the limit is full, so each place is taken
        // again at once).
        let mut ends = Vec::new();
        for slot in 0..3u64 {
            let mut admitted = slot;
            while admitted < 1000 {
                ends.push((admitted, admitted + 100));
                admitted += 101;
            }
        }
        ends.sort_by_key(|&(_, at)| at);
        for (admitted, at) in ends {
            harness.end(Outcome::Ok, admitted, at, 4);
        }
        let samples = harness.samples();
        assert!(samples.len() >= 3, "{samples:?}");
        for sample in &samples[1..] {
            assert!(sample.round_trip);
            assert_eq!(sample.overdue, 1, "{sample:?}");
        }
    }

    /// A limit that lets its controller hear one in `one_in` operations: every `one_in`-th.
    struct Sampled {
        capacity: AtomicUsize,
        one_in: AtomicU32,
        admitted: AtomicU32,
    }

    impl Resize for Sampled {
        fn capacity(&self) -> usize {
            self.capacity.load(Relaxed)
        }

        fn resize(&self, capacity: usize) {
            self.capacity.store(capacity, Relaxed);
        }

        fn hear_one_in(&self, one_in: u32) -> u32 {
            self.one_in.store(one_in, Relaxed);
            one_in
        }
    }

    impl Sampled {
        fn hears_next(&self) -> bool {
            let admitted = self.admitted.fetch_add(1, Relaxed);
            admitted % self.one_in.load(Relaxed).max(1) == 0
        }
    }

    #[test]
    fn a_busy_limit_is_heard_in_samples_that_add_up_to_its_ends() {
        let samples = Arc::new(Mutex::new(Vec::new()));
        let recorder = Recorder {
            samples: Arc::clone(&samples),
            next: Arc::new(AtomicUsize::new(0)),
        };
        let limit = Arc::new(Sampled {
            capacity: AtomicUsize::new(80),
            one_in: AtomicU32::new(1),
            admitted: AtomicU32::new(0),
        });
        let weak: Weak<dyn Resize> = Arc::downgrade(&limit) as Weak<dyn Resize>;
        let controller = WindowControl::new(&Adaptive::new(recorder, 1..=100), weak, 80);
        let start = Instant::now();
        // An end every 1.4 us (714 a millisecond), each after 80 us, 80 in flight, for 42 ms.
        let us = Duration::from_micros;
        let (operations, mut heard_late) = (30_000u64, 0u64);
        for i in 0..operations {
            if !limit.hears_next() {
                continue;
            }
            heard_late += u64::from(i >= operations / 2);
            let at = start + us(1_000) + Duration::from_nanos(1_400 * i);
            controller.ended(&Ended::new(Outcome::Ok, us(80), Some(at)), 80);
        }
        let samples = std::mem::take(&mut *samples.lock().unwrap());
        // A window closes on its count only once it is 2 ms old: about 21 of them, not one
        // per 80 ends.
        assert!(samples.len() <= 23, "{} windows", samples.len());
        // 1428 ends in a shortest window: one in 32 heard (about 45 of them a window).
        assert_eq!(limit.one_in.load(Relaxed), 32);
        let share = heard_late as f64 / (operations / 2) as f64;
        assert!(
            (0.024..=0.04).contains(&share),
            "heard {share:.3} of the operations"
        );
        let late: Vec<&Sample> = samples.iter().skip(samples.len() / 2).collect();
        for sample in &late {
            assert_eq!(sample.mean_run_time, Some(us(80)), "{sample:?}");
            assert_eq!(sample.in_flight, 80.0);
            assert_eq!(sample.overdue, 0, "not counted from a sample");
            assert_eq!(sample.ended % 32, 0, "scaled: {sample:?}");
        }
        // Scaled back up, the windows' own ends are about what ran in them (less the
        // operations admitted before each opened: 80 us of each millisecond or so).
        let own: u64 = late.iter().map(|sample| sample.ended).sum();
        let elapsed = late.iter().map(|sample| sample.elapsed).sum::<Duration>();
        let ran = elapsed.as_nanos() as f64 / 1_400.0;
        assert!(
            (0.8..=1.1).contains(&(own as f64 / ran)),
            "{own} of {ran} ends"
        );

        // Idle for 50 ms, then as busy again: the window open through the idle spell does not
        // read as a slow one (it halves the scale at most, for one window).
        let busy_from = start + us(51_000) + Duration::from_nanos(1_400 * operations);
        let mut lowest = u32::MAX;
        for i in 0..10_000 {
            if limit.hears_next() {
                let at = busy_from + Duration::from_nanos(1_400 * i);
                controller.ended(&Ended::new(Outcome::Ok, us(80), Some(at)), 80);
                lowest = lowest.min(limit.one_in.load(Relaxed));
            }
        }
        assert!(lowest >= 16, "one in {lowest} after an idle spell");

        // The rate falls to an end a millisecond: within a few windows it hears every one.
        let slow_from = busy_from + Duration::from_nanos(1_400 * 10_000);
        for i in 1..=300 {
            if limit.hears_next() {
                let at = slow_from + Duration::from_millis(i);
                controller.ended(&Ended::new(Outcome::Ok, us(80), Some(at)), 1);
            }
        }
        assert_eq!(limit.one_in.load(Relaxed), 1, "hears every one again");
    }

    #[test]
    fn fixed_windows_count_every_end() {
        let limit = Arc::new(Fixed(AtomicUsize::new(2)));
        let samples = Arc::new(Mutex::new(Vec::new()));
        let recorder = Recorder {
            samples: Arc::clone(&samples),
            next: Arc::new(AtomicUsize::new(0)),
        };
        let adaptive = Adaptive::new(recorder, 1..=8).window(1, Duration::from_secs(3600));
        let weak: Weak<dyn Resize> = Arc::downgrade(&limit) as Weak<dyn Resize>;
        let controller = WindowControl::new(&adaptive, weak, 2);
        let start = Instant::now();
        let ms = Duration::from_millis;
        for at in 1..=4 {
            let ended = Ended::new(Outcome::Ok, ms(1000), Some(start + ms(1000 + at)));
            controller.ended(&ended, 2);
        }
        let samples = samples.lock().unwrap();
        assert_eq!(samples.len(), 1, "2 × capacity ends, admitted whenever");
        assert_eq!((samples[0].ended, samples[0].overdue), (4, 0));
    }
}
