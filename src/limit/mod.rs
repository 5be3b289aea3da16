//! What a limit is ([`Acquire`]), the crate's own ([`Limit`]), how a limit shows itself in the
//! metrics ([`Capacity`], [`Reading`]), what it hears of each operation's end ([`Ended`]), and
//! how a limit is asked for a permit, in a service's `poll_ready` or in an `async` block.
//!
//! NeMo Gym's module enters "`limit`, which is any async context manager such as an
//! `asyncio.Semaphore`". Here a limit is anything that hands out a permit and takes it back when
//! the permit drops: tokio's [`Semaphore`](tokio::sync::Semaphore), this crate's [`Limit`], a
//! weighted semaphore, a pool whose checkout is the permit, a semaphore kept in a store that
//! every replica of a fleet reaches (the companion crate `tower-resources-operation-redis`).
//!
//! A limit of your own uses the same seams as the crate's: [`Acquire`] to admit,
//! [`Capacity::of_limit`] to report its name, capacity and live counts, and
//! [`Acquire::ended`] with a [`Control`] to be adapted, and [`warn`] to say what goes wrong.

mod acquire;
mod error;
mod feedback;
mod front;
mod local;
mod poll;
mod queue_timeout;
mod report;
mod resize;

pub use crate::diagnostics::{inform, warn};
pub use acquire::{Acquire, IntoLimit, LimitId};
pub(crate) use error::limit_failed;
pub use error::{AcquireError, Rejected};
pub use feedback::{Control, Ended, MakeControl, Resize};
pub use local::{InvalidCapacity, InvalidLimit, Limit, LimitBuilder, LimitPermit};
pub(crate) use poll::{in_place, Asking, Stands, Waiting};
pub use queue_timeout::QueueTimeout;
pub use report::{check_name, Capacity, InvalidName, Reading, Scope};
