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
//! does not hear ends, an operation has nothing to record: it only holds its permit, which a
//! service takes on the path of a free permit without the rest of that step
//! ([`Lifecycle::admit_free`]).
//!
//! While its work runs, an admitted operation is the thread's [scope]: [`set_outcome`] sets its
//! outcome, and a request that reaches its limit again is admitted on the place it holds
//! ([`scope::holds`]).

pub(crate) mod scope;
mod trace;

use std::fmt;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::time::Instant;

pub use scope::set_outcome;

use self::scope::{Holding, Slot};
use self::trace::Trace;
use crate::attributes::{Outcome, Rejection, SeriesKey};
use crate::guard::guarded;
use crate::limit::{Acquire, AcquireError, Asking, Capacity, Ended};
use crate::metrics::Series;

/// The operation's limit as its spans describe it (its name, its queue), read only when a span
/// is made: a closure, so that an operation with no span does not even look it up.
pub(crate) trait LimitOf<'c>: Fn() -> Option<&'c Capacity> + Copy {}

impl<'c, F: Fn() -> Option<&'c Capacity> + Copy> LimitOf<'c> for F {}

/// A drop of an operation that had a deadline counts as `timeout` when it comes this close to
/// the deadline (or a tenth of it, for short ones): the operation started to wait a little after
/// its caller started the clock.
const DEADLINE_SLACK: Duration = Duration::from_millis(10);

/// One operation on a limit `A`: the permit it holds, and what it records.
///
/// `K` is what a called operation carries to decide its outcome when its work returns: the
/// classifier in a response future, the end-of-stream rule in a body (made only for an
/// operation that records, and kept in its record).
///
/// It is admitted while it holds its permit. With nothing to record it is only its permit and a
/// null word, so that a response future is built, moved and dropped about as cheaply as tower's;
/// recording, three words more (four with the `tracing` feature: its spans, or a null word), so
/// that a queued request's task stays within tower's size class. Dropped before it ended, it
/// ends as the drop means (an abandoned wait, a cancelled operation), and only then does the
/// permit go back.
pub struct Lifecycle<A: Acquire, K = ()> {
    /// `None`: nothing to record (metrics off and a limit that does not hear ends, or nothing
    /// asked yet).
    record: Option<Record<K>>,
    /// Held from admission to the end.
    permit: Option<A::Permit>,
}

/// What an operation records, and when it started to.
///
/// Four words: its series, its clock (two words, so that its end reads the clock once and
/// subtracts once, as any timer does), and its stage, which carries the small facts each stage
/// needs in the word's spare bytes (a record with them beside the stage would be five).
struct Record<K> {
    /// `None` with metrics off: the operation is timed for its limit alone.
    series: Option<Series>,
    /// When it started to wait (while waiting), or was admitted (once admitted), on tokio's
    /// clock (so that a paused clock is followed); `None` if the clock could not be read
    /// (tokio's paused clock panics once its runtime's thread-locals are gone).
    at: Option<Instant>,
    stage: Stage<K>,
    /// Its spans in its request's trace, if they are enabled (one null word otherwise; none
    /// without the `tracing` feature).
    trace: Trace,
}

/// The time from `from` to `to`: 0 if either is not known, or `to` is earlier.
#[inline]
fn between(from: Option<Instant>, to: Option<Instant>) -> Duration {
    match (from, to) {
        (Some(from), Some(to)) => to.saturating_duration_since(from),
        _ => Duration::ZERO,
    }
}

/// Where a recorded operation stands, with what it needs at that stage. An enum, so that
/// "nothing to record" takes no word of its own; one word for a small `K` (the tag, `K`, the
/// series key and the [`Marks`] beside a 32-bit number).
#[derive(Debug, PartialEq, Eq)]
enum Stage<K> {
    /// Waiting for its permit.
    Waiting {
        /// How long after it started to wait a drop is past the server's deadline.
        deadline: Budget,
        /// Its operation and executor.
        key: SeriesKey,
    },
    /// Holding its permit, not called yet.
    Admitted {
        /// How long it waited, in microseconds (saturated).
        queued_us: u32,
        /// Its operation and executor, as its limit hears them.
        key: SeriesKey,
        marks: Marks,
    },
    /// Called: its work runs.
    Called {
        /// How long after its admission a drop is past its caller's deadline.
        deadline: Budget,
        /// Its operation and executor, as its limit hears them.
        key: SeriesKey,
        marks: Marks,
        /// What decides its outcome when its work returns.
        decides: K,
    },
    /// Recorded.
    Ended,
}

