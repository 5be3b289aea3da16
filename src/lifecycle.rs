//! The one path every operation takes, whoever drives it (the layer, the per-request layer,
//! the response body, [`resources_operation`](crate::resources_operation)).
//!
//! An operation that asks for a permit is exactly one of: admitted (one queue sample, then
//! [`Running`] until it ends, one duration sample), rejected (by reason), or abandoned (its
//! caller went away while it waited). [`Waiting`] is the operation between asking and one of
//! those; [`Running`] the admitted operation. Both are guards: whatever drops them records the
//! end that a drop means (abandoned; cancelled or, past a deadline, timeout), exactly once.

use std::borrow::Borrow;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Duration;

use crate::metrics::Series;
use crate::{Outcome, Rejection};

/// A drop of an operation that had a deadline counts as `timeout` when it comes this close to
/// the deadline (or a tenth of it, for short ones): the operation started to wait a little after
/// its caller started the clock.
const DEADLINE_SLACK: Duration = Duration::from_millis(10);

/// An operation waiting for its permit: counted in `queued` until it is admitted, rejected, or
/// dropped (abandoned).
pub(crate) struct Waiting<H: Borrow<Series>> {
    /// `None` once the wait has ended.
    series: Option<H>,
    /// When it started to wait, on the metrics' clock.
    since: i64,
}

impl<H: Borrow<Series>> Waiting<H> {
    /// The operation starts to wait; `None` if its metrics are disabled.
    pub(crate) fn start(series: H) -> Option<Self> {
        let shared = series.borrow().shared()?;
        shared.start_waiting(series.borrow().index());
        let since = shared.now().unwrap_or(UNKNOWN);
        Some(Self {
            series: Some(series),
            since,
        })
    }

    /// The operation got its permit.
    pub(crate) fn admit(mut self) -> Running<H> {
        let series = self.series.take().expect("a wait ends once");
        admit(series, Some(self.since))
    }

    /// The operation was turned away after waiting.
    pub(crate) fn reject(mut self, rejection: Rejection) {
        if let Some(series) = self.series.take() {
            let series = series.borrow();
            if let Some(shared) = series.shared() {
                shared.reject(series.index(), rejection, true);
            }
        }
    }
}

impl<H: Borrow<Series>> Drop for Waiting<H> {
    fn drop(&mut self) {
        if let Some(series) = self.series.take() {
            let series = series.borrow();
            if let Some(shared) = series.shared() {
                shared.abandon(series.index(), true);
            }
        }
    }
}

/// Admits an operation: records its queue sample (0 if it never waited, the time since
/// `waited_since` otherwise) and counts it as active.
pub(crate) fn admit<H: Borrow<Series>>(series: H, waited_since: Option<i64>) -> Running<H> {
    let Some(shared) = series.borrow().shared() else {
        return Running::EMPTY;
    };
    let now = shared.now().unwrap_or(UNKNOWN);
    let queued_ns = match waited_since {
        Some(since) if since != UNKNOWN && now != UNKNOWN => now.saturating_sub(since).max(0),
        _ => 0,
    };
    shared.admit(series.borrow().index(), waited_since.is_some(), queued_ns);
    Running {
        series: Some(series),
        start: now,
        queued_us: u32::try_from(queued_ns / 1_000).unwrap_or(u32::MAX),
        deadline_ms: 0,
        chosen: None,
    }
}

/// An operation turned away without waiting.
pub(crate) fn reject(series: &Series, rejection: Rejection) {
    if let Some(shared) = series.shared() {
        shared.reject(series.index(), rejection, false);
    }
}

/// An operation whose limit failed before it had to wait: it counts as abandoned.
pub(crate) fn abandon(series: &Series) {
    if let Some(shared) = series.shared() {
        shared.abandon(series.index(), false);
    }
}

/// An instant the clock could not read: a duration from or to it is 0.
const UNKNOWN: i64 = i64::MIN;

