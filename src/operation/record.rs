//! What an operation records: its [`Record`], one [`Stage`] at a time, and each record it makes
//! (into its series and its spans) as it goes from one stage to the next.

use std::time::Duration;

use tokio::time::Instant;

use super::clock::Tick;
use super::deadline::Budget;
use super::outcome::{decide, Ending};
use super::trace::Trace;
use super::LimitOf;
use crate::attributes::{Outcome, Rejection, SeriesKey};
use crate::guard::guarded;
use crate::limit::Ended;
use crate::metrics::Series;

/// What an operation records, at the stage it is at.
///
/// Four words: its series, its stage (the stage's clock, and the small facts the stage needs),
/// and with the `tracing` feature its spans' word (null without any; the clock then takes one
/// word less), so that a queued request's task keeps tower's size class.
pub(super) struct Record<K> {
    /// `None` with metrics off: the operation is timed for its limit, or its spans, alone.
    pub(super) series: Option<Series>,
    pub(super) stage: Stage<K>,
    /// Its spans in its request's trace, if they are enabled.
    pub(super) trace: Trace,
}

/// Where a recorded operation stands, with what it needs at that stage. Each stage's clock is a
/// [`Tick`] of tokio's clock.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Stage<K> {
    /// Waiting for its permit, since `since`: counted in `queued`.
    Waiting {
        since: Tick,
        /// How long after it started to wait a drop is past the server's deadline.
        deadline: Budget,
        key: SeriesKey,
    },
    /// Holding its permit since `at`, not called yet: counted in `active`. Its queue sample is
    /// recorded when it is called; dropped before that, its caller left before its work began,
    /// and it is abandoned.
    Admitted {
        at: Tick,
        /// How long it waited, in microseconds (saturated).
        queued_us: u32,
        key: SeriesKey,
        marks: Marks,
    },
    /// Called at some time after its admission at `at`: its work runs.
    Called {
        at: Tick,
        /// How long after its admission a drop is past its caller's deadline.
        deadline: Budget,
        key: SeriesKey,
        marks: Marks,
        /// What decides its outcome when its work returns.
        decides: K,
    },
    /// Recorded.
    Ended,
}

/// What an admitted operation carries to its end besides its clock, in one byte: whether its
/// limit hears its end ([`Acquire::hears_end`](crate::Acquire::hears_end), asked as it was
/// admitted), and the outcome [`set_outcome`](crate::set_outcome) chose, if it did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Marks(u8);

impl Marks {
    /// The bit that says its limit hears its end; the bits below hold the chosen outcome's
    /// index plus one (0: none chosen).
    const HEARD: u8 = 0x80;