/// What an admitted operation carries to its end besides its clock, in one byte: whether its
/// limit hears its end ([`Acquire::hears_end`], asked as it was admitted), and the outcome
/// [`set_outcome`] chose, if it did. One byte, not two, so that [`Stage`] stays a word.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Marks(u8);

impl Marks {
    /// The bit that says its limit hears its end; the bits below hold the chosen outcome's
    /// index plus one (0: none chosen).
    const HEARD: u8 = 0x80;

    /// Nothing chosen yet; `heard`: whether its limit hears its end.
    #[inline]
    fn new(heard: bool) -> Self {
        Self(if heard { Self::HEARD } else { 0 })
    }

    #[inline]
    fn heard(self) -> bool {
        self.0 & Self::HEARD != 0
    }

    #[inline]
    fn chosen(self) -> Option<Outcome> {
        let chosen = usize::from(self.0 & !Self::HEARD);
        chosen
            .checked_sub(1)
            .and_then(|index| Outcome::ALL.get(index).copied())
    }

    #[inline]
    fn choose(&mut self, outcome: Option<Outcome>) {
        // At most 5 outcomes: the index always fits below the heard bit.
        let chosen = outcome.map_or(0, |outcome| outcome.index() as u8 + 1);
        self.0 = (self.0 & Self::HEARD) | chosen;
    }
}

/// `duration` in whole milliseconds, rounded up; in 64 bits (`as_nanos` is a 128-bit division).
fn ceil_ms(duration: Duration) -> u64 {
    let part = duration.subsec_nanos().div_ceil(1_000_000);
    duration
        .as_secs()
        .saturating_mul(1_000)
        .saturating_add(u64::from(part))
}

/// How long an operation may take before a drop is past a deadline, in whole milliseconds; or
/// no deadline. In 32 bits, so that a stage, and so every service and response future, is a
/// word smaller than with an `Option<Duration>`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Budget(u32);

impl Budget {
    const NONE: Self = Self(u32::MAX);

    /// `deadline` less a slack (the caller started its clock a little before the operation
    /// asked), rounded up to a millisecond: at most the longest a budget holds.
    fn new(deadline: Option<Duration>) -> Self {
        let Some(deadline) = deadline else {
            return Self::NONE;
        };
        let slack = DEADLINE_SLACK.min(deadline / 10);
        let ms = ceil_ms(deadline.saturating_sub(slack));
        Self(u32::try_from(ms).unwrap_or(u32::MAX - 1).min(u32::MAX - 1))
    }

    /// The budget left after `spent`.
    fn less(self, spent: Duration) -> Self {
        match self {
            Self::NONE => Self::NONE,
            Self(ms) => {
                let spent = u32::try_from(ceil_ms(spent)).unwrap_or(u32::MAX);
                Self(ms.saturating_sub(spent))
            }
        }
    }

