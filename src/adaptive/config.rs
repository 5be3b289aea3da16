//! [`Adaptive`]: an adaptive limit's configuration: its algorithm, its bounds, its windows.

use std::fmt;
use std::ops::RangeInclusive;
use std::sync::Arc;
use std::time::Duration;

use super::algorithm::Algorithm;

/// The controller of an adaptive [`Limit`](crate::Limit): its algorithm, the bounds of its capacity, and
/// how long its windows are. Give it to [`LimitBuilder::adaptive`](crate::limit::LimitBuilder::adaptive).
///
/// Each limit built gets its own copy of the algorithm, in its initial state.
#[derive(Clone)]
pub struct Adaptive {
    pub(super) make: Arc<dyn Fn() -> Box<dyn Algorithm> + Send + Sync>,
    pub(super) algorithm: &'static str,
    pub(super) min: usize,
    pub(super) max: usize,
    pub(super) operations: usize,
    pub(super) interval: Duration,
    pub(super) tolerance: f64,
}

impl Adaptive {
    /// A controller that runs `algorithm` and keeps the capacity within `bounds`.
    ///
    /// Start the limit at the bottom of the bounds: an algorithm that reacts to latency takes
    /// its baseline from the run times it sees at low load.
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
            operations: 16,
            interval: Duration::from_secs(1),
            tolerance: 0.0,
        }
    }

    /// How long a window is: it closes once `max(operations, 2 × capacity)` operations have
    /// ended in it, or once it is `interval` old and `capacity` operations have ended in it.
    /// Defaults to 16 operations and 1 second.
    ///
    /// More operations per window smooth out noisy run times; a shorter interval follows slow
    /// operations sooner.
    ///
    /// # Panics
    ///
    /// If `operations` is 0.
    #[track_caller]
    pub fn window(mut self, operations: usize, interval: Duration) -> Self {
        assert!(operations > 0, "a window needs at least one operation");
        self.operations = operations;
        self.interval = interval;
        self
    }

    /// The share of a window's operations that may be signs of congestion before the window
    /// counts as congested, in `[0, 1]`: for a server that fails some requests whatever its
    /// load. A window closes as soon as it passes it. Defaults to 0: the first `timeout`,
    /// `error` or `crashed` closes the window, congested.
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
}

impl fmt::Debug for Adaptive {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Adaptive")
            .field("algorithm", &self.algorithm)
            .field("bounds", &self.bounds())
            .field("operations", &self.operations)
            .field("interval", &self.interval)
            .field("tolerance", &self.tolerance)
            .finish()
    }
}
