//! [`Doorbell`]: how a limit's handles and listener hurry its refresh loop.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use super::books::lock;

/// Refreshes wanted within this of each other are made as one, at the later: a place handed to
/// another process every millisecond asks for one refresh per this, not one per place.
const GRAIN: Duration = Duration::from_millis(20);

/// How the handles and the listener hurry the refresh loop.
#[derive(Debug)]
pub(crate) struct Doorbell {
    notify: Notify,
    probe: AtomicBool,
    /// Refreshes wanted, each by its time, in order: a place handed to another process's
    /// waiter, to be found at once if its claim expires untaken. Each is kept until a refresh
    /// that started after it: one wanted sooner does not stand for one wanted later.
    by: Mutex<VecDeque<Instant>>,
}

impl Default for Doorbell {
    fn default() -> Self {
        Self {
            notify: Notify::new(),
            probe: AtomicBool::new(false),
            by: Mutex::new(VecDeque::new()),
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

    /// Refresh at `at` (or soon after): a claim handed to another process expires then.
    pub(crate) fn refresh_at(&self, at: Instant) {
        {
            let mut by = lock(&self.by);
            match by.back_mut() {
                Some(last) if at <= *last + GRAIN => *last = (*last).max(at),
                _ => by.push_back(at),
            }
        }
        self.notify.notify_one();
    }

    /// The soonest refresh wanted, if any.
    pub(crate) fn next_wanted(&self) -> Option<Instant> {
        lock(&self.by).front().copied()
    }

    /// A refresh that started at `started` is done: every refresh wanted by then is made.
    pub(crate) fn refreshed(&self, started: Instant) {
        let mut by = lock(&self.by);
        while by.front().is_some_and(|at| *at <= started) {
            by.pop_front();
        }
    }

    /// Resolves when rung.
    pub(crate) async fn rung(&self) {
        self.notify.notified().await;
    }
}
