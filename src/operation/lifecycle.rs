//! [`Lifecycle`]: one operation on a limit, from asking for its permit to its end.

use std::fmt;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::time::Instant;

use super::clock::Tick;
use super::deadline::Budget;
use super::outcome::Ending;
use super::record::{Marks, Record, Stage};
use super::scope::{self, Holding, Slot};
use super::trace::Trace;
use super::LimitOf;
use crate::attributes::{Outcome, SeriesKey};
use crate::config::Recording;
use crate::guard::guarded;
use crate::limit::Acquire;
use crate::metrics::Series;
use crate::rejected::Rejected;

/// One way of asking a limit for a permit: a service's wait, kept across its `poll_ready` calls
/// ([`Waiting`](crate::admission)), or a wait on an `async` block's stack
/// ([`resources_operation`](crate::resources_operation)).
pub(crate) trait Asking {
    /// What the limit hands out.
    type Permit;

    /// Whether a wait is in progress: the last poll of it was `Pending`.
    fn is_waiting(&self) -> bool;

    /// A permit now if one is free; `None` if the operation has to wait.
    fn try_now(&mut self) -> Option<Result<Self::Permit, Rejected>>;

    /// Polls the wait for a permit, starting one if none is in progress.
    fn poll_wait(&mut self, cx: &mut Context<'_>) -> Poll<Result<Self::Permit, Rejected>>;
}

/// One operation on a limit `A`: the permit it holds, and what it records.
///
/// `K` is what a called operation carries to decide its outcome when its work returns: the
/// classifier in a response future, the end-of-stream rule in a body (made only for an
/// operation that records, and kept in its record).
///
/// It is admitted while it holds its permit. With nothing to record it is only its permit and a
/// null word, so that a response future is built, moved and dropped about as cheaply as tower's.
/// Dropped before it ended, it ends as the drop means (an abandoned wait, a cancelled
/// operation), and only then does the permit go back.
pub(crate) struct Lifecycle<A: Acquire, K = ()> {
    /// `None`: nothing to record (metrics off and a limit that does not hear ends, and no span;
    /// or nothing asked yet).
    record: Option<Record<K>>,
    /// Held from admission to the end.
    permit: Option<A::Permit>,
}

/// What [`Lifecycle::admit_free`] found (and the service's `Admission::admit_free`, which asks
/// it only for an idle service whose request holds no place of the limit).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Free {
    /// A free permit, taken: the operation is admitted.
    Admitted,
    /// No place free: the operation waits, and need not ask the limit for a free one again.
    Busy,
    /// Not asked (a wait in progress, a rejection to answer, a request on a place already, an
    /// operation that records its wait), or refused: [`Lifecycle::poll_admit`] asks, and
    /// records what it must.
    Ask,
}

impl<A: Acquire, K> Lifecycle<A, K> {
    /// An operation that has not asked yet.
    #[inline]
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
    #[inline(always)]
    pub(crate) fn end(&mut self, end: Ending, classify: impl FnOnce(&K) -> Option<Outcome>) {
        if self.record.is_some() {
            self.record_end(end, classify, None);
        }
        self.permit = None;
    }

    /// Ends the operation as [`end`](Self::end) does, but keeps its permit until the lifecycle
    /// is dropped: a response future's, which `.await` drops as it completes (tower's limit
    /// frees its permit there too).
    #[inline(always)]
    pub(crate) fn finish(&mut self, end: Ending, classify: impl FnOnce(&K) -> Option<Outcome>) {
        if self.record.is_some() {
            self.record_end(end, classify, None);
        }
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
        // Ended in place, then dropped: a record moved out first is copied in wide loads that
        // wait for the narrow stores just made to it (its outcome, as its work returned).
        let Some(record) = &mut self.record else {
            return;
        };
        let ended = record.end(end, classify);
        if let (Some(ended), Some(permit)) = (ended, self.permit.as_ref().or(lent)) {
            guarded(|| A::ended(permit, &ended));
        }
        self.record = None;
    }

    /// Polls `work` (the operation's response future or body) as this operation, for an owner
    /// that a panic in it drops: recording, it is [`run`](Self::run); with nothing to record,
    /// the work is polled with only its limit's place published ([`scope::holds`]), and the
    /// drop that follows a panic gives the permit back.
    #[inline(always)]
    pub(crate) fn poll<R>(&mut self, work: impl FnOnce() -> R) -> R {
        if self.record.is_none() {
            let _holding = Holding::enter(self.permit.as_ref().and_then(A::id_of));
            return work();
        }
        self.run_lent(None, work)
    }

    /// Runs `work` (the inner service's `poll_ready`) as this operation, for an owner that
    /// outlives a panic in it (a service): [`set_outcome`](crate::set_outcome) inside it sets
    /// this operation's outcome, and a panic ends it as [`Outcome::Crashed`], giving its permit
    /// back, before the panic goes on. Outside the run span: readiness is no work of the
    /// operation's.
    #[inline(always)]
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
    #[inline(always)]
    pub(crate) fn call<R>(&mut self, work: impl FnOnce() -> R) -> R {
        self.run_as(None, false, work)
    }

