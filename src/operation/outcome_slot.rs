//! The slot that [`set_outcome`] writes to: the outcome so far of the operation whose work runs
//! on this thread, if one does.

use std::cell::Cell;

use crate::attributes::Outcome;

/// What the thread's slot holds.
#[derive(Clone, Copy)]
pub(super) enum Slot {
    /// No operation is being called or polled on this thread.
    Outside,
    /// An operation is; this is its outcome so far.
    Inside(Option<Outcome>),
}

thread_local! {
    static CURRENT: Cell<Slot> = const { Cell::new(Slot::Outside) };
}

/// Makes the operation whose outcome so far is `chosen` the thread's current one; returns the
/// slot to give back, or `None` while the thread is being torn down (the work then runs without
/// a slot rather than fail).
#[inline]
pub(super) fn enter(chosen: Option<Outcome>) -> Option<Slot> {
    CURRENT
        .try_with(|slot| slot.replace(Slot::Inside(chosen)))
        .ok()
}

/// Gives the thread's slot back as `previous`; returns the outcome the work chose.
#[inline]
pub(super) fn leave(previous: Slot) -> Option<Outcome> {
    match CURRENT.try_with(|slot| slot.replace(previous)) {
        Ok(Slot::Inside(chosen)) => chosen,
        _ => None,
    }
}

/// Sets the outcome of the operation whose work is running on this thread, overriding what the
/// classifier would say: NeMo Gym's `op.outcome = ...`. Returns `true` if the outcome will be
/// recorded.
///
/// Call it from the work itself, for example from an axum handler behind the layer, or from the
/// future given to [`resources_operation`](crate::resources_operation), when the work ended other
/// than its result shows: a handler that hit its own deadline and answers with a fallback sets
/// [`Outcome::Timeout`]. The last call wins, and it wins over every other rule.
///
/// Returns `false` and changes nothing outside an operation, and in a task spawned from the work
/// (`tokio::spawn` runs it elsewhere; set the outcome in the work that awaits it). A limit whose
/// metrics are [disabled](crate::OperationMetrics::disabled) is only a limit: inside it,
/// `set_outcome` sets the outcome of the enabled operation around it, if there is one, and
/// returns `false` otherwise.
///
/// ```
/// use tower_resources_operation::{set_outcome, Outcome};
///
/// // Outside any operation there is nothing to set.
/// assert!(!set_outcome(Outcome::Timeout));
/// ```
pub fn set_outcome(outcome: Outcome) -> bool {
    CURRENT
        .try_with(|slot| match slot.get() {
            Slot::Outside => false,
            Slot::Inside(_) => {
                slot.set(Slot::Inside(Some(outcome)));
                true
            }
        })
        .unwrap_or(false)
}
