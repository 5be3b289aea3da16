//! One operation, from asking for a permit to its end: the state machine that every form drives
//! (the layer's service, its response future and body, the per-request layer, and
//! [`resources_operation`](crate::resources_operation)).
//!
//! An operation that asks a limit for a permit is exactly one of:
//!
//! - **admitted**: it holds the permit, records its queue time, runs, and ends with an outcome,
//!   recorded once with its run time and told to its limit
//!   ([`Acquire::ended`](crate::limit::Acquire::ended)), *before* the permit goes back;
//! - **rejected**: the limit turned it away (a full queue, a queue timeout), or could not admit
//!   it (closed, its store out of reach: `unavailable`), counted by reason;
//! - **abandoned**: its caller went away while it waited.
//!
//! The three places a reader looks for are here: where the permit is taken
//! ([`Lifecycle::poll_admit`], the one acquire-or-refuse step), where the outcome is decided
//! ([`decide`]), and where user code runs guarded ([`Lifecycle::run`] for the work,
//! [`guarded`](crate::guard::guarded) for everything else). With metrics off, and a limit that
//! does not hear ends, an operation takes the same path with nothing to record: it only holds
//! its permit.

mod outcome_slot;

use std::fmt;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::time::Instant;

pub use outcome_slot::set_outcome;

use self::outcome_slot::{enter, leave, Slot};
use crate::attributes::{Outcome, Rejection, SeriesKey};
use crate::guard::guarded;
use crate::limit::{Acquire, AcquireError, Asking, Ended};
use crate::metrics::Series;

/// A drop of an operation that had a deadline counts as `timeout` when it comes this close to
/// the deadline (or a tenth of it, for short ones): the operation started to wait a little after
/// its caller started the clock.
const DEADLINE_SLACK: Duration = Duration::from_millis(10);

/// One operation on a limit `A`: the permit it holds, and what it records.
///
/// `K` is what it carries to decide its outcome when its work returns: nothing while a service
/// prepares it, the classifier in a response future, the end-of-stream rule in a body.
///
/// It is admitted while it holds its permit. With nothing to record it is only its permit and a
/// null word, so that a response future is built, moved and dropped about as cheaply as tower's.
/// Dropped before it ended, it ends as the drop means (an abandoned wait, a cancelled
/// operation), and only then does the permit go back.
pub struct Lifecycle<A: Acquire, K = ()> {
    /// `None`: nothing to record (metrics off and a limit that does not hear ends, or nothing
    /// asked yet).
    record: Option<Record>,
    /// What decides the outcome when the work returns: `()` while a service prepares the
    /// operation, then the classifier (made only for an operation that records).
    decides: K,
    /// Held from admission to the end.
    permit: Option<A::Permit>,
}

/// What an operation records, and when it started to.
struct Record {
    /// `None` with metrics off: the operation is timed for its limit alone.
    series: Option<Series>,
    stage: Stage,
    /// The outcome [`set_outcome`] chose, if it did (see [`Chosen`]).
    chosen: Chosen,
    /// Waiting: how long it may wait before a drop is past the server's deadline, in
    /// milliseconds. Admitted: how long it waited, in microseconds. Called: how long it may run
    /// before a drop is past its caller's deadline, in milliseconds ([`NO_DEADLINE`] for none,
    /// waiting or called). One field for all three keeps a record, and so every service and
    /// response future, a word smaller.
    timing: u32,
    /// When it started to wait (while waiting), or was admitted (once admitted); `None` if the
    /// clock could not be read (a duration from it is then 0).
    at: Option<Instant>,
    /// Whether its limit hears its end ([`Acquire::hears_end`]), asked as it was admitted.
    heard: bool,
    /// Its operation and executor, as its limit hears them (in what would be padding).
    key: SeriesKey,
}

/// Where a recorded operation stands. An enum, so that "nothing to record" takes no word of
/// its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    Waiting,
    Admitted,
    Called,
    Ended,
}

