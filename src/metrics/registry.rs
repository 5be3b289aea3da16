//! [`Registry`]: which limits each series draws from, behind `gym.resources.operation.limit`
//! and the per-limit instruments.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::guard::guarded;
use crate::limit::{Capacity, Reading, Scope};

/// Limits per series remembered without taking the registry's lock.
const KNOWN: usize = 4;

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
            .any(|id| id.load(Ordering::Relaxed) == capacity.id())
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
                .compare_exchange(0, capacity.id(), Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
            {
                break;
            }
        }
    }

    /// The sum of the capacities of each series' limits, by scope (`None` for a series with
    /// none of that scope), and forgets the limits that are gone. A capacity that panics when
    /// read costs its series that collection.
    pub(super) fn totals(&self) -> [[Option<usize>; Scope::ALL.len()]; SERIES] {
        let mut totals = [[None::<usize>; Scope::ALL.len()]; SERIES];
        self.read(|index, _, reading| {
            let total = totals[index][reading.scope.index()].get_or_insert(0);
            *total = total.saturating_add(reading.capacity);
        });
        totals
    }

    /// Each named limit's reading, once per limit however many series draw from it; limits
    /// that share a name and a scope add up. In the order the names were first registered.
    pub(super) fn named(&self) -> Vec<(Arc<str>, Reading)> {
        let mut seen: Vec<u64> = Vec::new();
        let mut named: Vec<(Arc<str>, Reading)> = Vec::new();
        self.read(|_, capacity, reading| {
            let Some(name) = capacity.shared_name() else {
                return;
            };
            if seen.contains(&capacity.id()) {
                return;
            }
            seen.push(capacity.id());
            match named
                .iter_mut()
                .find(|(known, sum)| known == name && sum.scope == reading.scope)
            {
                Some((_, sum)) => sum.add(&reading),
                None => named.push((Arc::clone(name), reading)),
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
                guarded(|| capacity.read()).ok_or(())
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
                            capacity.id(),
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
