//! [`Controller`]: which window each end of an adaptive limit's operations belongs to, when a
//! window closes, and the close that runs the algorithm once per window.
//!
//! A window lasts one round trip: it measures the operations admitted after it opened (an
//! operation's admission is its end less its run time, so nothing is tracked while it runs),
//! which ran at the capacity it opened with, and closes once as many of them as the capacity
//! have ended, or at the first sign of congestion. A failure of an operation admitted before the
//! last decrease, within a round trip of it, is not news: that decrease already answered it, so
//! it does not count as congestion (it still closes the window, for the algorithm to see).

use std::fmt;
use std::ops::RangeInclusive;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use tokio::time::Instant;

use super::algorithm::{Algorithm, Sample};
use super::config::{Adaptive, Windows};
use super::window::{Counted, Running, Totals, Window, NONE, WINDOW_CAP};
use crate::attributes::Outcome;
use crate::guard::guarded;
use crate::limit::{Control, Ended, MakeControl, Resize};

/// One limit's controller: the window that operations add to, and the algorithm that reads it
/// when it closes.
pub(super) struct Controller {
    window: Window,
    /// When the current window opened, in nanoseconds (see [`Controller::nanos`]); 0 for the
    /// first window, which every operation belongs to.
    opened: AtomicU64,
    /// When the capacity was last lowered, likewise; 0 for never.
    decreased: AtomicU64,
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
    min: usize,
    max: usize,
    windows: Windows,
    interval_ns: u64,
    tolerance: f64,
}

/// One end, as the limit reports it.
struct End {
    outcome: Outcome,
    ran: Duration,
    /// When it ended, in nanoseconds; `None` without a clock.
    at: Option<u64>,
    in_flight: usize,
}

impl Controller {
    /// The controller `adaptive` describes, for `limit`, which starts at `capacity`.
    pub(super) fn new(adaptive: &Adaptive, limit: Weak<dyn Resize>, capacity: usize) -> Self {
        let controller = Self {
            window: Window::new(),
            opened: AtomicU64::new(0),
            decreased: AtomicU64::new(0),
            round_trip_ns: AtomicU64::new(NONE),
            // The first window's places were taken at once, with no window closing before it.
            resized: AtomicU64::new((capacity as u64).saturating_sub(1)),
            due: AtomicU64::new(0),
            tolerated: AtomicU64::new(0),
            turnover: AtomicU64::new(0),
            closing: AtomicBool::new(false),
            epoch: OnceLock::new(),
            algorithm: Mutex::new((adaptive.make)()),
            baseline_us: AtomicU64::new(NONE),
            estimate_us: AtomicU64::new(NONE),
            limit,
            min: adaptive.min,
            max: adaptive.max,
            windows: adaptive.windows,
            interval_ns: u64::try_from(adaptive.interval.as_nanos()).unwrap_or(u64::MAX),
            tolerance: adaptive.tolerance,
        };
        controller.open(capacity);
        controller
    }

    fn is_round_trip(&self) -> bool {
        matches!(self.windows, Windows::RoundTrip { .. })
    }

    /// Sets when the next window closes, at `capacity`.
    fn open(&self, capacity: usize) {
        let due = match self.windows {
            // A turnover of operations admitted in the window: the first of them end one run
            // time after it opened, the rest within about one more. (Not fewer: the first to
            // end are the fastest, and a server that took a burst of them served the first few
            // at a lower load than the last.)
            Windows::RoundTrip { operations } => operations.max(capacity),
            Windows::Fixed { operations } => operations.max(capacity.saturating_mul(2)),
        };
        let count = |n: usize| u64::try_from(n).unwrap_or(WINDOW_CAP).min(WINDOW_CAP);
        let due = count(due);
        self.due.store(due, Relaxed);
        self.tolerated
            .store((self.tolerance * due as f64) as u64, Relaxed);
        self.turnover.store(count(capacity.max(1)), Relaxed);
    }

