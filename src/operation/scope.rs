//! What a thread knows of the operation whose work runs on it: its outcome so far, which
//! [`set_outcome`] writes, and the limits whose places the operations around the work hold, so
//! that a request that reaches one of them again is admitted on the place it holds (see
//! [`holds`]).
//!
//! An operation enters its scope each time its work runs or is polled (`Lifecycle::run`), and
//! leaves it when the work returns, so the scope follows the request's path however deeply its
//! layers nest, as tracing's spans follow a future. A task spawned from the work runs elsewhere,
//! outside it. Two thread-locals of a word each: the outcome slot, entered only by an operation
//! that records, and the limit held, entered by every operation whose limit says which it is
//! ([`Acquire::id_of`](crate::Acquire::id_of)).

use std::cell::Cell;

use crate::attributes::Outcome;
use crate::limit::LimitId;

/// The outcome slot: the outcome so far of the recorded operation whose work runs on this
/// thread, if one does.
#[derive(Clone, Copy)]
pub(super) enum Slot {
    /// No recorded operation is being called or polled on this thread.
    Outside,
    /// A recorded operation is; this is its outcome so far.
    Inside(Option<Outcome>),
}

/// The limit held by the innermost operation around the running work that says which its limit
/// is. One word: checked by every operation that asks for a place, and published by every one
/// that runs its work, it must cost next to nothing (two words cost 0.08x of tower's limit per
/// operation, one 0.01x). So a request that passes another limit between two layers of one
/// limit is checked against the innermost only.
type Held = Option<LimitId>;

thread_local! {
    static OUTCOME: Cell<Slot> = const { Cell::new(Slot::Outside) };
    static HELD: Cell<Held> = const { Cell::new(None) };
}

/// Makes the recorded operation whose outcome so far is `chosen` the thread's current one;
/// returns the slot to give back, or `None` while the thread is being torn down (the work then
/// runs without a slot rather than fail).
#[inline]
pub(super) fn enter(chosen: Option<Outcome>) -> Option<Slot> {
    OUTCOME
        .try_with(|slot| slot.replace(Slot::Inside(chosen)))
        .ok()
}

/// Gives the thread's slot back as `previous`; returns the outcome the work chose.
#[inline]
pub(super) fn leave(previous: Slot) -> Option<Outcome> {
    match OUTCOME.try_with(|slot| slot.replace(previous)) {
        Ok(Slot::Inside(chosen)) => chosen,
        _ => None,
    }
}

/// The place of a limit that an operation holds, published while its work runs: dropped, the
/// limit held around it is the thread's again.
pub(super) struct Holding(Option<Held>);

impl Holding {
    /// Publishes `held`, a limit whose place the operation about to run its work holds.
    #[inline(always)]
    pub(super) fn enter(held: Option<LimitId>) -> Self {
        match held {
            Some(id) => Self(HELD.try_with(|current| current.replace(Some(id))).ok()),
            None => Self(None),
        }
    }
}

impl Drop for Holding {
    #[inline(always)]
    fn drop(&mut self) {
        if let Some(previous) = self.0 {
            let _ = HELD.try_with(|current| current.set(previous));
        }
    }
}

/// Whether an operation around the work running on this thread holds a place of the limit
/// `id`: a request that reaches its own limit again (one limit applied twice on its path).
#[inline(always)]
pub(crate) fn holds(id: LimitId) -> bool {
    HELD.try_with(|current| current.get() == Some(id))
        .unwrap_or(false)
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
    OUTCOME
        .try_with(|slot| match slot.get() {
            Slot::Outside => false,
            Slot::Inside(_) => {
                slot.set(Slot::Inside(Some(outcome)));
                true
            }
        })
        .unwrap_or(false)
}
