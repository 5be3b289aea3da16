//! The fleet on paused time, against the in-memory store: members in one process, each with its
//! own books, background work and ids, sharing one [`MemoryFleet`] as replicas share Redis.
//! Every behaviour of the fleet that is not Redis's own is checked here, deterministically and
//! without waiting: what the store keeps (at most N, first come first served, claims, dead
//! members), what members do while it is away, the capacity, an adaptive fleet's windows and
//! its leader, and the interleavings that real servers cannot be made to reach.

mod members;
mod races;
mod shares;
mod windows;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio::time::Instant;
use tower_resources_operation::Rejected;

use super::assemble;
use super::books::new_token;
use super::control::{AdaptiveSettings, FleetControl};
use super::member::{Handle, Settings};
use super::place::Place;
use super::share::Unreachable;
use super::waiter::acquire;
use crate::memory_store::{MemoryFleet, MemoryStore};

/// The defaults a member is built with (the builder's).
const TTL: Duration = Duration::from_secs(2);
const CALL: Duration = Duration::from_millis(500);
const CLAIM: Duration = Duration::from_millis(250);

/// A fleet limit named `name` of `capacity` places, kept in one in-memory store.
pub(super) struct Fleet {
    pub(super) store: Arc<MemoryFleet>,
    name: Arc<str>,
    capacity: usize,
}

/// One member of it: its handle and its background work.
pub(super) struct Replica {
    pub(super) handle: Arc<Handle<MemoryStore>>,
    background: JoinHandle<()>,
}

impl Fleet {
    pub(super) fn new(capacity: usize) -> Self {
        Self {
            store: Arc::default(),
            name: Arc::from("fleet"),
            capacity,
        }
    }

    /// A member with the defaults.
    pub(super) fn replica(&self) -> Replica {
        self.replica_with(|_| {}, None)
    }

    /// A member whose settings `change` changes, adaptive with `adaptive` if given.
    pub(super) fn replica_with(
        &self,
        change: impl FnOnce(&mut Settings),
        adaptive: Option<AdaptiveSettings>,
    ) -> Replica {
        let mut settings = Settings {
            name: Arc::clone(&self.name),
            capacity: self.capacity,
            overwrite: false,
            max_queued: None,
            unreachable: Unreachable::Share,
            lease_ttl: TTL,
            call_timeout: CALL,
            fallback_poll: Duration::from_secs(1).min(TTL / 3),
            claim_timeout: CLAIM,
        };
        change(&mut settings);
        let token = new_token();
        let (store, events) = self.store.member(
            &self.name,
            settings.capacity,
            settings.lease_ttl,
            settings.claim_timeout,
            settings.max_queued,
        );
        let control = adaptive.map(|adaptive| {
            FleetControl::new(adaptive, &token, settings.call_timeout, settings.lease_ttl)
        });
        let (handle, background) = assemble(store, settings, token, control, events);
        Replica {
            handle,
            background: tokio::spawn(background),
        }
    }
}

impl Replica {
    /// Takes a place, waiting for one if it has to.
    pub(super) async fn acquire(&self) -> Result<Place<MemoryStore>, Rejected> {
        acquire(Arc::clone(&self.handle)).await
    }

    /// A task that takes a place and keeps it until told, with its admission counted.
    pub(super) fn waiter(&self, admitted: &Arc<AtomicUsize>) -> JoinHandle<Place<MemoryStore>> {
        let (handle, admitted) = (Arc::clone(&self.handle), Arc::clone(admitted));
        tokio::spawn(async move {
            let place = acquire(handle).await.expect("a place");
            admitted.fetch_add(1, Ordering::SeqCst);
            place
        })
    }

    /// This member's waiters now.
    pub(super) fn queued(&self) -> usize {
        self.handle.member.counts.queued.load(Ordering::SeqCst)
    }

    /// This member's places now.
    pub(super) fn active(&self) -> usize {
        self.handle.member.counts.active.load(Ordering::SeqCst)
    }

    /// Killed, as with `kill -9`: its background work stops mid-step, and nothing it holds is
    /// given back (what its places send goes nowhere).
    pub(super) fn kill(self) {
        self.background.abort();
    }
}

/// Yields until `condition` holds, for at most `within` of (paused) time.
pub(super) async fn until(what: &str, within: Duration, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !condition() {
        assert!(Instant::now() < deadline, "not within {within:?}: {what}");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}
