//! An adaptive fleet limit's controller in one process ([`FleetControl`]): what its operations'
//! ends add to (a handful of relaxed atomics, nothing that reaches the store), and what the
//! process knows of the fleet's window and decisions. The background task flushes the counts
//! to the store every tick and, in the one process that holds the leader's lease, runs the
//! algorithm once per window of the fleet.

use std::fmt;
use std::ops::RangeInclusive;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;
use tower_resources_operation::adaptive::{Algorithm, Sample};
use tower_resources_operation::limit::Ended;
use tower_resources_operation::Outcome;

use super::books::next_id;

/// An atomic duration's "none".
const NONE: u64 = u64::MAX;

/// How an adaptive fleet limit decides, as the builder was told.
#[derive(Clone)]
pub(crate) struct AdaptiveSettings {
    pub(crate) make: Arc<dyn Fn() -> Box<dyn Algorithm> + Send + Sync>,
    pub(crate) algorithm: &'static str,
    pub(crate) min: usize,
    pub(crate) max: usize,
    pub(crate) tick: Duration,
}

impl AdaptiveSettings {
    #[track_caller]
    pub(crate) fn new<A: Algorithm + Clone + Sync>(
        algorithm: A,
        bounds: RangeInclusive<usize>,
    ) -> Self {
        let (min, max) = bounds.into_inner();
        assert!(
            min >= 1 && min <= max,
            "tower-resources-operation-redis: an adaptive limit's bounds must be a non-empty \
             range starting at 1 or more; got {min}..={max}"
        );
        Self {
            make: Arc::new(move || Box::new(algorithm.clone())),
            algorithm: std::any::type_name::<A>(),
            min,
            max,
            tick: Duration::from_millis(50),
        }
    }
}

impl fmt::Debug for AdaptiveSettings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Adaptive")
            .field("algorithm", &self.algorithm)
            .field("bounds", &(self.min..=self.max))
            .field("tick", &self.tick)
            .finish()
    }
}

/// What this process's operations added up to since the last tick.
#[derive(Debug)]
pub(crate) struct Tally {
    /// Of the operations admitted in the window this process knows of: ended, ended `ok`, the
    /// sum of their run times (µs), of their squares (µs² / 1024), the shortest (`NONE`).
    ended: AtomicU64,
    timed: AtomicU64,
    sum_us: AtomicU64,
    squares: AtomicU64,
    min_us: AtomicU64,
    /// Of every end: signs of congestion that are news, and those that are not.
    congested: AtomicU64,
    stale: AtomicU64,
    /// Operations turned away by the limit (a full queue).
    rejected: AtomicU64,
}

/// What a tick takes of the tally, and what the fleet's window adds up to.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Counts {
    pub(crate) ended: u64,
    pub(crate) timed: u64,
    pub(crate) sum_us: u64,
    pub(crate) squares: u64,
    pub(crate) min_us: Option<u64>,
    pub(crate) congested: u64,
    pub(crate) stale: u64,
    pub(crate) rejected: u64,
}

impl Tally {
    fn new() -> Self {
        Self {
            ended: AtomicU64::new(0),
            timed: AtomicU64::new(0),
            sum_us: AtomicU64::new(0),
            squares: AtomicU64::new(0),
            min_us: AtomicU64::new(NONE),
            congested: AtomicU64::new(0),
            stale: AtomicU64::new(0),
            rejected: AtomicU64::new(0),
        }
    }

    pub(crate) fn take(&self) -> Counts {
        Counts {
            ended: self.ended.swap(0, Relaxed),
            timed: self.timed.swap(0, Relaxed),
            sum_us: self.sum_us.swap(0, Relaxed),
            squares: self.squares.swap(0, Relaxed),
            min_us: match self.min_us.swap(NONE, Relaxed) {
                NONE => None,
                us => Some(us),
            },
            congested: self.congested.swap(0, Relaxed),
            stale: self.stale.swap(0, Relaxed),
            rejected: self.rejected.swap(0, Relaxed),
        }
    }
}

