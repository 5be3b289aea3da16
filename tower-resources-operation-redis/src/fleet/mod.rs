//! What makes one limit of many processes, whatever store keeps it: each process's part
//! ([`member`]), its books and ids ([`books`]), how an operation takes a place ([`waiter`]) and
//! holds it ([`place`]), whether the store is reached ([`health`]), the background work
//! ([`background`]), an adaptive limit's controller ([`control`]), all written once against
//! the [`store::Store`] seam. Nothing here knows Redis: the Redis store (`crate::redis_store`)
//! implements the seam, and imports from here, never the other way round.

pub(crate) mod background;
pub(crate) mod books;
pub(crate) mod checks;
pub(crate) mod control;
pub(crate) mod doorbell;
pub(crate) mod health;
pub(crate) mod leader;
pub(crate) mod member;
pub(crate) mod place;
pub(crate) mod share;
pub(crate) mod store;
pub(crate) mod waiter;

#[cfg(test)]
mod tests;

use std::sync::{Arc, Weak};

use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};
use tower_resources_operation::limit::Capacity;

use background::Background;
use control::FleetControl;
use member::{Handle, Member, Settings};
use store::{Event, Store};

/// A member of the fleet on `store`, whose ids start with `token`: its handle (what the limit's
/// clones share) and its background work, which hears what the store pushes on `events`.
pub(crate) fn assemble<S: Store>(
    store: S,
    settings: Settings,
    token: Arc<str>,
    control: Option<FleetControl>,
    events: UnboundedReceiver<Event>,
) -> (Arc<Handle<S>>, Background) {
    let name = Arc::clone(&settings.name);
    let member = Arc::new(Member::new(store, settings, token, control));
    let (releases, released) = unbounded_channel();
    let handle = Arc::new_cyclic(|handle: &Weak<Handle<S>>| {
        let handle = handle.clone();
        let gauge = Capacity::of_limit(Some(&name), move || {
            handle.upgrade().map(|handle| handle.member.reading())
        })
        .expect("the name was checked when the builder was made");
        Handle::new(Arc::clone(&member), releases, gauge)
    });
    (handle, Background::new(member, released, events))
}
