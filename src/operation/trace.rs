//! An operation in its request's trace: a wait span while it waits for its limit, and a run span
//! while it runs inside it, through `tracing` (the `tracing` feature). Without the feature,
//! [`Trace`] is empty and every step is a no-op.
//!
//! Two spans rather than one operation span with the wait as an event: a wait is a stretch of
//! time, not a moment, and a trace viewer draws a span's length where it draws the request's.
//! Both are children of the span current when the operation arrived; with none current, the
//! run span is the wait span's child, so that the wait and what ran inside the limit stay one
//! trace. An operation that got its permit at once has no wait span, only its run span (queue
//! time 0); one turned away at once has a wait span of no length.
//!
//! Disabled (no subscriber, or the level filtered out), an operation's one check is a read of
//! `tracing`'s max level ([`Trace::may_trace`]), and the record carries one null word; with the
//! level on but the target filtered out, each step also checks its span callsite's interest.

use std::time::Duration;

use crate::attributes::{Outcome, Rejection, SeriesKey};
use crate::limit::Capacity;
#[cfg(feature = "tracing")]
use crate::names::{
    DURATION_ATTRIBUTE, LIMIT_ATTRIBUTE, OUTCOME_ATTRIBUTE, QUEUED_AHEAD_ATTRIBUTE,
    QUEUE_DURATION_ATTRIBUTE, REJECTION_ATTRIBUTE, TARGET, WAIT_ATTRIBUTE,
};

/// How a wait ended, as [`WAIT_ATTRIBUTE`](crate::names::WAIT_ATTRIBUTE) says it: admitted,
/// turned away for `rejection`, or abandoned (no rejection).
#[cfg_attr(not(feature = "tracing"), allow(dead_code))]
fn wait_end(admitted: bool, rejection: Option<Rejection>) -> &'static str {
    match (admitted, rejection) {
        (true, _) => "admitted",
        (false, Some(_)) => "rejected",
        (false, None) => "abandoned",
    }
}

#[cfg(feature = "tracing")]
pub(crate) use on::Trace;

#[cfg(not(feature = "tracing"))]
pub(crate) use off::Trace;

#[cfg(feature = "tracing")]
mod on {
    use tracing::field::Empty;
    use tracing::Span;

    use super::*;
    use crate::metrics::millis;

    /// An operation's spans, or nothing (one null word) while none is made.
    pub(crate) struct Trace(Option<Box<Spans>>);

    struct Spans {
        /// The span current when the operation arrived, for the run span.
        parent: Span,
        /// Open while the operation waits, and until it is called.
        wait: Span,
        /// Open while the operation runs.
        run: Span,
    }

    /// The wait span; `counted`: whether the limit counts this operation among its waiters
    /// (it does from its first wait on, not when it is turned away at once).
    fn wait_span(key: SeriesKey, limit: Option<&Capacity>, counted: bool) -> Span {
        let span = tracing::debug_span!(
            target: TARGET,
            "gym.resources.operation.wait",
            nemo.gym.resources.operation = key.operation().as_str(),
            nemo.gym.resources.executor = key.executor().as_str(),
            nemo.gym.resources.limit = Empty,
            nemo.gym.resources.operation.queued_ahead = Empty,
            nemo.gym.resources.operation.queue_duration_ms = Empty,
            nemo.gym.resources.operation.wait = Empty,
            nemo.gym.resources.operation.rejection = Empty,
        );
        if !span.is_disabled() {
            if let Some(limit) = limit {
                described(&span, limit);
                if let Some(reading) = limit.read() {
                    let ahead = match counted {
                        true => reading.queued.saturating_sub(1),
                        false => reading.queued,
                    };
                    span.record(QUEUED_AHEAD_ATTRIBUTE, ahead);
                }
            }
        }
        span
    }

