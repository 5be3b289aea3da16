//! [`Controller`]: the window every operation of an adaptive limit adds to, lock-free, and the
//! close that runs the algorithm once per window.

use std::fmt;
use std::ops::RangeInclusive;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use tokio::time::Instant;

use super::algorithm::{Algorithm, Sample};
use super::config::Adaptive;
use crate::attributes::Outcome;
use crate::guard::guarded;
use crate::limit::{Control, Ended, MakeControl, Resize};

/// Operations a window counts at most, so that its three counts fit one word.
const WINDOW_CAP: u64 = 1 << 20;
const COUNT_BITS: u32 = 21;
const COUNT_MASK: u64 = (1 << COUNT_BITS) - 1;
/// One more ended operation, in a window's tally.
const ENDED: u64 = 1;
/// One more sign of congestion.
const CONGESTED: u64 = 1 << COUNT_BITS;
/// One more `ok` operation, whose run time is summed.
const TIMED: u64 = 1 << (2 * COUNT_BITS);
// A window's three counts fit one word, with as much again for the ends that race its close.
const _: () = assert!(3 * COUNT_BITS <= 64 && WINDOW_CAP < COUNT_MASK);
/// An atomic duration's "none".
const NONE: u64 = u64::MAX;

/// One limit's controller: the window that operations add to, and the algorithm that reads it
/// when it closes.
pub(super) struct Controller {
    window: Window,
    /// When the current window opened, in nanoseconds since `epoch`.
    opened: AtomicU64,
    /// Ends after which the current window closes.
    due: AtomicU64,
    /// Signs of congestion the current window tolerates.
    tolerated: AtomicU64,
    /// Ends after which the current window closes once it is `interval` old: the capacity.
    turnover: AtomicU64,
    /// Held by the one thread closing a window.
    closing: AtomicBool,
    /// The first time an operation ended: the origin of `opened`.
    epoch: OnceLock<Instant>,
    /// Locked only by the thread holding `closing`.
    algorithm: Mutex<Box<dyn Algorithm>>,
    /// What the algorithm measured, in microseconds, for the gauges (`NONE` for nothing).
    baseline_us: AtomicU64,
    estimate_us: AtomicU64,
    limit: Weak<dyn Resize>,
    min: usize,
    max: usize,
    operations: usize,
    interval_ns: u64,
    tolerance: f64,
}

/// What the operations of the current window add up to: what every operation writes, on a
/// cache line of its own.
#[derive(Debug)]
#[repr(align(64))]
struct Window {
    /// Ended, congested and timed counts, `COUNT_BITS` each.
    tally: AtomicU64,
    /// Sum of the run times of the timed (`ok`) operations, in microseconds.
    sum_us: AtomicU64,
    /// Shortest of them (`NONE` for none yet).
    min_us: AtomicU64,
    peak: AtomicUsize,
    rejected: AtomicU64,
}

impl Controller {
    /// The controller `adaptive` describes, for `limit`, which starts at `capacity`.
    pub(super) fn new(adaptive: &Adaptive, limit: Weak<dyn Resize>, capacity: usize) -> Self {
        let controller = Self {
            window: Window {
                tally: AtomicU64::new(0),
                sum_us: AtomicU64::new(0),
                min_us: AtomicU64::new(NONE),
                peak: AtomicUsize::new(0),
                rejected: AtomicU64::new(0),
            },
            opened: AtomicU64::new(0),
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
            operations: adaptive.operations,
            interval_ns: u64::try_from(adaptive.interval.as_nanos()).unwrap_or(u64::MAX),
            tolerance: adaptive.tolerance,
        };
        controller.open(capacity);
        controller
    }

    /// Sets when the next window closes, at `capacity`.
    fn open(&self, capacity: usize) {
        let count = |n: usize| u64::try_from(n).unwrap_or(WINDOW_CAP).min(WINDOW_CAP);
        let due = count(self.operations.max(capacity.saturating_mul(2)));
        self.due.store(due, Relaxed);
        self.tolerated
            .store((self.tolerance * due as f64) as u64, Relaxed);
        self.turnover.store(count(capacity.max(1)), Relaxed);
    }

    /// Whether a window of `tally` (its ended, congested and timed counts), `age` old in
    /// nanoseconds (if known), is due to close.
    #[inline]
    fn is_due(&self, tally: u64, age: Option<u64>) -> bool {
        let ended = tally & COUNT_MASK;
        let congested = (tally >> COUNT_BITS) & COUNT_MASK;
        ended >= self.due.load(Relaxed)
            || congested > self.tolerated.load(Relaxed)
            || (age.is_some_and(|age| age >= self.interval_ns)
                && ended >= self.turnover.load(Relaxed))
    }

