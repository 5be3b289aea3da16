//! [`MemoryStore`]: the fleet's [`Store`] kept in this process, for the fleet's tests on paused
//! time: several members (each a [`Member`](crate::fleet::member::Member) of its own, as
//! replicas are) share one [`MemoryFleet`], as replicas share Redis. Each step is the Redis
//! script of the same name, step for step, under one lock, on tokio's clock (so that paused time
//! drives every expiry); what a script publishes is sent to every member's channel. The fleet can
//! be taken out of reach, and back, and lose its data, as a Redis server can.
//!
//! It is the trait's second user: nothing in [`Store`] had to change for it but what both stores
//! answer (the places held by members not heard from).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};
use tokio::time::Instant;

use crate::error::{Error, ErrorKind};
use crate::fleet::books::lock;
use crate::fleet::store::{Decision, Event, Refresh, Refreshed, State, Store, Taken, Tick, Ticked};

#[cfg(test)]
mod model;
mod scripts;
mod step;
#[cfg(test)]
pub(crate) mod tests;
mod windows;

use step::{Data, Step};

/// A store several members share: the data, who hears what is published, and whether it can
/// be reached.
#[derive(Default)]
pub(crate) struct MemoryFleet {
    data: Mutex<Data>,
    members: Mutex<Vec<UnboundedSender<Event>>>,
    away: AtomicBool,
}

/// One member's way to the shared store.
pub(crate) struct MemoryStore {
    fleet: Arc<MemoryFleet>,
    name: Arc<str>,
    capacity: usize,
    lease_ttl: Duration,
    claim_timeout: Duration,
    max_queued: Option<usize>,
    /// How long each of this member's steps takes on its way to the store, by the step's name
    /// (none: at once), so that a test can make one call overtake another.
    latency: Mutex<HashMap<&'static str, Duration>>,
}

impl MemoryFleet {
    /// A member's store, with what the fleet publishes for it to hear.
    pub(crate) fn member(
        self: &Arc<Self>,
        name: &Arc<str>,
        capacity: usize,
        lease_ttl: Duration,
        claim_timeout: Duration,
        max_queued: Option<usize>,
    ) -> (MemoryStore, UnboundedReceiver<Event>) {
        let (events, heard) = unbounded_channel();
        lock(&self.members).push(events);
        let store = MemoryStore {
            fleet: Arc::clone(self),
            name: Arc::clone(name),
            capacity,
            lease_ttl,
            claim_timeout,
            max_queued,
            latency: Mutex::default(),
        };
        (store, heard)
    }

    /// Out of reach (every call fails at once), or back: every member hears that the
    /// connection came back, as a Redis client does.
    pub(crate) fn set_away(&self, away: bool) {
        let was = self.away.swap(away, Ordering::SeqCst);
        if was && !away {
            self.publish(&[Event::Reconnected]);
        }
    }

    /// Loses every key, as a Redis server restarted without persistence.
    pub(crate) fn wipe(&self) {
        *lock(&self.data) = Data::default();
    }

    /// Pushes `event` to every member, as if a script had published it.
    pub(crate) fn announce(&self, event: Event) {
        self.publish(&[event]);
    }

    /// The fleet's window is `epoch` from now on (an adaptive limit's, as its leader's ticks
    /// would have made it).
    pub(crate) fn set_epoch(&self, epoch: u64) {
        lock(&self.data).adaptive.epoch = Some(epoch);
    }

    /// Drops the ticket `id` from the queue, as its expiry would.
    pub(crate) fn drop_ticket(&self, id: &str) {
        let mut data = lock(&self.data);
        if let Some(arrival) = data.arrival_of.remove(id) {
            data.queue.remove(&arrival);
        }
        data.waiting.remove(id);
    }

    /// Tickets waiting now, in order.
    pub(crate) fn queue(&self) -> Vec<String> {
        lock(&self.data).queue.values().cloned().collect()
    }

    /// Leases and claims held now, by id: what no test can see through a member.
    pub(crate) fn holders(&self) -> Vec<String> {
        let mut ids: Vec<String> = lock(&self.data).holders.keys().cloned().collect();
        ids.sort();
        ids
    }

    fn publish(&self, events: &[Event]) {
        let members = lock(&self.members);
        for member in members.iter() {
            for event in events {
                let _ = member.send(event.clone());
            }
        }
    }
}

impl MemoryStore {
    /// This member's calls of `step` (`"take"`, `"release"`, `"refresh"`, ...) take `latency`
    /// on their way to the store.
    pub(crate) fn set_latency(&self, step: &'static str, latency: Duration) {
        lock(&self.latency).insert(step, latency);
    }

    /// Runs `step` (the script `name`) as one script, after its latency, or fails while the
    /// fleet is away.
    async fn step<T>(
        &self,
        name: &'static str,
        step: impl FnOnce(&mut Step<'_>, usize) -> T,
    ) -> Result<T, Error> {
        let latency = lock(&self.latency).get(name).copied();
        if let Some(latency) = latency {
            tokio::time::sleep(latency).await;
        }
        if self.fleet.away.load(Ordering::SeqCst) {
            return Err(Error::new(
                ErrorKind::Unreachable,
                &self.name,
                self.address(),
                "the store is out of reach".to_owned(),
                None,
            ));
        }
        let (answer, published) = {
            let mut data = lock(&self.fleet.data);
            let mut step_data = Step {
                data: &mut data,
                now: Instant::now(),
                ttl: self.lease_ttl,
                claim: self.claim_timeout,
                published: Vec::new(),
            };
            let capacity = step_data.prelude(self.capacity);
            let answer = step(&mut step_data, capacity);
            (answer, step_data.published)
        };
        self.fleet.publish(&published);
        Ok(answer)
    }
}

impl Store for MemoryStore {
    fn address(&self) -> &str {
        "memory"
    }

    async fn connect(&self) -> Result<(), Error> {
        self.step("connect", |_, _| ()).await
    }

    async fn take(&self, id: &str) -> Result<Taken, Error> {
        let max_queued = self.max_queued;
        self.step("take", |step, _| scripts::take(step, id, max_queued))
            .await
    }

    async fn release(&self, ids: &[String]) -> Result<usize, Error> {
        self.step("release", |step, _| scripts::release(step, ids))
            .await
    }

    async fn refresh(&self, books: &Refresh<'_>) -> Result<Refreshed, Error> {
        self.step("refresh", |step, _| scripts::refresh(step, books))
            .await
    }

    async fn set_capacity(&self, capacity: usize) -> Result<usize, Error> {
        self.step("set_capacity", |step, _| {
            scripts::set_capacity(step, capacity)
        })
        .await
    }

    async fn state(&self, member: &str) -> Result<State, Error> {
        self.step("state", |step, _| scripts::state(step, member))
            .await
    }

    async fn tick(&self, tick: &Tick<'_>) -> Result<Ticked, Error> {
        self.step("tick", |step, _| windows::tick(step, tick)).await
    }

    async fn decide(&self, decision: &Decision<'_>) -> Result<Option<usize>, Error> {
        self.step("decide", |step, _| windows::decide(step, decision))
            .await
    }
}
