//! One operation, from asking for a permit to its end: the state machine that every form drives
//! (the layer's service, its response future and body, the per-request layer, and
//! [`resources_operation`](crate::resources_operation)).
//!
//! An operation that asks a limit for a permit is exactly one of:
//!
//! - **admitted**: it holds the permit, records its queue time, runs, and ends with an outcome,
//!   recorded once with its run time, *before* the permit goes back;
//! - **rejected**: the limit turned it away (a full queue, a queue timeout), or could not admit
//!   it (closed, its store out of reach: `unavailable`), counted by reason;
//! - **abandoned**: its caller went away while it waited.
//!
//! The three places a reader looks for are here: where the permit is taken
//! ([`Lifecycle::poll_admit`], the one acquire-or-refuse step), where the outcome is decided
//! ([`decide`]), and where user code runs guarded ([`Lifecycle::run`] for the work,
//! [`guarded`](crate::guard::guarded) for everything else). With metrics off an operation takes the same path with
//! nothing to record: it only holds its permit.

use std::cell::Cell;
use std::fmt;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::time::Instant;

use crate::guard::guarded;
use crate::limit::{AcquireError, Asking};
use crate::metrics::Series;
use crate::Outcome;

/// A drop of an operation that had a deadline counts as `timeout` when it comes this close to
/// the deadline (or a tenth of it, for short ones): the operation started to wait a little after
/// its caller started the clock.
const DEADLINE_SLACK: Duration = Duration::from_millis(10);

/// One operation: the permit it holds, and what it records.
///
/// `K` is what it carries to decide its outcome when its work returns: nothing while a service
/// prepares it, the classifier in a response future, the end-of-stream rule in a body.
///
/// It is admitted while it holds its permit. With nothing to record it is only its permit and a
/// null pointer, and has no drop code of its own, so that a response future is built, moved and
/// dropped as cheaply as tower's. What a drop means (an abandoned wait, a cancelled operation) is
/// the record's to say: it is declared first, so it records before the permit goes back.
pub struct Lifecycle<P, K = ()> {
    /// `None`: nothing to record (metrics off, or nothing asked yet).
    record: Option<Record>,
    /// What decides the outcome when the work returns: `()` while a service prepares the
    /// operation, then the classifier (made only for an operation that records).
    decides: K,
    /// Held from admission to the end.
    permit: Option<P>,
}

/// What an operation records, and when it started to. Dropped before it was ended, it records
/// what the drop means.
struct Record {
    series: Series,
    /// Where the operation stands: one of the `WAITING`, `ADMITTED`, `CALLED` and `ENDED` below.
    stage: u8,
    /// The outcome [`set_outcome`] chose, if it did (see [`Chosen`]).
    chosen: Chosen,
    /// Admitted: how long it waited, in microseconds. Called: how long it may run before a drop
    /// is past its caller's deadline, in milliseconds ([`NO_DEADLINE`] for none). One field for
    /// both keeps a record, and so every service and response future, a word smaller.
    timing: u32,
    /// When it started to wait (while waiting), or was admitted (once admitted); `None` if the
    /// clock could not be read (a duration from it is then 0).
    at: Option<Instant>,
}

const WAITING: u8 = 0;
const ADMITTED: u8 = 1;
const CALLED: u8 = 2;
const ENDED: u8 = 3;

/// A called operation's `timing` when its caller set no deadline.
const NO_DEADLINE: u32 = u32::MAX;

/// An outcome that [`set_outcome`] may have chosen, kept in a plain byte: a record's only
/// niche is then its series pointer, so that "nothing to record" is one null word.
#[derive(Clone, Copy)]
struct Chosen(u8);

impl Chosen {
    const NONE: Self = Self(u8::MAX);

    #[inline]
    fn get(self) -> Option<Outcome> {
        Outcome::ALL.get(usize::from(self.0)).copied()
    }