    /// An admitted operation ended `outcome` after running `ran`, at `now`, with `running`
    /// operations in flight; closes the window if this end completes it.
    #[inline]
    fn end(&self, outcome: Outcome, ran: Duration, now: Option<Instant>, running: usize) {
        let window = &self.window;
        if running > window.peak.load(Relaxed) {
            window.peak.fetch_max(running, Relaxed);
        }
        let add = match outcome {
            Outcome::Ok => ENDED | TIMED,
            Outcome::Cancelled => ENDED,
            Outcome::Error | Outcome::Timeout | Outcome::Crashed => ENDED | CONGESTED,
        };
        let tally = window.tally.fetch_add(add, Relaxed) + add;
        if outcome == Outcome::Ok {
            let us = u64::try_from(ran.as_micros()).unwrap_or(NONE - 1);
            window.sum_us.fetch_add(us, Relaxed);
            if us < window.min_us.load(Relaxed) {
                window.min_us.fetch_min(us, Relaxed);
            }
        }
        let at = now.map(|now| self.nanos(now));
        let age = at.map(|at| at.saturating_sub(self.opened.load(Relaxed)));
        if self.is_due(tally, age) {
            self.close(at);
        }
    }

    /// `now`, in nanoseconds since the controller's first end.
    fn nanos(&self, now: Instant) -> u64 {
        let epoch = *self.epoch.get_or_init(|| now);
        u64::try_from(now.saturating_duration_since(epoch).as_nanos()).unwrap_or(u64::MAX)
    }

    /// Closes the window, if no other thread is closing it and it is still due: reads it,
    /// opens the next, runs the algorithm and sets the capacity it names.
    #[cold]
    #[inline(never)]
    fn close(&self, at: Option<u64>) {
        if self
            .closing
            .swap(true, std::sync::atomic::Ordering::Acquire)
        {
            return;
        }
        let _reopen = Reopen(&self.closing);
        let window = &self.window;
        let age = at.map(|at| at.saturating_sub(self.opened.load(Relaxed)));
        // Another thread may have closed it between this end and the flag.
        if !self.is_due(window.tally.load(Relaxed), age) {
            return;
        }
        // An end racing this may land its count in one window and its run time in the next:
        // a small error, once in a while, for no lock on the operations' path.
        let sum_us = window.sum_us.swap(0, Relaxed);
        let min_us = window.min_us.swap(NONE, Relaxed);
        let tally = window.tally.swap(0, Relaxed);
        let peak = window.peak.swap(0, Relaxed);
        let rejected = window.rejected.swap(0, Relaxed);
        if let Some(at) = at {
            self.opened.store(at, Relaxed);
        }
        let Some(limit) = self.limit.upgrade() else {
            return;
        };
        let capacity = limit.capacity();
        let timed = (tally >> (2 * COUNT_BITS)) & COUNT_MASK;
        let sample = Sample {
            capacity,
            min_capacity: self.min,
            max_capacity: self.max,
            ended: tally & COUNT_MASK,
            congested: (tally >> COUNT_BITS) & COUNT_MASK,
            tolerance: self.tolerance,
            rejected,
            mean_run_time: (timed > 0).then(|| Duration::from_micros(sum_us / timed)),
            min_run_time: (min_us != NONE).then(|| Duration::from_micros(min_us)),
            peak_in_flight: peak,
            elapsed: Duration::from_nanos(age.unwrap_or(0)),
        };
        let mut algorithm = self.algorithm.lock().unwrap_or_else(|p| p.into_inner());
        let next = guarded(|| algorithm.update(&sample)).unwrap_or(capacity);
        let next = next.clamp(self.min, self.max);
        if next != capacity {
            limit.resize(next);
        }
        self.open(next);
        let (baseline, estimate) =
            guarded(|| (algorithm.baseline(), algorithm.estimate())).unwrap_or_default();
        self.baseline_us.store(micros(baseline), Relaxed);
        self.estimate_us.store(micros(estimate), Relaxed);
    }
}

impl Control for Controller {
    #[inline]
    fn ended(&self, ended: &Ended, in_flight: usize) {
        self.end(ended.outcome(), ended.run_time(), ended.at(), in_flight);
    }

    fn rejected(&self) {
        self.window.rejected.fetch_add(1, Relaxed);
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
