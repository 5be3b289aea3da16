//! A fleet of replicas on one limit, decided as `tower-resources-operation-redis` decides an
//! adaptive fleet limit, with the store in memory, and built only from the core's public seam
//! for windows kept outside the process (`adaptive::{Window, Adaptive}`).
//!
//! - Each replica records its operations' ends in a [`Window`] of its own, own and news on
//!   marks that are the fleet's window numbers: an operation is marked with the window its
//!   replica knew when it was admitted, a decrease with the window it was decided in.
//! - Every tick (50 ms, or at once at the first sign of congestion that is news), a replica takes
//!   its window and adds it to the fleet's window in the store ([`Window::into_next`] if the
//!   window changed since), which also samples the fleet's load (its places held).
//! - The leader (replica 0 here; a lease in Redis) takes the window once it is due (the same
//!   rule as a `Limit`'s, on the store's clock), turns the sum into the [`Sample`] its algorithm
//!   reads ([`Window::sample`], with the fleet's own load and the window's length), sets the one
//!   limit's capacity, and tells every replica the new window's number and, if it lowered the
//!   capacity, the window of the decrease.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tower_resources_operation::adaptive::{Adaptive, Algorithm, Sample, Window};
use tower_resources_operation::limit::Ended;
use tower_resources_operation::Limit;

/// How many replicas share the limit.
pub const REPLICAS: usize = 3;
/// How often a replica sends its counts.
const TICK: Duration = Duration::from_millis(50);

/// One replica: its tally, and what it knows of the fleet's windows.
#[derive(Debug)]
struct Replica {
    tally: Mutex<Window>,
    /// The window in which the capacity was last lowered (0 for none).
    decreased: AtomicU64,
    /// The fleet's window, as this replica last heard.
    epoch: AtomicU64,
    doorbell: Notify,
}

/// The fleet's window, in the store.
#[derive(Debug)]
struct Store {
    epoch: u64,
    opened: Instant,
    counts: Window,
    /// The fleet's places held, sampled at each tick: how many samples, their sum, the most.
    samples: u64,
    active_sum: u64,
    peak: u64,
    announced: bool,
    /// The last window's mean run time (the fleet's round trip).
    round_trip: Option<Duration>,
}

/// The fleet: its replicas, the store, the leader's algorithm, and the one limit.
pub struct Fleet {
    limit: Limit,
    adaptive: Adaptive,
    replicas: Vec<Replica>,
    store: Mutex<Store>,
    algorithm: Mutex<Box<dyn Algorithm>>,
    /// Operations holding a place of the limit, across the fleet.
    holders: AtomicUsize,
}

/// An operation admitted by a replica: the window it knew.
#[derive(Clone, Copy, Debug)]
pub struct Admitted {
    replica: usize,
    epoch: u64,
}

impl Fleet {
    /// A fleet deciding `limit`'s capacity as `adaptive` says.
    pub fn new(limit: Limit, adaptive: Adaptive) -> Arc<Self> {
        let algorithm = Mutex::new(adaptive.new_algorithm());
        Arc::new(Self {
            limit,
            replicas: (0..REPLICAS)
                .map(|_| Replica {
                    tally: Mutex::default(),
                    decreased: AtomicU64::new(0),
                    epoch: AtomicU64::new(1),
                    doorbell: Notify::new(),
                })
                .collect(),
            store: Mutex::new(Store {
                epoch: 1,
                opened: Instant::now(),
                counts: Window::new(),
                samples: 0,
                active_sum: 0,
                peak: 0,
                announced: false,
                round_trip: None,
            }),
            algorithm,
            adaptive,
            holders: AtomicUsize::new(0),
        })
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
        let news = admitted.epoch > replica.decreased.load(Relaxed);
        let own = admitted.epoch == replica.epoch.load(Relaxed);
        let first = {
            let mut tally = replica.tally.lock().unwrap();
            tally.record(ended, own, news) && tally.congested() == 1
        };
        if first {
            // The first sign of congestion since this replica's last tick: tick now.
            replica.doorbell.notify_one();
        }
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

    /// One replica's tick: what the fleet limit's script does with its counts, then the
    /// leader's decision.
    fn tick(&self, index: usize) {
        let replica = &self.replicas[index];
        let seen = replica.epoch.load(Relaxed);
        let counts = std::mem::take(&mut *replica.tally.lock().unwrap());
        let now = Instant::now();
        let capacity = self.limit.capacity();
        let mut store = self.store.lock().unwrap();
        let counts = match seen == store.epoch {
            true => counts,
            false => counts.into_next(),
        };
        store.counts += counts;
        let active = self.holders.load(Relaxed) as u64;
        store.samples += 1;
        store.active_sum += active;
        store.peak = store.peak.max(active);
        if !self.is_due(&store, capacity, now) {
            return;
        }
        if index != 0 {
            // Only the leader decides: it is told to tick at once.
            if !std::mem::replace(&mut store.announced, true) {
                self.replicas[0].doorbell.notify_one();
            }
            return;
        }
        let decided = store.epoch;
        let counts = std::mem::take(&mut store.counts);
        let mut sample = counts.sample(capacity, &self.adaptive);
        sample.in_flight = store.active_sum as f64 / store.samples.max(1) as f64;
        sample.peak_in_flight = store.peak as usize;
        sample.elapsed = now.saturating_duration_since(store.opened);
        (store.samples, store.active_sum, store.peak, store.announced) = (0, 0, 0, false);
        store.epoch += 1;
        store.opened = now;
        store.round_trip = sample.mean_run_time.or(store.round_trip);
        let next = self.decide(&sample);
        if next != capacity {
            self.limit.set_capacity(next).unwrap();
        }
        // Published: every replica hears it at once.
        for replica in &self.replicas {
            if next < capacity {
                replica.decreased.fetch_max(decided, Relaxed);
            }
            replica.epoch.store(store.epoch, Relaxed);
        }
    }

    /// Whether the fleet's window is due, as for one process: at the first sign of congestion
    /// that is news beyond the tolerance; once as many of its own operations as the capacity
    /// ended (two ticks old at least); more than twice the last round trip old with half of
    /// them; or `interval` old with one.
    fn is_due(&self, store: &Store, capacity: usize, now: Instant) -> bool {
        let counts = &store.counts;
        let age = now.saturating_duration_since(store.opened);
        let floor = (TICK * 2).max(Duration::from_millis(100));
        let tolerated = self.adaptive.tolerated_share() * capacity as f64;
        let capacity = capacity as u64;
        counts.congested() as f64 > tolerated.floor()
            || (age >= floor && counts.ended() >= capacity)
            || store.round_trip.is_some_and(|round_trip| {
                age >= floor.max(round_trip * 2) && counts.ended() * 2 >= capacity
            })
            || (age >= self.adaptive.interval() && counts.ended() >= 1)
    }

    /// The leader's algorithm's next capacity, within the bounds.
    fn decide(&self, sample: &Sample) -> usize {
        let bounds = self.adaptive.bounds();
        let next = self.algorithm.lock().unwrap().update(sample);
        next.clamp(*bounds.start(), *bounds.end())
    }
}
