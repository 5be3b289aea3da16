//! How an operation takes a place of the fleet ([`acquire`]): asks the store, waits in the
//! fleet's queue for news of its ticket, takes up a place handed over to it, and, while the
//! store is out of reach, is answered as the limit says: on this process's share, turned away,
//! or admitted without the limit.
//!
//! A waiter registers a [`Slot`] under its id before it asks, so that a wake-up pushed while
//! its first call is under way still finds it; one that goes away gives back its ticket (or the
//! place handed to it meanwhile).

use std::future::{poll_fn, Future};
use std::pin::pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::Poll;

use tower_resources_operation::Rejected;
use tower_resources_operation::Rejection;

use super::books::{lock, Slot, ASK, GRANTED};
use super::member::Handle;
use super::place::{Kind, Place};
use super::share::Unreachable;
use super::store::{Answer, Store};
use crate::error::Error;

/// Takes a place of the fleet, waiting for one in its queue if it has to.
pub(crate) async fn acquire<S: Store>(handle: Arc<Handle<S>>) -> Result<Place<S>, Rejected> {
    let mut waiter = Waiter::new(&handle);
    let member = &handle.member;
    loop {
        let asked_before = waiter.asked;
        waiter.asked = true;
        // The window as of before the call: a place the store grants meanwhile was admitted
        // in it or in a later one, and a decrease decided meanwhile lowered a capacity it was
        // perhaps admitted at (its failure is then not news).
        waiter.asked_in = member.window();
        // A place handed over before this call is what the call takes up, if anything: the
        // window it was handed over in counts for this call only (a claim that lapsed meanwhile
        // leaves the call to a place granted directly, or to the queue).
        let handed_in = waiter.slot.handed_in.swap(0, Ordering::Relaxed);
        let error = match member.take(&waiter.id).await {
            Ok(Answer::Granted) => return Ok(waiter.admitted(Kind::Lease, handed_in)),
            Ok(Answer::Queued) => {
                waiter.queue();
                if waiter.wait().await {
                    // A refresh took up the place handed over to it since its call.
                    let handed_in = waiter.slot.handed_in.swap(0, Ordering::Relaxed);
                    return Ok(waiter.admitted(Kind::Lease, handed_in));
                }
                continue;
            }
            Ok(Answer::Full) => {
                // No ticket and no lease of this id is left in the store.
                waiter.asked = false;
                if let Some(control) = &member.control {
                    control.rejected();
                }
                return Err(Rejected::new(Rejection::QueueFull));
            }
            Err(error) => error,
        };
        if error.is_short_circuited() {
            // Not asked this time: only an earlier ask may have left a ticket.
            waiter.asked = asked_before;
        }
        match member.settings.unreachable {
            Unreachable::Closed => return Err(Rejected::failed(error)),
            Unreachable::Open => {
                member.counts.failed_open.fetch_add(1, Ordering::Relaxed);
                return Ok(Place::new(
                    Arc::clone(&handle),
                    Kind::Unlimited,
                    member.window(),
                ));
            }
            Unreachable::Share => {
                if let Some(admitted) = waiter.on_share(error).await {
                    return admitted;
                }
                // The store answers again: ask it.
            }
        }
    }
}

/// One operation waiting for its place: registered so that wake-ups reach it, and, if it goes
/// away before it is admitted, its ticket (or the place handed to it) goes back.
struct Waiter<S> {
    handle: Arc<Handle<S>>,
    id: String,
    slot: Arc<Slot>,
    /// Whether the store may hold a ticket, a claim or a lease of this id.
    asked: bool,
    /// The fleet's window as this process knew it before its last call to the store.
    asked_in: u64,
    admitted: bool,
}

impl<S: Store> Waiter<S> {
    fn new(handle: &Arc<Handle<S>>) -> Self {
        let slot = Arc::new(Slot::default());
        let id = {
            let mut books = lock(&handle.member.books);
            let id = books.next_id();
            books.waiting.insert(id.clone(), Arc::clone(&slot));
            id
        };
        Self {
            handle: Arc::clone(handle),
            id,
            slot,
            asked: false,
            asked_in: 0,
            admitted: false,
        }
    }

    /// It waits (in the fleet's queue, or for a place of the share): counted, and its ticket
    /// refreshed by the background task (which is told, so that it refreshes at least every
    /// fallback poll from now).
    fn queue(&mut self) {
        if !self.slot.queued.swap(true, Ordering::Relaxed) {
            let member = &self.handle.member;
            if member.counts.queued.fetch_add(1, Ordering::Relaxed) == 0 {
                member.doorbell.hurry();
            }
        }
    }

