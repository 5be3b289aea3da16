//! A member's share of the fleet's capacity: what it admits on its own while the store is out
//! of reach, and the settling after the store answers again, before the fleet's count of places
//! is whole again.

use std::sync::atomic::Ordering;
use std::sync::Mutex;

use tokio::sync::Notify;
use tokio::time::Instant;

use super::books::lock;
use super::member::Member;

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

    /// When the fleet will have settled, if it is settling.
    pub(crate) fn settled_at(&self) -> Option<Instant> {
        lock(&self.fleet).settled_at
    }

    /// The fleet settles until `at`: the member admits nothing new meanwhile.
    pub(crate) fn settle_until(&self, at: Instant) {
        lock(&self.fleet).settled_at = Some(at);
    }

    /// Whether the fleet has settled by now: if so, it no longer settles.
    fn settled(&self) -> bool {
        let mut fleet = lock(&self.fleet);
        match fleet.settled_at {
            Some(at) if Instant::now() >= at => {
                fleet.settled_at = None;
                true
            }
            _ => false,
        }
    }
}

impl<S: super::store::Store> Member<S> {
    /// This process's share of the fleet's last capacity, if it knows one: that capacity over
    /// the replicas alive, rounded down, and at least 1.
    pub(crate) fn share(&self) -> Option<usize> {
        let replicas = self.share.replicas()?;
        Some((self.capacity.load(Ordering::Relaxed) / replicas.max(1)).max(1))
    }

    /// The share it runs on now, if it does: the store is out of reach (or answers again, and
    /// the fleet is settling), and it knows one.
    pub(crate) fn running_on_share(&self) -> Option<usize> {
        match self.settings.unreachable {
            Unreachable::Share if self.health.is_down() || self.is_settling() => self.share(),
            _ => None,
        }
    }

    /// Whether the store answers again but the fleet has not all told it of its places yet.
    pub(crate) fn is_settling(&self) -> bool {
        self.share.settled_at().is_some()
    }

    /// After a refresh: once the fleet has settled, back on the fleet limit, and every waiter
    /// on the share asks the store.
    pub(crate) fn settle(&self) {
        if self.share.settled() {
            self.poll_all();
            self.share.freed.notify_waiters();
        }
    }

    /// Takes a place on the share, if this process holds fewer places than its share.
    pub(crate) fn take_on_share(&self, share: usize) -> bool {
        // Under the fleet's lock, so that two callers cannot both take the last place.
        let _serial = lock(&self.share.fleet);
        let active = &self.counts.active;
        if active.load(Ordering::Relaxed) < share {
            active.fetch_add(1, Ordering::Relaxed);
            return true;
        }
        false
    }
}
