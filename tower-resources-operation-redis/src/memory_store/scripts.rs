//! The scripts of the in-memory store that places need, each the Redis script of its name, step
//! for step: taking a place, giving places back, a member's refresh, the capacity, the state.

use super::step::{token, Step};
use crate::fleet::store::{Answer, Event, Refresh, Refreshed, State, Status, Taken};

/// Asks for a place for `id`, with `max_queued` the bound on the queue.
pub(super) fn take(step: &mut Step<'_>, id: &str, max_queued: Option<usize>) -> Taken {
    step.promote();
    let replicas = step.alive(token(id));
    let capacity = step.capacity();
    let taken = |answer| Taken {
        answer,
        capacity,
        replicas,
    };
    if step.data.holders.contains_key(id) {
        step.lease(id);
        return taken(Answer::Granted);
    }
    if step.queued(id) {
        step.extend_ticket(id);
        return taken(Answer::Queued);
    }
    let queued = step.data.queue.len();
    if queued == 0 && step.data.holders.len() < capacity {
        step.lease(id);
        return taken(Answer::Granted);
    }
    if max_queued.is_some_and(|bound| queued >= bound) {
        return taken(Answer::Full);
    }
    step.data.arrivals += 1;
    let arrival = step.data.arrivals;
    step.data.queue.insert(arrival, id.to_owned());
    step.data.arrival_of.insert(id.to_owned(), arrival);
    step.extend_ticket(id);
    taken(Answer::Queued)
}

/// Gives back the leases, claims and tickets `ids`, and hands the places freed over.
pub(super) fn release(step: &mut Step<'_>, ids: &[String]) -> usize {
    for id in ids {
        step.data.holders.remove(id);
        step.data.claims.remove(id);
        step.drop_ticket(id);
    }
    step.promote();
    step.capacity()
}

/// A member's refresh: it is alive, and each of its ids' status.
pub(super) fn refresh(step: &mut Step<'_>, books: &Refresh<'_>) -> Refreshed {
    step.promote();
    let replicas = step.alive(books.process);
    let capacity = step.capacity();
    let held = books
        .held
        .iter()
        .map(|id| {
            if step.data.holders.contains_key(id) {
                step.lease(id);
                Status::Holds
            } else if step.queued(id) {
                step.extend_ticket(id);
                Status::Waits
            } else if step.data.queue.is_empty() && step.data.holders.len() < capacity {
                step.lease(id);
                Status::TakenBack
            } else {
                Status::Gone
            }
        })
        .collect();
    let unheard = books
        .unheard
        .iter()
        .map(|id| {
            step.lease(id);
            step.drop_ticket(id);
            Status::Holds
        })
        .collect();
    let waiting = books
        .waiting
        .iter()
        .map(|id| {
            if step.data.holders.contains_key(id) {
                step.lease(id);
                Status::Holds
            } else if step.queued(id) {
                step.extend_ticket(id);
                Status::Waits
            } else {
                Status::Gone
            }
        })
        .collect();
    Refreshed {
        capacity,
        replicas,
        fleet_held: step.data.holders.len(),
        fleet_unheard: step.unheard(),
        held,
        unheard,
        waiting,
    }
}

/// Sets the fleet's capacity, and tells every member.
pub(super) fn set_capacity(step: &mut Step<'_>, capacity: usize) -> usize {
    step.data.capacity = Some(capacity);
    step.promote();
    step.published.push(Event::Capacity(capacity));
    capacity
}

/// The fleet's state; `member` is alive.
pub(super) fn state(step: &mut Step<'_>, member: &str) -> State {
    step.promote();
    let replicas = step.alive(member);
    let adaptive = step
        .data
        .adaptive
        .ticked
        .is_some_and(|ticked| step.now.saturating_duration_since(ticked) < step.ttl);
    State {
        capacity: step.capacity(),
        active: step.data.holders.len(),
        unheard: step.unheard(),
        queued: step.data.queue.len(),
        replicas,
        adaptive,
    }
}