/// An admitted operation: counted as active until it ends, and recorded exactly once, with the
/// outcome it ended with. Dropped before that, it ends as `cancelled` (or `timeout`, past its
/// deadline).
#[derive(Debug)]
pub(crate) struct Running<H: Borrow<Series>> {
    /// `None` once recorded, or when there is nothing to record.
    series: Option<H>,
    /// When it was admitted, on the metrics' clock.
    start: i64,
    /// How long it waited before that, in microseconds.
    queued_us: u32,
    /// How long its caller waits for it, from when it asked for the permit, in whole
    /// milliseconds; 0 for no deadline.
    deadline_ms: u32,
    /// The outcome [`set_outcome`](crate::set_outcome) chose, if it did.
    chosen: Option<Outcome>,
}

impl<H: Borrow<Series>> Running<H> {
    /// Nothing to record: what an operation whose metrics are disabled carries.
    pub(crate) const EMPTY: Self = Self {
        series: None,
        start: UNKNOWN,
        queued_us: 0,
        deadline_ms: 0,
        chosen: None,
    };

    /// Whether the end is still to be recorded.
    #[inline]
    pub(crate) fn is_recording(&self) -> bool {
        self.series.is_some()
    }

    /// The outcome [`set_outcome`](crate::set_outcome) chose, if it did.
    #[inline]
    pub(crate) fn chosen_outcome(&self) -> Option<Outcome> {
        self.chosen
    }

    /// Keeps the outcome [`set_outcome`](crate::set_outcome) chose, to win over any other.
    #[inline]
    pub(crate) fn choose_outcome(&mut self, outcome: Option<Outcome>) {
        self.chosen = outcome;
    }

    /// The caller waits for the operation `deadline` from when it asked for its permit: a drop
    /// past it ends the operation as `timeout`, not `cancelled`.
    pub(crate) fn set_deadline(&mut self, deadline: Duration) {
        self.deadline_ms = u32::try_from(deadline.as_millis())
            .unwrap_or(u32::MAX)
            .max(1);
    }

    /// Ends the operation with `outcome`, unless [`set_outcome`](crate::set_outcome) chose one.
    /// Only the first end records.
    #[inline]
    pub(crate) fn finish(&mut self, outcome: Outcome) {
        if self.series.is_some() {
            self.end(Some(outcome));
        }
    }

    /// Ends the operation with what `classify` says, unless [`set_outcome`](crate::set_outcome)
    /// chose an outcome (then `classify` does not run). A `classify` that panics costs the
    /// operation its outcome (`error`), never the caller its answer.
    #[inline]
    pub(crate) fn finish_with(&mut self, classify: impl FnOnce() -> Outcome) {
        if self.series.is_some() {
            let outcome = match self.chosen {
                Some(chosen) => chosen,
                None => catch_unwind(AssertUnwindSafe(classify)).unwrap_or(Outcome::Error),
            };
            self.end(Some(outcome));
        }
    }

    #[inline(never)]
    fn end(&mut self, outcome: Option<Outcome>) {
        let Some(series) = self.series.take() else {
            return;
        };
        let series = series.borrow();
        // Resolved when the operation was admitted.
        let Some(shared) = series.shared() else {
            return;
        };
        let now = shared.now().unwrap_or(UNKNOWN);
        let outcome = self.chosen.or(outcome).unwrap_or_else(|| self.dropped(now));
        let ran_ns = if self.start == UNKNOWN || now == UNKNOWN {
            0
        } else {
            now.saturating_sub(self.start).max(0)
        };
        shared.end(series.index(), outcome, ran_ns);
    }

    /// The outcome of an operation dropped at `now`: `timeout` if its deadline has passed,
    /// `cancelled` otherwise.
    fn dropped(&self, now: i64) -> Outcome {
        if now == UNKNOWN || self.start == UNKNOWN || self.deadline_ms == 0 {
            return Outcome::Cancelled;
        }
        let deadline = Duration::from_millis(u64::from(self.deadline_ms));
        let slack = DEADLINE_SLACK.min(deadline / 10);
        let waited = Duration::from_micros(u64::from(self.queued_us));
        let ran = Duration::from_nanos(u64::try_from(now.saturating_sub(self.start)).unwrap_or(0));
        if waited + ran + slack >= deadline {
            Outcome::Timeout
        } else {
            Outcome::Cancelled
        }
    }
}

impl<H: Borrow<Series>> Drop for Running<H> {
    #[inline]
    fn drop(&mut self) {
        if self.series.is_some() {
            self.end(None);
        }
    }
}
