//! [`Capacity`]: what a limit reports as `gym.resources.operation.limit`.

use std::fmt;
use std::sync::Arc;

/// How many operations a limit admits at once, read at each metrics collection.
///
/// It is also the limit's identity in the metrics: a series served by several limits reports
/// the sum of their capacities, and a limit reached through several layers counts once. So make
/// one `Capacity` per limit and hand out clones of it; each `Capacity` made anew is another limit.
/// A limit counts as long as something other than the metrics holds one of its `Capacity`
/// values: the limit itself, or a layer or service given it.
///
/// ```
/// use tower_resources_operation::Capacity;
///
/// let four = Capacity::fixed(4);
/// assert_eq!(four.get(), Some(4));
/// assert!(four.same_limit(&four.clone()));
/// assert!(!four.same_limit(&Capacity::fixed(4)));
/// ```
#[derive(Clone)]
pub struct Capacity(Arc<dyn Fn() -> Option<usize> + Send + Sync>);

impl Capacity {
    /// A limit of `capacity` operations at once, for good.
    pub fn fixed(capacity: usize) -> Self {
        Self(Arc::new(move || Some(capacity)))
    }

    /// A limit whose capacity `read` returns at each collection (for a pool that grows, say).
    pub fn from_fn(read: impl Fn() -> usize + Send + Sync + 'static) -> Self {
        Self(Arc::new(move || Some(read())))
    }

    /// A limit whose capacity `read` returns while the limit exists, and `None` once it is gone:
    /// a gone limit stops counting in the metrics.
    pub(crate) fn while_alive(read: impl Fn() -> Option<usize> + Send + Sync + 'static) -> Self {
        Self(Arc::new(read))
    }

    /// The capacity now, or `None` if the limit it describes is gone.
    pub fn get(&self) -> Option<usize> {
        (self.0)()
    }

    /// Whether `self` and `other` describe the same limit (one is a clone of the other).
    pub fn same_limit(&self, other: &Capacity) -> bool {
        self.key() == other.key()
    }

    /// Whether this is the last `Capacity` of its limit: nothing else (the limit, a layer, a
    /// service) describes that limit any more, so it is gone.
    pub(crate) fn is_last(&self) -> bool {
        Arc::strong_count(&self.0) == 1
    }

    /// The identity of the limit, for the metrics' registry.
    pub(crate) fn key(&self) -> usize {
        Arc::as_ptr(&self.0).cast::<()>() as usize
    }
}

impl fmt::Debug for Capacity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Capacity").field(&self.get()).finish()
    }
}
