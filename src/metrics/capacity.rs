//! [`Capacity`], and the registry behind `gym.resources.operation.limit`: which limits each series
//! draws from, and how many operations each admits at once.

use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Limits per series remembered without taking the registry's lock.
const KNOWN: usize = 4;

/// How many operations a limit admits at once, read at each metrics collection: what a limit
/// reports as `gym.resources.operation.limit`.
///
/// It is also the limit's identity in the metrics: a series served by several limits reports
/// the sum of their capacities, and a limit reached through several layers counts once. So make
/// one `Capacity` per limit and hand out clones of it; each `Capacity` made anew is another
/// limit. A limit counts as long as something other than the metrics holds one of its
/// `Capacity` values: the limit itself, or a layer or service given it.
///
/// ```
/// use tower_resources_operation::metrics::Capacity;
///
/// let four = Capacity::fixed(4);
/// assert_eq!(four.get(), Some(4));
/// assert!(four.same_limit(&four.clone()));
/// assert!(!four.same_limit(&Capacity::fixed(4)));
/// ```
#[derive(Clone)]
pub struct Capacity {
    /// Unique to the limit, never reused.
    id: u64,
    read: Arc<dyn Fn() -> Option<usize> + Send + Sync>,
}

impl Capacity {
    /// A limit of `capacity` operations at once, for good.
    pub fn fixed(capacity: usize) -> Self {
        Self::while_alive(move || Some(capacity))
    }

    /// A limit whose capacity `read` returns at each collection (for a pool that grows, say).
    pub fn from_fn(read: impl Fn() -> usize + Send + Sync + 'static) -> Self {
        Self::while_alive(move || Some(read()))
    }

    /// A limit whose capacity `read` returns while the limit exists, and `None` once it is gone:
    /// a gone limit stops counting in the metrics.
    pub(crate) fn while_alive(read: impl Fn() -> Option<usize> + Send + Sync + 'static) -> Self {
        static NEXT_ID: AtomicU64 = AtomicU64::new(1);
        Self {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            read: Arc::new(read),
        }
    }

    /// The capacity now, or `None` if the limit it describes is gone.
    pub fn get(&self) -> Option<usize> {
        (self.read)()
    }

    /// Whether `self` and `other` describe the same limit (one is a clone of the other).
    pub fn same_limit(&self, other: &Capacity) -> bool {
        self.id == other.id
    }

    /// Whether this is the last `Capacity` of its limit: nothing else describes that limit.
    fn is_last(&self) -> bool {
        Arc::strong_count(&self.read) == 1
    }
}

impl fmt::Debug for Capacity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Capacity").field(&self.get()).finish()
    }
}

/// The limits each series draws from.
#[derive(Debug)]
pub(super) struct Registry<const SERIES: usize> {
    limits: Mutex<Vec<(usize, Capacity)>>,
    /// Ids of limits already registered for each series, so that the scoped API and the
    /// per-request layer do not take the lock on every operation; 0 is free.
    known: [[AtomicU64; KNOWN]; SERIES],
}

impl<const SERIES: usize> Registry<SERIES> {
    pub(super) fn new() -> Self {
        Self {
            limits: Mutex::new(Vec::new()),
            known: std::array::from_fn(|_| Default::default()),
        }
    }

    /// Counts `capacity` in the limit of series `index`, once.
    pub(super) fn register(&self, index: usize, capacity: &Capacity) {
        let known = &self.known[index];
        if known
            .iter()
            .any(|id| id.load(Ordering::Relaxed) == capacity.id)
        {
            return;
        }
        let mut limits = self.limits.lock().unwrap_or_else(|p| p.into_inner());
        if !limits
            .iter()
            .any(|(i, known)| *i == index && known.same_limit(capacity))
        {
            limits.push((index, capacity.clone()));
        }
        for id in known {
            if id
                .compare_exchange(0, capacity.id, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
            {
                break;
            }
        }
    }

    /// The sum of the capacities of each series' limits (`None` for a series with none), and
    /// forgets the limits that are gone. A capacity that panics when read costs its series
    /// that collection.
    pub(super) fn totals(&self) -> [Option<usize>; SERIES] {
        let mut totals = [None::<usize>; SERIES];
        let mut limits = self.limits.lock().unwrap_or_else(|p| p.into_inner());
        limits.retain(|(index, capacity)| {
            let read = if capacity.is_last() {
                Ok(None)
            } else {
                catch_unwind(AssertUnwindSafe(|| capacity.get()))
            };
            match read {
                Ok(Some(value)) => {
                    let total = totals[*index].get_or_insert(0);
                    *total = total.saturating_add(value);
                    true
                }
                // Read again at the next collection.
                Err(_) => true,
                Ok(None) => {
                    for id in &self.known[*index] {
                        let _ = id.compare_exchange(
                            capacity.id,
                            0,
                            Ordering::Relaxed,
                            Ordering::Relaxed,
                        );
                    }
                    false
                }
            }
        });
        totals
    }
}
