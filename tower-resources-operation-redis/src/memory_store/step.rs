//! One step of the in-memory store: the data Redis keeps for a limit, and what every script
//! starts with (what expired goes, a claim untaken takes its member's tickets with it) and
//! shares (handing places over, a member alive, a lease, the places held by members not heard
//! from).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use tokio::time::Instant;

use crate::fleet::store::Event;

/// What Redis keeps of one limit, key for key.
#[derive(Clone, Default)]
pub(super) struct Data {
    pub(super) capacity: Option<usize>,
    /// Lease and claim ids, by when they expire.
    pub(super) holders: HashMap<String, Instant>,
    /// Places handed over and not yet taken up, by when the claim expires.
    pub(super) claims: HashMap<String, Instant>,
    /// Tickets, by order of arrival; and each ticket's arrival.
    pub(super) queue: BTreeMap<u64, String>,
    pub(super) arrival_of: HashMap<String, u64>,
    /// Tickets, by when they expire.
    pub(super) waiting: HashMap<String, Instant>,
    pub(super) arrivals: u64,
    /// Members, by when they stop being counted alive.
    pub(super) members: HashMap<String, Instant>,
    pub(super) adaptive: Adaptive,
    pub(super) window: HashMap<String, i64>,
    /// The leader's id, and when its lease ends.
    pub(super) leader: Option<(String, Instant)>,
}

/// An adaptive limit's state, field for field of the Redis hash.
#[derive(Clone, Default)]
pub(super) struct Adaptive {
    pub(super) epoch: Option<u64>,
    pub(super) opened: Option<Instant>,
    pub(super) decreased: u64,
    pub(super) rtt_us: Option<i64>,
    pub(super) baseline_us: Option<i64>,
    pub(super) estimate_us: Option<i64>,
    pub(super) baselines: String,
    pub(super) ticked: Option<Instant>,
}

#[cfg(test)]
impl Data {
    /// What it keeps of places, the same for two stores that differ only in how they got
    /// there: each key in order, expiries counted from `now`, the queue in its order.
    pub(super) fn canonical(&self, now: Instant) -> String {
        let sorted = |map: &HashMap<String, Instant>| {
            let mut entries: Vec<String> = map
                .iter()
                .map(|(id, at)| format!("{id}@{}", at.saturating_duration_since(now).as_millis()))
                .collect();
            entries.sort();
            entries.join(",")
        };
        format!(
            "cap {:?} holders [{}] claims [{}] queue {:?} waiting [{}] members [{}]",
            self.capacity,
            sorted(&self.holders),
            sorted(&self.claims),
            self.queue.values().collect::<Vec<_>>(),
            sorted(&self.waiting),
            sorted(&self.members),
        )
    }

    /// Whether `id` holds a lease (or a claim) that has not expired at `now`.
    pub(super) fn holds_lease(&self, id: &str, now: Instant) -> bool {
        self.holders.get(id).is_some_and(|expires| *expires > now)
    }
}

/// The token of an id: what is before its colon.
pub(super) fn token(id: &str) -> &str {
    id.split_once(':').map_or(id, |(token, _)| token)
}

/// One step under way: the data, the time, the step's settings, and what it publishes.
pub(super) struct Step<'a> {
    pub(super) data: &'a mut Data,
    pub(super) now: Instant,
    pub(super) ttl: Duration,
    pub(super) claim: Duration,
    pub(super) published: Vec<Event>,
}

impl Step<'_> {
    /// The prelude of every script: what expired goes, a claim untaken takes its member's
    /// tickets with it, and the capacity is the member's own if the fleet has none.
    pub(super) fn prelude(&mut self, default_capacity: usize) -> usize {
        let now = self.now;
        let data = &mut *self.data;
        data.holders.retain(|_, expires| *expires > now);
        data.members.retain(|_, expires| *expires > now);
        let untaken: Vec<String> = data
            .claims
            .iter()
            .filter(|(_, expires)| **expires <= now)
            .map(|(id, _)| id.clone())
            .collect();
        if !untaken.is_empty() {
            let gone: HashSet<String> = untaken.iter().map(|id| token(id).to_owned()).collect();
            for id in &untaken {
                data.claims.remove(id);
                data.holders.remove(id);
            }
            let dead: Vec<String> = data
                .queue
                .values()
                .filter(|id| gone.contains(token(id)))
                .cloned()
                .collect();
            for id in dead {
                self.drop_ticket(&id);
            }
            for member in &gone {
                self.data.members.remove(member);
            }
        }
        let expired: Vec<String> = self
            .data
            .waiting
            .iter()
            .filter(|(_, expires)| **expires <= now)
            .map(|(id, _)| id.clone())
            .collect();
        for id in expired {
            self.drop_ticket(&id);
        }
        *self.data.capacity.get_or_insert(default_capacity)
    }

    pub(super) fn drop_ticket(&mut self, id: &str) {
        if let Some(arrival) = self.data.arrival_of.remove(id) {
            self.data.queue.remove(&arrival);
        }
        self.data.waiting.remove(id);
    }

    pub(super) fn capacity(&self) -> usize {
        self.data.capacity.unwrap_or(0)
    }

    /// Hands the free places to the first waiters, as claims, and tells every member.
    pub(super) fn promote(&mut self) {
        let free = self.capacity().saturating_sub(self.data.holders.len());
        if free == 0 {
            return;
        }
        let first: Vec<String> = self.data.queue.values().take(free).cloned().collect();
        if first.is_empty() {
            return;
        }
        let expires = self.now + self.claim;
        for id in &first {
            self.data.holders.insert(id.clone(), expires);
            self.data.claims.insert(id.clone(), expires);
            self.drop_ticket(id);
        }
        let window = self.data.adaptive.epoch.unwrap_or(0);
        self.published.push(Event::Handed { window, ids: first });
    }

    pub(super) fn alive(&mut self, member: &str) -> usize {
        self.data
            .members
            .insert(member.to_owned(), self.now + self.ttl);
        self.data.members.len()
    }

    pub(super) fn lease(&mut self, id: &str) {
        self.data.holders.insert(id.to_owned(), self.now + self.ttl);
        self.data.claims.remove(id);
    }

    pub(super) fn queued(&self, id: &str) -> bool {
        self.data.arrival_of.contains_key(id)
    }

    pub(super) fn extend_ticket(&mut self, id: &str) {
        self.data.waiting.insert(id.to_owned(), self.now + self.ttl);
    }

    /// Places held by members not heard from within half a lease TTL.
    pub(super) fn unheard(&self) -> usize {
        let quiet: HashSet<&str> = self
            .data
            .members
            .iter()
            .filter(|(_, expires)| **expires <= self.now + self.ttl / 2)
            .map(|(member, _)| member.as_str())
            .collect();
        self.data
            .holders
            .keys()
            .filter(|id| quiet.contains(token(id)))
            .count()
    }
}