    /// Whether `elapsed` is past it.
    fn is_past(self, elapsed: Duration) -> bool {
        self != Self::NONE && elapsed >= Duration::from_millis(u64::from(self.0))
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

impl<A: Acquire, K> Lifecycle<A, K> {
    /// An operation that has not asked yet.
    pub(crate) fn new() -> Self {
        Self {
            record: None,
            permit: None,
        }
    }

    /// Carries on with `decides` in place of what it carried (a response future handing its
    /// operation to the body); `J::default()` if `decides` panics.
    pub(crate) fn carry<J: Default>(&mut self, decides: impl FnOnce(&K) -> J) -> Lifecycle<A, J> {
        Lifecycle {
            record: self.record.take().map(|record| record.carry(decides)),
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
            permit: None,
        };
        (permit, lent)
    }

    /// Whether it owns nothing: no permit, nothing to record.
    #[inline(always)]
    pub(crate) fn is_empty(&self) -> bool {
        self.record.is_none() && self.permit.is_none()
    }

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
        // Ended in place, then dropped. Moved out first, the record was copied in wide loads
        // that waited for the narrow stores just made to it (its outcome, as its work
        // returned): a stall on every operation (see `record_admission`).
        let Some(record) = &mut self.record else {
            return;
        };
        let ended = record.end(end, classify);
        if let (Some(ended), Some(permit)) = (ended, self.permit.as_ref().or(lent)) {
            guarded(|| A::ended(permit, &ended));
        }
        self.record = None;
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
    /// the work is polled with only its limit's place published ([`scope::holds`]), and the
    /// drop that follows a panic gives the permit back.
    #[inline]
    pub(crate) fn poll<R>(&mut self, work: impl FnOnce() -> R) -> R {
        if self.record.is_none() {
            let _holding = Holding::enter(self.permit.as_ref().and_then(A::id_of));
            return work();
        }
        self.run_lent(None, work)
    }

    /// Runs `work` (the inner service's `poll_ready`) as this operation, for an owner that
    /// outlives a panic in it (a service): [`set_outcome`] inside it sets this operation's
    /// outcome, and a panic ends it as [`Outcome::Crashed`], giving its permit back, before the
    /// panic goes on. Outside the run span: readiness is no work of the operation's, and the
    /// span's check stays off the path of every reused service.
    #[inline]
    pub(crate) fn run<R>(&mut self, work: impl FnOnce() -> R) -> R {
        if self.record.is_none() {
            // Nothing to record: only its place is published, and a panic drops its permit.
            let _holding = Holding::enter(self.permit.as_ref().and_then(A::id_of));
            let mut unwinding = Unwinding {
                permit: &mut self.permit,
                returned: false,
            };
            let output = work();
            unwinding.returned = true;
            return output;
        }
        self.run_unspanned(None, true, work)
    }

    /// Calls the inner service with `work`, as [`run`](Self::run) does, but without publishing
    /// its limit's place: layers inside it that share the limit asked for their place in
    /// `poll_ready`, where it was published, and the future the call returns is polled as this
    /// operation's.
    #[inline]
    pub(crate) fn call<R>(&mut self, work: impl FnOnce() -> R) -> R {
        self.run_as(None, false, work)
    }

    /// [`run`](Self::run), for an operation whose permit is `lent` to its work (see
    /// [`lend_permit`](Self::lend_permit)): a panic is told to the limit through it.
    #[inline]
    pub(crate) fn run_lent<R>(&mut self, lent: Option<&A::Permit>, work: impl FnOnce() -> R) -> R {
        self.run_as(lent, true, work)
    }

    /// Runs `work` as this operation, publishing its limit's place if `holding`, inside its
    /// run span if it has one.
    #[inline(always)]
    fn run_as<R>(
        &mut self,
        lent: Option<&A::Permit>,
        holding: bool,
        work: impl FnOnce() -> R,
    ) -> R {
        if self
            .record
            .as_ref()
            .is_some_and(|record| record.trace.is_some())
        {
            return self.run_in_span(lent, holding, work);
        }
        self.run_unspanned(lent, holding, work)
    }

    /// [`run_as`](Self::run_as) inside the run span, out of line: an operation without one
    /// carries no guard.
    #[inline(never)]
    fn run_in_span<R>(
        &mut self,
        lent: Option<&A::Permit>,
        holding: bool,
        work: impl FnOnce() -> R,
    ) -> R {
        // Kept until the work returned or unwound, so that the span closes after it, even if
        // the operation ended meanwhile (a panic).
        let _in_run = self
            .record
            .as_ref()
            .and_then(|record| record.trace.enter_run());
        self.run_unspanned(lent, holding, work)
    }

    #[inline(always)]
    fn run_unspanned<R>(
        &mut self,
        lent: Option<&A::Permit>,
        holding: bool,
        work: impl FnOnce() -> R,
    ) -> R {
        // The limit whose place it holds, so that the work does not wait for a second one.
        let held = match holding {
            true => self.permit.as_ref().or(lent).and_then(A::id_of),
            false => None,
        };
        let _holding = Holding::enter(held);
        let previous = match &self.record {
            Some(record) => scope::enter(record.chosen()),
            None => None,
        };
        let mut running = Running {
            operation: self,
            previous,
            lent,
            returned: false,
        };
        let output = work();
        running.returned = true;
        output
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
            Stage::Waiting { deadline, key } => {
                record.stage = Stage::Ended;
                let waited = between(record.at, guarded(Instant::now));
                let past_deadline = deadline.is_past(waited);
                if record.trace.is_some() {
                    let rejection = past_deadline.then_some(Rejection::Deadline);
                    record.trace.refused(key, None, rejection, Some(waited));
                }
                if let Some(series) = &record.series {
                    match past_deadline {
                        // The server gave up on it while the limit kept it waiting.
                        true => series.reject(Rejection::Deadline, true),
                        false => series.abandon(true),
                    }
                }
                self.record = None;
            }
            Stage::Admitted { .. } | Stage::Called { .. } => {
                self.record_end(Ending::Dropped, |_| None, None)
            }
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

/// What [`Lifecycle::admit_free`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Free {
    /// A free permit, taken: the operation is admitted.
    Admitted,
    /// No place free: the operation waits, and need not ask the limit for a free one again.
    Busy,
    /// Not asked, or refused: [`Lifecycle::poll_admit`] asks, and records what it must.
    Ask,
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
    /// is its operation and executor, for its limit to hear with its end. `limit` describes the
    /// limit (its name, its queue) to the operation's spans.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    pub(crate) fn poll_admit<'c>(
        &mut self,
        asking: &mut impl Asking<Permit = A::Permit>,
        series: Option<&Series>,
        records: bool,
        key: SeriesKey,
        limit: impl LimitOf<'c>,
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
            None => {
                std::task::ready!(self.poll_wait(asking, series, records, key, limit, deadline, cx))
            }
        };
        let permit = match acquired {
            Ok(permit) => permit,
            Err(error) => return Poll::Ready(self.refused(error, series, key, limit)),
        };
        // Asked only where the limit could hear it: a limit that samples its operations
        // leaves the others unrecorded, with metrics off.
        let heard = records && A::hears_end(&permit);
        if self.permit.is_none() {
            self.permit = Some(permit);
        } else {
            held_twice(permit);
        }
        // An operation that waited recorded its admission as its wait ended (`poll_wait`): the
        // path of a free permit looks for no record.
        if records && (heard || series.is_some()) {
            self.record_admission(series, heard, key, limit);
        } else if Trace::may_trace() {
            self.trace_admission(key, limit);
        }
        Poll::Ready(Ok(()))
    }

    /// The path of a free permit for an operation that will record nothing (`records` is
    /// false: metrics off, and a limit that hears no ends; and no span is enabled): takes the
    /// permit, which is all [`poll_admit`](Self::poll_admit) would do, without setting up what
    /// a wait or a record would need. Otherwise [`poll_admit`](Self::poll_admit) waits, or
    /// counts the refusal.
    #[inline(always)]
    pub(crate) fn admit_free(&mut self, limit: &A, records: bool) -> Free {
        if records || Trace::may_trace() {
            return Free::Ask;
        }
        match limit.try_acquire() {
            Some(Ok(permit)) if self.permit.is_none() => {
                self.permit = Some(permit);
                Free::Admitted
            }
            None => Free::Busy,
            // A limit that refuses (closed, failed) is asked again by `poll_admit`, which
            // counts it.
            Some(_) => Free::Ask,
        }
    }

    /// Admitted at once with nothing else to record: its spans, if they are enabled (a record
    /// made for them alone).
    #[cold]
    #[inline(never)]
    fn trace_admission<'c>(&mut self, key: SeriesKey, limit: impl LimitOf<'c>) {
        if self.record.is_some() {
            // It waited, and was admitted as its wait ended.
            return;
        }
        let trace = Trace::at_once(key, limit());
        if trace.is_some() {
            let mut record = Record::at_once(None, trace);
            record.admit(false, false, key, limit);
            self.record = Some(record);
        }
    }

