//! A [`Limit`] that finds its own capacity: a controller that raises or lowers it from the run
//! times and outcomes of the operations it admits.
//!
//! A verifier pool that is CPU-bound should run about as many operations as there are cores; a
//! judge endpoint as many as it can serve before its latency climbs. Both figures change while
//! the server runs. Give a limit an [`Adaptive`] controller and it looks for them:
//!
//! ```
//! use tower_resources_operation::adaptive::{Adaptive, Gradient};
//! use tower_resources_operation::Limit;
//!
//! // Starts at 1 and goes where the run times say, between 1 and 64.
//! let verifiers = Limit::builder(1)
//!     .name("verifiers")
//!     .adaptive(Adaptive::new(Gradient::default(), 1..=64))
//!     .build();
//! assert_eq!(verifiers.capacity(), 1);
//! ```
//!
//! # How it decides
//!
//! Each operation that ends feeds the controller its run time and whether its outcome is a sign
//! of congestion (`timeout`, `error`, `crashed`; not `ok`, nor `cancelled`, whose caller went
//! away). The controller adds them to the current *window*, which closes:
//!
//! - once `max(operations, 2 × capacity)` operations have ended in it;
//! - once it is `interval` old and `capacity` operations have ended in it (one turnover of the
//!   limit: the run times it saw then reflect its capacity, however slow the operations);
//! - at once when its signs of congestion pass the tolerance (by default, at the first one), so
//!   that a probe above what the server takes costs one failure rather than a window of them.
//!
//! (See [`Adaptive::window`] and [`Adaptive::tolerance`].) The [`Algorithm`] then reads what the
//! window saw (a [`Sample`]) and names the next capacity, which the controller clamps to
//! `[min, max]` and sets with [`Limit::set_capacity`]. Lowering revokes nobody: running
//! operations finish, and the places above the new capacity are taken out as they do.
//!
//! - [`Aimd`]: additive increase on a window without congestion in which the limit was used,
//!   multiplicative decrease on congestion (or on a run time above a threshold you give). It
//!   finds a server that fails, times out or answers 503 above some load.
//! - [`Gradient`]: compares the recent run time with a baseline (the run time at low load) and
//!   shrinks the limit by their ratio when the run time climbs past a tolerance; grows by a
//!   headroom of `√capacity` while it does not. It finds a server that slows down above some
//!   load, a CPU-bound pool among them, without any failure.
//! - [`Algorithm`]: your own.
//!
//! The limit's own rejections (a full queue, a queue timeout) are counted in the sample, but the
//! built-in algorithms do not shrink for them: they say the limit is too small for the demand,
//! not that what it guards is overloaded, and shrinking would turn more away. A rejection from
//! *downstream* (a `503`, RESOURCE_EXHAUSTED) reaches the controller as the `error` the
//! classifier makes of it.
//!
//! # Every form
//!
//! A controller belongs to its limit: the layer, [`resources_operation`](crate::resources_operation),
//! several routes' layers on clones of one limit, and a per-request layer's named limits all
//! feed the same one. It learns even with metrics [disabled](crate::OperationMetrics::disabled):
//! an adaptive limit's operations then record into the controller alone.
//!
//! # What it decided, in the metrics
//!
//! `gym.resources.operation.limit` and, for a named limit, `gym.resources.limit.capacity`
//! follow the capacity it sets. A named adaptive limit also reports what its algorithm measured:
//! [`LIMIT_BASELINE_INSTRUMENT`](crate::metrics::LIMIT_BASELINE_INSTRUMENT) (the run time it
//! takes as normal) and [`LIMIT_ESTIMATE_INSTRUMENT`](crate::metrics::LIMIT_ESTIMATE_INSTRUMENT)
//! (the recent run time it compares with it), in milliseconds, with the limit's name as their
//! only attribute.
//!
//! # Cost
//!
//! No lock on an operation's path: an admission adds one to an atomic, an end adds to three in
//! the window (and reads the clock the operation reads anyway). The thread whose operation
//! closes a window wins an atomic flag and runs the algorithm, once per window. A limit without
//! a controller pays one `Option` check per admission and per end.

mod aimd;
mod gradient;

use std::fmt;
use std::ops::RangeInclusive;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use tokio::time::Instant;

pub use aimd::Aimd;
pub use gradient::Gradient;

use crate::guard::guarded;
use crate::Outcome;

#[cfg(doc)]
use crate::Limit;

