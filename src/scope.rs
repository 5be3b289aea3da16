//! [`set_outcome`]: NeMo Gym's `op.outcome = ...`, for code running inside limited work.
//!
//! While the layer (or [`resources_operation`](crate::resources_operation)) calls or polls the
//! work, a thread-local slot holds that operation's outcome; `set_outcome` writes it, and the
//! operation reads it back when the call or poll returns. Nested operations save and restore the
//! slot, so each sees only its own. The slot is a `Copy` value in a `const` thread-local: no
//! allocation and no lazy initialisation on the request path.

use std::borrow::Borrow;
use std::cell::Cell;

use crate::lifecycle::Running;
use crate::metrics::Series;
use crate::Outcome;

#[derive(Clone, Copy)]
enum Slot {
    /// No operation is being called or polled on this thread.
    Outside,
    /// An operation is; this is its outcome so far.
    Inside(Option<Outcome>),
}

thread_local! {
    static CURRENT: Cell<Slot> = const { Cell::new(Slot::Outside) };
}

/// Sets the outcome of the operation whose work is running on this thread, overriding what the
/// classifier would say. Returns `true` if the outcome will be recorded.
///
/// Call it from the work itself, for example from an axum handler behind the layer, or from the
/// future given to [`resources_operation`](crate::resources_operation), when the work ended other
/// than its result shows: a handler that hit its own deadline and answers with a fallback sets
/// [`Outcome::Timeout`]. The last call wins.
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

/// Runs `work` (one call or one poll of the operation's inner work) with `running` as the
/// current operation. If `work` panics, the operation ends as [`Outcome::Crashed`] and the panic
/// goes on unchanged.
#[inline]
pub(crate) fn enter<H: Borrow<Series>, R>(running: &mut Running<H>, work: impl FnOnce() -> R) -> R {
    let Ok(previous) =
        CURRENT.try_with(|slot| slot.replace(Slot::Inside(running.chosen_outcome())))
    else {
        // The thread is being torn down: run the work without a slot rather than fail it.
        return work();
    };
    let unwinding = Unwinding { running, previous };
    let output = work();
    // `work` returned: leave the scope here, in line, and disarm the guard.
    leave(unwinding.running, unwinding.previous);
    std::mem::forget(unwinding);
    output
}

/// Gives the thread's slot back to the operation around this one, keeping the outcome that the
/// work chose, if it did.
#[inline]
fn leave<H: Borrow<Series>>(running: &mut Running<H>, previous: Slot) {
    if let Ok(Slot::Inside(outcome)) = CURRENT.try_with(|slot| slot.replace(previous)) {
        running.choose_outcome(outcome);
    }
}

/// Dropped only while `work` unwinds: leaves the scope and ends the operation as crashed.
struct Unwinding<'a, H: Borrow<Series>> {
    running: &'a mut Running<H>,
    previous: Slot,
}

impl<H: Borrow<Series>> Drop for Unwinding<'_, H> {
    fn drop(&mut self) {
        leave(self.running, self.previous);
        self.running.finish(Outcome::Crashed);
    }
}