    #[inline]
    fn new(outcome: Option<Outcome>) -> Self {
        outcome.map_or(Self::NONE, |outcome| Self(outcome as u8))
    }
}

/// How an admitted operation ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Ending {
    /// Its work returned: the classifier decides.
    Returned,
    /// Its service said it will not be called (an error from the inner `poll_ready`), or its
    /// body failed.
    Failed,
    /// Its work panicked.
    Crashed,
    /// It was dropped before its work returned: its caller went away.
    Dropped,
}

impl<P, K: Default> Lifecycle<P, K> {
    /// An operation that has not asked yet.
    pub(crate) fn new() -> Self {
        Self {
            record: None,
            decides: K::default(),
            permit: None,
        }
    }
}

impl<P, K> Lifecycle<P, K> {
    /// Whether it holds its permit.
    #[inline]
    pub(crate) fn is_admitted(&self) -> bool {
        self.permit.is_some()
    }

    /// Whether its end is still to be recorded: what it will carry, then, is worth making.
    #[inline]
    pub(crate) fn is_recording(&self) -> bool {
        self.record.is_some()
    }

    /// Ends the admitted operation as `end` says, asking `classify` for the outcome if its work
    /// returned; records it, then gives the permit back. Only the first end counts.
    #[inline]
    pub(crate) fn end(&mut self, end: Ending, classify: impl FnOnce(&K) -> Option<Outcome>) {
        if self.record.is_some() {
            self.record_end(end, classify);
        }
        self.permit = None;
    }

    #[inline(never)]
    fn record_end(&mut self, end: Ending, classify: impl FnOnce(&K) -> Option<Outcome>) {
        if let Some(record) = &mut self.record {
            let decides = &self.decides;
            record.end(end, || classify(decides));
        }
        self.record = None;
    }

    /// Ends the operation as [`end`](Self::end) does, but keeps its permit until the lifecycle
    /// is dropped: a response future's, which `.await` drops as it completes (tower's limit
    /// frees its permit there too).
    #[inline]
    pub(crate) fn finish(&mut self, end: Ending, classify: impl FnOnce(&K) -> Option<Outcome>) {
        if self.record.is_some() {
            self.record_end(end, classify);
        }
    }

    /// Carries on with `decides` in place of what it carried (a response future handing its
    /// operation to the body).
    pub(crate) fn carry<J: Default>(&mut self, decides: impl FnOnce(&K) -> J) -> Lifecycle<P, J> {
        let carried = match &self.record {
            Some(_) => guarded(|| decides(&self.decides)).unwrap_or_default(),
            None => J::default(),
        };
        Lifecycle {
            record: self.record.take(),
            decides: carried,
            permit: self.permit.take(),
        }
    }

    /// Lends the admitted operation's permit to its work: the operation goes on holding `()` in
    /// its place, and its owner ends it before the permit goes back.
    pub(crate) fn lend_permit(self) -> (P, Lifecycle<(), K>) {
        let permit = self
            .permit
            .expect("only an admitted operation lends its permit");
        let lent = Lifecycle {
            record: self.record,
            decides: self.decides,
            permit: Some(()),
        };
        (permit, lent)
    }

    /// Polls `work` (the operation's response future or body) as this operation, for an owner
    /// that a panic in it drops: recording, it is [`run`](Self::run); with nothing to record,
    /// the work is polled as is, and the drop that follows a panic gives the permit back.
    #[inline]
    pub(crate) fn poll<R>(&mut self, work: impl FnOnce() -> R) -> R {
        if self.record.is_none() {
            return work();
        }
        self.run(work)
    }

