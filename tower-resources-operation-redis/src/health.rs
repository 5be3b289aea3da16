//! Whether a limit reaches Redis, and what it says about it.
//!
//! After the first failure the limit is *down*: callers are answered at once (turned away, or
//! admitted without the fleet limit) with the failure that started it, instead of each waiting
//! a whole call timeout, and the background task asks Redis again every fallback poll. The
//! first call that succeeds, whoever makes it, brings the limit back up. Each outage is said
//! once, with the address and the cause, and its end once.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

use crate::error::Error;
use crate::waiters::lock;

/// Up or down, and the answer while down.
pub(crate) struct Health {
    limit: &'static str,
    fail_open: bool,
    retry_every: Duration,
    down: AtomicBool,
    outage: Mutex<Option<Outage>>,
}

/// An outage under way.
struct Outage {
    /// The answer given meanwhile: the failure that started it, short-circuited.
    answer: Error,
    since: Instant,
}

impl Health {
    pub(crate) fn new(limit: &'static str, fail_open: bool, retry_every: Duration) -> Self {
        Self {
            limit,
            fail_open,
            retry_every,
            down: AtomicBool::new(false),
            outage: Mutex::new(None),
        }
    }

    /// Whether the last call failed: callers are answered without asking.
    pub(crate) fn is_down(&self) -> bool {
        self.down.load(Ordering::Acquire)
    }

    /// The answer to give without asking while down, if it is down.
    pub(crate) fn answer(&self) -> Option<Error> {
        if !self.is_down() {
            return None;
        }
        lock(&self.outage)
            .as_ref()
            .map(|outage| outage.answer.clone())
    }

    /// A call failed with `error`: `true` if it was up until now (the outage starts here, and
    /// is said once).
    pub(crate) fn failed(&self, error: &Error) -> bool {
        if !error.is_unavailable() {
            // Redis answered: reached, if wrongly (a script error, authentication).
            self.reached();
            return false;
        }
        let mut outage = lock(&self.outage);
        let started = outage.is_none();
        match outage.as_mut() {
            Some(outage) => outage.answer = error.short_circuited(),
            None => {
                *outage = Some(Outage {
                    answer: error.short_circuited(),
                    since: Instant::now(),
                })
            }
        }
        self.down.store(true, Ordering::Release);
        drop(outage);
        if started {
            let what = if self.fail_open {
                "admits operations at once without the fleet limit (fail open)"
            } else {
                "turns operations away at once as unavailable (fail closed)"
            };
            warn(
                self.limit,
                &format!(
                    "{error}. Until Redis answers again the limit {what}, and asks Redis again \
                     every {:?} in the background",
                    self.retry_every
                ),
            );
        }
        started
    }

    /// A call reached Redis: `true` if it was down until now (the outage ends here).
    pub(crate) fn reached(&self) -> bool {
        if !self.is_down() {
            return false;
        }
        let outage = {
            let mut outage = lock(&self.outage);
            let Some(ended) = outage.take() else {
                return false;
            };
            self.down.store(false, Ordering::Release);
            ended
        };
        info(
            self.limit,
            &format!(
                "tower-resources-operation-redis: the fleet limit {:?} reaches Redis at {} \
                 again, after {:?}",
                self.limit,
                outage.answer.address(),
                outage.since.elapsed()
            ),
        );
        true
    }
}

/// A warning about the limit `limit`: through `tracing` with the feature, else on standard
/// error.
pub(crate) fn warn(limit: &'static str, message: &str) {
    #[cfg(feature = "tracing")]
    tracing::warn!(target: "tower_resources_operation_redis", limit, "{message}");
    #[cfg(not(feature = "tracing"))]
    {
        let _ = limit;
        eprintln!("WARN tower_resources_operation_redis: {message}");
    }
}

/// News worth a line about the limit `limit`: through `tracing` with the feature, else
/// nothing.
fn info(limit: &'static str, message: &str) {
    #[cfg(feature = "tracing")]
    tracing::info!(target: "tower_resources_operation_redis", limit, "{message}");
    #[cfg(not(feature = "tracing"))]
    let _ = (limit, message);
}
