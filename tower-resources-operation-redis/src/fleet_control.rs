//! An adaptive fleet limit's controller in one process ([`FleetControl`]): what its operations'
//! ends add to (a handful of relaxed atomics, nothing that reaches Redis), what the process
//! knows of the fleet's window and decisions, and the background loop ([`decide`]) that flushes
//! the counts to Redis every tick and, in the one process that holds the leader's lease, runs
//! the algorithm once per window of the fleet.

use std::fmt;
use std::ops::RangeInclusive;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;
use tower_resources_operation::adaptive::{Algorithm, Sample};
use tower_resources_operation::limit::Ended;
use tower_resources_operation::Outcome;

use crate::core::Core;
use crate::waiters::next_id;

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
struct Tally {
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
    ended: u64,
    timed: u64,
    sum_us: u64,
    squares: u64,
    min_us: Option<u64>,
    congested: u64,
    stale: u64,
    rejected: u64,
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

    fn take(&self) -> Counts {
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
    settings: AdaptiveSettings,
    /// This process's id as a candidate for the leader's lease.
    id: String,
    /// How long the leader's lease lasts without a tick that extends it.
    pub(crate) leader_ttl: Duration,
    tally: Tally,
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
    leads: AtomicBool,
    /// Windows this process decided.
    decisions: AtomicU64,
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

    /// What was published of a decision: `<epoch> <decreased> <rtt> <baseline> <estimate>`.
    pub(crate) fn heard(&self, message: &str) {
        let mut parts = message.split(' ').map(|part| part.parse::<i64>().ok());
        let mut next = || parts.next().flatten();
        let (Some(epoch), Some(decreased)) = (next(), next()) else {
            return;
        };
        let us = |value: Option<i64>| value.and_then(|v| u64::try_from(v).ok());
        let (rtt_us, baseline_us, estimate_us) = (us(next()), us(next()), us(next()));
        self.learn(&Known {
            epoch: u64::try_from(epoch).unwrap_or(0),
            decreased: u64::try_from(decreased).unwrap_or(0),
            rtt_us,
            baseline_us,
            estimate_us,
        });
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
#[derive(Clone, Copy, Debug, Default)]
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
    counts: Counts,
    samples: u64,
    active_sum: u64,
    peak: u64,
}

impl Ticked {
    /// The script's strings, as [`FLEET_TICK`](crate::scripts) returns them.
    pub(crate) fn parse(fields: &[String]) -> Option<Self> {
        let number = |index: usize| -> Option<u64> {
            fields
                .get(index)
                .and_then(|field| field.parse::<i64>().ok())
                .and_then(|value| u64::try_from(value).ok())
        };
        let taken = number(0)? == 1;
        let known = Known {
            epoch: number(2)?,
            decreased: number(5).unwrap_or(0),
            rtt_us: number(6),
            baseline_us: number(7),
            estimate_us: number(8),
        };
        let taken = taken.then(|| {
            let count = |index: usize| number(9 + index).unwrap_or(0);
            Taken {
                counts: Counts {
                    ended: count(0),
                    timed: count(1),
                    sum_us: count(2),
                    squares: count(3),
                    min_us: number(9 + 4),
                    congested: count(5),
                    stale: count(6),
                    rejected: count(7),
                },
                samples: count(8),
                active_sum: count(9),
                peak: count(10),
            }
        });
        Some(Self {
            capacity: usize::try_from(number(1)?).unwrap_or(usize::MAX),
            leads: number(3)? == 1,
            age_ms: number(4).unwrap_or(0),
            known,
            taken,
        })
    }
}

impl Taken {
    /// The sample the algorithm decides from, at `capacity`.
    fn sample(&self, capacity: usize, settings: &AdaptiveSettings, age_ms: u64) -> Sample {
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

/// An adaptive limit's background loop: a tick every `tick` (sooner at the first sign of
/// congestion, or when the leader hears the window is due), and the leader's decision on each
/// window it takes. Redis errors here reach no request: the counts of a tick that failed are
/// dropped, and the loop goes on. Never ends by itself.
pub(crate) async fn decide(core: Arc<Core>) {
    let Some(control) = core.adaptive.as_ref() else {
        return;
    };
    let settings = &control.settings;
    // The leader's algorithm: made anew each time this process takes the lease, from the
    // fleet's stored capacity.
    let mut algorithm: Option<Box<dyn Algorithm>> = None;
    loop {
        let _ = tokio::time::timeout(settings.tick, control.doorbell.notified()).await;
        if core.health.is_down() {
            // The counts of an outage are dropped: the fleet cannot be measured meanwhile.
            let _ = control.tally.take();
            continue;
        }
        let seen = control.epoch();
        let counts = control.tally.take();
        let Ok(ticked) = core.fleet_tick(control, seen, counts).await else {
            continue;
        };
        control.learn(&ticked.known);
        control.leads.store(ticked.leads, Relaxed);
        if !ticked.leads {
            algorithm = None;
            continue;
        }
        let Some(taken) = ticked.taken else {
            continue;
        };
        let algorithm = algorithm.get_or_insert_with(|| (settings.make)());
        let sample = taken.sample(ticked.capacity, settings, ticked.age_ms);
        let next = catch_unwind(AssertUnwindSafe(|| algorithm.update(&sample)))
            .unwrap_or(ticked.capacity)
            .clamp(settings.min, settings.max);
        let (baseline, estimate) = catch_unwind(AssertUnwindSafe(|| {
            (algorithm.baseline(), algorithm.estimate())
        }))
        .unwrap_or_default();
        let rtt_us = sample.mean_run_time.map(micros).or(ticked.known.rtt_us);
        let decision = Known {
            epoch: ticked.known.epoch,
            decreased: match next < ticked.capacity {
                true => ticked.known.epoch,
                false => ticked.known.decreased,
            },
            rtt_us,
            baseline_us: baseline.map(micros),
            estimate_us: estimate.map(micros),
        };
        if let Ok(true) = core.fleet_decide(control, next, &decision).await {
            control.decisions.fetch_add(1, Relaxed);
        }
    }
}

fn micros(duration: Duration) -> u64 {
    u64::try_from(duration.as_micros())
        .unwrap_or(NONE - 1)
        .min(NONE - 1)
}

/// The arguments of a tick, after the common ones.
pub(crate) fn tick_arguments(control: &FleetControl, seen: u64, counts: Counts) -> Vec<String> {
    let ms = |duration: Duration| duration.as_millis().to_string();
    let floor = control.settings.tick * 2;
    vec![
        control.id.clone(),
        ms(control.leader_ttl),
        seen.to_string(),
        counts.ended.to_string(),
        counts.timed.to_string(),
        counts.sum_us.to_string(),
        counts.squares.to_string(),
        counts
            .min_us
            .map_or_else(|| "-1".to_owned(), |us| us.to_string()),
        counts.congested.to_string(),
        counts.stale.to_string(),
        counts.rejected.to_string(),
        ms(floor.max(Duration::from_millis(100))),
        ms(Duration::from_secs(1)),
        "0".to_owned(),
    ]
}

/// The arguments of a decision, after the common ones.
pub(crate) fn decide_arguments(control: &FleetControl, next: usize, known: &Known) -> Vec<String> {
    let us = |us: Option<u64>| us.map_or_else(|| "-1".to_owned(), |us| us.to_string());
    vec![
        control.id.clone(),
        known.epoch.to_string(),
        next.to_string(),
        us(known.rtt_us),
        us(known.baseline_us),
        us(known.estimate_us),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(fields: &[&str]) -> Vec<String> {
        fields.iter().map(|field| (*field).to_owned()).collect()
    }

    #[test]
    fn a_tick_that_took_no_window_says_what_the_fleet_knows() {
        let ticked = Ticked::parse(&strings(&["0", "7", "12", "0", "40", "", "", "", ""])).unwrap();
        assert_eq!(
            (ticked.capacity, ticked.leads, ticked.age_ms),
            (7, false, 40)
        );
        assert_eq!((ticked.known.epoch, ticked.known.decreased), (12, 0));
        assert_eq!(ticked.known.rtt_us, None);
        assert!(ticked.taken.is_none());
    }

    #[test]
    fn a_taken_window_makes_the_fleets_sample() {
        let fields = strings(&[
            "1", "8", "5", "1", "150", "3", "50000", "51000", "52000", // known
            "8", "6", "300000", "14648437", "49000", "1", "2", "0", "4", "30", "9",
        ]);
        let ticked = Ticked::parse(&fields).unwrap();
        assert!(ticked.leads);
        assert_eq!(ticked.known.baseline_us, Some(51_000));
        let settings = AdaptiveSettings::new(
            tower_resources_operation::adaptive::Vegas::default(),
            1..=64,
        );
        let sample = ticked.taken.unwrap().sample(8, &settings, ticked.age_ms);
        assert_eq!(
            (sample.ended, sample.congested, sample.stale_congested),
            (8, 1, 2)
        );
        assert_eq!(sample.mean_run_time, Some(Duration::from_millis(50)));
        assert_eq!(sample.min_run_time, Some(Duration::from_millis(49)));
        assert_eq!((sample.peak_in_flight, sample.in_flight), (9, 7.5));
        assert!(!sample.round_trip, "congested");
        assert_eq!(sample.elapsed, Duration::from_millis(150));
        let deviation = sample.run_time_deviation.unwrap();
        assert!(deviation < Duration::from_millis(1), "{deviation:?}");
    }
}