    /// Nothing chosen yet; `heard`: whether its limit hears its end.
    #[inline]
    pub(super) fn new(heard: bool) -> Self {
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

/// Tokio's clock now, as a tick and as an instant (`None` if it cannot be read).
#[inline]
fn now() -> (Tick, Option<Instant>) {
    let now = guarded(Instant::now);
    (Tick::of(now), now)
}

/// A queue time in the microseconds a stage keeps.
#[inline]
pub(super) fn micros(queued: Duration) -> u32 {
    u32::try_from(queued.as_micros()).unwrap_or(u32::MAX)
}

impl<K> Record<K> {
    /// The outcome [`set_outcome`](crate::set_outcome) chose so far, if it did.
    #[inline]
    pub(super) fn chosen(&self) -> Option<Outcome> {
        match self.stage {
            Stage::Admitted { marks, .. } | Stage::Called { marks, .. } => marks.chosen(),
            Stage::Waiting { .. } | Stage::Ended => None,
        }
    }

    /// Keeps the outcome the work chose, if it chose one (work runs only once admitted).
    #[inline]
    pub(super) fn choose(&mut self, outcome: Option<Outcome>) {
        if let Stage::Admitted { marks, .. } | Stage::Called { marks, .. } = &mut self.stage {
            marks.choose(outcome);
        }
    }

    /// Admitted after waiting since its stage's clock: counted as active rather than queued,
    /// and its wait span says how long it waited. `heard`: whether its limit hears its end.
    #[inline]
    pub(super) fn admit(&mut self, heard: bool) {
        let Stage::Waiting { since, key, .. } = self.stage else {
            return;
        };
        let (now, _) = now();
        // Kept in whole microseconds until it is recorded: its span says the same.
        let queued_us = micros(since.until(now));
        if let Some(series) = &self.series {
            series.admit(true);
        }
        self.trace
            .admitted(Duration::from_micros(u64::from(queued_us)));
        self.stage = Stage::Admitted {
            at: now,
            queued_us,
            key,
            marks: Marks::new(heard),
        };
    }

    /// Called, with what `decides` its outcome and its caller's `deadline` counted from when
    /// it asked: its queue sample is recorded (inside its wait span, or its run span, if it has
    /// one), and it keeps how long it may run before a drop is past that deadline. `None` for
    /// an operation that was not admitted.
    #[inline(always)]
    pub(super) fn called<'c, J>(
        mut self,
        decides: J,
        deadline: Option<Duration>,
        limit: impl LimitOf<'c>,
    ) -> Option<Record<J>> {
        let Stage::Admitted {
            at,
            queued_us,
            key,
            marks,
        } = self.stage
        else {
            return None;
        };
        let queued = Duration::from_micros(u64::from(queued_us));
        self.record_queue(key, queued, limit);
        Some(Record {
            series: self.series,
            stage: Stage::Called {
                at,
                deadline: Budget::new(deadline).less(queued),
                key,
                marks,
                decides,
            },
            trace: self.trace,
        })
    }

    /// Records the queue sample of an operation that goes on to run (or ends as it is called).
    #[inline(always)]
    fn record_queue<'c>(&mut self, key: SeriesKey, queued: Duration, limit: impl LimitOf<'c>) {
        if self.trace.is_some() || Trace::may_trace() {
            return self.record_queue_traced(key, queued, limit);
        }
        if let Some(series) = &self.series {
            series.record_queue(queued);
        }
    }

