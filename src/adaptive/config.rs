//! [`Adaptive`]: an adaptive limit's configuration: its algorithm, its bounds, its windows.

use std::fmt;
use std::ops::RangeInclusive;
use std::sync::Arc;
use std::time::Duration;

use super::algorithm::Algorithm;
use crate::limit::local::LimitBuilder;

/// The controller of an adaptive [`Limit`](crate::Limit): its algorithm, the bounds of its capacity, and
/// how long its windows are. Give it to [`LimitBuilder::adaptive`](crate::LimitBuilder::adaptive).
///
/// Each limit built gets its own copy of the algorithm, in its initial state. Its settings can
/// be read back ([`bounds`](Self::bounds), [`tolerated_share`](Self::tolerated_share),
/// [`interval`](Self::interval), and a fresh algorithm from
/// [`new_algorithm`](Self::new_algorithm)), so that a controller whose windows are kept
/// outside the process ([`Window`](super::Window)) decides as a `Limit`'s does from the same
/// value.
///
/// ```
/// use std::time::Duration;
/// use tower_resources_operation::adaptive::{Adaptive, Vegas};
///
/// let adaptive = Adaptive::new(Vegas::default(), 1..=64).tolerance(0.05);
/// assert_eq!(adaptive.bounds(), 1..=64);
/// assert_eq!(adaptive.tolerated_share(), 0.05);
/// assert_eq!(adaptive.interval(), Duration::from_secs(1));
/// let _fresh = adaptive.new_algorithm();
/// ```
#[derive(Clone)]
pub struct Adaptive {
    pub(super) make: Arc<dyn Fn() -> Box<dyn Algorithm> + Send + Sync>,
    pub(super) algorithm: &'static str,
    pub(super) min: usize,
    pub(super) max: usize,
    pub(super) windows: Windows,
    pub(super) interval: Duration,
    pub(super) tolerance: f64,
}

/// How a controller's windows are measured (see [`Adaptive::window`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub(crate) enum Windows {
    /// One round trip: the operations admitted after the window opened, at least `operations`
    /// of them and as many as the capacity (the default, with `operations` 1).
    RoundTrip {
        /// The fewest that close a window.
        operations: usize,
    },
    /// A count of ends, whenever their operations were admitted: `max(operations, 2 ×
    /// capacity)` ([`Adaptive::window`]).
    Fixed {
        /// The fewest that close a window.
        operations: usize,
    },
}

impl Adaptive {
    /// A controller that runs `algorithm` and keeps the capacity within `bounds`.
    ///
    /// Start the limit at the bottom of the bounds: an algorithm that reacts to latency takes
    /// its baseline from the run times it sees at low load, and [`Vegas`](super::Vegas)
    /// slow-starts from there (half as many again each round trip) until the first sign of
    /// congestion.
    ///
    /// # Panics
    ///
    /// If the bounds are empty or start at 0 (a limit of 0 admits nothing, so it would never
    /// learn that it could admit more).
    #[track_caller]
    pub fn new<A: Algorithm + Clone + Sync>(algorithm: A, bounds: RangeInclusive<usize>) -> Self {
        let (min, max) = bounds.into_inner();
        assert!(
            min >= 1 && min <= max,
            "tower-resources-operation: an adaptive limit's bounds must be a non-empty range \
             starting at 1 or more; got {min}..={max}"
        );
        Self {
            make: Arc::new(move || Box::new(algorithm.clone())),
            algorithm: std::any::type_name::<A>(),
            min,
            max,
            windows: Windows::RoundTrip { operations: 1 },
            interval: Duration::from_secs(1),
            tolerance: 0.0,
        }
    }

