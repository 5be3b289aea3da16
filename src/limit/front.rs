//! The places of a [`Limit`](super::Limit): free ones in an atomic count, and tokio's semaphore
//! only for the operations that wait.
//!
//! Giving a place back to tokio's semaphore takes its lock, whether or not anyone waits: about
//! a third of what tower's limit costs per operation. Here a place is taken from, and given
//! back to, the count in front with one atomic operation, as long as nobody waits; the
//! semaphore holds the queue (first come, first served) and the places handed to it.
//!
//! The free places and the waiters are counted in one word, so that a waiter cannot miss a
//! place: joining the waiters takes a free place instead, if there is one, in the same step,
//! and a place given back while anyone waits goes to the queue, in the same step as it looks.
//! A place handed to the queue for a waiter that then gave up stays there, free, for the next
//! waiter or the next [`try_take`](Front::try_take). The loom tests below check every
//! interleaving of it, with the resizes of [`Resizable`](super::resize::Resizable):
//!
//! ```text
//! RUSTFLAGS="--cfg tro_loom" cargo test --release --lib limit::
//! ```

#[cfg(not(all(test, tro_loom)))]
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};

#[cfg(all(test, tro_loom))]
use loom::sync::atomic::{AtomicU64, Ordering::SeqCst};

use tokio::sync::TryAcquireError;

use super::resize::Places;

/// The low 31 bits of the word: free places in front of the queue (more go to the queue).
const FREE: u64 = (1 << 31) - 1;
/// Set once the limit is closed.
const CLOSED: u64 = 1 << 31;
/// The high 32 bits: the operations that wait.
const WAITER: u64 = 1 << 32;

/// What the front needs of the semaphore behind it: tokio's, or a model of it under loom.
pub(super) trait Queue {
    /// A place the queue holds, if it holds one that no waiter has taken.
    fn try_take(&self) -> Result<(), TryAcquireError>;
    /// Hands `n` places to the waiters (or keeps them, free).
    fn add(&self, n: usize);
    /// Takes up to `n` free places out for good; returns how many.
    fn forget(&self, n: usize) -> usize;
    /// Turns its waiters away.
    fn close(&self);
    /// The places it holds free.
    fn available(&self) -> usize;
}

impl Queue for tokio::sync::Semaphore {
    #[inline]
    fn try_take(&self) -> Result<(), TryAcquireError> {
        // The place leaves tokio's count: the front gives it back (`add`) when it is released.
        self.try_acquire().map(tokio::sync::SemaphorePermit::forget)
    }

    fn add(&self, n: usize) {
        self.add_permits(n);
    }

    fn forget(&self, n: usize) -> usize {
        self.forget_permits(n)
    }

    fn close(&self) {
        tokio::sync::Semaphore::close(self);
    }

    fn available(&self) -> usize {
        self.available_permits()
    }
}

/// Free places counted in front of a queue of waiters.
///
/// On cache lines of its own: every operation writes the word, and every one that waits or
/// hands a place on writes the queue, while what the limit only reads per operation (its
/// controller, its debt, the bound on its queue) and the handle's count stay off these lines,
/// so that a core that reads them does not take the line from the core that writes it.
#[derive(Debug)]
#[repr(align(64))]
pub(super) struct Front<Q> {
    /// Free places outside the queue ([`FREE`]), [`CLOSED`], and the waiters ([`WAITER`]s).
    word: AtomicU64,
    /// The waiters, and the places handed to them.
    queue: Q,
}

/// What joining the waiters came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Joined {
    /// A place was free after all: it was taken instead.
    Took,
    /// Counted as a waiter, after `ahead` others: wait on the queue, and
    /// [`leave`](Front::leave) once admitted or given up.
    Waits { ahead: usize },
    /// The limit is closed.
    Closed,
}

fn free(word: u64) -> usize {
    // At most `FREE`: fits any `usize` of 32 bits or more.
    (word & FREE) as usize
}

impl<Q: Queue> Front<Q> {
    /// `free` free places, and `queue`, whose own free places are free too.
    pub(super) fn new(free: usize, queue: Q) -> Self {
        let front = free.min(FREE as usize);
        if free > front {
            queue.add(free - front);
        }
        Self {
            word: AtomicU64::new(front as u64),
            queue,
        }
    }

    /// The queue, which a waiter waits on once [`join`](Self::join)ed.
    pub(super) fn queue(&self) -> &Q {
        &self.queue
    }