/// A called operation's `timing` when its caller set no deadline.
const NO_DEADLINE: u32 = u32::MAX;

/// An outcome that [`set_outcome`] may have chosen, kept in a plain byte.
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

/// Now, on tokio's clock (so that a paused clock is followed); `None` if it cannot be read
/// (tokio's paused clock panics once its runtime's thread-locals are gone).
#[inline]
fn now() -> Option<Instant> {
    guarded(Instant::now)
}

impl<A: Acquire, K: Default> Lifecycle<A, K> {
    /// An operation that has not asked yet.
    pub(crate) fn new() -> Self {
        Self {
            record: None,
            decides: K::default(),
            permit: None,
        }
    }

    /// Carries on with `decides` in place of what it carried (a response future handing its
    /// operation to the body).
    pub(crate) fn carry<J: Default>(&mut self, decides: impl FnOnce(&K) -> J) -> Lifecycle<A, J> {
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

    /// Lends the admitted operation's permit to its work: the operation goes on without it, and
    /// its owner ends it with [`end_lent`](Self::end_lent) before the permit goes back.
    pub(crate) fn lend_permit(mut self) -> (A::Permit, Self) {
        let permit = self
            .permit
            .take()
            .expect("only an admitted operation lends its permit");
        let lent = Lifecycle {
            record: self.record.take(),
            decides: std::mem::take(&mut self.decides),
            permit: None,
        };
        (permit, lent)
    }
}

impl<A: Acquire, K> Lifecycle<A, K> {
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
    /// returned; records it and tells the limit, then gives the permit back. Only the first end
    /// counts.
    #[inline]
    pub(crate) fn end(&mut self, end: Ending, classify: impl FnOnce(&K) -> Option<Outcome>) {
        if self.record.is_some() {
            self.record_end(end, classify, None);
        }
        self.permit = None;
    }

    /// Ends the operation whose permit it lent out (see [`lend_permit`](Self::lend_permit)),
    /// telling the limit through `permit`.
    pub(crate) fn end_lent(
        &mut self,
        permit: &A::Permit,
        end: Ending,
        classify: impl FnOnce(&K) -> Option<Outcome>,
    ) {
        if self.record.is_some() {
            self.record_end(end, classify, Some(permit));
        }
    }

    #[inline(never)]
    fn record_end(
        &mut self,
        end: Ending,
        classify: impl FnOnce(&K) -> Option<Outcome>,
        lent: Option<&A::Permit>,
    ) {
        let Some(mut record) = self.record.take() else {
            return;
        };
        let decides = &self.decides;
        let Some(ended) = record.end(end, || classify(decides)) else {
            return;
        };
        if !record.heard {
            return;
        }
        if let Some(permit) = self.permit.as_ref().or(lent) {
            guarded(|| A::ended(permit, &ended));
        }
    }

    /// Ends the operation as [`end`](Self::end) does, but keeps its permit until the lifecycle
    /// is dropped: a response future's, which `.await` drops as it completes (tower's limit
    /// frees its permit there too).
    #[inline]
    pub(crate) fn finish(&mut self, end: Ending, classify: impl FnOnce(&K) -> Option<Outcome>) {
        if self.record.is_some() {
            self.record_end(end, classify, None);
        }
    }

    /// Polls `work` (the operation's response future or body) as this operation, for an owner
    /// that a panic in it drops: recording, it is [`run`](Self::run); with nothing to record,
    /// the work is polled as is, and the drop that follows a panic gives the permit back.
    #[inline]
    pub(crate) fn poll<R>(&mut self, work: impl FnOnce() -> R) -> R {
        if self.record.is_none() {
            return work();
        }
        self.run_lent(None, work)
    }