/// An adaptive fleet limit's controller in this process.
pub(crate) struct FleetControl {
    pub(crate) settings: AdaptiveSettings,
    /// This process's id as a candidate for the leader's lease.
    pub(crate) id: String,
    /// How long the leader's lease lasts without a tick that extends it.
    pub(crate) leader_ttl: Duration,
    pub(crate) tally: Tally,
    /// The fleet's window, as this process last heard (0 before it heard any).
    epoch: AtomicU64,
    /// The first window after the fleet's last decrease (0 for none), and when this process
    /// heard of it (ns since `origin`).
    decreased: AtomicU64,
    decreased_at: AtomicU64,
    /// The fleet's last round trip (mean run time), baseline and estimate, in µs (`NONE`).
    rtt_us: AtomicU64,
    baseline_us: AtomicU64,
    estimate_us: AtomicU64,
    /// Whether this process held the leader's lease at its last tick.
    pub(crate) leads: AtomicBool,
    /// Windows this process decided.
    pub(crate) decisions: AtomicU64,
    origin: Instant,
    /// Tick now: a first sign of congestion, or the leader hears that the window is due.
    pub(crate) doorbell: Notify,
}

impl FleetControl {
    pub(crate) fn new(
        settings: AdaptiveSettings,
        call_timeout: Duration,
        lease_ttl: Duration,
    ) -> Self {
        let leader_ttl = (call_timeout * 3).max(settings.tick * 10).min(lease_ttl);
        Self {
            settings,
            id: next_id(),
            leader_ttl,
            tally: Tally::new(),
            epoch: AtomicU64::new(0),
            decreased: AtomicU64::new(0),
            decreased_at: AtomicU64::new(0),
            rtt_us: AtomicU64::new(NONE),
            baseline_us: AtomicU64::new(NONE),
            estimate_us: AtomicU64::new(NONE),
            leads: AtomicBool::new(false),
            decisions: AtomicU64::new(0),
            origin: Instant::now(),
            doorbell: Notify::new(),
        }
    }

    /// The window an operation admitted now belongs to.
    #[inline]
    pub(crate) fn epoch(&self) -> u64 {
        self.epoch.load(Relaxed)
    }

    /// Whether this process decides the fleet's capacity, as of its last tick.
    pub(crate) fn leads(&self) -> bool {
        self.leads.load(Relaxed)
    }

    pub(crate) fn decisions(&self) -> u64 {
        self.decisions.load(Relaxed)
    }

    pub(crate) fn bounds(&self) -> RangeInclusive<usize> {
        self.settings.min..=self.settings.max
    }

    /// The fleet's baseline and estimate, as last heard.
    pub(crate) fn measured(&self) -> (Option<Duration>, Option<Duration>) {
        let read = |us: &AtomicU64| match us.load(Relaxed) {
            NONE => None,
            us => Some(Duration::from_micros(us)),
        };
        (read(&self.baseline_us), read(&self.estimate_us))
    }

    /// An operation admitted in window `admitted` ended: a few relaxed atomics, and the
    /// doorbell at the first sign of congestion that is news since the last tick.
    #[inline]
    pub(crate) fn ended(&self, admitted: u64, ended: &Ended) {
        let tally = &self.tally;
        let outcome = ended.outcome();
        if admitted == self.epoch.load(Relaxed) {
            tally.ended.fetch_add(1, Relaxed);
            if outcome == Outcome::Ok {
                let us = u64::try_from(ended.run_time().as_micros()).unwrap_or(NONE - 1);
                tally.timed.fetch_add(1, Relaxed);
                tally.sum_us.fetch_add(us, Relaxed);
                tally
                    .squares
                    .fetch_add(us.saturating_mul(us) >> 10, Relaxed);
                tally.min_us.fetch_min(us, Relaxed);
            }
        }
        if matches!(
            outcome,
            Outcome::Error | Outcome::Timeout | Outcome::Crashed
        ) {
            if self.is_news(admitted, ended) {
                if tally.congested.fetch_add(1, Relaxed) == 0 {
                    self.doorbell.notify_one();
                }
            } else {
                tally.stale.fetch_add(1, Relaxed);
            }
        }
    }

    /// Whether the failure of an operation admitted in window `admitted` is news: admitted
    /// after the fleet's last decrease, or failing more than two round trips after it (the
    /// decrease had its time to take effect, and was not enough).
    #[cold]
    fn is_news(&self, admitted: u64, ended: &Ended) -> bool {
        if admitted >= self.decreased.load(Relaxed) {
            return true;
        }
        let rtt_ns = match self.rtt_us.load(Relaxed) {
            NONE => return false,
            us => us.saturating_mul(1000),
        };
        let shadow = self
            .decreased_at
            .load(Relaxed)
            .saturating_add(rtt_ns.saturating_mul(2));
        ended.at().is_some_and(|at| self.nanos(at) > shadow)
    }

