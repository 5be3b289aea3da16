//! What a limit hears of the operations it admitted ([`Ended`]), and, inside the crate, the seam
//! between a [`Limit`](crate::Limit) and its adaptive controller, as tower's
//! `load::TrackCompletion` is between a service and its load.
//!
//! Every form of operation (the layer's service, its response future or body, the per-request
//! layer, [`resources_operation`](crate::resources_operation)) tells its limit how it ended,
//! through [`Acquire::ended`](super::Acquire::ended), before the permit goes back, with metrics
//! on or off. A limit with a [`Control`] passes that on; the [adaptive](crate::adaptive)
//! controllers are one.

use std::fmt;
use std::ops::RangeInclusive;
use std::sync::{Arc, Weak};
use std::time::Duration;

use tokio::time::Instant;

use crate::attributes::{Executor, Operation, Outcome, SeriesKey};

/// How an admitted operation ended: what a limit hears, before its permit goes back.
///
/// It says which series the operation is of (its [`Operation`] and [`Executor`], whatever the
/// metrics), so that a controller can compare its run time with what is normal for its kind: a
/// limit shared by a verify of 100 ms and a judge of 1 s sees both.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ended {
    outcome: Outcome,
    series: SeriesKey,
    ran: Duration,
    at: Option<Instant>,
}

impl Ended {
    /// An operation that ended `outcome` at `at` (on tokio's clock), after running `ran`, of the
    /// series ([`Operation::Other`], [`Executor::Other`]) until
    /// [`with_series`](Self::with_series) says otherwise.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_resources_operation::limit::Ended;
    /// use tower_resources_operation::{Executor, Operation, Outcome};
    ///
    /// let ended = Ended::new(Outcome::Ok, Duration::from_millis(90), None)
    ///     .with_series(Operation::Verify, Executor::Subprocess);
    /// assert_eq!((ended.operation(), ended.executor()), (Operation::Verify, Executor::Subprocess));
    /// ```
    pub fn new(outcome: Outcome, ran: Duration, at: Option<Instant>) -> Self {
        Self::of(
            SeriesKey::new(Operation::Other, Executor::Other),
            outcome,
            ran,
            at,
        )
    }

    /// An operation of `series` that ended so.
    #[inline]
    pub(crate) fn of(
        series: SeriesKey,
        outcome: Outcome,
        ran: Duration,
        at: Option<Instant>,
    ) -> Self {
        Self {
            outcome,
            series,
            ran,
            at,
        }
    }

    /// The same end, of an operation of `operation` on `executor`.
    pub fn with_series(self, operation: Operation, executor: Executor) -> Self {
        Self {
            series: SeriesKey::new(operation, executor),
            ..self
        }
    }

    /// How it ended, as the metrics record it.
    pub fn outcome(&self) -> Outcome {
        self.outcome
    }

    /// What kind of work it was.
    pub fn operation(&self) -> Operation {
        self.series.operation()
    }

    /// Where it ran.
    pub fn executor(&self) -> Executor {
        self.series.executor()
    }

    /// Its series, as one small number.
    #[inline]
    pub(crate) fn series(&self) -> SeriesKey {
        self.series
    }

    /// How long it ran, from its permit to its end (0 if the clock could not be read).
    pub fn run_time(&self) -> Duration {
        self.ran
    }

    /// When it ended, on tokio's clock; `None` if the clock could not be read.
    pub fn at(&self) -> Option<Instant> {
        self.at
    }
}

/// A limit whose capacity can change while it serves: what a controller adjusts.
pub(crate) trait Resize: Send + Sync {
    /// The capacity now.
    fn capacity(&self) -> usize;

    /// Sets the capacity. Lowering it revokes no running operation.
    fn resize(&self, capacity: usize);

    /// Lets its controller hear one in `one_in` of its operations (a power of two), picked at
    /// random as each is admitted ([`Acquire::hears_end`](super::Acquire::hears_end)): at a
    /// million operations a second, a sample tells a controller as much as every one, and the
    /// others are not timed for it. Returns one in how many it hears from now on, which the
    /// controller scales its counts by. Defaults to 1: every operation, for a limit that does
    /// not sample.
    fn hear_one_in(&self, one_in: u32) -> u32 {
        let _ = one_in;
        1
    }
}

/// What hears a limit's operations end and may resize it: an adaptive controller.
///
/// A limit that has one calls [`ended`](Control::ended) from its
/// [`Acquire::ended`](super::Acquire::ended), on the operation's own task: keep it to a few
/// atomic operations, and do anything slower once in a while, on whichever call closes a window.
pub(crate) trait Control: Send + Sync + fmt::Debug {
    /// An admitted operation ended, with `in_flight` operations of the limit holding a place
    /// (itself included) as it did.
    fn ended(&self, ended: &Ended, in_flight: usize);

    /// The limit turned an operation away by a rule of its own (a full queue).
    fn rejected(&self) {}

    /// What the controller measured: the run time it takes as normal, and its recent estimate,
    /// reported by a named limit as `gym.resources.limit.adaptive.{baseline,estimate}_ms`.
    /// Defaults to neither.
    fn measured(&self) -> (Option<Duration>, Option<Duration>) {
        (None, None)
    }
}

/// What makes a limit's [`Control`], given to
/// [`LimitBuilder::adaptive`](super::LimitBuilder::adaptive) (the
/// [`Adaptive`](crate::adaptive::Adaptive) controllers are one). A limit of your own that can
/// [`Resize`] takes one the same way.
pub(crate) trait MakeControl: Send + Sync + fmt::Debug {
    /// The capacities the controller may set.
    fn bounds(&self) -> RangeInclusive<usize>;

    /// The controller of `limit`, which starts at `capacity`.
    fn make(&self, limit: Weak<dyn Resize>, capacity: usize) -> Arc<dyn Control>;
}
