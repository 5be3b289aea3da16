//! The leader's loop of an adaptive fleet limit ([`decide`]): every member runs it; the one
//! that holds the leader's lease turns the fleet's window into its algorithm's decision. It
//! stands above the member it reads and the member's
//! [`FleetControl`](super::control::FleetControl) it drives.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tower_resources_operation::adaptive::Algorithm;

use super::member::Member;
use super::store::{Decision, Known, Store, Tick};
use crate::guard::guarded;

/// `duration` in whole microseconds, for the store.
pub(crate) fn micros(duration: Duration) -> u64 {
    u64::try_from(duration.as_micros()).unwrap_or(u64::MAX)
}

/// An adaptive limit's loop: a tick every `tick` (sooner at the first sign of congestion, or
/// when the leader hears the window is due), and the leader's decision on each window it takes.
/// Store errors here reach no request: the counts of a tick that failed are dropped, and the
/// loop goes on. Never ends by itself.
pub(crate) async fn decide<S: Store>(member: Arc<Member<S>>) {
    let Some(control) = member.control.as_ref() else {
        return;
    };
    let settings = &control.settings;
    let adaptive = &settings.adaptive;
    // The leader's algorithm: made anew each time this process takes the lease, resumed at
    // the fleet's capacity if the fleet was decided before (a hand-over: no slow start from a
    // capacity that is not new).
    let mut algorithm: Option<Box<dyn Algorithm>> = None;
    // A hand-over's capacity, and until when it is held to one place above it: the dead
    // leader's places lapse within a lease TTL, and until they do the fleet looks busier than
    // its backend is.
    let mut handed_over: Option<(usize, Instant)> = None;
    // What the last leader's algorithm measured, as a tick answered it to this process while
    // it had no algorithm: what its own starts from.
    let mut handed = String::new();
    loop {
        let _ = tokio::time::timeout(settings.tick, control.doorbell.notified()).await;
        if member.health.is_down() {
            // The counts of an outage are dropped: the fleet cannot be measured meanwhile.
            control.drop_counts();
            continue;
        }
        let seen = control.epoch();
        let (counts, judged) = control.take_counts();
        let tick = Tick {
            candidate: &control.id,
            leader_ttl: control.leader_ttl,
            seen,
            counts,
            judged,
            shortest: (settings.tick * 2).max(Duration::from_millis(100)),
            longest: adaptive.interval(),
            tolerance: adaptive.tolerated_share(),
            starting: algorithm.is_none(),
        };
        let Ok(ticked) = member.store.tick(&tick).await else {
            continue;
        };
        member.capacity.store(ticked.capacity, Relaxed);
        control.learn(&ticked.known);
        control.leads.store(ticked.leads, Relaxed);
        if !ticked.leads {
            (algorithm, handed_over) = (None, None);
            continue;
        }
        let Some(taken) = ticked.taken else {
            continue;
        };
        if algorithm.is_none() {
            handed = ticked.handed;
        }
        let algorithm = algorithm.get_or_insert_with(|| {
            let mut algorithm = adaptive.new_algorithm();
            // Windows were decided before this one (the first the fleet ever closed opens
            // window 2): by a leader that is gone. Its successor starts from the capacity and
            // from what it measured.
            if ticked.known.epoch > 2 {
                let handover = std::mem::take(&mut handed);
                let _ = guarded(|| algorithm.resume(ticked.capacity, &handover));
                handed_over = Some((ticked.capacity, Instant::now() + member.settings.lease_ttl));
            }
            algorithm
        });
        let sample = taken.sample(ticked.capacity, adaptive, ticked.age_ms);
        let bounds = adaptive.bounds();
        let mut next = guarded(|| algorithm.update(&sample))
            .unwrap_or(ticked.capacity)
            .clamp(*bounds.start(), *bounds.end());
        if next > ticked.capacity && taken.is_thin(ticked.capacity) {
            // Few ended, whenever admitted: the window measured too little to grow on (a
            // hand-over, a stall while a dead process's places lapse).
            next = ticked.capacity;
        }
        match handed_over {
            Some((capacity, until)) if Instant::now() < until => next = next.min(capacity + 1),
            Some(_) => handed_over = None,
            None => {}
        }
        let (baseline, estimate, handover) = guarded(|| {
            (
                algorithm.baseline(),
                algorithm.estimate(),
                algorithm.handover(),
            )
        })
        .unwrap_or_default();
        let rtt_us = sample.mean_run_time.map(micros).or(ticked.known.rtt_us);
        // A decrease opens a window of its own (the store does the same): what was admitted
        // since the window was taken ran at the capacity it lowers.
        let decreases = next < ticked.capacity;
        let epoch = ticked.known.epoch + u64::from(decreases);
        let known = Known {
            epoch,
            decreased: match decreases {
                true => epoch,
                false => ticked.known.decreased,
            },
            rtt_us,
            baseline_us: baseline.map(micros).or(ticked.known.baseline_us),
            estimate_us: estimate.map(micros).or(ticked.known.estimate_us),
        };
        let decision = Decision {
            leader: &control.id,
            window: ticked.known.epoch,
            capacity: next,
            known,
            handover: &handover,
        };
        if let Ok(Some(capacity)) = member.store.decide(&decision).await {
            member.capacity.store(capacity, Relaxed);
            control.learn(&known);
            control.decisions.fetch_add(1, Relaxed);
        }
    }
}
