//! One operation, from asking for a permit to its end: the state machine that every form drives
//! (the layer's service, its response future and body, the per-request layer, and
//! [`resources_operation`](crate::resources_operation)).
//!
//! An operation that asks a limit for a permit is exactly one of:
//!
//! - **admitted**: it holds the permit, records its queue time when it is called, runs, and
//!   ends with an outcome, recorded once with its run time and told to its limit
//!   ([`Acquire::ended`](crate::Acquire::ended)), *before* the permit goes back;
//! - **rejected**: the limit turned it away (a full queue, a queue timeout), or could not admit
//!   it (closed, its store out of reach: `unavailable`), counted by reason;
//! - **abandoned**: its caller went away while it waited, or after it got its permit but
//!   before it was called: its work never began.
//!
//! - [`lifecycle`]: the operation and its steps ([`Lifecycle::poll_admit`] is where the permit
//!   is taken, [`Lifecycle::run`] where user code runs guarded);
//! - [`record`]: what it records at each stage, into its series and its spans;
//! - [`outcome`]: where the outcome is decided;
//! - [`deadline`]: how long a caller waits before a drop is a `timeout`;
//! - [`scope`]: what the thread knows of the operation whose work runs on it ([`set_outcome`],
//!   and the limit whose place it holds);
//! - [`trace`]: its spans.

mod clock;
mod deadline;
mod lifecycle;
mod outcome;
mod record;
pub(crate) mod scope;
mod trace;

pub(crate) use lifecycle::{Asking, Free, Lifecycle};
pub(crate) use outcome::Ending;
pub use scope::set_outcome;

use crate::limit::Capacity;

/// The operation's limit as its spans describe it (its name, its queue), read only when a span
/// is made: a closure, so that an operation with no span does not even look it up.
pub(crate) trait LimitOf<'c>: Fn() -> Option<&'c Capacity> + Copy {}

impl<'c, F: Fn() -> Option<&'c Capacity> + Copy> LimitOf<'c> for F {}
