//! The waiter protocol: this process's books of its leases and waiters, how a waiter hears
//! what became of its ticket, and how one that goes away gives its ticket back.
//!
//! A waiter registers a [`Slot`] under its id before it asks, so that a wake-up published while
//! its first call is under way still finds it. What it hears is a number that only grows
//! until it reads it ([`POLL`], then [`GRANTED`]): a grant is never lost to a later poll.

use std::collections::hash_map::RandomState;
use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use tokio::sync::Notify;

use crate::limit::{RedisPermit, Shared};

/// This process's ids: the leases its permits hold, and its waiters.
#[derive(Default)]
pub(crate) struct Local {
    pub(crate) held: HashSet<String>,
    pub(crate) waiting: HashMap<String, Arc<Slot>>,
}

/// Where a waiter hears what became of its ticket.
#[derive(Default)]
pub(crate) struct Slot {
    news: AtomicU8,
    notify: Notify,
    /// Whether it has a ticket in the fleet's queue (and so is refreshed, and counted).
    pub(crate) queued: AtomicBool,
}

const NO_NEWS: u8 = 0;
/// Ask again: a wake-up may have been lost, the ticket is gone, or Redis went away.
pub(crate) const POLL: u8 = 1;
/// The place was handed over: the lease is held.
pub(crate) const GRANTED: u8 = 2;

impl Slot {
    /// Tells the waiter `news` ([`POLL`] or [`GRANTED`]).
    pub(crate) fn tell(&self, news: u8) {
        self.news.fetch_max(news, Ordering::AcqRel);
        self.notify.notify_one();
    }
}

/// One operation waiting for its place: registered so that wake-ups reach it, and, if it goes
/// away before it is admitted, its ticket (or the lease handed to it) goes back.
pub(crate) struct Waiter {
    shared: Arc<Shared>,
    pub(crate) id: String,
    slot: Arc<Slot>,
    /// Whether Redis may hold a ticket or a lease of this id.
    pub(crate) asked: bool,
    admitted: bool,
}

impl Waiter {
    pub(crate) fn new(shared: &Arc<Shared>) -> Self {
        let id = next_id();
        let slot = Arc::new(Slot::default());
        lock(&shared.core.local)
            .waiting
            .insert(id.clone(), Arc::clone(&slot));
        Self {
            shared: Arc::clone(shared),
            id,
            slot,
            asked: false,
            admitted: false,
        }
    }

    /// It has a ticket in the fleet's queue: counted, and refreshed by the background task
    /// (which is told, so that it refreshes at least every fallback poll from now).
    pub(crate) fn queue(&mut self) {
        if !self.slot.queued.swap(true, Ordering::Relaxed) {
            let core = &self.shared.core;
            if core.queued.fetch_add(1, Ordering::Relaxed) == 0 {
                core.keeper.hurry();
            }
        }
    }

    /// Waits for news of its ticket: `true` if the place was handed to it, `false` to ask again
    /// (a wake-up may have been lost, the ticket may be gone, Redis may be unreachable). Asks
    /// again after a TTL without news, in case the background task is not running.
    pub(crate) async fn wait(&self) -> bool {
        // One deadline for the whole wait: a wake-up without news does not put it off.
        let deadline = tokio::time::Instant::now() + self.shared.core.lease_ttl;
        loop {
            let heard = tokio::time::timeout_at(deadline, self.slot.notify.notified()).await;
            match self.slot.news.swap(NO_NEWS, Ordering::AcqRel) {
                GRANTED => return true,
                POLL => return false,
                _ if heard.is_err() => return false,
                _ => {}
            }
        }
    }

    /// The place is its: the lease becomes a permit's.
    pub(crate) fn admitted(mut self) -> RedisPermit {
        self.admitted = true;
        let core = &self.shared.core;
        let id = std::mem::take(&mut self.id);
        {
            let mut local = lock(&core.local);
            local.waiting.remove(&id);
            local.held.insert(id.clone());
        }
        if self.slot.queued.load(Ordering::Relaxed) {
            core.queued.fetch_sub(1, Ordering::Relaxed);
        }
        core.active.fetch_add(1, Ordering::Relaxed);
        RedisPermit::new(Arc::clone(&self.shared), Some(id))
    }
}

impl Drop for Waiter {
    fn drop(&mut self) {
        if self.admitted {
            return;
        }
        let core = &self.shared.core;
        lock(&core.local).waiting.remove(&self.id);
        if self.slot.queued.load(Ordering::Relaxed) {
            core.queued.fetch_sub(1, Ordering::Relaxed);
        }
        if self.asked {
            let id = std::mem::take(&mut self.id);
            self.shared.release(id);
        }
    }
}

/// A new id, unique across the fleet: this process's random token and a count.
pub(crate) fn next_id() -> String {
    static TOKEN: OnceLock<u64> = OnceLock::new();
    static COUNT: AtomicU64 = AtomicU64::new(0);
    let token = *TOKEN.get_or_init(|| {
        let mut hasher = RandomState::new().build_hasher();
        hasher.write_u32(std::process::id());
        if let Ok(since) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
            hasher.write_u128(since.as_nanos());
        }
        hasher.finish()
    });
    let count = COUNT.fetch_add(1, Ordering::Relaxed);
    format!("{token:016x}:{count}")
}

/// Locks `mutex`, whatever a panic left in it (what it guards stays consistent step by step).
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}
