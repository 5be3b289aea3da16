//! A limit of your own, reported and adapted as the crate's own [`Limit`] is: the
//! permit of a [`Limit`], and what any [`Acquire`] uses to show
//! itself in the metrics and to hear how its operations end.
//!
//! NeMo Gym's module enters "`limit`, which is any async context manager such as an
//! `asyncio.Semaphore`". Here a limit is anything that hands out a permit and takes it back when
//! the permit drops ([`Acquire`]): tokio's `Semaphore`, this crate's
//! [`Limit`], a weighted semaphore, a pool whose checkout is the permit, a
//! semaphore kept in a store that every replica of a fleet reaches (the companion crate
//! `tower-resources-operation-redis`).
//!
//! - [`Capacity`] and [`Reading`]: what the metrics read of a limit, at each collection, and
//!   [`Scope`]: whose capacity it is (this process's, or a fleet's);
//! - [`LimitId`]: which limit a permit is of, so that a request that reaches a limit whose
//!   place it already holds runs on that place;
//! - [`Ended`]: how an admitted operation ended, as its limit hears it
//!   ([`Acquire::ended`]).

pub(crate) mod acquire;
pub(crate) mod feedback;
mod front;
pub(crate) mod local;
mod report;
mod resize;

pub(crate) use acquire::Acquire;
pub use acquire::LimitId;
pub use feedback::Ended;
pub(crate) use feedback::{Control, MakeControl, Resize};
pub use local::LimitPermit;
pub(crate) use local::{IntoLimit, Limit};
pub use report::{Capacity, Reading, Scope};