    /// [`record_queue`](Self::record_queue) inside the operation's spans (out of line: most
    /// operations have none).
    #[cold]
    #[inline(never)]
    fn record_queue_traced<'c>(
        &mut self,
        key: SeriesKey,
        queued: Duration,
        limit: impl LimitOf<'c>,
    ) {
        let series = &self.series;
        self.trace.called(key, limit, queued, || {
            if let Some(series) = series {
                series.record_queue(queued);
            }
        });
    }

    /// The same record, carrying what `decides` makes of what it carried (`J::default()` if
    /// that panics).
    pub(super) fn carry<J: Default>(self, decides: impl FnOnce(&K) -> J) -> Record<J> {
        let stage = match self.stage {
            Stage::Waiting {
                since,
                deadline,
                key,
            } => Stage::Waiting {
                since,
                deadline,
                key,
            },
            Stage::Admitted {
                at,
                queued_us,
                key,
                marks,
            } => Stage::Admitted {
                at,
                queued_us,
                key,
                marks,
            },
            Stage::Called {
                at,
                deadline,
                key,
                marks,
                decides: carried,
            } => Stage::Called {
                at,
                deadline,
                key,
                marks,
                decides: guarded(|| decides(&carried)).unwrap_or_default(),
            },
            Stage::Ended => Stage::Ended,
        };
        Record {
            series: self.series,
            stage,
            trace: self.trace,
        }
    }

    /// Records the end of the admitted operation, once; `classify` says what a returned work's
    /// outcome is from what decides it, if it can. Returns how it ended, if its limit hears it.
    ///
    /// An operation dropped before it was called never began its work: it is abandoned, with
    /// no queue sample and no outcome, and its limit does not hear it.
    pub(super) fn end(
        &mut self,
        end: Ending,
        classify: impl FnOnce(&K) -> Option<Outcome>,
    ) -> Option<Ended> {
        let (at, key, marks) = match self.stage {
            Stage::Admitted { .. } if end == Ending::Dropped => {
                self.stage = Stage::Ended;
                return self.abandon_admitted();
            }
            Stage::Admitted {
                at,
                queued_us,
                key,
                marks,
            } => {
                // Ended before its call: its inner readiness failed, or panicked.
                let queued = Duration::from_micros(u64::from(queued_us));
                self.record_queue(key, queued, || None);
                (at, key, marks)
            }
            Stage::Called { at, key, marks, .. } => (at, key, marks),
            Stage::Waiting { .. } | Stage::Ended => return None,
        };
        let (now, instant) = now();
        let ran = at.until(now);
        let outcome = decide(
            marks.chosen(),
            end,
            || match &self.stage {
                Stage::Called { decides, .. } => classify(decides),
                _ => None,
            },
            || match self.stage {
                // Only a called operation has its caller's deadline.
                Stage::Called { deadline, .. } => {
                    at.is_known() && now.is_known() && deadline.is_past(ran)
                }
                _ => false,
            },
        );
        self.stage = Stage::Ended;
        // Recorded inside the run span, if there is one, which then ends.
        if self.trace.is_some() {
            self.end_traced(outcome, ran);
        } else if let Some(series) = &self.series {
            series.end(outcome, ran);
        }
        marks.heard().then(|| Ended::of(key, outcome, ran, instant))
    }

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

    /// An admitted operation dropped before it was called: abandoned.
    #[cold]
    fn abandon_admitted(&mut self) -> Option<Ended> {
        self.trace.abandoned();
        if let Some(series) = &self.series {
            series.abandon_admitted();
        }
        None
    }

    /// A wait dropped before its permit came: abandoned, or turned away for the deadline if the
    /// server's deadline had passed (the server gave up on it while the limit kept it waiting).
    #[cold]
    pub(super) fn dropped_waiting(&mut self) {
        let Stage::Waiting {
            since, deadline, ..
        } = self.stage
        else {
            return;
        };
        self.stage = Stage::Ended;
        let waited = since.until(now().0);
        let past_deadline = deadline.is_past(waited);
        if self.trace.is_some() {
            let rejection = past_deadline.then_some(Rejection::Deadline);
            self.trace.refused(rejection, Some(waited));
        }
        if let Some(series) = &self.series {
            match past_deadline {
                true => series.reject(Rejection::Deadline, true),
                false => series.abandon(true),
            }
        }
    }

    /// The limit turned the waiting operation away: how long it waited, its series, and its
    /// spans, which say so.
    pub(super) fn refused(self) -> (Option<Series>, Option<Duration>, Trace) {
        let waited = match self.stage {
            Stage::Waiting { since, .. } => Some(since.until(now().0)),
            _ => None,
        };
        (self.series, waited, self.trace)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attributes::{Executor, Operation};

    fn key() -> SeriesKey {
        SeriesKey::new(Operation::Other, Executor::Other)
    }

    /// A record admitted at `at` after waiting `queued`, with nothing to record it to.
    fn admitted(at: Instant, queued: Duration) -> Record<()> {
        Record {
            series: None,
            stage: Stage::Admitted {
                at: Tick::of(Some(at)),
                queued_us: micros(queued),
                key: key(),
                marks: Marks::new(true),
            },
            trace: Trace::NONE,
        }
    }

    fn ms(ms: u64) -> Duration {
        Duration::from_millis(ms)
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

    #[test]
    fn an_operation_dropped_before_it_was_called_is_abandoned_and_heard_by_no_limit() {
        let mut record = admitted(Instant::now(), ms(5));
        assert_eq!(record.end(Ending::Dropped, |()| None), None);
        assert_eq!(record.stage, Stage::Ended);
    }

    #[test]
    fn a_called_operation_dropped_is_heard_as_cancelled_and_one_past_its_deadline_as_timeout() {
        let at = Instant::now();
        for (deadline, outcome) in [(None, Outcome::Cancelled), (Some(ms(1)), Outcome::Timeout)] {
            let mut record = admitted(at - ms(50), ms(0))
                .called((), deadline, || None)
                .unwrap();
            let ended = record.end(Ending::Dropped, |()| None).unwrap();
            assert_eq!(ended.outcome(), outcome, "{deadline:?}");
        }
    }

    /// A record's clock rides in its stage: it must stay four words, with the spans' word of
    /// the `tracing` feature or without it, or a queued request's task may outgrow tower's size
    /// class (tokio's task cells grow 128 bytes at a time).
    #[test]
    fn a_record_with_its_clock_stays_four_words_with_its_spans_or_without() {
        let words = |bytes: usize| bytes / std::mem::size_of::<usize>();
        assert_eq!(words(std::mem::size_of::<Option<Record<()>>>()), 4);
        assert_eq!(
            words(std::mem::size_of::<
                Option<Record<Option<crate::classify::DefaultClassifier>>>,
            >()),
            4
        );
    }
}