    /// Waits for the permit: the operation counts as queued from the first `Pending`, and a
    /// recorded wait (with metrics on, or traced) records its admission as it ends, here, off
    /// the path of a free permit. `records`: as for [`poll_admit`](Self::poll_admit).
    #[allow(clippy::too_many_arguments)]
    #[inline(never)]
    fn poll_wait<'c>(
        &mut self,
        asking: &mut impl Asking<Permit = A::Permit>,
        series: Option<&Series>,
        records: bool,
        key: SeriesKey,
        limit: impl LimitOf<'c>,
        deadline: impl FnOnce() -> Option<Duration>,
        cx: &mut Context<'_>,
    ) -> Poll<Result<A::Permit, AcquireError>> {
        let polled = asking.poll_wait(cx);
        match (&polled, &mut self.record) {
            (Poll::Pending, None) => self.start_waiting(series, key, limit, deadline),
            (Poll::Ready(Ok(permit)), Some(waited)) => {
                waited.admit(true, records && A::hears_end(permit), key, limit);
            }
            _ => {}
        }
        polled
    }

    /// It starts to wait: recorded with metrics on, or with its wait span enabled.
    #[cold]
    fn start_waiting<'c>(
        &mut self,
        series: Option<&Series>,
        key: SeriesKey,
        limit: impl LimitOf<'c>,
        deadline: impl FnOnce() -> Option<Duration>,
    ) {
        // Nothing to record and no span possible: not even a disabled span is made.
        if series.is_none() && !Trace::may_trace() {
            return;
        }
        let trace = Trace::waiting(key, limit());
        if series.is_none() && !trace.is_some() {
            return;
        }
        if let Some(series) = series {
            series.start_waiting();
        }
        self.record = Some(Record {
            series: series.cloned(),
            at: guarded(Instant::now),
            stage: Stage::Waiting {
                deadline: Budget::new(guarded(deadline).flatten()),
                key,
            },
            trace,
        });
    }

    /// Records the admission of an operation that did not wait (one that waited recorded it
    /// as its wait ended): its queue sample is 0, and one more active.
    #[inline(never)]
    fn record_admission<'c>(
        &mut self,
        series: Option<&Series>,
        heard: bool,
        key: SeriesKey,
        limit: impl LimitOf<'c>,
    ) {
        if self.record.is_some() {
            return;
        }
        // It never waited (or waited unrecorded, for a limit that hears ends with metrics
        // off): its queue sample is 0, and needs no clock.
        if Trace::may_trace() {
            let mut record = Record::at_once(series.cloned(), Trace::NONE);
            record.admit(false, heard, key, limit);
            self.record = Some(record);
            return;
        }
        // Built in place. Built aside and moved here, the record was copied in wide loads that
        // waited for the narrow stores just made to it. With `record_end`'s, that stall was
        // 7% to 11% of a recorded operation through bound instruments, 2% to 5% through
        // unbound ones (BENCHMARKS.md, "store forwarding"). This is `Record::admit`'s untraced
        // branch written out: `admit` called on a record inserted in place did 61 instructions
        // more, and ran 1.5% slower with unbound instruments.
        let at = guarded(Instant::now);
        if let Some(series) = series {
            series.admit(false, Duration::ZERO);
        }
        self.record = Some(Record {
            series: series.cloned(),
            at,
            stage: Stage::Admitted {
                queued_us: 0,
                key,
                marks: Marks::new(heard),
            },
            trace: Trace::NONE,
        });
    }

    /// The limit admitted no operation: it is counted as rejected, by reason (a failure is
    /// `unavailable`), and the error goes back to the caller to answer.
    #[cold]
    fn refused<'c>(
        &mut self,
        error: AcquireError,
        series: Option<&Series>,
        key: SeriesKey,
        limit: impl LimitOf<'c>,
    ) -> Result<(), AcquireError> {
        // Counted in `queued` only if its wait was recorded.
        let (series, queued, mut trace, waited) = match self.record.take() {
            Some(mut record) => {
                record.stage = Stage::Ended;
                let waited = between(record.at, guarded(Instant::now));
                (record.series.clone(), true, record.trace, Some(waited))
            }
            None => (series.cloned(), false, Trace::NONE, None),
        };
        // Its wait span, or one made now for an operation turned away at once.
        trace.refused(key, limit(), Some(error.rejection()), waited);
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
    pub(crate) fn called<K>(
        &mut self,
        carried: impl FnOnce() -> (K, Option<Duration>),
    ) -> Lifecycle<A, K> {
        let permit = self.permit.take();
        let Some(record) = self.record.take() else {
            // Nothing to record: the lifecycle is its permit, and only that is moved.
            return Lifecycle {
                record: None,
                permit,
            };
        };
        let (decides, deadline) = carried();
        Lifecycle {
            record: record.called(decides, deadline),
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

impl Record<()> {
    /// The record of an operation admitted without waiting (or after a wait nothing recorded):
    /// its queue sample is 0, and needs no clock.
    #[inline]
    fn at_once(series: Option<Series>, trace: Trace) -> Self {
        Record {
            series,
            at: None,
            stage: Stage::Ended,
            trace,
        }
    }
}

impl<K> Record<K> {
    /// The outcome [`set_outcome`] chose so far, if it did.
    #[inline]
    fn chosen(&self) -> Option<Outcome> {
        match self.stage {
            Stage::Admitted { marks, .. } | Stage::Called { marks, .. } => marks.chosen(),
            Stage::Waiting { .. } | Stage::Ended => None,
        }
    }

    /// Keeps the outcome the work chose, if it chose one (work runs only once admitted).
    #[inline]
    fn choose(&mut self, outcome: Option<Outcome>) {
        if let Stage::Admitted { marks, .. } | Stage::Called { marks, .. } = &mut self.stage {
            marks.choose(outcome);
        }
    }

    /// Admitted, after waiting since `self.at` if it `waited`: records the queue sample (0 if it
    /// did not wait) and counts it as active. `heard`: whether its limit hears its end; `key`:
    /// its operation and executor. The queue time is recorded inside the operation's span, if it
    /// has one.
    #[inline]
    fn admit<'c>(&mut self, waited: bool, heard: bool, key: SeriesKey, limit: impl LimitOf<'c>) {
        let now = guarded(Instant::now);
        let queued = if waited {
            between(self.at, now)
        } else {
            Duration::ZERO
        };
        if self.trace.is_some() || Trace::may_trace() {
            self.admit_traced(waited, queued, key, limit);
        } else if let Some(series) = &self.series {
            series.admit(waited, queued);
        }
        self.at = now;
        self.stage = Stage::Admitted {
            queued_us: u32::try_from(queued.as_micros()).unwrap_or(u32::MAX),
            key,
            marks: Marks::new(heard),
        };
    }

    /// [`admit`](Self::admit)'s record, inside the operation's span (out of line: most
    /// operations have none).
    #[cold]
    #[inline(never)]
    fn admit_traced<'c>(
        &mut self,
        waited: bool,
        queued: Duration,
        key: SeriesKey,
        limit: impl LimitOf<'c>,
    ) {
        let series = &self.series;
        self.trace.admitted(key, limit, queued, || {
            if let Some(series) = series {
                series.admit(waited, queued);
            }
        });
    }

    /// Called, with what `decides` its outcome and its caller's `deadline` counted from when
    /// it asked: keeps how long it may run before a drop is past that deadline (less a slack:
    /// the caller started its clock a little before the operation asked). `None` for an
    /// operation that was not admitted.
    #[inline]
    fn called<J>(self, decides: J, deadline: Option<Duration>) -> Option<Record<J>> {
        let Stage::Admitted {
            queued_us,
            key,
            marks,
        } = self.stage
        else {
            return None;
        };
        let queued = Duration::from_micros(u64::from(queued_us));
        Some(Record {
            series: self.series,
            at: self.at,
            stage: Stage::Called {
                deadline: Budget::new(deadline).less(queued),
                key,
                marks,
                decides,
            },
            trace: self.trace,
        })
    }

    /// The same record, carrying what `decides` makes of what it carried (`J::default()` if
    /// that panics).
    fn carry<J: Default>(self, decides: impl FnOnce(&K) -> J) -> Record<J> {
        let stage = match self.stage {
            Stage::Waiting { deadline, key } => Stage::Waiting { deadline, key },
            Stage::Admitted {
                queued_us,
                key,
                marks,
            } => Stage::Admitted {
                queued_us,
                key,
                marks,
            },
            Stage::Called {
                deadline,
                key,
                marks,
                decides: carried,
            } => Stage::Called {
                deadline,
                key,
                marks,
                decides: guarded(|| decides(&carried)).unwrap_or_default(),
            },
            Stage::Ended => Stage::Ended,
        };
        Record {
            series: self.series,
            at: self.at,
            stage,
            trace: self.trace,
        }
    }

    /// Records the end of the admitted operation, once; `classify` says what a returned work's
    /// outcome is from what decides it, if it can. Returns how it ended, if its limit hears it.
    fn end(&mut self, end: Ending, classify: impl FnOnce(&K) -> Option<Outcome>) -> Option<Ended> {
        let (Stage::Admitted { key, marks, .. } | Stage::Called { key, marks, .. }) = self.stage
        else {
            return None;
        };
        let now = guarded(Instant::now);
        let outcome = decide(self, end, classify, now);
        self.stage = Stage::Ended;
        let ran = between(self.at, now);
        // Recorded inside the run span, if there is one, which then ends.
        if self.trace.is_some() {
            self.end_traced(outcome, ran);
        } else if let Some(series) = &self.series {
            series.end(outcome, ran);
        }
        marks.heard().then(|| Ended::of(key, outcome, ran, now))
    }
}

impl<K> Record<K> {
    /// [`end`](Self::end)'s record, inside the run span, which then ends (out of line: most
    /// operations have none).
    #[cold]
    #[inline(never)]
    fn end_traced(&mut self, outcome: Outcome, ran: Duration) {
        let series = &self.series;
        self.trace.ended(outcome, ran, || {
            if let Some(series) = series {
                series.end(outcome, ran);
            }
        });
    }
}

/// Where an operation's outcome is decided, for every way it can end: [`set_outcome`] wins;
/// then a returned work is what its classifier says (`error` if the classifier panics, or was
/// not made), a failure is `error`, a panic `crashed`, and a drop `cancelled`, or `timeout` once
/// the caller's deadline has passed.
fn decide<K>(
    record: &Record<K>,
    end: Ending,
    classify: impl FnOnce(&K) -> Option<Outcome>,
    now: Option<Instant>,
) -> Outcome {
    if let Some(chosen) = record.chosen() {
        return chosen;
    }
    match end {
        Ending::Returned => match &record.stage {
            Stage::Called { decides, .. } => guarded(|| classify(decides))
                .flatten()
                .unwrap_or(Outcome::Error),
            _ => Outcome::Error,
        },
        Ending::Failed => Outcome::Error,
        Ending::Crashed => Outcome::Crashed,
        Ending::Dropped if past_deadline(record, now) => Outcome::Timeout,
        Ending::Dropped => Outcome::Cancelled,
    }
}

/// Whether the caller's deadline has passed at `now`, counted from when the operation asked.
fn past_deadline<K>(record: &Record<K>, now: Option<Instant>) -> bool {
    // Only a called operation has its caller's deadline.
    let Stage::Called { deadline, .. } = record.stage else {
        return false;
    };
    if record.at.is_none() || now.is_none() {
        return false;
    }
    deadline.is_past(between(record.at, now))
}

/// The permit of an operation with nothing to record, while its service's readiness is
/// polled: dropped before the poll returned (a panic), it gives the permit back.
struct Unwinding<'a, P> {
    permit: &'a mut Option<P>,
    returned: bool,
}