/// What one window of operations showed: what an [`Algorithm`] decides from.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct Sample {
    /// The limit's capacity when the window closed.
    pub capacity: usize,
    /// The lowest capacity the controller may set.
    pub min_capacity: usize,
    /// The highest capacity the controller may set.
    pub max_capacity: usize,
    /// Operations that ended in the window, whatever their outcome.
    pub ended: u64,
    /// Of those, the ones that ended `timeout`, `error` or `crashed`: signs of congestion.
    pub congested: u64,
    /// The share of `ended` that may be signs of congestion before the window counts as
    /// congested ([`Adaptive::tolerance`]).
    pub tolerance: f64,
    /// Operations the limit turned away during the window (a full queue, a queue timeout).
    pub rejected: u64,
    /// The mean run time of the operations that ended `ok`; `None` if none did.
    pub mean_run_time: Option<Duration>,
    /// The shortest run time of an operation that ended `ok`.
    pub min_run_time: Option<Duration>,
    /// The most operations of the limit that ran at once during the window, as their ends saw
    /// it: whether the limit was used, or the load stayed below it.
    pub peak_in_flight: usize,
    /// How long the window lasted (0 if the clock could not be read).
    pub elapsed: Duration,
}

impl Sample {
    /// Whether the load reached at least half the capacity: an algorithm that grows the limit
    /// only then does not grow a limit that nothing uses.
    pub fn is_used(&self) -> bool {
        self.peak_in_flight.saturating_mul(2) >= self.capacity
    }

    /// Whether the window's signs of congestion passed the tolerance: what the built-in
    /// algorithms back off for.
    pub fn is_congested(&self) -> bool {
        self.congested as f64 > self.tolerance * self.ended as f64
    }
}

/// How a controller decides the next capacity of its limit, once per window.
///
/// ```
/// use tower_resources_operation::adaptive::{Adaptive, Algorithm, Sample};
/// use tower_resources_operation::Limit;
///
/// /// One more while nothing fails, half as many when something does.
/// #[derive(Clone)]
/// struct Halving;
///
/// impl Algorithm for Halving {
///     fn update(&mut self, sample: &Sample) -> usize {
///         if sample.congested > 0 {
///             sample.capacity / 2
///         } else if sample.is_used() {
///             sample.capacity + 1
///         } else {
///             sample.capacity
///         }
///     }
/// }
///
/// let judges = Limit::builder(4).adaptive(Adaptive::new(Halving, 1..=32)).build();
/// # drop(judges);
/// ```
pub trait Algorithm: Send + 'static {
    /// The capacity for the next window, from what the last one showed. The controller clamps
    /// it to `[min, max]`. A panic keeps the capacity as it is.
    fn update(&mut self, sample: &Sample) -> usize;

    /// The run time this algorithm takes as normal (at low load), if it keeps one: reported as
    /// `gym.resources.limit.adaptive.baseline_ms`. Defaults to `None`.
    fn baseline(&self) -> Option<Duration> {
        None
    }

    /// The recent run time it compares with its baseline, if it keeps one: reported as
    /// `gym.resources.limit.adaptive.estimate_ms`. Defaults to `None`.
    fn estimate(&self) -> Option<Duration> {
        None
    }
}

/// The controller of an adaptive [`Limit`]: its algorithm, the bounds of its capacity, and
/// how long its windows are. Give it to [`LimitBuilder::adaptive`](crate::limit::LimitBuilder::adaptive).
///
/// Each limit built gets its own copy of the algorithm, in its initial state.
#[derive(Clone)]
pub struct Adaptive {
    make: Arc<dyn Fn() -> Box<dyn Algorithm> + Send + Sync>,
    algorithm: &'static str,
    min: usize,
    max: usize,
    operations: usize,
    interval: Duration,
    tolerance: f64,
}

impl Adaptive {
    /// A controller that runs `algorithm` and keeps the capacity within `bounds`.
    ///
    /// Start the limit at the bottom of the bounds: an algorithm that reacts to latency takes
    /// its baseline from the run times it sees at low load.
    ///
    /// # Panics
    ///
    /// If the bounds are empty or start at 0 (a limit of 0 admits nothing, so it would never
    /// learn that it could admit more).
    #[track_caller]
    pub fn new<A: Algorithm + Clone + Sync>(algorithm: A, bounds: RangeInclusive<usize>) -> Self {
        let (min, max) = bounds.into_inner();
        assert!(
            min >= 1 && min <= max,
            "tower-resources-operation: an adaptive limit's bounds must be a non-empty range \
             starting at 1 or more; got {min}..={max}"
        );
        Self {
            make: Arc::new(move || Box::new(algorithm.clone())),
            algorithm: std::any::type_name::<A>(),
            min,
            max,
            operations: 16,
            interval: Duration::from_secs(1),
            tolerance: 0.0,
        }
    }

    /// How long a window is: it closes once `max(operations, 2 × capacity)` operations have
    /// ended in it, or once it is `interval` old and `capacity` operations have ended in it.
    /// Defaults to 16 operations and 1 second.
    ///
    /// More operations per window smooth out noisy run times; a shorter interval follows slow
    /// operations sooner.
    ///
    /// # Panics
    ///
    /// If `operations` is 0.
    #[track_caller]
    pub fn window(mut self, operations: usize, interval: Duration) -> Self {
        assert!(operations > 0, "a window needs at least one operation");
        self.operations = operations;
        self.interval = interval;
        self
    }