    /// Takes a free place, if there is one: from the count, or one left in the queue while
    /// nobody waits. `NoPermits` means the caller would wait.
    #[inline]
    pub(super) fn try_take(&self) -> Result<(), TryAcquireError> {
        match self.take_free(self.word.load(SeqCst)) {
            Ok(()) => Ok(()),
            Err(word) if word & CLOSED != 0 => Err(TryAcquireError::Closed),
            // The queue keeps a free place only while nobody waits.
            Err(word) if word < WAITER => self.queue.try_take(),
            Err(_) => Err(TryAcquireError::NoPermits),
        }
    }

    /// Takes a place from the count, starting from `word`; if there is none (or the limit is
    /// closed), returns the word that says so.
    #[inline]
    fn take_free(&self, mut word: u64) -> Result<(), u64> {
        while word & FREE != 0 && word & CLOSED == 0 {
            match self
                .word
                .compare_exchange_weak(word, word - 1, SeqCst, SeqCst)
            {
                Ok(_) => return Ok(()),
                Err(now) => word = now,
            }
        }
        Err(word)
    }

    /// Counts one more waiter, unless a place is free by now (it is taken instead) or the
    /// limit is closed. Once counted, no place is added to the count, so one that is still
    /// there is taken now or by somebody else.
    pub(super) fn join(&self) -> Joined {
        let before = self.word.fetch_add(WAITER, SeqCst);
        if before & (FREE | CLOSED) == 0 {
            return Joined::Waits {
                ahead: usize::try_from(before / WAITER).unwrap_or(usize::MAX),
            };
        }
        let joined = match self.take_free(before + WAITER) {
            Ok(()) => Joined::Took,
            Err(word) if word & CLOSED != 0 => Joined::Closed,
            Err(_) => {
                return Joined::Waits {
                    ahead: usize::try_from(before / WAITER).unwrap_or(usize::MAX),
                }
            }
        };
        self.leave();
        joined
    }

    /// A waiter leaves, with a place or without.
    pub(super) fn leave(&self) {
        self.word.fetch_sub(WAITER, SeqCst);
    }

    /// How many wait now.
    pub(super) fn waiting(&self) -> usize {
        usize::try_from(self.word.load(SeqCst) / WAITER).unwrap_or(usize::MAX)
    }

    /// Free places now, in the count and in the queue.
    pub(super) fn available(&self) -> usize {
        free(self.word.load(SeqCst)).saturating_add(self.queue.available())
    }

    /// Turns away the waiters and every later caller.
    pub(super) fn close(&self) {
        self.word.fetch_or(CLOSED, SeqCst);
        self.queue.close();
    }
}

impl<Q: Queue> Places for Front<Q> {
    /// Frees `n` places: into the count if nobody waits, else to the waiters.
    #[inline]
    fn add(&self, n: usize) {
        let mut word = self.word.load(SeqCst);
        loop {
            if word >= WAITER {
                return self.queue.add(n);
            }
            let fits = n.min(free(FREE - (word & FREE)));
            match self
                .word
                .compare_exchange_weak(word, word + fits as u64, SeqCst, SeqCst)
            {
                Ok(_) if fits == n => return,
                Ok(_) => return self.queue.add(n - fits),
                Err(now) => word = now,
            }
        }
    }

    fn forget(&self, n: usize) -> usize {
        let mut taken = 0;
        let _ = self.word.fetch_update(SeqCst, SeqCst, |word| {
            taken = free(word).min(n);
            Some(word - taken as u64)
        });
        if taken < n {
            taken += self.queue.forget(n - taken);
        }
        taken
    }
}

#[cfg(all(test, tro_loom))]
mod loom_tests {
    use loom::sync::atomic::AtomicUsize;
    use loom::sync::Arc;
    use loom::thread;

    use super::*;
    use crate::limit::resize::loom_tests::Model;
    use crate::limit::resize::Resizable;

    /// Tokio's semaphore without its wakers (resize's model): a count of the places handed to
    /// the waiters. Closing it is the front's to check.
    impl Queue for Model {
        fn try_take(&self) -> Result<(), TryAcquireError> {
            match Model::try_take(self) {
                true => Ok(()),
                false => Err(TryAcquireError::NoPermits),
            }
        }

        fn add(&self, n: usize) {
            super::Places::add(self, n);
        }

