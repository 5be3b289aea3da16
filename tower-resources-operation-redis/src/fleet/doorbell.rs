//! [`Doorbell`]: how a limit's handles and listener hurry its refresh loop.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use tokio::sync::Notify;
use tokio::time::Instant;

/// How the handles and the listener hurry the refresh loop.
#[derive(Debug)]
pub(crate) struct Doorbell {
    notify: Notify,
    probe: AtomicBool,
    /// A refresh wanted by then (ns since `origin`, 0 for none): a place handed to another
    /// process's waiter, to be found if its claim expires untaken.
    by: AtomicU64,
    origin: Instant,
}

impl Default for Doorbell {
    fn default() -> Self {
        Self {
            notify: Notify::new(),
            probe: AtomicBool::new(false),
            by: AtomicU64::new(0),
            origin: Instant::now(),
        }
    }
}

impl Doorbell {
    /// Refresh at least every fallback poll from now: a waiter joined the queue, or a release
    /// is to be retried.
    pub(crate) fn hurry(&self) {
        self.notify.notify_one();
    }

    /// Ask the store at once: an outage started.
    pub(crate) fn probe(&self) {
        self.probe.store(true, Ordering::Release);
        self.notify.notify_one();
    }

    /// Whether a probe was asked for since the last call.
    pub(crate) fn take_probe(&self) -> bool {
        self.probe.swap(false, Ordering::AcqRel)
    }

    /// Refresh by `at` at the latest (an earlier request stands).
    pub(crate) fn refresh_by(&self, at: Instant) {
        let ns = u64::try_from(at.saturating_duration_since(self.origin).as_nanos())
            .unwrap_or(u64::MAX)
            .max(1);
        let before = self.by.load(Ordering::Acquire);
        if before == 0 || ns < before {
            // A race with another request keeps one of the two: both are at most a claim
            // timeout off, and the refresh asks again when it finds work to do.
            self.by.store(ns, Ordering::Release);
            self.notify.notify_one();
        }
    }

    /// The refresh wanted soonest, if any, forgotten once taken.
    pub(crate) fn take_by(&self) -> Option<Instant> {
        match self.by.swap(0, Ordering::AcqRel) {
            0 => None,
            ns => Some(self.origin + std::time::Duration::from_nanos(ns)),
        }
    }

    /// Resolves when rung.
    pub(crate) async fn rung(&self) {
        self.notify.notified().await;
    }
}
