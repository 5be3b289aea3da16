//! The places of a limit whose capacity changes while it serves.
//!
//! A place is free (in the front or its queue), held (by a running operation), or owed: when the
//! capacity is lowered below what is held, the places above it are a debt, paid by the operations
//! that hold them as they finish, so that lowering never revokes a running operation. Every step
//! keeps `capacity = free + held - debt`: a release pays one unit of debt or frees its place; a
//! sweep takes free places out only to pay debt, and frees again any it took that it could not pay
//! with. So no place is lost and none is made up, whatever the interleaving; the loom tests below
//! check every interleaving of it:
//!
//! ```text
//! RUSTFLAGS="--cfg tro_loom" cargo test --release --lib limit::
//! ```
//!
//! (A cfg of the crate's own: `--cfg loom` would also switch tokio to its loom build, which has
//! no `net`, and the dev-dependencies need it.)

#[cfg(not(all(test, tro_loom)))]
use std::sync::{
    atomic::{AtomicUsize, Ordering::SeqCst},
    Mutex,
};

#[cfg(all(test, tro_loom))]
use loom::sync::{
    atomic::{AtomicUsize, Ordering::SeqCst},
    Mutex,
};

/// Where free places are kept: a [`Front`](super::front::Front) and its queue, or a model of
/// them under loom.
pub(super) trait Places {
    /// Frees `n` places (or hands them to waiters).
    fn add(&self, n: usize);
    /// Takes up to `n` free places out for good; returns how many it took.
    fn forget(&self, n: usize) -> usize;
}

/// Places that a capacity can be changed over.
#[derive(Debug)]
pub(super) struct Resizable<S> {
    places: S,
    capacity: AtomicUsize,
    /// Places to take out of circulation as they come back.
    debt: AtomicUsize,
    /// Serialises resizes.
    resizing: Mutex<()>,
}

impl<S: Places> Resizable<S> {
    /// `places`, holding `capacity` free places.
    pub(super) fn new(places: S, capacity: usize) -> Self {
        Self {
            places,
            capacity: AtomicUsize::new(capacity),
            debt: AtomicUsize::new(0),
            resizing: Mutex::new(()),
        }
    }

    pub(super) fn places(&self) -> &S {
        &self.places
    }

    pub(super) fn capacity(&self) -> usize {
        self.capacity.load(SeqCst)
    }

    /// Places held now, given `free` of them are free: `capacity + debt - free` (a snapshot,
    /// for the metrics; above the capacity for a while after it was lowered).
    pub(super) fn held(&self, free: usize) -> usize {
        (self.capacity.load(SeqCst) + self.debt.load(SeqCst)).saturating_sub(free)
    }

    /// A held place comes back: it pays a unit of debt, or is freed.
    #[inline]
    pub(super) fn release(&self) {
        if self.debt.load(SeqCst) != 0 {
            return self.release_owed();
        }
        self.places.add(1);
        // A resize that raised the debt after the check above finds this place in its own
        // sweep, or this sweep finds it.
        if self.debt.load(SeqCst) != 0 {
            self.sweep();
        }
    }

    /// A place comes back while a lowered capacity is owed.
    #[cold]
    fn release_owed(&self) {
        if self.pay(1) == 1 {
            return;
        }
        self.places.add(1);
        if self.debt.load(SeqCst) != 0 {
            self.sweep();
        }
    }

    /// Sets the capacity: raising it pays the debt first, then frees new places (admitting
    /// waiters at once); lowering it takes free places out, and owes the rest.
    pub(super) fn set_capacity(&self, capacity: usize) {
        let _resizing = self.resizing.lock().unwrap_or_else(|p| p.into_inner());
        let old = self.capacity.swap(capacity, SeqCst);
        if capacity > old {
            let more = capacity - old;
            let paid = self.pay(more);
            if more > paid {
                self.places.add(more - paid);
            }
        } else if capacity < old {
            self.debt.fetch_add(old - capacity, SeqCst);
            self.sweep();
        }
    }