    /// [`run`](Self::run), for an operation whose permit is `lent` to its work (see
    /// [`lend_permit`](Self::lend_permit)): a panic is told to the limit through it.
    #[inline(always)]
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
            Stage::Waiting { .. } => {
                record.dropped_waiting();
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
    #[inline(always)]
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
    /// acquire-or-refuse step: admitted, the operation holds the permit and counts as active;
    /// turned away, or refused by a limit that failed, it is counted by reason
    /// ([`Rejected::rejection`]: a failure is `unavailable`) and the error is returned for the
    /// caller to answer.
    ///
    /// `records` is whether the admitted operation may record anything: with a `series`, or for
    /// a limit that [hears ends](Acquire::hears_ends) (it is then timed for the limit alone,
    /// if the limit [hears its end](Acquire::hears_end)). `deadline` is how long the server lets
    /// the request take, if the layer knows: a wait dropped past it is
    /// [`Rejection::Deadline`](crate::Rejection::Deadline), not abandoned. `key` is its
    /// operation and executor, for its limit to hear with its end. `limit` describes the limit
    /// (its name, its queue) to the operation's spans.
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
    ) -> Poll<Result<(), Rejected>> {
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
        // An operation that waited was admitted as its wait ended (`poll_wait`): the path of a
        // free permit looks for no record.
        if records && (heard || series.is_some()) {
            self.record_admission(series, heard, key);
        } else if Trace::may_trace() {
            self.trace_admission(key, limit);
        }
        Poll::Ready(Ok(()))
    }

    /// The path of a free permit for an operation with no series to count (metrics off) and
    /// no span enabled: takes the permit, which is all [`poll_admit`](Self::poll_admit) would
    /// do, without setting up what a wait would need; an adaptive limit's operation that its
    /// controller hears is stamped as it is admitted, the others (most, as the limit samples
    /// them) record nothing. Otherwise [`poll_admit`](Self::poll_admit) waits, or counts the
    /// refusal.
    #[inline(always)]
    pub(crate) fn admit_free(&mut self, limit: &A, recording: &Recording) -> Free {
        if recording.series.is_some() || Trace::may_trace() {
            return Free::Ask;
        }
        match limit.try_acquire() {
            Some(Ok(permit)) if self.permit.is_none() => {
                let heard = recording.records && A::hears_end(&permit);
                self.permit = Some(permit);
                if heard {
                    self.record_admission(None, true, recording.key);
                }
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
            self.record = Some(Record {
                series: None,
                stage: Stage::Admitted {
                    at: Tick::of(guarded(Instant::now)),
                    queued_us: 0,
                    key,
                    marks: Marks::new(false),
                },
                trace,
            });
        }
    }

    /// Waits for the permit: the operation counts as queued from the first `Pending`, and a
    /// recorded wait (with metrics on, or traced) is admitted as it ends, here, off the path of
    /// a free permit. `records`: as for [`poll_admit`](Self::poll_admit).
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
    ) -> Poll<Result<A::Permit, Rejected>> {
        let polled = asking.poll_wait(cx);
        match (&polled, &mut self.record) {
            (Poll::Pending, None) => self.start_waiting(series, key, limit, deadline),
            (Poll::Ready(Ok(permit)), Some(waited)) => {
                waited.admit(records && A::hears_end(permit));
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
            stage: Stage::Waiting {
                since: Tick::of(guarded(Instant::now)),
                deadline: Budget::new(guarded(deadline).flatten()),
                key,
            },
            trace,
        });
    }

    /// Admits an operation that did not wait (one that waited was admitted as its wait ended):
    /// one more active, its queue time 0.
    #[inline(never)]
    fn record_admission(&mut self, series: Option<&Series>, heard: bool, key: SeriesKey) {
        if self.record.is_some() {
            return;
        }
        // Built in place: a record built aside and moved here is copied in wide loads that wait
        // for the narrow stores just made to it.
        let at = Tick::of(guarded(Instant::now));
        if let Some(series) = series {
            series.admit(false);
        }
        self.record = Some(Record {
            series: series.cloned(),
            stage: Stage::Admitted {
                at,
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
        error: Rejected,
        series: Option<&Series>,
        key: SeriesKey,
        limit: impl LimitOf<'c>,
    ) -> Result<(), Rejected> {
        let rejection = error.rejection();
        match self.record.take() {
            // Counted in `queued` while it waited; its wait span says how it ended.
            Some(record) => {
                let (series, waited, mut trace) = record.refused();
                trace.refused(Some(rejection), waited);
                if let Some(series) = series {
                    series.reject(rejection, true);
                }
            }
            None => {
                if Trace::may_trace() {
                    Trace::rejected_at_once(key, limit(), rejection);
                }
                if let Some(series) = series {
                    series.reject(rejection, false);
                }
            }
        }
        Err(error)
    }

    /// The operation was called (its work ran as this operation, in place): its queue sample
    /// is recorded, and it goes on, in the lifecycle returned, carrying what decides its
    /// outcome and the caller's deadline, which `carried` makes only if there is something to
    /// record (`None` for a classifier that could not be made: the outcome is then `error`).
    /// The lifecycle it leaves behind has not asked yet.
    #[inline(always)]
    pub(crate) fn called<'c, K>(
        &mut self,
        carried: impl FnOnce() -> (K, Option<Duration>),
        limit: impl LimitOf<'c>,
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
            record: record.called(decides, deadline, limit),
            permit,
        }
    }

    /// [`called`](Self::called), for an operation with nothing to record: the lifecycle is its
    /// permit, and only that is moved.
    #[inline(always)]
    pub(crate) fn called_unrecorded<K>(&mut self) -> Lifecycle<A, K> {
        debug_assert!(self.record.is_none());
        Lifecycle {
            record: None,
            permit: self.permit.take(),
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
            // Written only when the work chose anew: a record is moved right after its work
            // returns (into the response future), and a byte just written would stall the wide
            // loads that move it.
            if let Some(record) = &mut self.operation.record {
                if record.chosen() != chosen {
                    record.choose(chosen);
                }
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
