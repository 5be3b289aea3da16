//! The limit's background work in this process, as one future, [`Background`]: four loops, each
//! of which waits for its own thing, so that none waits behind another.
//!
//! - **Releases** go out as soon as they come (batched: whatever came while the last call was
//!   under way goes in the next). While the store is down they are not sent but kept for a
//!   retry (for up to a TTL: after that the lease expired anyway).
//! - **The refresh** says this process is alive and extends its leases and tickets every third
//!   of the TTL (every fallback poll while anything waits, a release is to be retried, or the
//!   store is down: then it is also the probe that ends the outage), sooner when a place was
//!   handed to another process's waiter (if that process is gone, its claim expires untaken and
//!   the place is found at once), and sends the retried releases after it. It checks its own
//!   deadline before it waits for anything, so no stream of wake-ups can put it off:
//!   `tokio::time::timeout` polls what it wraps first, and a loop around
//!   `timeout_at(next, recv())` never reaches its periodic branch while a message is always
//!   waiting.
//! - **The listener** routes what the store pushes: places handed to this process's waiters, a
//!   new capacity, a decision, a dropped or renewed connection.
//! - **The decisions** of an adaptive limit: every tick, this process's counts go to the fleet's
//!   window, and the leader (whichever process holds the leader's lease) takes the window once
//!   it is due and runs the algorithm on it.
//!
//! It ends once every handle and permit of the limit is gone, after a last try at the releases
//! it still has.

use std::collections::HashSet;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use tokio::sync::mpsc::UnboundedReceiver;
use tokio::time::Instant;

use super::books::lock;
use super::leader;
use super::member::Member;
use super::store::{Event, Store};

/// The most ids given back in one call.
const BATCH: usize = 512;

/// Releases that could not be sent, and since when.
type Retries = Mutex<Vec<(String, Instant)>>;

type Task = Pin<Box<dyn Future<Output = ()> + Send>>;

/// A fleet limit's background work in this process: sending releases, refreshing leases and
/// tickets (and asking the store again while it is down), hearing what the store pushes, and,
/// for an adaptive limit, its ticks and decisions. See
/// [`RedisLimitBuilder::build_pair`](crate::RedisLimitBuilder::build_pair).
///
/// Run it on a tokio runtime with its time and IO drivers enabled, for as long as the limit
/// serves (`tokio::spawn(background)` does). It ends by itself once every handle and permit of
/// its limit is gone. While it does not run, releases wait (a lease is given back within the
/// TTL anyway, when it expires), held leases are not extended (so they are lost after a TTL),
/// and a waiter whose wake-up was lost waits a TTL before it asks again.
#[must_use = "a limit's background work runs only while this future is polled"]
pub struct Background {
    limit: std::sync::Arc<str>,
    releases: Task,
    refresh: Option<Task>,
    listen: Option<Task>,
    /// An adaptive limit's ticks and decisions.
    decide: Option<Task>,
}

impl Background {
    pub(crate) fn new<S: Store>(
        member: Arc<Member<S>>,
        releases: UnboundedReceiver<String>,
        events: UnboundedReceiver<Event>,
    ) -> Self {
        let retries: Arc<Retries> = Arc::default();
        Self {
            limit: Arc::clone(&member.settings.name),
            releases: Box::pin(send_releases(
                Arc::clone(&member),
                Arc::clone(&retries),
                releases,
            )),
            refresh: Some(Box::pin(refresh(Arc::clone(&member), retries))),
            decide: member
                .control
                .is_some()
                .then(|| Box::pin(leader::decide(Arc::clone(&member))) as Task),
            listen: Some(Box::pin(listen(member, events))),
        }
    }
}

