//! An adaptive fleet: its leader's hand-over when it dies, a decision that crosses one, and
//! three members that settle near a backend's capacity and follow it.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio::time::Instant;
use tower_resources_operation::adaptive::{Adaptive, Vegas, Window};
use tower_resources_operation::limit::Ended;
use tower_resources_operation::{Executor, Limit, Operation, OperationMetrics, Outcome};

use super::{until, Fleet, TTL};
use crate::fleet::control::AdaptiveSettings;
use crate::fleet::member::Settings;
use crate::fleet::place::Kind;
use crate::fleet::store::{Decision, Known, Store, Tick};

fn adaptive() -> Option<AdaptiveSettings> {
    Some(AdaptiveSettings {
        adaptive: Adaptive::new(Vegas::default(), 1..=8),
        tick: Duration::from_millis(50),
    })
}

#[tokio::test(start_paused = true)]
async fn when_the_leader_dies_another_member_leads_within_the_leaders_lease_and_keeps_the_capacity()
{
    let fleet = Fleet::new(4);
    let members: Vec<_> = (0..3)
        .map(|_| fleet.replica_with(|_| {}, adaptive()))
        .collect();
    until("one leads", Duration::from_secs(1), || {
        members
            .iter()
            .filter(|m| m.handle.member.control.as_ref().unwrap().leads())
            .count()
            == 1
    })
    .await;
    let leader = members
        .iter()
        .position(|m| m.handle.member.control.as_ref().unwrap().leads())
        .unwrap();
    let lease = members[leader]
        .handle
        .member
        .control
        .as_ref()
        .unwrap()
        .leader_ttl;
    let mut members = members;
    members.remove(leader).kill();
    until("another leads", lease + Duration::from_millis(200), || {
        members
            .iter()
            .any(|m| m.handle.member.control.as_ref().unwrap().leads())
    })
    .await;
    tokio::time::sleep(TTL).await;
    for member in &members {
        assert_eq!(member.handle.member.capacity.load(Ordering::SeqCst), 4);
    }
}

#[tokio::test(start_paused = true)]
async fn a_decision_the_old_leader_makes_after_the_hand_over_is_dropped() {
    let fleet = Fleet::new(4);
    let member = fleet.replica();
    let store = &member.handle.member.store;
    let lease = Duration::from_secs(1);
    let tick = |candidate, seen| Tick {
        candidate,
        leader_ttl: lease,
        seen,
        counts: Window::from_fields([("ended", 1), ("congested", 1)]),
        judged: 0,
        shortest: Duration::from_millis(100),
        longest: Duration::from_secs(1),
        tolerance: 0.0,
        starting: false,
    };
    let taken = store.tick(&tick("a", 0)).await.unwrap();
    assert!(taken.leads && taken.taken.is_some());
    // The old leader stalls past its lease; another member takes it, and a window.
    tokio::time::sleep(lease + Duration::from_millis(100)).await;
    let new = store.tick(&tick("b", taken.known.epoch)).await.unwrap();
    assert!(new.leads, "the lease lapsed: b leads");
    let late = Decision {
        leader: "a",
        window: taken.known.epoch,
        capacity: 1,
        known: Known {
            epoch: taken.known.epoch + 1,
            decreased: taken.known.epoch + 1,
            ..Known::default()
        },
        handover: "",
    };
    assert_eq!(store.decide(&late).await.unwrap(), None, "dropped");
    assert_eq!(store.state("c").await.unwrap().capacity, 4, "not lowered");
}

/// The backend of the real-Redis scenario (`tests/fleet_adaptive.rs`) on paused time: each
/// request takes 50 ms; one that arrives while more than `k` are in (itself included) is
/// deferred, answered an error after the same 50 ms.
#[derive(Default)]
struct Backend {
    k: AtomicUsize,
    in_flight: AtomicUsize,
    served: AtomicUsize,
    deferred: AtomicUsize,
}

impl Backend {
    /// One request: whether it was served.
    async fn serve(&self) -> bool {
        let level = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
        let served = level <= self.k.load(Ordering::SeqCst);
        let count = if served { &self.served } else { &self.deferred };
        count.fetch_add(1, Ordering::SeqCst);
        served
    }

    /// `clients` call it until the phases end, its capacity 12, then 6, then 12, 5 s each:
    /// its mean in flight in the last half of each phase, and its deferrals per success.
    async fn phases(&self, stop: &AtomicBool, clients: Vec<JoinHandle<()>>) -> (Vec<f64>, f64) {
        let mut tails = Vec::new();
        for k in PHASES {
            self.k.store(k, Ordering::SeqCst);
            tokio::time::sleep(PHASE / 2).await;
            let mut levels = Vec::new();
            for _ in 0..PHASE.as_millis() / 2 / 10 {
                tokio::time::sleep(Duration::from_millis(10)).await;
                levels.push(self.in_flight.load(Ordering::SeqCst) as f64);
            }
            tails.push(levels.iter().sum::<f64>() / levels.len() as f64);
        }
        stop.store(true, Ordering::SeqCst);
        for client in clients {
            client.await.unwrap();
        }
        let failures = self.deferred.load(Ordering::SeqCst) as f64
            / self.served.load(Ordering::SeqCst).max(1) as f64;
        (tails, failures)
    }
}

