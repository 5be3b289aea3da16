//! [`Controller`]: the controller of a limit of your own, which a [`WindowControl`] runs as
//! it runs a [`Limit`](crate::Limit)'s.

use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use super::config::Adaptive;
#[cfg(doc)]
use super::controller::WindowControl;
use crate::limit::{Control, Ended, MakeControl, Resize};

/// The controller of a limit of your own, made by [`Adaptive::controller`]: it hears how each
/// of the limit's operations ended, and sets the limit's capacity, as the controller of an
/// adaptive [`Limit`](crate::Limit) does.
///
/// Call [`ended`](Self::ended) from the limit's [`Acquire::ended`](crate::Acquire::ended), on
/// the operation's own task (a few atomic operations; the window's close runs the algorithm,
/// once per window, on the task whose end closes it).
///
/// ```
/// use std::sync::atomic::{AtomicUsize, Ordering};
/// use std::sync::Arc;
/// use std::time::Duration;
/// use tower_resources_operation::adaptive::{Adaptive, Vegas};
/// use tower_resources_operation::limit::Ended;
/// use tower_resources_operation::Outcome;
///
/// // A pool of your own, whose size the controller sets.
/// let size = Arc::new(AtomicUsize::new(2));
/// let resized = Arc::clone(&size);
/// let controller = Adaptive::new(Vegas::default(), 1..=16)
///     .controller(2, move |capacity| resized.store(capacity, Ordering::Relaxed));
/// // From the pool's `Acquire::ended`: each operation's end, with the places it held.
/// controller.ended(&Ended::new(Outcome::Ok, Duration::from_millis(40), None), 2);
/// # drop(size);
/// ```
pub struct Controller {
    control: Arc<dyn Control>,
    /// What the control resizes (it holds it weakly).
    _limit: Arc<dyn Resize>,
}

/// A limit of your own, as a controller resizes it: through `resize`.
struct Resized<F> {
    capacity: AtomicUsize,
    resize: F,
}

impl<F: Fn(usize) + Send + Sync> Resize for Resized<F> {
    fn capacity(&self) -> usize {
        self.capacity.load(Relaxed)
    }

    fn resize(&self, capacity: usize) {
        self.capacity.store(capacity, Relaxed);
        (self.resize)(capacity);
    }
}

impl Adaptive {
    /// The controller of a limit of your own, which starts at `capacity` (brought within the
    /// bounds) and whose capacity `resize` sets: see [`Controller`].
    pub fn controller(
        &self,
        capacity: usize,
        resize: impl Fn(usize) + Send + Sync + 'static,
    ) -> Controller {
        let bounds = self.bounds();
        let capacity = capacity.clamp(*bounds.start(), *bounds.end());
        let limit: Arc<dyn Resize> = Arc::new(Resized {
            capacity: AtomicUsize::new(capacity),
            resize,
        });
        Controller {
            control: self.make(Arc::downgrade(&limit), capacity),
            _limit: limit,
        }
    }
}

impl Controller {
    /// An admitted operation of the limit ended as `ended` says, with `in_flight` operations of
    /// the limit holding a place (itself included) as it did. Before its place goes back.
    pub fn ended(&self, ended: &Ended, in_flight: usize) {
        self.control.ended(ended, in_flight);
    }

    /// The limit turned an operation away by a rule of its own (a full queue).
    pub fn rejected(&self) {
        self.control.rejected();
    }

    /// What its algorithm measured: the run time it takes as normal, and its recent estimate,
    /// for the limit's [`Reading`](crate::limit::Reading).
    pub fn measured(&self) -> (Option<Duration>, Option<Duration>) {
        self.control.measured()
    }
}

impl fmt::Debug for Controller {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Controller")
            .field("control", &self.control)
            .finish_non_exhaustive()
    }
}