    /// Runs `work` (one call of the inner service, or one poll of it) as this operation, for an
    /// owner that outlives a panic in it (a service): [`set_outcome`] inside it sets this
    /// operation's outcome, and a panic ends it as [`Outcome::Crashed`], giving its permit back,
    /// before the panic goes on.
    #[inline]
    pub(crate) fn run<R>(&mut self, work: impl FnOnce() -> R) -> R {
        let previous = match &self.record {
            Some(record) => enter(record.chosen.get()),
            None => None,
        };
        let unwinding = Unwinding {
            operation: self,
            previous,
        };
        let output = work();
        // The work returned: leave the scope here, in line, and disarm the guard.
        if let Some(previous) = unwinding.previous {
            unwinding.operation.leave(previous);
        }
        std::mem::forget(unwinding);
        output
    }

    /// Gives the thread's slot back to the operation around this one, keeping the outcome that
    /// the work chose, if it chose one.
    #[inline]
    fn leave(&mut self, previous: Slot) {
        let chosen = leave(previous);
        if let Some(record) = &mut self.record {
            record.chosen = Chosen::new(chosen);
        }
    }
}

impl<P> Lifecycle<P> {
    /// One step of asking for the permit, in `poll_ready` or in an `async` block: a free permit
    /// is taken at once; otherwise the operation waits (counted as queued from the first
    /// `Pending`), until the limit admits it or turns it away. This is the one
    /// acquire-or-refuse step: admitted, the operation holds the permit and has recorded its
    /// queue time; turned away, or refused by a limit that failed, it is counted by reason
    /// ([`AcquireError::rejection`]: a failure is `unavailable`) and the error is returned for
    /// the caller to answer.
    #[inline(always)]
    pub(crate) fn poll_admit(
        &mut self,
        asking: &mut impl Asking<Permit = P>,
        series: Option<&Series>,
        cx: &mut Context<'_>,
    ) -> Poll<Result<(), AcquireError>> {
        let acquired = match asking.is_waiting() {
            false => match asking.try_now() {
                Some(now) => now,
                None => std::task::ready!(self.poll_wait(asking, series, cx)),
            },
            true => std::task::ready!(self.poll_wait(asking, series, cx)),
        };
        Poll::Ready(match acquired {
            Ok(permit) => {
                if self.permit.is_none() {
                    self.permit = Some(permit);
                } else {
                    held_twice(permit);
                }
                if series.is_some() {
                    self.record_admission(series);
                }
                Ok(())
            }
            Err(error) => self.refused(error, series),
        })
    }

    /// Waits for the permit: the operation counts as queued from the first `Pending`.
    #[inline]
    fn poll_wait(
        &mut self,
        asking: &mut impl Asking<Permit = P>,
        series: Option<&Series>,
        cx: &mut Context<'_>,
    ) -> Poll<Result<P, AcquireError>> {
        let polled = asking.poll_wait(cx);
        if polled.is_pending() && self.record.is_none() {
            if let Some(series) = series {
                self.start_waiting(series);
            }
        }
        polled
    }

    fn start_waiting(&mut self, series: &Series) {
        series.start_waiting();
        self.record = Some(Record::new(series.clone(), series.now()));
    }

    /// Records the admission: the queue sample (0 if it did not wait), and one more active.
    #[inline(never)]
    fn record_admission(&mut self, series: Option<&Series>) {
        match &mut self.record {
            Some(waited) => waited.admit(true),
            None => {
                if let Some(series) = series {
                    // It never waited: its queue sample is 0, and needs no clock.
                    let mut record = Record::new(series.clone(), None);
                    record.admit(false);
                    self.record = Some(record);
                }
            }
        }
    }

    /// The limit admitted no operation: it is counted as rejected, by reason (a failure is
    /// `unavailable`), and the error goes back to the caller to answer.
    #[cold]
    fn refused(
        &mut self,
        error: AcquireError,
        series: Option<&Series>,
    ) -> Result<(), AcquireError> {
        // Counted in `queued` only if its wait was recorded.
        let (series, queued) = match self.record.take() {
            Some(mut record) => {
                record.stage = ENDED;
                (Some(record.series.clone()), true)
            }
            None => (series.cloned(), false),
        };
        if let Some(series) = series {
            series.reject(error.rejection(), queued);
        }
        Err(error)
    }

