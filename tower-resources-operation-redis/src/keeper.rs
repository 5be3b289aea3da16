//! The limit's background work in this process, as one future, [`Background`]: three loops,
//! each of which waits for its own thing, so that none waits behind another.
//!
//! - **Releases** go out as soon as they come (batched: whatever came while the last call was
//!   under way goes in the next). While Redis is down they are not sent but kept for a retry
//!   (for up to a TTL: after that the lease expired anyway).
//! - **The refresh** extends this process's leases and tickets every third of the TTL (every
//!   fallback poll while anything waits, a release is to be retried, or Redis is down: then it
//!   is also the probe that ends the outage), and sends the retried releases after it. It
//!   checks its own deadline before it waits for anything, so no stream of wake-ups can put it
//!   off: `tokio::time::timeout` polls what it wraps first, and a loop around
//!   `timeout_at(next, recv())` never reaches its periodic branch while a message is always
//!   waiting.
//! - **The listener** routes what the connection hears on the limit's channel: places handed
//!   to this process's waiters, a new capacity, a dropped or renewed connection.
//!
//! - **The decisions** of an adaptive limit: every tick, this process's counts go to the
//!   fleet's window, and the leader (whichever process holds the leader's lease) takes the
//!   window once it is due and runs the algorithm on it.
//!
//! It ends once every handle and permit of the limit is gone, after a last try at the
//! releases it still has.

use std::collections::HashSet;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use redis::{FromRedisValue, PushInfo, PushKind};
use tokio::sync::mpsc::UnboundedReceiver;
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::core::Core;
use crate::fleet_control::decide;
use crate::waiters::lock;

/// The most ids given back in one call.
const BATCH: usize = 512;

/// How the handles hurry the refresh loop.
#[derive(Debug, Default)]
pub(crate) struct Doorbell {
    notify: Notify,
    probe: AtomicBool,
}

impl Doorbell {
    /// Refresh at least every fallback poll from now: a waiter joined the queue, or a release
    /// is to be retried.
    pub(crate) fn hurry(&self) {
        self.notify.notify_one();
    }

    /// Ask Redis at once: an outage started.
    pub(crate) fn probe(&self) {
        self.probe.store(true, Ordering::Release);
        self.notify.notify_one();
    }
}

/// Releases that could not be sent, and since when.
type Retries = Mutex<Vec<(String, Instant)>>;

type Task = Pin<Box<dyn Future<Output = ()> + Send>>;

/// A fleet limit's background work in this process: sending releases, refreshing leases and
/// tickets (and asking Redis again while it is down), and hearing what is published on the
/// limit's channel. See [`RedisLimitBuilder::build_pair`](crate::RedisLimitBuilder::build_pair).
///
/// Run it on a tokio runtime with its time and IO drivers enabled, for as long as the limit
/// serves (`tokio::spawn(background)` does). It ends by itself once every handle and permit of
/// its limit is gone. While it does not run, releases wait (a lease is given back within the
/// TTL anyway, when it expires), held leases are not extended (so they are lost after a TTL),
/// and a waiter whose wake-up was lost waits a TTL before it asks again.
#[must_use = "a limit's background work runs only while this future is polled"]
pub struct Background {
    limit: &'static str,
    releases: Task,
    refresh: Option<Task>,
    listen: Option<Task>,
    /// An adaptive limit's ticks and decisions.
    decide: Option<Task>,
}

impl Background {
    pub(crate) fn new(
        core: Arc<Core>,
        releases: UnboundedReceiver<String>,
        pushes: UnboundedReceiver<PushInfo>,
    ) -> Self {
        let retries: Arc<Retries> = Arc::default();
        Self {
            limit: core.name,
            releases: Box::pin(send_releases(
                Arc::clone(&core),
                Arc::clone(&retries),
                releases,
            )),
            refresh: Some(Box::pin(refresh(Arc::clone(&core), retries))),
            decide: core
                .adaptive
                .is_some()
                .then(|| Box::pin(decide(Arc::clone(&core))) as Task),
            listen: Some(Box::pin(listen(core, pushes))),
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
            .field("limit", &self.limit)
            .finish_non_exhaustive()
    }
}

/// Sends releases as they come, batched; keeps them for a retry while Redis is down or when a
/// call fails. Ends when every handle and permit is gone.
async fn send_releases(
    core: Arc<Core>,
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
        if core.health.is_down() || core.release(&ids).await.is_err() {
            let now = Instant::now();
            lock(&retries).extend(ids.into_iter().map(|id| (id, now)));
            core.keeper.hurry();
        }
    }
    // Gone: the releases still to be made, once.
    let ids: Vec<String> = lock(&retries)
        .drain(..)
        .filter(|(_, at)| at.elapsed() < core.lease_ttl)
        .map(|(id, _)| id)
        .collect();
    for batch in ids.chunks(BATCH) {
        if core.health.is_down() || core.release(batch).await.is_err() {
            return;
        }
    }
}

/// Refreshes every third of the TTL (the fallback poll when urgent), and at once when an
/// outage starts. Never ends by itself.
async fn refresh(core: Arc<Core>, retries: Arc<Retries>) {
    let urgent = |retries: &Retries| !lock(retries).is_empty();
    let mut next = Instant::now() + core.every(false);
    loop {
        // The deadline first, whatever else is asked meanwhile.
        let now = Instant::now();
        if core.keeper.probe.swap(false, Ordering::AcqRel) {
            next = now;
        }
        if now >= next {
            tick(&core, &retries).await;
            // A probe asked while this one ran is answered by it.
            core.keeper.probe.store(false, Ordering::Release);
            next = Instant::now() + core.every(urgent(&retries));
            continue;
        }
        // Woken early: perhaps sooner now (a waiter queued, a release to retry, an outage).
        let _ = tokio::time::timeout_at(next, core.keeper.notify.notified()).await;
        next = next.min(Instant::now() + core.every(urgent(&retries)));
    }
}

/// One refresh (the probe while Redis is down), then the releases to retry.
async fn tick(core: &Core, retries: &Retries) {
    let ids: Vec<String> = {
        let mut retries = lock(retries);
        // A lease given back after it expired is moot.
        retries.retain(|(_, at)| at.elapsed() < core.lease_ttl);
        retries.iter().map(|(id, _)| id.clone()).collect()
    };
    core.refresh().await;
    let mut sent = HashSet::new();
    for batch in ids.chunks(BATCH) {
        if core.health.is_down() || core.release(batch).await.is_err() {
            break;
        }
        sent.extend(batch.iter().cloned());
    }
    if !sent.is_empty() {
        lock(retries).retain(|(id, _)| !sent.contains(id));
    }
}

/// Routes what the connection hears on the limit's channel, and makes every waiter ask again
/// when the connection drops or comes back.
async fn listen(core: Arc<Core>, mut pushes: UnboundedReceiver<PushInfo>) {
    while let Some(push) = pushes.recv().await {
        match push.kind {
            PushKind::Message => {
                if let Some(Ok(message)) = push.data.get(1).map(String::from_redis_value) {
                    core.heard(&message);
                }
            }
            PushKind::Disconnection | PushKind::Subscribe => core.poll_all(),
            _ => {}
        }
    }
}
