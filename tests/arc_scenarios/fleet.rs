//! A fleet of replicas on one limit, decided as `tower-resources-operation-redis` decides an
//! adaptive fleet limit, with the store in memory: each replica adds its operations' ends to a
//! tally of its own and sends its counts to the fleet's window every tick (50 ms, or at once at
//! the first sign of congestion); the leader (replica 0) takes the window once it is due, runs
//! the algorithm on the fleet's sample, and sets the one limit's capacity; every replica hears
//! the window's number and the last decrease at once (the fleet limit publishes them).
//!
//! Each operation carries the window its replica knew when it was admitted: only those of the
//! current window give it run times, and a failure of one admitted before the last decrease is
//! not news unless it comes more than two round trips after it.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tower_resources_operation::adaptive::{Algorithm, Sample};
use tower_resources_operation::limit::Ended;
use tower_resources_operation::{Limit, Outcome};

/// How many replicas share the limit.
pub const REPLICAS: usize = 3;
/// How often a replica sends its counts.
const TICK: Duration = Duration::from_millis(50);
/// An atomic duration's "none".
const NONE: u64 = u64::MAX;

/// What one replica's operations added up to since its last tick.
#[derive(Debug)]
struct Tally {
    ended: AtomicU64,
    timed: AtomicU64,
    sum_us: AtomicU64,
    squares: AtomicU64,
    min_us: AtomicU64,
    congested: AtomicU64,
    stale: AtomicU64,
}

#[derive(Clone, Copy, Debug, Default)]
struct Counts {
    ended: u64,
    timed: u64,
    sum_us: u64,
    squares: u64,
    min_us: Option<u64>,
    congested: u64,
    stale: u64,
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
        }
    }
}

/// One replica: its tally, and what it knows of the fleet's window.
#[derive(Debug)]
struct Replica {
    tally: Tally,
    epoch: AtomicU64,
    decreased: AtomicU64,
    decreased_at: AtomicU64,
    rtt_us: AtomicU64,
    doorbell: Notify,
}

/// The fleet's window, in the store.
#[derive(Debug)]
struct Store {
    epoch: u64,
    opened: Instant,
    counts: Counts,
    samples: u64,
    active_sum: u64,
    peak: u64,
    announced: bool,
    decreased: u64,
    rtt_us: Option<u64>,
}

/// The fleet: its replicas, the store, the leader's algorithm, and the one limit.
pub struct Fleet {
    limit: Limit,
    replicas: Vec<Replica>,
    store: Mutex<Store>,
    algorithm: Mutex<Box<dyn Algorithm>>,
    bounds: (usize, usize),
    /// Operations holding a place of the limit, across the fleet.
    holders: AtomicUsize,
    origin: Instant,
}

/// An operation admitted by a replica: the window it knew, and when.
#[derive(Clone, Copy, Debug)]
pub struct Admitted {
    replica: usize,
    epoch: u64,
}

impl Fleet {
    /// A fleet deciding `limit`'s capacity with `algorithm`, within `bounds`.
    pub fn new(limit: Limit, algorithm: Box<dyn Algorithm>, bounds: (usize, usize)) -> Arc<Self> {
        let now = Instant::now();
        Arc::new(Self {
            limit,
            replicas: (0..REPLICAS)
                .map(|_| Replica {
                    tally: Tally::new(),
                    epoch: AtomicU64::new(1),
                    decreased: AtomicU64::new(0),
                    decreased_at: AtomicU64::new(0),
                    rtt_us: AtomicU64::new(NONE),
                    doorbell: Notify::new(),
                })
                .collect(),
            store: Mutex::new(Store {
                epoch: 1,
                opened: now,
                counts: Counts::default(),
                samples: 0,
                active_sum: 0,
                peak: 0,
                announced: false,
                decreased: 0,
                rtt_us: None,
            }),
            algorithm: Mutex::new(algorithm),
            bounds,
            holders: AtomicUsize::new(0),
            origin: now,
        })
    }

    fn nanos(&self, at: Instant) -> u64 {
        u64::try_from(at.saturating_duration_since(self.origin).as_nanos()).unwrap_or(u64::MAX)
    }

    /// Replica `replica` admitted an operation.
    pub fn admitted(&self, replica: usize) -> Admitted {
        self.holders.fetch_add(1, Relaxed);
        Admitted {
            replica,
            epoch: self.replicas[replica].epoch.load(Relaxed),
        }
    }

    /// The operation `admitted` ended, before its place goes back.
    pub fn ended(&self, admitted: Admitted, ended: &Ended) {
        self.holders.fetch_sub(1, Relaxed);
        let replica = &self.replicas[admitted.replica];
        let tally = &replica.tally;
        let outcome = ended.outcome();
        if admitted.epoch == replica.epoch.load(Relaxed) {
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
            if self.is_news(replica, admitted.epoch, ended) {
                if tally.congested.fetch_add(1, Relaxed) == 0 {
                    replica.doorbell.notify_one();
                }
            } else {
                tally.stale.fetch_add(1, Relaxed);
            }
        }
    }

