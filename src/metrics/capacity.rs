//! [`Capacity`], and the registry behind `gym.resources.operation.limit` and the per-limit
//! instruments: which limits each series draws from, how many operations each admits at once,
//! and, for a named [`Limit`](crate::Limit), how many it holds and how many wait.

use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::Controlled;
use crate::adaptive::Controller;

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
    /// The limit's name, for a limit that reports instruments of its own.
    name: Option<&'static str>,
    read: Arc<dyn Fn() -> Option<Reading> + Send + Sync>,
    /// The controller of an adaptive limit, and the series its operations record through.
    controlled: Option<Arc<Controlled>>,
}

/// What a limit reports at a collection.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Reading {
    /// Operations it admits at once.
    pub(crate) capacity: usize,
    /// Operations holding one of its places now (above `capacity` for a while after it was
    /// lowered).
    pub(crate) active: usize,
    /// Operations waiting for it now.
    pub(crate) queued: usize,
    /// An adaptive limit's baseline run time, if its algorithm keeps one.
    pub(crate) baseline: Option<Duration>,
    /// An adaptive limit's estimate of its recent run time, if its algorithm keeps one.
    pub(crate) estimate: Option<Duration>,
    /// A limit that can fail open: operations admitted without it, so far (`None` for a limit
    /// that cannot).
    pub(crate) failed_open: Option<u64>,
    /// A limit of leases: leases found lost while their operations ran, so far (`None` for a
    /// limit without leases).
    pub(crate) leases_lost: Option<u64>,
}

/// Adds `more` to `sum`, keeping `None` only when both are.
fn add_counts(sum: Option<u64>, more: Option<u64>) -> Option<u64> {
    match (sum, more) {
        (None, None) => None,
        (sum, more) => Some(sum.unwrap_or(0).saturating_add(more.unwrap_or(0))),
    }
}

impl Capacity {
    /// A limit of `capacity` operations at once, for good.
    pub fn fixed(capacity: usize) -> Self {
        Self::from_fn(move || capacity)
    }

    /// A limit whose capacity `read` returns at each collection (for a pool that grows, say).
    pub fn from_fn(read: impl Fn() -> usize + Send + Sync + 'static) -> Self {
        Self::of_limit(
            None,
            move || {
                Some(Reading {
                    capacity: read(),
                    ..Reading::default()
                })
            },
            None,
        )
    }

    /// A limit named `name` (if it is), whose state `read` returns while the limit exists, and
    /// `None` once it is gone: a gone limit stops counting in the metrics. An adaptive limit
    /// gives its `controller`, which its operations then feed.
    pub(crate) fn of_limit(
        name: Option<&'static str>,
        read: impl Fn() -> Option<Reading> + Send + Sync + 'static,
        controller: Option<Arc<Controller>>,
    ) -> Self {
        static NEXT_ID: AtomicU64 = AtomicU64::new(1);
        Self {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            name,
            read: Arc::new(read),
            controlled: controller.map(|controller| Arc::new(Controlled::new(controller))),
        }
    }

    /// The controller of an adaptive limit, with the series its operations record through.
    pub(crate) fn controlled(&self) -> Option<&Controlled> {
        self.controlled.as_deref()
    }

    /// The controller of an adaptive limit.
    pub(crate) fn controller(&self) -> Option<&Controller> {
        self.controlled().map(Controlled::controller)
    }

    /// This capacity without its controller: what the registry keeps, so that the series an
    /// adaptive limit keeps, which hold the metrics, are not held by the metrics in turn.
    fn reported(&self) -> Self {
        Self {
            id: self.id,
            name: self.name,
            read: Arc::clone(&self.read),
            controlled: None,
        }
    }

    /// The capacity now, or `None` if the limit it describes is gone.
    pub fn get(&self) -> Option<usize> {
        (self.read)().map(|reading| reading.capacity)
    }

    /// The name of the limit, if it has one: a named [`Limit`](crate::Limit) reports
    /// `gym.resources.limit.*` under it.
    pub fn name(&self) -> Option<&'static str> {
        self.name
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
        f.debug_struct("Capacity")
            .field("name", &self.name)
            .field("capacity", &self.get())
            .finish()
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
            limits.push((index, capacity.reported()));
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
        self.read(|index, _, reading| {
            let total = totals[index].get_or_insert(0);
            *total = total.saturating_add(reading.capacity);
        });
        totals
    }

    /// Each named limit's reading, once per limit however many series draw from it; limits
    /// that share a name add up. In the order the names were first registered.
    pub(super) fn named(&self) -> Vec<(&'static str, Reading)> {
        let mut seen: Vec<u64> = Vec::new();
        let mut named: Vec<(&'static str, Reading)> = Vec::new();
        self.read(|_, capacity, reading| {
            let Some(name) = capacity.name else { return };
            if seen.contains(&capacity.id) {
                return;
            }
            seen.push(capacity.id);
            match named.iter_mut().find(|(known, _)| *known == name) {
                Some((_, sum)) => {
                    sum.capacity = sum.capacity.saturating_add(reading.capacity);
                    sum.active = sum.active.saturating_add(reading.active);
                    sum.queued = sum.queued.saturating_add(reading.queued);
                    // Run times do not add up: the slowest of the limits that share a name.
                    sum.baseline = sum.baseline.max(reading.baseline);
                    sum.estimate = sum.estimate.max(reading.estimate);
                    sum.failed_open = add_counts(sum.failed_open, reading.failed_open);
                    sum.leases_lost = add_counts(sum.leases_lost, reading.leases_lost);
                }
                None => named.push((name, reading)),
            }
        });
        named
    }

    /// Reads every registered limit for `each` (with its series), and forgets the limits that
    /// are gone. A limit that panics when read is left out of that collection.
    fn read(&self, mut each: impl FnMut(usize, &Capacity, Reading)) {
        let mut limits = self.limits.lock().unwrap_or_else(|p| p.into_inner());
        limits.retain(|(index, capacity)| {
            let read = if capacity.is_last() {
                Ok(None)
            } else {
                catch_unwind(AssertUnwindSafe(|| (capacity.read)()))
            };
            match read {
                Ok(Some(reading)) => {
                    each(*index, capacity, reading);
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
    }
}