    /// Windows of a fixed count of operations instead of round trips: a window closes once
    /// `max(operations, 2 × capacity)` operations have ended in it, whenever they were
    /// admitted, or once it is `interval` old and `capacity` operations have ended in it.
    ///
    /// By default a window lasts one *round trip*: it measures the operations admitted after it
    /// opened (which ran at the capacity it set), and closes once as many of them as the
    /// capacity have ended, or once it is more than twice the last round trip old with half of
    /// them, or `interval` (1 second) old with half of them, or half as old again with one (the
    /// first to end are the fastest): about two run times, whatever the run time, so that an
    /// algorithm steps once per round trip. Fixed windows smooth out noisy run times over more
    /// operations, mix in the operations admitted at the capacity before, and step once per
    /// `2 × capacity` operations; their samples have no
    /// [`overdue`](super::Sample::overdue) count.
    ///
    /// # Panics
    ///
    /// If `operations` is 0.
    #[track_caller]
    pub fn window(mut self, operations: usize, interval: Duration) -> Self {
        assert!(
            operations > 0,
            "tower-resources-operation: Adaptive::window needs at least 1 operation; got 0"
        );
        self.windows = Windows::Fixed { operations };
        self.interval = interval;
        self
    }

    /// The share of a window's operations that may be signs of congestion before the window
    /// counts as congested, in `[0, 1]`: for a server that fails some requests whatever its
    /// load. A window closes as soon as it passes it. Defaults to 0: the first `timeout`,
    /// `error` or `crashed` closes the window, congested.
    ///
    /// Only news counts: the failure of an operation admitted before the capacity was last
    /// lowered was answered by that decrease, so it neither closes a window nor counts here
    /// (it is in [`Sample::stale_congested`](super::Sample::stale_congested)). So a server
    /// that fails everything above its capacity costs one decrease per round trip, not one
    /// per failure.
    ///
    /// # Panics
    ///
    /// If `share` is outside `[0, 1]` or not a number, with a message that names it.
    #[track_caller]
    pub fn tolerance(mut self, share: f64) -> Self {
        self.tolerance = super::in_range("Adaptive::tolerance", share, 0.0..=1.0);
        self
    }

    /// The bounds of the capacity.
    pub fn bounds(&self) -> RangeInclusive<usize> {
        self.min..=self.max
    }

    /// The share of a window's operations that may be signs of congestion before it counts as
    /// congested ([`tolerance`](Self::tolerance)).
    pub fn tolerated_share(&self) -> f64 {
        self.tolerance
    }

    /// How its windows are measured: round trips, or fixed counts ([`window`](Self::window)).
    pub(crate) fn windows(&self) -> Windows {
        self.windows
    }

    /// How old a round trip's window may grow with one of its operations ended before it
    /// closes anyway; for fixed windows, how old one must be to close on the capacity's count.
    /// 1 second unless [`window`](Self::window) said otherwise.
    pub fn interval(&self) -> Duration {
        self.interval
    }

    /// A new copy of the algorithm, in its initial state: what each limit decides with, and
    /// what a fleet's leader starts from each time it takes the lead.
    pub fn new_algorithm(&self) -> Box<dyn Algorithm> {
        (self.make)()
    }
}

// A limit's builder takes a controller through one crate-private seam (`controlled`); the
// method that names `Adaptive` stands here so that the limit depends on no controller.
impl LimitBuilder {
    /// Lets `controller` set the capacity, from the run times and outcomes of the limit's
    /// operations, within its bounds: see [`adaptive`](crate::adaptive). The capacity given to
    /// [`Limit::builder`](crate::Limit::builder) is where it starts (brought within the bounds).
    ///
    /// ```
    /// use tower_resources_operation::adaptive::{Adaptive, Vegas};
    /// use tower_resources_operation::Limit;
    ///
    /// let judges = Limit::builder(1)
    ///     .name("judges")
    ///     .adaptive(Adaptive::new(Vegas::default(), 1..=64))
    ///     .build();
    /// assert!(judges.is_adaptive());
    /// ```
    pub fn adaptive(self, adaptive: Adaptive) -> Self {
        self.controlled(adaptive)
    }
}

impl fmt::Debug for Adaptive {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Adaptive")
            .field("algorithm", &self.algorithm)
            .field("bounds", &self.bounds())
            .field("windows", &self.windows)
            .field("interval", &self.interval)
            .field("tolerance", &self.tolerance)
            .finish()
    }
}