    /// The operation was called (its work ran as this operation, in place): it goes on, in
    /// the lifecycle returned, carrying what decides its outcome and the caller's deadline,
    /// which `carried` makes only if there is something to record (`None` for a classifier
    /// that could not be made: the outcome is then `error`). The lifecycle it leaves behind has
    /// not asked yet.
    #[inline]
    pub(crate) fn called<K: Default>(
        &mut self,
        carried: impl FnOnce() -> (K, Option<Duration>),
    ) -> Lifecycle<P, K> {
        let permit = self.permit.take();
        if self.record.is_none() {
            // Nothing to record: the lifecycle is its permit, and only that is moved.
            return Lifecycle {
                record: None,
                decides: K::default(),
                permit,
            };
        }
        let (decides, deadline) = carried();
        let mut record = self.record.take();
        if let Some(record) = &mut record {
            record.called(deadline);
        }
        Lifecycle {
            record,
            decides,
            permit,
        }
    }
}

/// A second permit for an operation that already holds one: a bug in the caller, since an
/// operation asks only while it holds none. The stale one goes back.
#[cold]
#[inline(never)]
fn held_twice<P>(stale: P) {
    drop(stale);
}

impl<P, K> fmt::Debug for Lifecycle<P, K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lifecycle")
            .field("admitted", &self.permit.is_some())
            .field("recording", &self.record.is_some())
            .finish()
    }
}

impl Record {
    /// A record of an operation that started to wait `at`.
    fn new(series: Series, at: Option<Instant>) -> Self {
        Record {
            series,
            stage: WAITING,
            chosen: Chosen::NONE,
            timing: 0,
            at,
        }
    }

    /// Admitted, after waiting since `self.at` if it `waited`: records the queue sample (0 if it
    /// did not wait) and counts it as active.
    #[inline]
    fn admit(&mut self, waited: bool) {
        let now = self.series.now();
        let queued = if waited {
            elapsed(self.at, now)
        } else {
            Duration::ZERO
        };
        self.series.admit(waited, queued);
        self.stage = ADMITTED;
        self.at = now;
        self.timing = u32::try_from(queued.as_micros()).unwrap_or(u32::MAX);
    }

    /// Called, with its caller's `deadline` counted from when it asked: keeps how long it may
    /// run before a drop is past that deadline (less a slack: the caller started its clock a
    /// little before the operation asked).
    fn called(&mut self, deadline: Option<Duration>) {
        if self.stage != ADMITTED {
            return;
        }
        let queued = Duration::from_micros(u64::from(self.timing));
        self.timing = deadline.map_or(NO_DEADLINE, |deadline| {
            let slack = DEADLINE_SLACK.min(deadline / 10);
            let may_run = deadline.saturating_sub(queued + slack);
            let ms = may_run.as_nanos().div_ceil(1_000_000);
            u32::try_from(ms)
                .unwrap_or(NO_DEADLINE - 1)
                .min(NO_DEADLINE - 1)
        });
        self.stage = CALLED;
    }
}

impl Record {
    /// Records the end of the admitted operation, once; `classify` says what a returned work's
    /// outcome is, if it can (`None` when nothing was made to decide it).
    fn end(&mut self, end: Ending, classify: impl FnOnce() -> Option<Outcome>) {
        if self.stage != ADMITTED && self.stage != CALLED {
            return;
        }
        let now = self.series.now();
        let outcome = decide(self, end, classify, now);
        self.stage = ENDED;
        self.series.end(outcome, elapsed(self.at, now), now);
    }
}

impl Drop for Record {
    /// Dropped while waiting, the operation is abandoned; dropped admitted, it ends as
    /// [`Ending::Dropped`] (and the permit, dropped after the record, goes back after that).
    #[inline]
    fn drop(&mut self) {
        if self.stage != ENDED {
            self.dropped();
        }
    }
}