        fn forget(&self, n: usize) -> usize {
            super::Places::forget(self, n)
        }

        fn close(&self) {}

        fn available(&self) -> usize {
            self.0.load(SeqCst)
        }
    }

    type Places = Resizable<Front<Model>>;

    fn limit(capacity: usize) -> Arc<Places> {
        Arc::new(Resizable::new(
            Front::new(capacity, Model(AtomicUsize::new(0))),
            capacity,
        ))
    }

    /// Asks for a place as `Limit` does: now, or by joining the waiters. Returns whether it
    /// has one; if not, it waits on the queue, where only a place handed to the queue wakes it.
    fn ask(limit: &Places) -> bool {
        let front = limit.places();
        front.try_take().is_ok() || front.join() == Joined::Took
    }

    /// Spawns `n` threads that ask for a place; returns how many got one at once.
    fn askers(limit: &Arc<Places>, n: usize) -> Vec<thread::JoinHandle<bool>> {
        (0..n)
            .map(|_| {
                let limit = Arc::clone(limit);
                thread::spawn(move || ask(&limit))
            })
            .collect()
    }

    /// Once every release is done: each waiter has a place in the queue to wake it, and the
    /// places held by those that got one, plus the free ones, are the capacity.
    fn check(limit: &Places, capacity: usize, admitted: usize, waiters: usize) {
        let front = limit.places();
        assert_eq!(front.waiting(), waiters);
        assert!(
            front.queue().available() >= waiters,
            "a waiter waits while a place is free in front of the queue"
        );
        assert_eq!(
            front.available() + admitted,
            capacity,
            "a place was lost or made up"
        );
    }

    /// How many of `askers` got a place at once.
    fn settle(askers: Vec<thread::JoinHandle<bool>>) -> usize {
        askers
            .into_iter()
            .map(|asker| asker.join().unwrap())
            .filter(|&admitted| admitted)
            .count()
    }

    #[test]
    fn a_waiter_is_handed_the_place_freed_while_it_joins() {
        loom::model(|| {
            let limit = limit(1);
            assert!(limit.places().try_take().is_ok());
            let asker = askers(&limit, 1);
            limit.release();
            let admitted = settle(asker);
            check(&limit, 1, admitted, 1 - admitted);
        });
    }

    #[test]
    fn two_waiters_and_two_releases_lose_and_make_up_no_place() {
        loom::model(|| {
            let limit = limit(2);
            assert!(limit.places().try_take().is_ok());
            assert!(limit.places().try_take().is_ok());
            let askers = askers(&limit, 2);
            limit.release();
            limit.release();
            let admitted = settle(askers);
            check(&limit, 2, admitted, 2 - admitted);
        });
    }

    #[test]
    fn a_lowering_while_a_waiter_joins_loses_and_makes_up_no_place() {
        loom::model(|| {
            let limit = limit(2);
            assert!(limit.places().try_take().is_ok());
            assert!(limit.places().try_take().is_ok());
            let asker = askers(&limit, 1);
            limit.release();
            limit.set_capacity(1);
            limit.release();
            let admitted = settle(asker);
            check(&limit, 1, admitted, 1 - admitted);
        });
    }

    #[test]
    fn a_place_handed_to_a_waiter_that_gave_up_stays_free() {
        loom::model(|| {
            let limit = limit(1);
            assert!(limit.places().try_take().is_ok());
            let quitter = {
                let limit = Arc::clone(&limit);
                thread::spawn(move || {
                    if !ask(&limit) {
                        // Its caller went away while it waited.
                        limit.places().leave();
                        return false;
                    }
                    true
                })
            };
            limit.release();
            if quitter.join().unwrap() {
                limit.release();
            }
            check(&limit, 1, 0, 0);
            assert!(
                limit.places().try_take().is_ok(),
                "the free place is out of reach"
            );
        });
    }

    #[test]
    fn a_closed_front_turns_away_whatever_is_free() {
        loom::model(|| {
            let limit = limit(1);
            let closer = {
                let limit = Arc::clone(&limit);
                thread::spawn(move || limit.places().close())
            };
            let taken = limit.places().try_take();
            closer.join().unwrap();
            if taken.is_ok() {
                limit.release();
            }
            assert!(matches!(
                limit.places().try_take(),
                Err(TryAcquireError::Closed)
            ));
        });
    }
}