    fn is_news(&self, replica: &Replica, admitted: u64, ended: &Ended) -> bool {
        if admitted >= replica.decreased.load(Relaxed) {
            return true;
        }
        let rtt_ns = match replica.rtt_us.load(Relaxed) {
            NONE => return false,
            us => us.saturating_mul(1000),
        };
        let shadow = replica
            .decreased_at
            .load(Relaxed)
            .saturating_add(rtt_ns.saturating_mul(2));
        ended.at().is_some_and(|at| self.nanos(at) > shadow)
    }

    /// Every replica's tick loop, until aborted.
    pub fn start(self: &Arc<Self>) -> Vec<JoinHandle<()>> {
        (0..REPLICAS)
            .map(|replica| {
                let fleet = Arc::clone(self);
                tokio::spawn(async move {
                    // The replicas' ticks are not in step.
                    tokio::time::sleep(TICK.mul_f64(replica as f64 / REPLICAS as f64)).await;
                    loop {
                        let doorbell = fleet.replicas[replica].doorbell.notified();
                        let _ = tokio::time::timeout(TICK, doorbell).await;
                        fleet.tick(replica);
                    }
                })
            })
            .collect()
    }

    /// One replica's tick: as the fleet limit's script, then the leader's decision.
    fn tick(&self, index: usize) {
        let replica = &self.replicas[index];
        let seen = replica.epoch.load(Relaxed);
        let counts = replica.tally.take();
        let now = Instant::now();
        let capacity = self.limit.capacity();
        let mut store = self.store.lock().unwrap();
        let store = &mut *store;
        let window = &mut store.counts;
        if seen == store.epoch {
            window.ended += counts.ended;
            window.timed += counts.timed;
            window.sum_us += counts.sum_us;
            window.squares += counts.squares;
            window.min_us = match (window.min_us, counts.min_us) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
        }
        window.congested += counts.congested;
        window.stale += counts.stale;
        let active = self.holders.load(Relaxed) as u64;
        store.samples += 1;
        store.active_sum += active;
        store.peak = store.peak.max(active);
        let leads = index == 0;
        let age = now.saturating_duration_since(store.opened);
        let floor = (TICK * 2).max(Duration::from_millis(100));
        let rtt = store.rtt_us.map(Duration::from_micros);
        let (ended, congested) = (store.counts.ended, store.counts.congested);
        let due = congested > 0
            || (age >= floor && ended >= capacity as u64)
            || rtt.is_some_and(|rtt| age >= floor.max(rtt * 2) && ended * 2 >= capacity as u64)
            || (age >= Duration::from_secs(1) && ended >= 1);
        if due && !leads {
            if !std::mem::replace(&mut store.announced, true) {
                self.replicas[0].doorbell.notify_one();
            }
            return;
        }
        if !due {
            return;
        }
        // The leader takes the window.
        let taken = std::mem::take(&mut store.counts);
        let (samples, active_sum, peak) = (store.samples, store.active_sum, store.peak);
        (store.samples, store.active_sum, store.peak, store.announced) = (0, 0, 0, false);
        store.epoch += 1;
        store.opened = now;
        let sample = sample(
            &taken,
            capacity,
            self.bounds,
            samples,
            active_sum,
            peak,
            age,
        );
        let mut algorithm = self.algorithm.lock().unwrap();
        let next = algorithm
            .update(&sample)
            .clamp(self.bounds.0, self.bounds.1);
        if next < capacity {
            store.decreased = store.epoch;
        }
        if let Some(mean) = sample.mean_run_time {
            store.rtt_us = Some(mean.as_micros() as u64);
        }
        if next != capacity {
            self.limit.set_capacity(next).unwrap();
        }
        // Published: every replica hears it at once.
        for replica in &self.replicas {
            replica.epoch.store(store.epoch, Relaxed);
            if replica.decreased.swap(store.decreased, Relaxed) != store.decreased {
                replica.decreased_at.store(self.nanos(now), Relaxed);
            }
            if let Some(rtt) = store.rtt_us {
                replica.rtt_us.store(rtt, Relaxed);
            }
        }
    }
}

/// The fleet's sample, as the fleet limit builds it from the window it took.
fn sample(
    counts: &Counts,
    capacity: usize,
    (min, max): (usize, usize),
    samples: u64,
    active_sum: u64,
    peak: u64,
    age: Duration,
) -> Sample {
    let mut sample = Sample::new(capacity, min, max);
    sample.ended = counts.ended;
    sample.congested = counts.congested;
    sample.stale_congested = counts.stale;
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
    sample.peak_in_flight = peak as usize;
    if samples > 0 {
        sample.in_flight = active_sum as f64 / samples as f64;
    }
    sample.round_trip = counts.congested == 0;
    sample.elapsed = age;
    sample
}