    /// The share of a window's operations that may be signs of congestion before the window
    /// counts as congested, in `[0, 1]`: for a server that fails some requests whatever its
    /// load. A window closes as soon as it passes it. Defaults to 0: the first `timeout`,
    /// `error` or `crashed` closes the window, congested.
    pub fn tolerance(mut self, share: f64) -> Self {
        self.tolerance = share.clamp(0.0, 1.0);
        self
    }

    /// The bounds of the capacity.
    pub fn bounds(&self) -> RangeInclusive<usize> {
        self.min..=self.max
    }

    /// The capacity a limit built with `capacity` starts at: within the bounds.
    pub(crate) fn start(&self, capacity: usize) -> usize {
        capacity.clamp(self.min, self.max)
    }
}

impl fmt::Debug for Adaptive {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Adaptive")
            .field("algorithm", &self.algorithm)
            .field("bounds", &self.bounds())
            .field("operations", &self.operations)
            .field("interval", &self.interval)
            .field("tolerance", &self.tolerance)
            .finish()
    }
}

/// What a controller changes: its limit.
pub(crate) trait Resize: Send + Sync {
    /// The capacity now.
    fn capacity(&self) -> usize;
    /// Sets the capacity (lowering revokes nobody).
    fn resize(&self, capacity: usize);
}

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
pub(crate) struct Controller {
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

/// What the operations of the current window add up to, with the count of operations in
/// flight: what every operation writes, on a cache line of its own.
#[derive(Debug)]
#[repr(align(64))]
struct Window {
    /// Operations of the limit admitted and not yet ended, as the controller saw them.
    in_flight: AtomicUsize,
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
    pub(crate) fn new(adaptive: &Adaptive, limit: Weak<dyn Resize>, capacity: usize) -> Self {
        let controller = Self {
            window: Window {
                in_flight: AtomicUsize::new(0),
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

    /// One more operation of the limit holds a place.
    #[inline]
    pub(crate) fn admitted(&self) {
        self.window.in_flight.fetch_add(1, Relaxed);
    }

    /// The limit turned an operation away.
    pub(crate) fn rejected(&self) {
        self.window.rejected.fetch_add(1, Relaxed);
    }

    /// An admitted operation ended `outcome` after running `ran`, at `now`; closes the window
    /// if this end completes it.
    #[inline]
    pub(crate) fn ended(&self, outcome: Outcome, ran: Duration, now: Option<Instant>) {
        let window = &self.window;
        let running = window.in_flight.fetch_sub(1, Relaxed);
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
        let peak = window.peak.swap(window.in_flight.load(Relaxed), Relaxed);
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

    /// What the algorithm measured: its baseline and its estimate of the run time.
    pub(crate) fn measured(&self) -> (Option<Duration>, Option<Duration>) {
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
            .field("in_flight", &self.window.in_flight.load(Relaxed))
            .field("baseline", &baseline)
            .field("estimate", &estimate)
            .finish_non_exhaustive()
    }
}

/// An exponentially weighted moving average of run times, in seconds.
#[derive(Clone, Copy, Debug, Default)]
struct Average {
    value: Option<f64>,
}

impl Average {
    /// Moves `weight` of the way toward `sample` (all the way for the first one).
    fn add(&mut self, sample: f64, weight: f64) -> f64 {
        let next = match self.value {
            None => sample,
            Some(value) => value + weight * (sample - value),
        };
        self.value = Some(next);
        next
    }

    fn duration(self) -> Option<Duration> {
        self.value.map(Duration::from_secs_f64)
    }
}

/// The capacity an algorithm works from: its own fractional estimate while the limit still has
/// it, or the limit's capacity once something else changed it (a clamp, `set_capacity`).
fn working(estimate: &mut Option<f64>, capacity: usize) -> f64 {
    let capacity_f = capacity as f64;
    match *estimate {
        Some(value) if (value.round() - capacity_f).abs() < 1.0 => value,
        _ => {
            *estimate = Some(capacity_f);
            capacity_f
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) fn sample(capacity: usize) -> Sample {
        Sample {
            capacity,
            min_capacity: 1,
            max_capacity: 100,
            ended: 20,
            congested: 0,
            tolerance: 0.0,
            rejected: 0,
            mean_run_time: Some(Duration::from_millis(100)),
            min_run_time: Some(Duration::from_millis(90)),
            peak_in_flight: capacity,
            elapsed: Duration::from_secs(1),
        }
    }

    #[test]
    fn a_sample_is_used_from_half_its_capacity() {
        let mut s = sample(10);
        s.peak_in_flight = 5;
        assert!(s.is_used());
        s.peak_in_flight = 4;
        assert!(!s.is_used());
    }

    #[test]
    #[should_panic(expected = "non-empty range")]
    fn bounds_starting_at_zero_are_refused() {
        let _ = Adaptive::new(Aimd::default(), 0..=4);
    }
}
