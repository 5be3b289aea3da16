//! This process's books of one fleet limit: the places its permits hold, the places admitted on
//! its share that the store has not heard of yet, its waiters (each with the [`Slot`] where it
//! hears what became of its ticket), and how many of each ([`Counts`]). Also the ids: unique
//! across the fleet, and each telling which member of it it is of.

use std::collections::hash_map::RandomState;
use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::Notify;

use super::store::Status;

/// This member's ids of one limit.
pub(crate) struct Books {
    /// This member's token: random, and the same for every id it makes, so that the store can
    /// tell its ids from another member's (and drop every ticket of a member found dead).
    token: Arc<str>,
    /// Ids made so far.
    made: u64,
    /// Leases held by permits (extended by every refresh).
    pub(crate) held: HashSet<String>,
    /// Places admitted on this process's share while the store was out of reach, still running:
    /// the store is told of them (they become leases) at the first refresh that reaches it.
    pub(crate) unheard: HashSet<String>,
    /// Waiters, by id.
    pub(crate) waiting: HashMap<String, Arc<Slot>>,
}

impl Books {
    /// The books of a member whose ids start with `token`.
    pub(crate) fn new(token: Arc<str>) -> Self {
        Self {
            token,
            made: 0,
            held: HashSet::new(),
            unheard: HashSet::new(),
            waiting: HashMap::new(),
        }
    }

    /// A new id, unique across the fleet: this member's token, a colon, and a count.
    pub(crate) fn next_id(&mut self) -> String {
        self.made += 1;
        format!("{}:{}", self.token, self.made)
    }

    /// Whether `id` is one of this member's.
    pub(crate) fn is_own(&self, id: &str) -> bool {
        id.split_once(':')
            .is_some_and(|(token, _)| token == &*self.token)
    }

    /// This member's token.
    pub(crate) fn token(&self) -> &str {
        &self.token
    }

    /// What a refresh tells the store of these books, as they are now.
    pub(crate) fn to_refresh(&self) -> Sent {
        let waiting = (self.waiting.iter())
            .filter(|(_, slot)| slot.queued.load(Ordering::Relaxed))
            .map(|(id, slot)| (id.clone(), Arc::clone(slot)))
            .collect();
        let held = self.held.iter().cloned().collect();
        let unheard = self.unheard.iter().cloned().collect();
        Sent {
            token: self.token.to_string(),
            held,
            unheard,
            waiting,
        }
    }

    /// What the store answered of the held and unheard ids `sent` told it of: the ids to give
    /// back again, and how many leases were lost.
    pub(crate) fn refreshed(
        &mut self,
        sent: &Sent,
        held_now: &[Status],
        unheard_now: &[Status],
    ) -> (Vec<String>, u64) {
        // Ids the store holds a lease for that this member let go of while the refresh was on
        // its way (a permit dropped, a place of the share ended): its release may have reached
        // the store first. Given back again.
        let (mut stray, mut lost) = (Vec::new(), 0);
        for (id, status) in sent.held.iter().zip(held_now) {
            let still_held = self.held.contains(id);
            match status {
                Status::Holds | Status::TakenBack if !still_held => stray.push(id.clone()),
                Status::Holds | Status::Waits => {}
                Status::TakenBack => lost += 1,
                Status::Gone => {
                    // Lost, and its place may be someone else's now: no longer extended.
                    lost += u64::from(still_held);
                    self.held.remove(id);
                }
            }
        }
        let still_running = sent.unheard.iter().zip(unheard_now);
        for (id, _) in still_running.filter(|(_, status)| **status == Status::Holds) {
            // A lease from now on, extended and given back as any other.
            if self.unheard.remove(id) {
                self.held.insert(id.clone());
            } else {
                stray.push(id.clone());
            }
        }
        (stray, lost)
    }
}

/// What a refresh tells the store of a member's books, as they were when it set out.
pub(crate) struct Sent {
    pub(crate) token: String,
    /// Leases held by permits.
    pub(crate) held: Vec<String>,
    /// Places of the share the store has not heard of.
    pub(crate) unheard: Vec<String>,
    /// The waiters still queued, with their slots.
    pub(crate) waiting: Vec<(String, Arc<Slot>)>,
}

/// How many places this member holds and how many of its operations wait, as the metrics and
/// the share read them; and what it admitted without the limit, or lost.
#[derive(Debug, Default)]
pub(crate) struct Counts {
    /// Places held now (leases, and places of its share).
    pub(crate) active: AtomicUsize,
    /// Operations waiting now (in the fleet's queue, or for a place of the share).
    pub(crate) queued: AtomicUsize,
    /// Operations admitted without the fleet limit, failing open.
    pub(crate) failed_open: AtomicU64,
    /// Leases found lost while their operations ran.
    pub(crate) leases_lost: AtomicU64,
}

/// A new member's token: random, for ids no other member of the fleet makes.
pub(crate) fn new_token() -> Arc<str> {
    static MADE: AtomicU64 = AtomicU64::new(0);
    let mut hasher = RandomState::new().build_hasher();
    hasher.write_u32(std::process::id());
    hasher.write_u64(MADE.fetch_add(1, Ordering::Relaxed));
    if let Ok(since) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
        hasher.write_u128(since.as_nanos());
    }
    format!("{:016x}", hasher.finish()).into()
}

/// Where a waiter hears what became of its ticket. What it hears is a number that only grows
/// until it reads it ([`ASK`], then [`GRANTED`]): a grant is never lost to a later "ask again".
#[derive(Default)]
pub(crate) struct Slot {
    news: AtomicU8,
    notify: Notify,
    /// The fleet's window its place was handed over in, as the store said (0 for none heard).
    pub(crate) handed_in: AtomicU64,
    /// Whether it has a ticket in the fleet's queue (and so is refreshed, and counted).
    pub(crate) queued: AtomicBool,
}

const NO_NEWS: u8 = 0;
/// Ask the store again: a place was handed over to it (to be claimed), a wake-up may have been
/// lost, the ticket is gone, or the store went away or came back.
pub(crate) const ASK: u8 = 1;
/// The place is its: a refresh claimed it.
pub(crate) const GRANTED: u8 = 2;

impl Slot {
    /// Tells the waiter `news` ([`ASK`] or [`GRANTED`]).
    pub(crate) fn tell(&self, news: u8) {
        self.news.fetch_max(news, Ordering::AcqRel);
        self.notify.notify_one();
    }

    /// The news since the last read, if any.
    pub(crate) fn take_news(&self) -> u8 {
        self.news.swap(NO_NEWS, Ordering::AcqRel)
    }

    /// Resolves once news may have come.
    pub(crate) async fn notified(&self) {
        self.notify.notified().await;
    }
}

/// Locks `mutex`, whatever a panic left in it (what it guards stays consistent step by step).
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_unique_and_say_which_member_they_are_of() {
        let (mut books, other) = (Books::new(new_token()), Books::new(new_token()));
        let (a, b) = (books.next_id(), books.next_id());
        assert_ne!(a, b);
        assert!(books.is_own(&a) && books.is_own(&b));
        assert!(a.starts_with(books.token()));
        assert!(!other.is_own(&a), "another member's");
        assert!(!books.is_own("no-colon"));
    }

    #[test]
    fn a_grant_is_never_lost_to_a_later_ask() {
        let slot = Slot::default();
        slot.tell(GRANTED);
        slot.tell(ASK);
        assert_eq!(slot.take_news(), GRANTED);
        assert_eq!(slot.take_news(), NO_NEWS);
    }
}