    fn nanos(&self, at: Instant) -> u64 {
        u64::try_from(at.saturating_duration_since(self.origin).as_nanos()).unwrap_or(u64::MAX)
    }

    /// The limit turned an operation away (a full queue).
    pub(crate) fn rejected(&self) {
        self.tally.rejected.fetch_add(1, Relaxed);
    }

    /// What Redis said of the fleet's window and its last decision.
    pub(crate) fn learn(&self, known: &Known) {
        self.epoch.store(known.epoch, Relaxed);
        if self.decreased.swap(known.decreased, Relaxed) != known.decreased {
            self.decreased_at.store(self.nanos(Instant::now()), Relaxed);
        }
        let store = |atomic: &AtomicU64, us: Option<u64>| {
            if let Some(us) = us {
                atomic.store(us, Relaxed);
            }
        };
        store(&self.rtt_us, known.rtt_us);
        self.baseline_us
            .store(known.baseline_us.unwrap_or(NONE), Relaxed);
        self.estimate_us
            .store(known.estimate_us.unwrap_or(NONE), Relaxed);
    }
}

impl fmt::Debug for FleetControl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (baseline, estimate) = self.measured();
        f.debug_struct("FleetControl")
            .field("settings", &self.settings)
            .field("leads", &self.leads())
            .field("epoch", &self.epoch())
            .field("baseline", &baseline)
            .field("estimate", &estimate)
            .finish_non_exhaustive()
    }
}

/// What a tick or a decision says of the fleet's adaptive state.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Known {
    pub(crate) epoch: u64,
    pub(crate) decreased: u64,
    pub(crate) rtt_us: Option<u64>,
    pub(crate) baseline_us: Option<u64>,
    pub(crate) estimate_us: Option<u64>,
}

/// What a tick answered.
#[derive(Clone, Debug)]
pub(crate) struct Ticked {
    pub(crate) capacity: usize,
    pub(crate) leads: bool,
    pub(crate) age_ms: u64,
    pub(crate) known: Known,
    /// The window, if this process took it.
    pub(crate) taken: Option<Taken>,
}

/// A window the leader took.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Taken {
    /// The fleet's counts, every process's ticks added up.
    pub(crate) counts: Counts,
    pub(crate) samples: u64,
    pub(crate) active_sum: u64,
    pub(crate) peak: u64,
}

impl Taken {
    /// The sample the algorithm decides from, at `capacity`.
    pub(crate) fn sample(
        &self,
        capacity: usize,
        settings: &AdaptiveSettings,
        age_ms: u64,
    ) -> Sample {
        let counts = &self.counts;
        let mut sample = Sample::new(capacity, settings.min, settings.max);
        sample.ended = counts.ended;
        sample.congested = counts.congested;
        sample.stale_congested = counts.stale;
        sample.rejected = counts.rejected;
        if counts.timed > 0 {
            let mean = counts.sum_us as f64 / counts.timed as f64;
            sample.mean_run_time = Some(Duration::from_secs_f64(mean / 1e6));
            sample.min_run_time = counts.min_us.map(Duration::from_micros);
            if counts.timed >= 2 {
                let mean_square = counts.squares as f64 * 1024.0 / counts.timed as f64;
                let variance = (mean_square - mean * mean).max(0.0);
                sample.run_time_deviation = Some(Duration::from_secs_f64(variance.sqrt() / 1e6));
            }
        }
        sample.peak_in_flight = usize::try_from(self.peak).unwrap_or(usize::MAX);
        if self.samples > 0 {
            sample.in_flight = self.active_sum as f64 / self.samples as f64;
        }
        sample.round_trip = counts.congested == 0;
        sample.elapsed = Duration::from_millis(age_ms);
        sample
    }
}

/// `duration` in whole microseconds, for the atomics and the store.
pub(crate) fn micros(duration: Duration) -> u64 {
    u64::try_from(duration.as_micros())
        .unwrap_or(NONE - 1)
        .min(NONE - 1)
}