    fn run_span(key: SeriesKey, limit: Option<&Capacity>, parent: Option<&Span>) -> Span {
        macro_rules! run_span {
            ($($parent:tt)*) => {
                tracing::debug_span!(
                    target: TARGET,
                    $($parent)*
                    "gym.resources.operation.run",
                    nemo.gym.resources.operation = key.operation().as_str(),
                    nemo.gym.resources.executor = key.executor().as_str(),
                    nemo.gym.resources.limit = Empty,
                    nemo.gym.resources.operation.queue_duration_ms = Empty,
                    nemo.gym.resources.operation.duration_ms = Empty,
                    nemo.gym.resources.operation.outcome = Empty,
                )
            };
        }
        let span = match parent {
            Some(parent) => run_span!(parent: parent,),
            None => run_span!(),
        };
        if let (false, Some(limit)) = (span.is_disabled(), limit) {
            described(&span, limit);
        }
        span
    }

    /// The limit's name, on a span that has a field for it.
    fn described(span: &Span, limit: &Capacity) {
        if let Some(name) = limit.name() {
            span.record(LIMIT_ATTRIBUTE, name);
        }
    }

    impl Trace {
        pub(crate) const NONE: Self = Self(None);

        /// The operation starts to wait: its wait span, if it is enabled, child of the span
        /// current now.
        #[inline]
        pub(crate) fn waiting(key: SeriesKey, limit: Option<&Capacity>) -> Self {
            let wait = wait_span(key, limit, true);
            if wait.is_disabled() {
                return Self::NONE;
            }
            Self(Some(Box::new(Spans {
                parent: Span::current(),
                wait,
                run: Span::none(),
            })))
        }

        /// Whether spans may be enabled at all: the one check on the path of an operation with
        /// no span, and the first one `tracing`'s own span macros make. It reads one word,
        /// `tracing`'s max level: `OFF` until a subscriber is set, then the most verbose level
        /// any subscriber enables.
        #[inline(always)]
        pub(crate) fn may_trace() -> bool {
            tracing::level_enabled!(tracing::Level::DEBUG)
        }

        /// Whether it has a span (a record that has nothing else to record is kept for it).
        #[inline]
        pub(crate) fn is_some(&self) -> bool {
            self.0.is_some()
        }

        /// The operation was admitted at once: its run span, if it is enabled.
        #[cold]
        #[inline(never)]
        pub(crate) fn at_once(key: SeriesKey, limit: Option<&Capacity>) -> Self {
            let run = run_span(key, limit, None);
            if run.is_disabled() {
                return Self::NONE;
            }
            Self(Some(Box::new(Spans {
                parent: Span::none(),
                wait: Span::none(),
                run,
            })))
        }

        /// The operation was admitted after waiting `queued`: its wait span says how long.
        #[inline]
        pub(crate) fn admitted(&mut self, queued: Duration) {
            if let Some(spans) = &self.0 {
                spans.wait.record(QUEUE_DURATION_ATTRIBUTE, millis(queued));
            }
        }

        /// The admitted operation was called: `record` (the queue-time histogram) runs inside
        /// the wait span, which ends with it, or inside the run span for an operation that did
        /// not wait; the run span starts, if it had not.
        #[inline]
        pub(crate) fn called<'c>(
            &mut self,
            key: SeriesKey,
            limit: impl Fn() -> Option<&'c Capacity>,
            queued: Duration,
            record: impl FnOnce(),
        ) {
            let spans = match &mut self.0 {
                Some(spans) => spans,
                None if !Self::may_trace() => return record(),
                None => {
                    *self = Self::at_once(key, limit());
                    match &mut self.0 {
                        Some(spans) => spans,
                        None => return record(),
                    }
                }
            };
            let queued = millis(queued);
            if !spans.wait.is_none() {
                spans.wait.record(WAIT_ATTRIBUTE, wait_end(true, None));
                spans.wait.in_scope(record);
                let parent = match spans.parent.is_none() {
                    true => &spans.wait,
                    false => &spans.parent,
                };
                spans.run = run_span(key, limit(), Some(parent));
                spans.wait = Span::none();
                spans.parent = Span::none();
            } else {
                spans.run.in_scope(record);
            }
            spans.run.record(QUEUE_DURATION_ATTRIBUTE, queued);
        }

