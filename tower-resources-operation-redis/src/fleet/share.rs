//! A member's share of the fleet's capacity: what it admits on its own while the store is out
//! of reach, and the settling after the store answers again, before the fleet's count of places
//! is whole again.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use tokio::sync::Notify;
use tokio::time::Instant;

use super::books::lock;

/// What a fleet limit answers while its store cannot be reached.
///
/// A fleet limit that protects a shared resource should neither stop the fleet (every caller
/// turned away) nor lift the limit (every caller admitted) while the store it is kept in is
/// away. Google's Doorman hands each client a safe capacity to fall back on; a fleet limit
/// works its own out: its share of the fleet's last capacity.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Unreachable {
    /// Each replica admits up to its share of the fleet's last capacity, that capacity divided
    /// by the replicas alive when it last reached the store (rounded down, and at least 1), and
    /// queues the rest locally; so the fleet runs at most that capacity meanwhile, once the
    /// operations admitted before the outage have ended. A replica that never reached the store
    /// has no share: it turns operations away, as `Closed` does. The default.
    #[default]
    Share,
    /// Turns every operation away as `unavailable` (HTTP `503`, gRPC `UNAVAILABLE`).
    Closed,
    /// Admits every operation without the fleet limit, counted in
    /// `gym.resources.limit.failed_open`.
    Open,
}

/// What a member knows of the fleet for its share: the replicas alive as last read, and whether
/// the fleet is settling after the store's return.
#[derive(Debug, Default)]
pub(crate) struct Share {
    fleet: Mutex<Fleet>,
    /// Rung as a place of the share ends, and as the fleet settles: its waiters look again.
    pub(crate) freed: Notify,
}

#[derive(Debug, Default)]
struct Fleet {
    /// The processes alive, as the store last said; `None` before it was reached.
    replicas: Option<usize>,
    /// When the fleet will have settled after the store answered again, if it is settling.
    settled_at: Option<Instant>,
}

impl Share {
    /// The replicas alive, as last read; `None` before the store was reached.
    pub(crate) fn replicas(&self) -> Option<usize> {
        lock(&self.fleet).replicas
    }

    /// The replicas alive, as a call returned them; kept as they were before an outage while
    /// the fleet settles after it (a store that lost its data counts only the replicas that
    /// reached it so far, and the share is worked out from the fleet as it was).
    pub(crate) fn read_replicas(&self, replicas: usize) {
        let mut fleet = lock(&self.fleet);
        if fleet.settled_at.is_none() {
            fleet.replicas = Some(replicas);
        }
    }

    /// Whether the store answers again but the fleet has not all told it of its places yet.
    pub(crate) fn is_settling(&self) -> bool {
        lock(&self.fleet).settled_at.is_some()
    }

    /// The fleet settles until `at`: the member admits nothing new meanwhile.
    pub(crate) fn settle_until(&self, at: Instant) {
        lock(&self.fleet).settled_at = Some(at);
    }

    /// Whether the fleet has settled by now: if so, it no longer settles.
    pub(crate) fn settled(&self) -> bool {
        let mut fleet = lock(&self.fleet);
        match fleet.settled_at {
            Some(at) if Instant::now() >= at => {
                fleet.settled_at = None;
                true
            }
            _ => false,
        }
    }

    /// A member's share of the fleet's `capacity`, if it knows the replicas: that capacity over
    /// the replicas alive, rounded down, and at least 1.
    pub(crate) fn of(&self, capacity: usize) -> Option<usize> {
        let replicas = self.replicas()?;
        Some((capacity / replicas.max(1)).max(1))
    }

    /// Takes a place on the share, if `active` (the places this process holds) is below it.
    pub(crate) fn take(&self, active: &AtomicUsize, share: usize) -> bool {
        // Under the fleet's lock, so that two callers cannot both take the last place.
        let _serial = lock(&self.fleet);
        if active.load(Ordering::Relaxed) < share {
            active.fetch_add(1, Ordering::Relaxed);
            return true;
        }
        false
    }

    /// What a limit answers while the store is out of reach, in words, for a fleet of
    /// `capacity`.
    pub(crate) fn answer_while_down(&self, unreachable: Unreachable, capacity: usize) -> String {
        match (unreachable, self.of(capacity)) {
            (Unreachable::Share, Some(share)) => format!(
                "runs on this replica's share of the fleet's last capacity: {share} at once \
                 ({capacity} over {} replicas alive; queued locally beyond that)",
                self.replicas().unwrap_or(1)
            ),
            (Unreachable::Share, None) => "turns operations away at once as unavailable: this \
                                           replica never reached the store, so it has no share \
                                           of the fleet's capacity"
                .to_owned(),
            (Unreachable::Closed, _) => {
                "turns operations away at once as unavailable (fail closed)".to_owned()
            }
            (Unreachable::Open, _) => {
                "admits operations at once without the fleet limit (fail open)".to_owned()
            }
        }
    }
}