impl Future for Background {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        if this.releases.as_mut().poll(cx).is_ready() {
            // The limit is gone.
            this.refresh = None;
            this.listen = None;
            this.decide = None;
            return Poll::Ready(());
        }
        for task in [&mut this.refresh, &mut this.listen, &mut this.decide] {
            if let Some(running) = task {
                if running.as_mut().poll(cx).is_ready() {
                    *task = None;
                }
            }
        }
        Poll::Pending
    }
}

impl fmt::Debug for Background {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Background")
            .field("limit", &&*self.limit)
            .finish_non_exhaustive()
    }
}

/// Sends releases as they come, batched; keeps them for a retry while the store is down or
/// when a call fails. Ends when every handle and permit is gone.
async fn send_releases<S: Store>(
    member: Arc<Member<S>>,
    retries: Arc<Retries>,
    mut releases: UnboundedReceiver<String>,
) {
    while let Some(first) = releases.recv().await {
        let mut ids = vec![first];
        while ids.len() < BATCH {
            match releases.try_recv() {
                Ok(id) => ids.push(id),
                Err(_) => break,
            }
        }
        if member.health.is_down() || member.release(&ids).await.is_err() {
            let now = Instant::now();
            lock(&retries).extend(ids.into_iter().map(|id| (id, now)));
            member.doorbell.hurry();
        }
    }
    // Gone: the releases still to be made, once.
    let ids: Vec<String> = lock(&retries)
        .drain(..)
        .filter(|(_, at)| at.elapsed() < member.settings.lease_ttl)
        .map(|(id, _)| id)
        .collect();
    for batch in ids.chunks(BATCH) {
        if member.health.is_down() || member.release(batch).await.is_err() {
            return;
        }
    }
}

/// Refreshes at once, then every third of the TTL (the fallback poll when urgent, sooner when
/// asked by a handed-over place), and at once when an outage starts. Never ends by itself.
async fn refresh<S: Store>(member: Arc<Member<S>>, retries: Arc<Retries>) {
    let urgent = |retries: &Retries| !lock(retries).is_empty();
    // At once: the process is counted among the replicas, and learns its share, from the
    // start.
    let mut next = Instant::now();
    loop {
        // The deadline first, whatever else is asked meanwhile.
        let now = Instant::now();
        if member.doorbell.take_probe() {
            next = now;
        }
        if let Some(wanted) = member.doorbell.next_wanted() {
            next = next.min(wanted);
        }
        if now >= next {
            tick(&member, &retries).await;
            member.doorbell.refreshed(now);
            // A probe asked while this one ran is answered by it.
            let _ = member.doorbell.take_probe();
            next = Instant::now() + member.every(urgent(&retries));
            continue;
        }
        // Woken early: perhaps sooner now (a waiter queued, a release to retry, an outage, a
        // place handed to another process).
        let _ = tokio::time::timeout_at(next, member.doorbell.rung()).await;
        next = next.min(Instant::now() + member.every(urgent(&retries)));
    }
}

/// One refresh (the probe while the store is down), then the releases to retry.
async fn tick<S: Store>(member: &Member<S>, retries: &Retries) {
    let ids: Vec<String> = {
        let mut retries = lock(retries);
        // A lease given back after it expired is moot.
        retries.retain(|(_, at)| at.elapsed() < member.settings.lease_ttl);
        retries.iter().map(|(id, _)| id.clone()).collect()
    };
    member.refresh().await;
    // Back on the fleet limit once the fleet has settled (the places this process admitted on
    // its share were in this refresh).
    member.settle();
    let mut sent = HashSet::new();
    for batch in ids.chunks(BATCH) {
        if member.health.is_down() || member.release(batch).await.is_err() {
            break;
        }
        sent.extend(batch.iter().cloned());
    }
    if !sent.is_empty() {
        lock(retries).retain(|(id, _)| !sent.contains(id));
    }
}

/// Routes what the store pushes.
async fn listen<S: Store>(member: Arc<Member<S>>, mut events: UnboundedReceiver<Event>) {
    while let Some(event) = events.recv().await {
        member.heard(event);
    }
}