    /// Takes free places out to pay the debt; frees again any it could not pay with (a release
    /// paid that unit meanwhile).
    #[cold]
    fn sweep(&self) {
        let debt = self.debt.load(SeqCst);
        if debt == 0 {
            return;
        }
        let taken = self.places.forget(debt);
        let paid = self.pay(taken);
        if taken > paid {
            self.places.add(taken - paid);
        }
    }

    /// Pays up to `at_most` units of debt; returns how many.
    fn pay(&self, at_most: usize) -> usize {
        let mut paid = 0;
        let _ = self.debt.fetch_update(SeqCst, SeqCst, |debt| {
            paid = debt.min(at_most);
            Some(debt - paid)
        });
        paid
    }
}

#[cfg(all(test, tro_loom))]
pub(super) mod loom_tests {
    use loom::sync::atomic::AtomicUsize;
    use loom::sync::Arc;
    use loom::thread;

    use super::*;

    /// A semaphore without waiters: a count of free places.
    #[derive(Debug, Default)]
    pub(in crate::limit) struct Model(pub(in crate::limit) AtomicUsize);

    impl Places for Model {
        fn add(&self, n: usize) {
            self.0.fetch_add(n, SeqCst);
        }

        fn forget(&self, n: usize) -> usize {
            let mut taken = 0;
            let _ = self.0.fetch_update(SeqCst, SeqCst, |free| {
                taken = free.min(n);
                Some(free - taken)
            });
            taken
        }
    }

    impl Model {
        pub(in crate::limit) fn try_take(&self) -> bool {
            self.0
                .fetch_update(SeqCst, SeqCst, |free| free.checked_sub(1))
                .is_ok()
        }
    }

    fn limit(capacity: usize) -> Arc<Resizable<Model>> {
        Arc::new(Resizable::new(Model(AtomicUsize::new(capacity)), capacity))
    }

    /// Once nothing is held: the free places are the capacity, and nothing is owed.
    fn check_at_rest(limit: &Resizable<Model>) {
        let free = limit.places.0.load(SeqCst);
        let debt = limit.debt.load(SeqCst);
        assert_eq!(free - debt, limit.capacity(), "a place was lost or made up");
        assert_eq!(debt, 0, "a debt is left with nothing held to pay it");
    }

    /// Takes a place if one is free, and gives it back.
    fn worker(limit: Arc<Resizable<Model>>) -> thread::JoinHandle<()> {
        thread::spawn(move || {
            if limit.places.try_take() {
                limit.release();
            }
        })
    }

    #[test]
    fn lowering_while_operations_finish_loses_and_makes_up_no_place() {
        loom::model(|| {
            let limit = limit(2);
            // Both places held when the capacity drops.
            assert!(limit.places.try_take() && limit.places.try_take());
            let releases: Vec<_> = (0..2)
                .map(|_| {
                    let limit = Arc::clone(&limit);
                    thread::spawn(move || limit.release())
                })
                .collect();
            limit.set_capacity(1);
            for release in releases {
                release.join().unwrap();
            }
            check_at_rest(&limit);
        });
    }

    #[test]
    fn resizing_down_and_up_while_operations_come_and_go_loses_and_makes_up_no_place() {
        loom::model(|| {
            let limit = limit(2);
            let workers = [worker(Arc::clone(&limit)), worker(Arc::clone(&limit))];
            let resizer = {
                let limit = Arc::clone(&limit);
                thread::spawn(move || {
                    limit.set_capacity(0);
                    limit.set_capacity(1);
                })
            };
            for worker in workers {
                worker.join().unwrap();
            }
            resizer.join().unwrap();
            check_at_rest(&limit);
        });
    }

    #[test]
    fn a_held_place_released_during_a_lowering_is_owed_not_freed() {
        loom::model(|| {
            let limit = limit(1);
            assert!(limit.places.try_take());
            let release = {
                let limit = Arc::clone(&limit);
                thread::spawn(move || limit.release())
            };
            limit.set_capacity(0);
            release.join().unwrap();
            check_at_rest(&limit);
            assert!(
                !limit.places.try_take(),
                "a capacity of 0 admitted an operation"
            );
        });
    }
}
