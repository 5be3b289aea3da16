//! [`Place`]: what an admitted operation holds, and gives back when it drops.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::books::lock;
use super::member::Handle;

/// A place of a fleet limit, held while the operation runs.
pub(crate) struct Place<S> {
    pub(crate) handle: Arc<Handle<S>>,
    pub(crate) kind: Kind,
    /// The fleet's window it was admitted in (adaptive limits): the store's, for a place
    /// handed over; else the one this process knew as it asked.
    pub(crate) epoch: u64,
}

/// How a place was admitted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// A lease of the fleet's.
    Lease(String),
    /// A place of this process's share, taken while the store was out of reach: it becomes a
    /// lease at the first refresh that reaches the store.
    Share(String),
    /// Admitted without the fleet limit, failing open.
    Unlimited,
}

impl<S> Place<S> {
    /// A place admitted in the fleet's window `epoch`.
    pub(crate) fn new(handle: Arc<Handle<S>>, kind: Kind, epoch: u64) -> Self {
        Self {
            handle,
            kind,
            epoch,
        }
    }

    /// Whether the fleet's limit (or this process's share of it) counts it.
    pub(crate) fn is_limited(&self) -> bool {
        self.kind != Kind::Unlimited
    }
}

impl<S> Drop for Place<S> {
    fn drop(&mut self) {
        let id = match &mut self.kind {
            Kind::Lease(id) | Kind::Share(id) => std::mem::take(id),
            Kind::Unlimited => return,
        };
        let member = &self.handle.member;
        {
            let mut books = lock(&member.books);
            if !books.held.remove(&id) {
                books.unheard.remove(&id);
            }
        }
        member.counts.active.fetch_sub(1, Ordering::Relaxed);
        // A place on the share may have become a lease meanwhile (a refresh in flight): giving
        // back an id the store does not know is a no-op.
        self.handle.release(id);
        member.share.freed.notify_one();
    }
}