    /// Runs `work` (one call of the inner service, or one poll of it) as this operation, for an
    /// owner that outlives a panic in it (a service): [`set_outcome`] inside it sets this
    /// operation's outcome, and a panic ends it as [`Outcome::Crashed`], giving its permit back,
    /// before the panic goes on.
    #[inline]
    pub(crate) fn run<R>(&mut self, work: impl FnOnce() -> R) -> R {
        self.run_lent(None, work)
    }

    /// [`run`](Self::run), for an operation whose permit is `lent` to its work (see
    /// [`lend_permit`](Self::lend_permit)): a panic is told to the limit through it.
    #[inline]
    pub(crate) fn run_lent<R>(&mut self, lent: Option<&A::Permit>, work: impl FnOnce() -> R) -> R {
        let previous = match &self.record {
            Some(record) => enter(record.chosen.get()),
            None => None,
        };
        let unwinding = Unwinding {
            operation: self,
            previous,
            lent,
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

    /// Dropped before it ended: a wait given up is abandoned, an admitted operation ends as
    /// [`Ending::Dropped`] (out of line: an operation that ended, the common case, is dropped
    /// with one check).
    #[inline(never)]
    fn dropped(&mut self) {
        let Some(record) = &mut self.record else {
            return;
        };
        match record.stage {
            Stage::Waiting => {
                record.stage = Stage::Ended;
                let past_deadline = record.timing != NO_DEADLINE
                    && elapsed(record.at, now()) >= Duration::from_millis(u64::from(record.timing));
                if let Some(series) = &record.series {
                    match past_deadline {
                        // The server gave up on it while the limit kept it waiting.
                        true => series.reject(Rejection::Deadline, true),
                        false => series.abandon(true),
                    }
                }
                self.record = None;
            }
            Stage::Admitted | Stage::Called => self.record_end(Ending::Dropped, |_| None, None),
            Stage::Ended => self.record = None,
        }
    }
}

impl<A: Acquire, K> Drop for Lifecycle<A, K> {
    #[inline]
    fn drop(&mut self) {
        if self.record.is_some() {
            self.dropped();
        }
    }
}

impl<A: Acquire> Lifecycle<A> {
    /// One step of asking for the permit, in `poll_ready` or in an `async` block: a free permit
    /// is taken at once; otherwise the operation waits (counted as queued from the first
    /// `Pending`), until the limit admits it or turns it away. This is the one
    /// acquire-or-refuse step: admitted, the operation holds the permit and has recorded its
    /// queue time; turned away, or refused by a limit that failed, it is counted by reason
    /// ([`AcquireError::rejection`]: a failure is `unavailable`) and the error is returned for
    /// the caller to answer.
    ///
    /// `records` is whether the admitted operation may record anything: with a `series`, or for
    /// a limit that [hears ends](Acquire::hears_ends) (it is then timed for the limit alone,
    /// if the limit [hears its end](Acquire::hears_end)). `deadline` is how long the server lets the
    /// request take, if the layer knows: a wait dropped past it is
    /// [`Rejection::Deadline`](crate::attributes::Rejection::Deadline), not abandoned. `key`
    /// is its operation and executor, for its limit to hear with its end.
    #[inline(always)]
    pub(crate) fn poll_admit(
        &mut self,
        asking: &mut impl Asking<Permit = A::Permit>,
        series: Option<&Series>,
        records: bool,
        key: SeriesKey,
        deadline: impl FnOnce() -> Option<Duration>,
        cx: &mut Context<'_>,
    ) -> Poll<Result<(), AcquireError>> {
        // One call site of the wait, out of line: the path of a free permit does not carry
        // the wait's code.
        let now = match asking.is_waiting() {
            false => asking.try_now(),
            true => None,
        };
        let acquired = match now {
            Some(now) => now,
            None => std::task::ready!(self.poll_wait(asking, series, key, deadline, cx)),
        };
        let permit = match acquired {
            Ok(permit) => permit,
            Err(error) => return Poll::Ready(self.refused(error, series)),
        };
        // Asked only where the limit could hear it: a limit that samples its operations
        // leaves the others unrecorded, with metrics off.
        let heard = records && A::hears_end(&permit);
        if self.permit.is_none() {
            self.permit = Some(permit);
        } else {
            held_twice(permit);
        }
        if records && (heard || series.is_some()) {
            self.record_admission(series, heard, key);
        }
        Poll::Ready(Ok(()))
    }

    /// Waits for the permit: the operation counts as queued from the first `Pending`.
    #[inline(never)]
    fn poll_wait(
        &mut self,
        asking: &mut impl Asking<Permit = A::Permit>,
        series: Option<&Series>,
        key: SeriesKey,
        deadline: impl FnOnce() -> Option<Duration>,
        cx: &mut Context<'_>,
    ) -> Poll<Result<A::Permit, AcquireError>> {
        let polled = asking.poll_wait(cx);
        if polled.is_pending() && self.record.is_none() {
            if let Some(series) = series {
                self.start_waiting(series, key, guarded(deadline).flatten());
            }
        }
        polled
    }

    #[cold]
    fn start_waiting(&mut self, series: &Series, key: SeriesKey, deadline: Option<Duration>) {
        series.start_waiting();
        let mut record = Record::new(Some(series.clone()), key, now());
        record.timing = deadline.map_or(NO_DEADLINE, |deadline| {
            let slack = DEADLINE_SLACK.min(deadline / 10);
            millis_within_record(deadline.saturating_sub(slack))
        });
        self.record = Some(record);
    }

    /// Records the admission: the queue sample (0 if it did not wait), and one more active.
    #[inline(never)]
    fn record_admission(&mut self, series: Option<&Series>, heard: bool, key: SeriesKey) {
        match &mut self.record {
            Some(waited) => {
                waited.admit(true);
                waited.heard = heard;
            }
            None => {
                // It never waited (or waited unrecorded, for a limit that hears ends with
                // metrics off): its queue sample is 0, and needs no clock.
                let mut record = Record::new(series.cloned(), key, None);
                record.admit(false);
                record.heard = heard;
                self.record = Some(record);
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
                record.stage = Stage::Ended;
                (record.series.clone(), true)
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
    ) -> Lifecycle<A, K> {
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

impl<A: Acquire, K> fmt::Debug for Lifecycle<A, K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lifecycle")
            .field("admitted", &self.permit.is_some())
            .field("recording", &self.record.is_some())
            .finish()
    }
}

impl Record {
    /// A record of an operation of `key` that started to wait `at`.
    fn new(series: Option<Series>, key: SeriesKey, at: Option<Instant>) -> Self {
        Record {
            series,
            stage: Stage::Waiting,
            chosen: Chosen::NONE,
            timing: 0,
            at,
            heard: false,
            key,
        }
    }

    /// Admitted, after waiting since `self.at` if it `waited`: records the queue sample (0 if it
    /// did not wait) and counts it as active.
    #[inline]
    fn admit(&mut self, waited: bool) {
        let now = now();
        let queued = if waited {
            elapsed(self.at, now)
        } else {
            Duration::ZERO
        };
        if let Some(series) = &self.series {
            series.admit(waited, queued);
        }
        self.stage = Stage::Admitted;
        self.at = now;
        self.timing = u32::try_from(queued.as_micros()).unwrap_or(u32::MAX);
    }

    /// Called, with its caller's `deadline` counted from when it asked: keeps how long it may
    /// run before a drop is past that deadline (less a slack: the caller started its clock a
    /// little before the operation asked).
    fn called(&mut self, deadline: Option<Duration>) {
        if self.stage != Stage::Admitted {
            return;
        }
        let queued = Duration::from_micros(u64::from(self.timing));
        self.timing = deadline.map_or(NO_DEADLINE, |deadline| {
            let slack = DEADLINE_SLACK.min(deadline / 10);
            millis_within_record(deadline.saturating_sub(queued + slack))
        });
        self.stage = Stage::Called;
    }

    /// Records the end of the admitted operation, once; `classify` says what a returned work's
    /// outcome is, if it can (`None` when nothing was made to decide it). Returns how it ended,
    /// for its limit to hear.
    fn end(&mut self, end: Ending, classify: impl FnOnce() -> Option<Outcome>) -> Option<Ended> {
        if self.stage != Stage::Admitted && self.stage != Stage::Called {
            return None;
        }
        let now = now();
        let outcome = decide(self, end, classify, now);
        self.stage = Stage::Ended;
        let ran = elapsed(self.at, now);
        if let Some(series) = &self.series {
            series.end(outcome, ran);
        }
        Some(Ended::of(self.key, outcome, ran, now))
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
    if record.stage != Stage::Called || record.timing == NO_DEADLINE {
        return false;
    }
    if record.at.is_none() || now.is_none() {
        return false;
    }
    elapsed(record.at, now) >= Duration::from_millis(u64::from(record.timing))
}

/// `duration` in whole milliseconds (rounded up), as a record's `timing` keeps it: at most the
/// longest it holds short of [`NO_DEADLINE`].
fn millis_within_record(duration: Duration) -> u32 {
    let ms = duration.as_nanos().div_ceil(1_000_000);
    u32::try_from(ms)
        .unwrap_or(NO_DEADLINE - 1)
        .min(NO_DEADLINE - 1)
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
struct Unwinding<'a, 'p, A: Acquire, K> {
    operation: &'a mut Lifecycle<A, K>,
    previous: Option<Slot>,
    lent: Option<&'p A::Permit>,
}

impl<A: Acquire, K> Drop for Unwinding<'_, '_, A, K> {
    fn drop(&mut self) {
        if let Some(previous) = self.previous {
            self.operation.leave(previous);
        }
        match self.lent {
            Some(permit) => self.operation.end_lent(permit, Ending::Crashed, |_| None),
            None => self.operation.end(Ending::Crashed, |_| None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A record admitted at `at` after waiting `queued`, with nothing to record it to.
    fn admitted(at: Instant, queued: Duration) -> Record {
        let other = SeriesKey::new(crate::Operation::Other, crate::Executor::Other);
        let mut record = Record::new(None, other, Some(at));
        record.stage = Stage::Admitted;
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
        record.stage = Stage::Ended;
    }

    #[test]
    fn a_wait_longer_than_the_deadline_makes_any_drop_past_it() {
        let at = Instant::now();
        let mut record = admitted(at, ms(150));
        record.called(Some(ms(100)));
        assert!(past_deadline(&record, Some(at)));
        record.stage = Stage::Ended;
    }

    #[test]
    fn without_a_deadline_or_a_call_no_drop_is_past_one() {
        let at = Instant::now();
        let mut no_deadline = admitted(at, ms(0));
        no_deadline.called(None);
        assert!(!past_deadline(&no_deadline, Some(at + ms(3_600_000))));
        no_deadline.stage = Stage::Ended;

        // Admitted, never called: its queue time (5 ms, kept as 5000 us) is not a deadline.
        let mut never_called = admitted(at, ms(5));
        let outcome = decide(
            &never_called,
            Ending::Dropped,
            || None,
            Some(at + ms(6_000)),
        );
        assert_eq!(outcome, Outcome::Cancelled);
        never_called.stage = Stage::Ended;
    }

    #[test]
    fn a_deadline_beyond_what_the_record_holds_is_kept_as_the_longest_it_can() {
        let at = Instant::now();
        let mut record = admitted(at, ms(0));
        record.called(Some(Duration::from_secs(60 * 60 * 24 * 365)));
        assert_eq!(record.timing, NO_DEADLINE - 1);
        assert!(!past_deadline(&record, Some(at + ms(1_000))));
        record.stage = Stage::Ended;
    }
}