    /// Whether a window that adds up to `running`, `age` old in nanoseconds (if known), is due
    /// to close.
    #[inline]
    fn is_due(&self, running: Running, age: Option<u64>) -> bool {
        let tolerated = self.tolerated.load(Relaxed);
        if running.congested > tolerated || running.ended >= self.due.load(Relaxed) {
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
                    || (running.ended >= 1 && age >= self.interval_ns)
                    || (running.ended >= self.due.load(Relaxed).div_ceil(2)
                        && age > round_trip.saturating_mul(2))
            }
            Windows::Fixed { .. } => {
                age >= self.interval_ns && running.ended >= self.turnover.load(Relaxed)
            }
        }
    }

    /// How the window counts `end`.
    #[inline]
    fn count(&self, end: &End, opened: u64) -> Counted {
        let congestion = matches!(
            end.outcome,
            Outcome::Error | Outcome::Timeout | Outcome::Crashed
        );
        let ran = u64::try_from(end.ran.as_nanos()).unwrap_or(u64::MAX);
        // When it was admitted and ended; without a clock, it belongs to every window.
        let times = end.at.map(|at| (at.saturating_sub(ran), at));
        // Whether it was admitted after `from` (0 being before anything), and so ran at what
        // was decided then. Not at the same instant: at that instant the operations of a
        // server that answered a burst at once are taken in order, the first at a lower load.
        let since = |from: u64| from == 0 || times.is_none_or(|(admitted, _)| admitted > from);
        // A failure of an operation admitted before the last decrease, within a round trip of
        // it (twice the last one's run time), was answered by it. Later, the decrease had its
        // round trip to take effect, and failures still coming say it was not enough.
        let decreased = self.decreased.load(Relaxed);
        let shadow = decreased.saturating_add(self.round_trip_ns.load(Relaxed).saturating_mul(2));
        let news = congestion && (since(decreased) || times.is_some_and(|(_, at)| at > shadow));
        Counted {
            after: times.is_none_or(|(_, at)| at > opened),
            own: !self.is_round_trip() || since(opened),
            ok: end.outcome == Outcome::Ok,
            news,
            stale: congestion && !news,
        }
    }

    /// An admitted operation ended; closes the window if this end completes it.
    #[inline]
    fn end(&self, end: End) {
        let opened = self.opened.load(Relaxed);
        let counted = self.count(&end, opened);
        let running = self.window.add(counted, end.ran, end.in_flight);
        let age = end.at.map(|at| at.saturating_sub(opened));
        if self.is_due(running, age) {
            self.close(end.at, end.in_flight);
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
        if !self.is_due(self.window.running(), age) {
            return;
        }
        let totals = self.window.take();
        if let Some(at) = at {
            self.opened.store(at, Relaxed);
        }
        if let Some(mean) = totals.mean_run_time() {
            let ns = u64::try_from(mean.as_nanos()).unwrap_or(NONE - 1);
            self.round_trip_ns.store(ns, Relaxed);
        }
        let sample = self.sample(&totals, capacity, in_flight, age);
        let mut algorithm = self.algorithm.lock().unwrap_or_else(|p| p.into_inner());
        let next = guarded(|| algorithm.update(&sample)).unwrap_or(capacity);
        let next = next.clamp(self.min, self.max);
        self.resized
            .store((next as i64).wrapping_sub(capacity as i64) as u64, Relaxed);
        if next != capacity {
            if let (true, Some(at)) = (next < capacity, at) {
                self.decreased.store(at, Relaxed);
            }
            limit.resize(next);
        }
        self.open(next);
        let (baseline, estimate) =
            guarded(|| (algorithm.baseline(), algorithm.estimate())).unwrap_or_default();
        self.baseline_us.store(micros(baseline), Relaxed);
        self.estimate_us.store(micros(estimate), Relaxed);
    }

    /// What the window that adds up to `totals` showed, closed `age` after it opened by an end
    /// that saw `in_flight` operations in flight, at `capacity`.
    fn sample(
        &self,
        totals: &Totals,
        capacity: usize,
        in_flight: usize,
        age: Option<u64>,
    ) -> Sample {
        let tolerated = self.tolerated.load(Relaxed);
        let round_trip =
            totals.congested <= tolerated && (!self.is_round_trip() || totals.stale <= tolerated);
        // The operations admitted before the window and still running. While the limit is full,
        // each end's place is taken again at once, so the window's own operations are one for
        // each end since it opened (the last window's closing end included, whose place was
        // taken as this one opened; not this one's, not yet), plus the places the resize added
        // (less those it took out); those that ended are not running, and what else runs now
        // (the closing end aside) is from before.
        let resized = self.resized.load(Relaxed) as i64;
        let own_running = totals.after as i64 + resized - totals.ended as i64;
        let overdue = (in_flight as i64 - 1 - own_running).max(0) as u64;
        let full = in_flight >= capacity;
        Sample {
            capacity,
            min_capacity: self.min,
            max_capacity: self.max,
            ended: totals.ended,
            congested: totals.congested,
            stale_congested: totals.stale,
            tolerance: self.tolerance,
            rejected: totals.rejected,
            mean_run_time: totals.mean_run_time(),
            min_run_time: totals.min_run_time(),
            run_time_deviation: totals.run_time_deviation(),
            peak_in_flight: totals.peak,
            in_flight: totals.mean_in_flight(),
            overdue: match self.is_round_trip() && round_trip && full {
                true => overdue,
                false => 0,
            },
            round_trip,
            elapsed: Duration::from_nanos(age.unwrap_or(0)),
        }
    }
}

impl Control for Controller {
    #[inline]
    fn ended(&self, ended: &Ended, in_flight: usize) {
        self.end(End {
            outcome: ended.outcome(),
            ran: ended.run_time(),
            at: ended.at().map(|at| self.nanos(at)),
            in_flight,
        });
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

impl fmt::Debug for Controller {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (baseline, estimate) = self.measured();
        f.debug_struct("Controller")
            .field("bounds", &(self.min..=self.max))
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
        Arc::new(Controller::new(self, limit, capacity))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use super::*;

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
        controller: Controller,
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
            let controller = Controller::new(&adaptive, weak, capacity);
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
    fn a_failure_admitted_before_a_decrease_is_no_news_for_a_round_trip() {
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
        // Another, admitted before the decrease, within a round trip of it: stale. It closes
        // the window (for the algorithm to see), not congested.
        harness.end(Outcome::Error, 120, 200, 3);
        let samples = harness.samples();
        assert_eq!((samples[0].congested, samples[0].stale_congested), (0, 1));
        // One admitted before the decrease but failing more than a round trip after it: the
        // decrease was not enough.
        harness.end(Outcome::Timeout, 140, 400, 3);
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
        let controller = Controller::new(&adaptive, weak, 2);
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