const PHASES: [usize; 3] = [12, 6, 12];
const PHASE: Duration = Duration::from_secs(5);

/// Three members of an adaptive fleet (Vegas within 1..=64, from 1), 16 clients each calling
/// the backend through the fleet limit without pause, while the backend's capacity goes
/// 12 -> 6 -> 12, 5 s each: the real-Redis scenario (`tests/fleet_adaptive.rs`) on the
/// in-memory store. In the last half of each phase the backend's mean in flight is within
/// 0.75-1.15 K (the real one's band is 0.6-1.3 K: its replicas are processes on a loaded
/// machine) and follows K down and back up; one member decides every window; and the fleet
/// fails no more per success than three adaptive limits of their own, one per member.
#[tokio::test(start_paused = true)]
async fn three_members_settle_near_the_backends_capacity_and_follow_it() {
    let fleet = Fleet::new(1);
    let adaptive = || {
        Some(AdaptiveSettings {
            adaptive: Adaptive::new(Vegas::default(), 1..=64),
            tick: Duration::from_millis(50),
        })
    };
    let members: Vec<_> = (0..3)
        .map(|_| {
            let ttl = |s: &mut Settings| s.lease_ttl = Duration::from_millis(1_500);
            Arc::new(fleet.replica_with(ttl, adaptive()))
        })
        .collect();
    let (backend, stop) = (
        Arc::new(Backend::default()),
        Arc::new(AtomicBool::new(false)),
    );
    let clients = (0..3 * 16)
        .map(|client| {
            let member = Arc::clone(&members[client % 3]);
            let (backend, stop) = (Arc::clone(&backend), Arc::clone(&stop));
            tokio::spawn(async move {
                while !stop.load(Ordering::SeqCst) {
                    let place = member.acquire().await.expect("a place");
                    let started = Instant::now();
                    let outcome = match backend.serve().await {
                        true => Outcome::Ok,
                        false => Outcome::Error,
                    };
                    let control = member.handle.member.control.as_ref().unwrap();
                    if matches!(place.kind, Kind::Lease(_)) {
                        let ended = Ended::new(outcome, started.elapsed(), Some(Instant::now()));
                        control.ended(place.epoch, &ended);
                    }
                }
            })
        })
        .collect();
    let (tails, failures) = backend.phases(&stop, clients).await;

    // The same clients, each member with an adaptive limit of its own.
    let (own, stop_own) = (
        Arc::new(Backend::default()),
        Arc::new(AtomicBool::new(false)),
    );
    let limits: Vec<Limit> = (0..3)
        .map(|_| {
            Limit::builder(1)
                .adaptive(Adaptive::new(Vegas::default(), 1..=64))
                .build()
        })
        .collect();
    let clients = (0..3 * 16)
        .map(|client| {
            let limit = limits[client % 3].clone();
            let (backend, stop) = (Arc::clone(&own), Arc::clone(&stop_own));
            tokio::spawn(async move {
                while !stop.load(Ordering::SeqCst) {
                    let work = async { backend.serve().await.then_some(()).ok_or("deferred") };
                    let _ = OperationMetrics::disabled()
                        .resources_operation(&limit, Operation::Judge, Executor::Inline, work)
                        .await;
                }
            })
        })
        .collect();
    let (own_tails, own_failures) = own.phases(&stop_own, clients).await;

    let decided: Vec<u64> = members
        .iter()
        .map(|m| m.handle.member.control.as_ref().unwrap().decisions())
        .collect();
    println!(
        "mean in flight in the last half of each phase (K = {PHASES:?}): the fleet {tails:.2?}, \
         {failures:.3} failures per success, decisions per member {decided:?}; a limit per \
         member {own_tails:.2?}, {own_failures:.3} failures per success"
    );
    for (&level, &k) in tails.iter().zip(&PHASES) {
        let share = level / k as f64;
        assert!(
            (0.75..=1.15).contains(&share),
            "{level:.2} in flight: {share:.2} K (K = {k}); {tails:.2?}"
        );
    }
    assert!(
        tails[1] < tails[0] && tails[2] > tails[1],
        "follows K: {tails:.2?}"
    );
    assert_eq!(
        decided.iter().filter(|&&d| d > 0).count(),
        1,
        "one leader: {decided:?}"
    );
    assert!(
        failures <= own_failures,
        "failures per success: the fleet {failures:.3}, a limit per member {own_failures:.3}"
    );
}
