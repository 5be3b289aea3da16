//! [`Series`]: the handle an operation records through, and every record it makes.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use super::instruments::{millis, Cell, Shared};
use crate::attributes::{Outcome, Rejection};
use crate::guard::guarded;

/// One (operation, executor) of one [`OperationMetrics`](super::OperationMetrics): what an
/// operation records through.
///
/// One pointer. Its cell is aligned to a cache line: its reference count changes on every
/// operation of a layer, from every core.
#[derive(Clone, Debug)]
pub(crate) struct Series(Arc<SeriesCell>);

#[derive(Debug)]
#[repr(align(64))]
struct SeriesCell {
    shared: Arc<Shared>,
    index: usize,
}

impl Series {
    pub(super) fn new(shared: &Arc<Shared>, index: usize) -> Self {
        Series(Arc::new(SeriesCell {
            shared: Arc::clone(shared),
            index,
        }))
    }

    #[inline]
    fn parts(&self) -> (&Shared, &Cell, usize) {
        let cell = &*self.0;
        (&cell.shared, &cell.shared.cells[cell.index], cell.index)
    }

    /// One more operation of the series waits.
    pub(crate) fn start_waiting(&self) {
        self.parts().1.queued.fetch_add(1, Ordering::Relaxed);
    }

    /// An operation got its permit, after waiting if it `waited` (counted in `queued` until
    /// now).
    #[inline]
    pub(crate) fn admit(&self, waited: bool) {
        let (_, cell, _) = self.parts();
        if waited {
            cell.queued.fetch_sub(1, Ordering::Relaxed);
        }
        cell.active.fetch_add(1, Ordering::Relaxed);
    }

    /// An admitted operation was called, after waiting `queued` for its permit: its queue
    /// sample.
    #[inline]
    pub(crate) fn record_queue(&self, queued: Duration) {
        let (shared, _, index) = self.parts();
        guarded(|| shared.record_queue(index, millis(queued)));
    }

    /// An admitted operation's caller went away before it was called.
    pub(crate) fn abandon_admitted(&self) {
        let (_, cell, _) = self.parts();
        cell.active.fetch_sub(1, Ordering::Relaxed);
        cell.abandoned.fetch_add(1, Ordering::Relaxed);
    }

    /// An operation was turned away, after waiting or not.
    pub(crate) fn reject(&self, rejection: Rejection, waited: bool) {
        let (_, cell, _) = self.parts();
        if waited {
            cell.queued.fetch_sub(1, Ordering::Relaxed);
        }
        cell.rejected[rejection.index()].fetch_add(1, Ordering::Relaxed);
    }

    /// A caller went away while it waited.
    pub(crate) fn abandon(&self, waited: bool) {
        let (_, cell, _) = self.parts();
        if waited {
            cell.queued.fetch_sub(1, Ordering::Relaxed);
        }
        cell.abandoned.fetch_add(1, Ordering::Relaxed);
    }

    /// An admitted operation that ran for `ran` ended with `outcome`.
    #[inline]
    pub(crate) fn end(&self, outcome: Outcome, ran: Duration) {
        let (shared, cell, index) = self.parts();
        cell.active.fetch_sub(1, Ordering::Relaxed);
        guarded(|| shared.record_duration(index, outcome, millis(ran)));
    }
}