impl Record {
    /// Dropped before it ended (out of line: a record that ended, the common case, is dropped
    /// with one check).
    #[inline(never)]
    fn dropped(&mut self) {
        match self.stage {
            WAITING => {
                self.stage = ENDED;
                self.series.abandon(true);
            }
            ADMITTED | CALLED => self.end(Ending::Dropped, || None),
            _ => {}
        }
    }
}

/// Where an operation's outcome is decided, for every way it can end: [`set_outcome`] wins;
/// then a returned work is what its classifier says (`error` if the classifier panics), a
/// failure is `error`, a panic `crashed`, and a drop `cancelled`, or `timeout` once the
/// caller's deadline has passed.
fn decide(
    record: &Record,
    end: Ending,
    classify: impl FnOnce() -> Option<Outcome>,
    now: Option<Instant>,
) -> Outcome {
    if let Some(chosen) = record.chosen.get() {
        return chosen;
    }
    match end {
        Ending::Returned => guarded(classify).flatten().unwrap_or(Outcome::Error),
        Ending::Failed => Outcome::Error,
        Ending::Crashed => Outcome::Crashed,
        Ending::Dropped if past_deadline(record, now) => Outcome::Timeout,
        Ending::Dropped => Outcome::Cancelled,
    }
}

/// Whether the caller's deadline has passed at `now`, counted from when the operation asked.
fn past_deadline(record: &Record, now: Option<Instant>) -> bool {
    // Only a called operation has its caller's deadline (admitted, `timing` is its queue time).
    if record.stage != CALLED || record.timing == NO_DEADLINE {
        return false;
    }
    if record.at.is_none() || now.is_none() {
        return false;
    }
    elapsed(record.at, now) >= Duration::from_millis(u64::from(record.timing))
}

/// The time from `from` to `to`: 0 if the clock could not read either, or `to` is earlier.
#[inline]
fn elapsed(from: Option<Instant>, to: Option<Instant>) -> Duration {
    match (from, to) {
        (Some(from), Some(to)) => to.saturating_duration_since(from),
        _ => Duration::ZERO,
    }
}

/// Dropped only while the work unwinds: leaves the scope and ends the operation as crashed.
struct Unwinding<'a, P, K> {
    operation: &'a mut Lifecycle<P, K>,
    previous: Option<Slot>,
}

impl<P, K> Drop for Unwinding<'_, P, K> {
    fn drop(&mut self) {
        if let Some(previous) = self.previous {
            self.operation.leave(previous);
        }
        self.operation.end(Ending::Crashed, |_| None);
    }
}

// ---------------------------------------------------------------------------------------------
// The slot that `set_outcome` writes to.

#[derive(Clone, Copy)]
enum Slot {
    /// No operation is being called or polled on this thread.
    Outside,
    /// An operation is; this is its outcome so far.
    Inside(Option<Outcome>),
}

thread_local! {
    static CURRENT: Cell<Slot> = const { Cell::new(Slot::Outside) };
}

/// Makes the operation whose outcome so far is `chosen` the thread's current one; returns the
/// slot to give back, or `None` while the thread is being torn down (the work then runs without
/// a slot rather than fail).
#[inline]
fn enter(chosen: Option<Outcome>) -> Option<Slot> {
    CURRENT
        .try_with(|slot| slot.replace(Slot::Inside(chosen)))
        .ok()
}

/// Gives the thread's slot back as `previous`; returns the outcome the work chose.
#[inline]
fn leave(previous: Slot) -> Option<Outcome> {
    match CURRENT.try_with(|slot| slot.replace(previous)) {
        Ok(Slot::Inside(chosen)) => chosen,
        _ => None,
    }
}