    /// Waits for news of its ticket: `true` if a refresh found the place its, `false` to ask
    /// again (a place handed over, to be claimed; a wake-up lost; the ticket gone; the store
    /// out of reach). Asks again after a TTL without news, in case the background task is not
    /// running.
    async fn wait(&self) -> bool {
        // One deadline for the whole wait: a wake-up without news does not put it off.
        let deadline = tokio::time::Instant::now() + self.handle.member.settings.lease_ttl;
        loop {
            let heard = tokio::time::timeout_at(deadline, self.slot.notified()).await;
            match self.slot.take_news() {
                GRANTED => return true,
                ASK => return false,
                _ if heard.is_err() => return false,
                _ => {}
            }
        }
    }

    /// While the store is out of reach (`error`), waits for a place of this process's share:
    /// `None` once the store answers again and the fleet has settled (ask it), else the answer.
    async fn on_share(&mut self, error: Error) -> Option<Result<Place<S>, Rejected>> {
        let member = Arc::clone(&self.handle.member);
        loop {
            let down = member.health.is_down();
            if !down && !member.share.is_settling() {
                return None;
            }
            // A replica that never reached the store has no share.
            let Some(share) = member.share() else {
                return Some(Err(Rejected::failed(error)));
            };
            // While the fleet settles after the store's return, nothing new is admitted on
            // the share: the store must hear of every place before it admits again.
            if down && member.share.take(&member.counts.active, share) {
                return Some(Ok(self.admitted_on_share()));
            }
            if let Some(bound) = member.settings.max_queued {
                let replicas = member.share.replicas().unwrap_or(1).max(1);
                if !self.slot.queued.load(Ordering::Relaxed)
                    && member.counts.queued.load(Ordering::Relaxed) >= bound / replicas
                {
                    return Some(Err(Rejected::new(Rejection::QueueFull)));
                }
            }
            self.queue();
            // A place of the share freed, or news (the store answers again, a grant): either
            // way, look again.
            {
                let mut freed = pin!(member.share.freed.notified());
                let mut news = pin!(self.slot.notified());
                poll_fn(|cx| match freed.as_mut().poll(cx) {
                    Poll::Ready(()) => Poll::Ready(()),
                    Poll::Pending => news.as_mut().poll(cx),
                })
                .await;
            }
            if self.slot.take_news() == GRANTED {
                let handed_in = self.slot.handed_in.swap(0, Ordering::Relaxed);
                return Some(Ok(self.admitted(Kind::Lease, handed_in)));
            }
        }
    }

    /// The place is its, a lease: handed over in the fleet's window `handed_in` (0: granted as
    /// it asked, in the window it knew before).
    fn admitted(&mut self, kind: fn(String) -> Kind, handed_in: u64) -> Place<S> {
        let epoch = match handed_in {
            0 => self.asked_in,
            handed_in => handed_in,
        };
        let id = self.leave();
        lock(&self.handle.member.books).held.insert(id.clone());
        self.handle
            .member
            .counts
            .active
            .fetch_add(1, Ordering::Relaxed);
        Place::new(Arc::clone(&self.handle), kind(id), epoch)
    }

    /// A place of the share is its (counted in `active` already): the store is told of it at
    /// the first refresh that reaches it.
    fn admitted_on_share(&mut self) -> Place<S> {
        let id = self.leave();
        lock(&self.handle.member.books).unheard.insert(id.clone());
        let epoch = self.handle.member.window();
        Place::new(Arc::clone(&self.handle), Kind::Share(id), epoch)
    }

    /// No longer waits: out of the books and the queued count, its id taken.
    fn leave(&mut self) -> String {
        self.admitted = true;
        let member = &self.handle.member;
        let id = std::mem::take(&mut self.id);
        lock(&member.books).waiting.remove(&id);
        if self.slot.queued.load(Ordering::Relaxed) {
            member.counts.queued.fetch_sub(1, Ordering::Relaxed);
        }
        id
    }
}

impl<S> Drop for Waiter<S> {
    fn drop(&mut self) {
        if self.admitted {
            return;
        }
        let member = &self.handle.member;
        lock(&member.books).waiting.remove(&self.id);
        if self.slot.queued.load(Ordering::Relaxed) {
            member.counts.queued.fetch_sub(1, Ordering::Relaxed);
        }
        if self.asked {
            let id = std::mem::take(&mut self.id);
            self.handle.release(id);
        }
    }
}