        /// The admitted operation was dropped before it was called: its wait, if it has one,
        /// ends abandoned, and no run span follows it.
        #[cold]
        pub(crate) fn abandoned(&mut self) {
            if let Some(spans) = self.0.take() {
                spans.wait.record(WAIT_ATTRIBUTE, wait_end(false, None));
            }
        }

        /// The wait ended without a permit, after `queued` (`None`: not known), turned away for
        /// `rejection` or abandoned (`None`): its wait span says so and ends.
        #[cold]
        pub(crate) fn refused(&mut self, rejection: Option<Rejection>, queued: Option<Duration>) {
            if let Some(spans) = self.0.take() {
                record_refusal(&spans.wait, rejection, queued);
            }
        }

        /// An operation turned away for `rejection` without a wait of its own: a wait span of
        /// no length says so, if it is enabled.
        #[cold]
        pub(crate) fn rejected_at_once(
            key: SeriesKey,
            limit: Option<&Capacity>,
            rejection: Rejection,
        ) {
            let wait = wait_span(key, limit, false);
            if !wait.is_disabled() {
                record_refusal(&wait, Some(rejection), None);
            }
        }

        /// The admitted operation ended with `outcome` after running `ran`: `record` (the
        /// run-time histogram) runs inside the run span, which then ends.
        #[inline]
        pub(crate) fn ended(&mut self, outcome: Outcome, ran: Duration, record: impl FnOnce()) {
            let Some(spans) = self.0.take() else {
                return record();
            };
            let run = spans.run;
            run.record(DURATION_ATTRIBUTE, millis(ran));
            run.record(OUTCOME_ATTRIBUTE, outcome.as_str());
            run.in_scope(record);
        }

        /// Enters the run span, if there is one, until the guard drops: the span stays open
        /// until then, even if the operation ends meanwhile (a panic in its work).
        #[inline]
        pub(crate) fn enter_run(&self) -> Option<tracing::span::EnteredSpan> {
            self.0.as_ref().map(|spans| spans.run.clone().entered())
        }
    }

    /// How a wait ended without a permit, on its span.
    fn record_refusal(wait: &Span, rejection: Option<Rejection>, queued: Option<Duration>) {
        if let Some(queued) = queued {
            wait.record(QUEUE_DURATION_ATTRIBUTE, millis(queued));
        }
        wait.record(WAIT_ATTRIBUTE, wait_end(false, rejection));
        if let Some(rejection) = rejection {
            wait.record(REJECTION_ATTRIBUTE, rejection.as_str());
        }
    }
}

#[cfg(not(feature = "tracing"))]
mod off {
    use super::*;

    /// Nothing: spans need the `tracing` feature.
    pub(crate) struct Trace;

    impl Trace {
        pub(crate) const NONE: Self = Self;

        #[inline(always)]
        pub(crate) fn waiting(_: SeriesKey, _: Option<&Capacity>) -> Self {
            Self
        }

        #[inline(always)]
        pub(crate) fn may_trace() -> bool {
            false
        }

        #[inline(always)]
        pub(crate) fn is_some(&self) -> bool {
            false
        }

        #[inline(always)]
        pub(crate) fn at_once(_: SeriesKey, _: Option<&Capacity>) -> Self {
            Self
        }

        #[inline(always)]
        pub(crate) fn admitted(&mut self, _: Duration) {}

        #[inline(always)]
        pub(crate) fn called<'c>(
            &mut self,
            _: SeriesKey,
            _: impl Fn() -> Option<&'c Capacity>,
            _: Duration,
            record: impl FnOnce(),
        ) {
            record()
        }

        #[inline(always)]
        pub(crate) fn abandoned(&mut self) {}