impl<P> Drop for Unwinding<'_, P> {
    #[inline]
    fn drop(&mut self) {
        if !self.returned {
            *self.permit = None;
        }
    }
}

/// An operation's work while it runs: the scope it entered is left when the work returns or
/// unwinds, and if it unwinds (`returned` still false), the operation ends as crashed.
struct Running<'a, 'p, A: Acquire, K> {
    operation: &'a mut Lifecycle<A, K>,
    /// The outcome slot to give back, if the operation records.
    previous: Option<Slot>,
    lent: Option<&'p A::Permit>,
    returned: bool,
}

impl<A: Acquire, K> Drop for Running<'_, '_, A, K> {
    #[inline]
    fn drop(&mut self) {
        if let Some(previous) = self.previous {
            let chosen = scope::leave(previous);
            if let Some(record) = &mut self.operation.record {
                record.choose(chosen);
            }
        }
        if !self.returned {
            self.crashed();
        }
    }
}

impl<A: Acquire, K> Running<'_, '_, A, K> {
    /// The work panicked: the operation ends as crashed, its permit going back.
    #[cold]
    #[inline(never)]
    fn crashed(&mut self) {
        match self.lent {
            Some(permit) => self.operation.end_lent(permit, Ending::Crashed, |_| None),
            None => self.operation.end(Ending::Crashed, |_| None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn milliseconds_round_up_as_the_nanoseconds_do() {
        for duration in [
            Duration::ZERO,
            Duration::from_nanos(1),
            Duration::from_micros(999_999),
            Duration::from_millis(1),
            Duration::new(3, 1),
            Duration::new(u64::MAX / 1_000, 999_999_999),
        ] {
            let slow = u64::try_from(duration.as_nanos().div_ceil(1_000_000)).unwrap_or(u64::MAX);
            assert_eq!(ceil_ms(duration), slow, "{duration:?}");
        }
        assert_eq!(ceil_ms(Duration::MAX), u64::MAX);
    }

    /// A record admitted at `at` after waiting `queued`, with nothing to record it to.
    fn admitted(at: Instant, queued: Duration) -> Record<()> {
        Record {
            series: None,
            at: Some(at),
            stage: Stage::Admitted {
                queued_us: u32::try_from(queued.as_micros()).unwrap(),
                key: SeriesKey::new(
                    crate::attributes::Operation::Other,
                    crate::attributes::Executor::Other,
                ),
                marks: Marks::new(false),
            },
            trace: Trace::NONE,
        }
    }

    /// `at` called with the caller's `deadline`.
    fn called(at: Instant, queued: Duration, deadline: Option<Duration>) -> Record<()> {
        admitted(at, queued).called((), deadline).unwrap()
    }

    fn ms(ms: u64) -> Duration {
        Duration::from_millis(ms)
    }

    #[test]
    fn the_queue_time_counts_toward_the_callers_deadline() {
        let at = Instant::now();
        // 100 ms from when it asked, 80 of them spent waiting, less a slack of 10 ms.
        let record = called(at, ms(80), Some(ms(100)));
        assert!(!past_deadline(&record, Some(at + ms(9))));
        assert!(past_deadline(&record, Some(at + ms(10))));
    }

    #[test]
    fn a_wait_longer_than_the_deadline_makes_any_drop_past_it() {
        let at = Instant::now();
        let record = called(at, ms(150), Some(ms(100)));
        assert!(past_deadline(&record, Some(at)));
    }

    #[test]
    fn without_a_deadline_or_a_call_no_drop_is_past_one() {
        let at = Instant::now();
        let no_deadline = called(at, ms(0), None);
        assert!(!past_deadline(&no_deadline, Some(at + ms(3_600_000))));

        // Admitted, never called: its queue time (5 ms, kept as 5000 us) is not a deadline.
        let never_called = admitted(at, ms(5));
        let outcome = decide(
            &never_called,
            Ending::Dropped,
            |()| None,
            Some(at + ms(6_000)),
        );
        assert_eq!(outcome, Outcome::Cancelled);
    }

    #[test]
    fn a_deadline_beyond_what_the_record_holds_is_kept_as_the_longest_it_can() {
        let at = Instant::now();
        let record = called(at, ms(0), Some(Duration::from_secs(60 * 60 * 24 * 365)));
        let Stage::Called { deadline, .. } = record.stage else {
            panic!("called")
        };
        assert_eq!(deadline, Budget(u32::MAX - 1));
        assert!(!past_deadline(&record, Some(at + ms(1_000))));
    }

    #[test]
    fn a_time_between_two_instants_is_zero_when_either_is_unknown_or_the_end_is_earlier() {
        let at = Instant::now();
        let (earlier, later) = (Some(at - ms(5)), Some(at + ms(5)));
        assert_eq!(between(earlier, later), ms(10));
        assert_eq!(between(later, earlier), Duration::ZERO);
        assert_eq!(between(None, later), Duration::ZERO);
        assert_eq!(between(earlier, None), Duration::ZERO);
    }

    #[test]
    fn marks_keep_whether_the_end_is_heard_beside_any_chosen_outcome() {
        for heard in [false, true] {
            let mut marks = Marks::new(heard);
            assert_eq!((marks.heard(), marks.chosen()), (heard, None));
            for outcome in Outcome::ALL.iter().copied().map(Some).chain([None]) {
                marks.choose(outcome);
                assert_eq!((marks.heard(), marks.chosen()), (heard, outcome));
            }
        }
    }

    /// Its admission's `Instant` is two words: the rest of the record must stay in two more
    /// (and its spans' word), or a queued request's task outgrows tokio's 256-byte cell
    /// (`cargo bench --bench queue`: 389 bytes per queued operation, 517 at five words).
    #[test]
    fn a_record_with_its_clock_stays_four_words() {
        let words = |bytes: usize| bytes / std::mem::size_of::<usize>();
        let trace = words(std::mem::size_of::<Trace>());
        assert_eq!(words(std::mem::size_of::<Option<Record<()>>>()), 4 + trace);
        assert_eq!(
            words(std::mem::size_of::<
                Option<Record<Option<crate::classify::DefaultClassifier>>>,
            >()),
            4 + trace
        );
    }
}
