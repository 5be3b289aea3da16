//! What a thread knows of the operation whose work runs on it: its outcome so far, which
//! [`set_outcome`] writes, and the limits whose places the operations around the work hold, so
//! that a request that reaches one of them again is admitted on the place it holds (see
//! [`holds`]).
//!
//! An operation enters its scope each time its work runs or is polled (`Lifecycle::run`), and
//! leaves it when the work returns, so the scope follows the request's path however deeply its
//! layers nest, as tracing's spans follow a future. A task spawned from the work runs elsewhere,
//! outside it.

use std::cell::Cell;

use crate::attributes::Outcome;
use crate::limit::LimitId;

/// How many enclosing limits a scope remembers: a request that passes more distinct limits
/// than this is checked against the innermost ones.
const HELD: usize = 3;

/// The thread's scope.
#[derive(Clone, Copy)]
pub(super) struct Scope {
    outcome: Slot,
    /// The limits held by the operations around the running work, innermost first.
    held: [Option<LimitId>; HELD],
}

/// What the thread's outcome slot holds.
#[derive(Clone, Copy)]
enum Slot {
    /// No recorded operation is being called or polled on this thread.
    Outside,
    /// A recorded operation is; this is its outcome so far.
    Inside(Option<Outcome>),
}

thread_local! {
    static CURRENT: Cell<Scope> = const {
        Cell::new(Scope {
            outcome: Slot::Outside,
            held: [None; HELD],
        })
    };
}

/// Enters the scope of an operation whose work is about to run: one that records, with its
/// outcome so far (`Some(chosen)`), or one that does not (`None`: [`set_outcome`] then reaches
/// the recorded operation around it, if any); holding a place of the limit `held`, if it is
/// known. Returns the scope to give back, or `None` while the thread is being torn down (the
/// work then runs without one rather than fail).
#[inline]
pub(super) fn enter(recorded: Option<Option<Outcome>>, held: Option<LimitId>) -> Option<Scope> {
    CURRENT
        .try_with(|current| {
            let previous = current.get();
            let mut next = previous;
            if let Some(chosen) = recorded {
                next.outcome = Slot::Inside(chosen);
            }
            if held.is_some() && previous.held[0] != held {
                next.held = [held, previous.held[0], previous.held[1]];
            }
            current.set(next);
            previous
        })
        .ok()
}

/// Gives the thread's scope back as `previous`, once the work of an operation that entered it
/// returned (or unwound). Returns the outcome the work chose, for an operation that records;
/// for one that does not, an outcome chosen meanwhile stays with the operation around it.
#[inline]
pub(super) fn leave(previous: Scope, recorded: bool) -> Option<Outcome> {
    CURRENT
        .try_with(|current| {
            let now = current.get();
            match recorded {
                true => {
                    current.set(previous);
                    match now.outcome {
                        Slot::Inside(chosen) => chosen,
                        Slot::Outside => None,
                    }
                }
                false => {
                    current.set(Scope {
                        outcome: now.outcome,
                        held: previous.held,
                    });
                    None
                }
            }
        })
        .ok()
        .flatten()
}

/// Whether an operation around the work running on this thread holds a place of the limit
/// `id`: a request that reaches its own limit again (one limit applied twice on its path).
#[inline]
pub(crate) fn holds(id: LimitId) -> bool {
    CURRENT
        .try_with(|current| current.get().held.contains(&Some(id)))
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
    CURRENT
        .try_with(|current| {
            let mut scope = current.get();
            match scope.outcome {
                Slot::Outside => false,
                Slot::Inside(_) => {
                    scope.outcome = Slot::Inside(Some(outcome));
                    current.set(scope);
                    true
                }
            }
        })
        .unwrap_or(false)
}