        #[inline(always)]
        pub(crate) fn refused(&mut self, _: Option<Rejection>, _: Option<Duration>) {}

        #[inline(always)]
        pub(crate) fn rejected_at_once(_: SeriesKey, _: Option<&Capacity>, _: Rejection) {}

        #[inline(always)]
        pub(crate) fn ended(&mut self, _: Outcome, _: Duration, record: impl FnOnce()) {
            record()
        }

        #[inline(always)]
        pub(crate) fn enter_run(&self) -> Option<()> {
            None
        }
    }
}

#[cfg(all(test, feature = "tracing"))]
mod tests {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::{Arc, Mutex};

    use tracing::span::{Attributes, Id, Record};
    use tracing::{Event, Metadata, Subscriber};

    use super::*;
    use crate::attributes::{Executor, Operation};
    use crate::names::{
        EXECUTOR_ATTRIBUTE, LIMIT_ATTRIBUTE, OPERATION_ATTRIBUTE, OUTCOME_ATTRIBUTE,
        REJECTION_ATTRIBUTE, RUN_SPAN, WAIT_SPAN,
    };

    /// A span as it was made: its target, name and field names.
    type Made = (String, String, Vec<String>);

    /// Keeps each new span as it was made.
    #[derive(Clone, Default)]
    struct Spans(Arc<Mutex<Vec<Made>>>, Arc<AtomicU64>);

    impl Subscriber for Spans {
        fn enabled(&self, _: &Metadata<'_>) -> bool {
            true
        }
        fn new_span(&self, span: &Attributes<'_>) -> Id {
            let meta = span.metadata();
            let fields = meta.fields().iter().map(|f| f.name().to_owned()).collect();
            let kept = (meta.target().to_owned(), meta.name().to_owned(), fields);
            self.0.lock().unwrap().push(kept);
            Id::from_u64(self.1.fetch_add(1, Ordering::Relaxed) + 1)
        }
        fn record(&self, _: &Id, _: &Record<'_>) {}
        fn record_follows_from(&self, _: &Id, _: &Id) {}
        fn event(&self, _: &Event<'_>) {}
        fn enter(&self, _: &Id) {}
        fn exit(&self, _: &Id) {}
    }

    #[test]
    fn the_spans_use_the_names_the_trace_module_publishes() {
        let spans = Spans::default();
        tracing::subscriber::with_default(spans.clone(), || {
            let key = SeriesKey::new(Operation::Verify, Executor::Subprocess);
            let mut trace = Trace::waiting(key, None);
            assert!(trace.is_some());
            trace.admitted(Duration::from_millis(3));
            trace.called(key, || None, Duration::from_millis(3), || {});
            trace.ended(Outcome::Ok, Duration::from_millis(5), || {});
        });
        let spans = spans.0.lock().unwrap();
        let [(wait_target, wait, wait_fields), (run_target, run, run_fields)] = &spans[..] else {
            panic!("a wait span and a run span: {spans:?}")
        };
        assert_eq!((wait_target.as_str(), wait.as_str()), (TARGET, WAIT_SPAN));
        assert_eq!((run_target.as_str(), run.as_str()), (TARGET, RUN_SPAN));
        let wait_expected = [
            OPERATION_ATTRIBUTE,
            EXECUTOR_ATTRIBUTE,
            LIMIT_ATTRIBUTE,
            QUEUED_AHEAD_ATTRIBUTE,
            QUEUE_DURATION_ATTRIBUTE,
            WAIT_ATTRIBUTE,
            REJECTION_ATTRIBUTE,
        ];
        assert_eq!(wait_fields, &wait_expected);
        let run_expected = [
            OPERATION_ATTRIBUTE,
            EXECUTOR_ATTRIBUTE,
            LIMIT_ATTRIBUTE,
            QUEUE_DURATION_ATTRIBUTE,
            DURATION_ATTRIBUTE,
            OUTCOME_ATTRIBUTE,
        ];
        assert_eq!(run_fields, &run_expected);
    }
}