/// Sets the outcome of the operation whose work is running on this thread, overriding what the
/// classifier would say: NeMo Gym's `op.outcome = ...`. Returns `true` if the outcome will be
/// recorded.
///
/// Call it from the work itself, for example from an axum handler behind the layer, or from the
/// future given to [`resources_operation`](crate::resources_operation), when the work ended other
/// than its result shows: a handler that hit its own deadline and answers with a fallback sets
/// [`Outcome::Timeout`]. The last call wins, and it wins over every other rule.
///
/// Returns `false` and changes nothing outside an operation, and in a task spawned from the work
/// (`tokio::spawn` runs it elsewhere; set the outcome in the work that awaits it). A limit whose
/// metrics are [disabled](crate::OperationMetrics::disabled) is only a limit: inside it,
/// `set_outcome` sets the outcome of the enabled operation around it, if there is one, and
/// returns `false` otherwise.
///
/// ```
/// use tower_resources_operation::{set_outcome, Outcome};
///
/// // Outside any operation there is nothing to set.
/// assert!(!set_outcome(Outcome::Timeout));
/// ```
pub fn set_outcome(outcome: Outcome) -> bool {
    CURRENT
        .try_with(|slot| match slot.get() {
            Slot::Outside => false,
            Slot::Inside(_) => {
                slot.set(Slot::Inside(Some(outcome)));
                true
            }
        })
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Executor, Operation, OperationMetrics};

    /// A record admitted at `at` after waiting `queued`, on a meter that exports nothing.
    fn admitted(at: Instant, queued: Duration) -> Record {
        let metrics = OperationMetrics::new(&opentelemetry::global::meter("operation-tests"));
        let series = metrics.series(Operation::Other, Executor::Other, None);
        let mut record = Record::new(series.expect("enabled metrics").into_owned(), Some(at));
        record.stage = ADMITTED;
        record.timing = u32::try_from(queued.as_micros()).unwrap();
        record
    }

    fn ms(ms: u64) -> Duration {
        Duration::from_millis(ms)
    }

    #[test]
    fn the_queue_time_counts_toward_the_callers_deadline() {
        let at = Instant::now();
        // 100 ms from when it asked, 80 of them spent waiting, less a slack of 10 ms.
        let mut record = admitted(at, ms(80));
        record.called(Some(ms(100)));
        assert!(!past_deadline(&record, Some(at + ms(9))));
        assert!(past_deadline(&record, Some(at + ms(10))));
        record.stage = ENDED;
    }

    #[test]
    fn a_wait_longer_than_the_deadline_makes_any_drop_past_it() {
        let at = Instant::now();
        let mut record = admitted(at, ms(150));
        record.called(Some(ms(100)));
        assert!(past_deadline(&record, Some(at)));
        record.stage = ENDED;
    }

    #[test]
    fn without_a_deadline_or_a_call_no_drop_is_past_one() {
        let at = Instant::now();
        let mut no_deadline = admitted(at, ms(0));
        no_deadline.called(None);
        assert!(!past_deadline(&no_deadline, Some(at + ms(3_600_000))));
        no_deadline.stage = ENDED;

        // Admitted, never called: its queue time (5 ms, kept as 5000 us) is not a deadline.
        let mut never_called = admitted(at, ms(5));
        let outcome = decide(
            &never_called,
            Ending::Dropped,
            || None,
            Some(at + ms(6_000)),
        );
        assert_eq!(outcome, Outcome::Cancelled);
        never_called.stage = ENDED;
    }

    #[test]
    fn a_deadline_beyond_what_the_record_holds_is_kept_as_the_longest_it_can() {
        let at = Instant::now();
        let mut record = admitted(at, ms(0));
        record.called(Some(Duration::from_secs(60 * 60 * 24 * 365)));
        assert_eq!(record.timing, NO_DEADLINE - 1);
        assert!(!past_deadline(&record, Some(at + ms(1_000))));
        record.stage = ENDED;
    }
}
