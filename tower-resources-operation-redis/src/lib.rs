//! [`RedisLimit`]: one limit for a whole fleet of replicas, kept in Redis, for
//! [`tower-resources-operation`](tower_resources_operation).
//!
//! Resources servers run as many replicas, and what they protect is often shared by all of them:
//! a judge endpoint with a concurrency quota, a sandbox cluster, a licence server, a GPU pool. A
//! [`Limit`](tower_resources_operation::Limit) of N on each of 8 replicas is a fleet limit of
//! 8N, wrong as soon as a replica dies or one is added. A [`RedisLimit`] of N is N for the whole
//! fleet: every process that names it shares it, through the Redis they all reach. It is an
//! [`Acquire`], so it goes wherever a `Limit` goes.
//!
//! # Setup
//!
//! ```no_run
//! use std::time::Duration;
//! use tower_resources_operation::{Executor, Operation, ResourcesOperationLayer};
//! use tower_resources_operation_redis::RedisLimit;
//!
//! # #[tokio::main]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // Eight judge calls at once across every replica that names "judges". Built within the
//! // tokio runtime that serves: its background task is spawned there.
//! let judges = RedisLimit::builder("judges", 8)
//!     .lease_ttl(Duration::from_secs(10))
//!     .call_timeout(Duration::from_millis(500))
//!     .max_queued(256)
//!     .build("redis://redis.internal:6379/")?;
//! judges.ready().await?; // optional: fail at startup if Redis cannot be reached
//!
//! // An HTTP layer answers a turned-away operation with 503.
//! let layer = ResourcesOperationLayer::new_for_http(judges.clone())
//!     .operation(Operation::Judge)
//!     .executor(Executor::Inline)
//!     .queue_timeout(Duration::from_secs(30));
//! # drop(layer);
//! // More judges came up: the whole fleet admits 12 from now on, waiters at once.
//! judges.set_capacity(12).await?;
//! # Ok(())
//! # }
//! ```
//!
//! # Background work, and on which runtime it runs
//!
//! Each limit has one background future in each process ([`Background`]): it sends the
//! releases, extends the process's leases and tickets, asks Redis again while it is down, and
//! hears what is published on the limit's channel. It ends once every handle and permit of the
//! limit is gone.
//!
//! - [`build`](RedisLimitBuilder::build) spawns it on the current tokio runtime, so it must be
//!   called within one (with its time and IO drivers enabled), the one that serves for as long
//!   as the limit does. Outside a runtime it returns [`ErrorKind::NoRuntime`], not a panic.
//! - [`build_pair`](RedisLimitBuilder::build_pair) returns it to the caller instead, as tower's
//!   `Buffer::pair` does: spawn it where you choose, or poll it alongside your server.
//!
//! Either way, the `redis` crate spawns its own connection driver on the runtime of the call
//! that first connects: use one runtime for the limit.
//!
//! # The capacity: the fleet's, stored in Redis
//!
//! The capacity given to the builder is the fleet's only until the fleet has one: the first
//! process to reach Redis stores it, and from then on every process reads the stored one, which
//! [`set_capacity`](RedisLimit::set_capacity) changes for all. A process built with another
//! capacity keeps the stored one, with one warning that names both; one built with
//! [`overwrite_capacity`](RedisLimitBuilder::overwrite_capacity) makes its own the fleet's at
//! its first call. Build one `RedisLimit` per name in a process and clone it: two built with
//! one name are two limits in the metrics (`tower-resources-operation`'s named instruments add
//! them up; this crate's own keep the last one registered).
//!
//! # How it works
//!
//! - **Leases.** A held place is a lease: an id in a sorted set, scored by when it expires on
//!   the server's clock. The background task extends all the process's leases and tickets of a
//!   limit in one call, every third of the lease TTL. A process killed with `kill -9` stops
//!   extending them: its places come back within the TTL.
//! - **A fair queue across the fleet.** An operation that finds no free place takes a ticket:
//!   an id in a second sorted set, scored by order of arrival (with its own expiry in a third,
//!   so a dead process's tickets leave the queue within the TTL). A place that frees up goes to
//!   the first ticket, whichever process holds it: first come, first served over the fleet.
//! - **Wake-ups without polling.** The script that frees a place hands it to the first waiter
//!   there and then, and publishes the waiter's id on the limit's channel. Each process
//!   subscribes once (on the connection it sends its commands on, in RESP3), and wakes the
//!   waiter, which holds its lease without another round trip. A wake-up lost (the connection
//!   dropped, a message missed) is covered by the refresh, which also tells each waiter
//!   what became of its ticket, at least every [`fallback_poll`](RedisLimitBuilder::fallback_poll)
//!   while anything waits.
//! - **Cancellation.** A caller that goes away (its request dropped, its queue timeout passed)
//!   gives its ticket back, or its lease if the place was handed to it meanwhile, at once
//!   (releases are batched). If that call cannot be made, it is retried with the refresh, and
//!   the ticket or lease expires within the TTL anyway.
//! - **Atomic steps, server time.** Every step that must be atomic is one Lua script, loaded
//!   once and called by its SHA; every expiry is computed from `redis.call('TIME')`, never from
//!   a replica's clock. An uncontended operation costs two round trips: one to take its lease,
//!   one to give it back; the refresh is one call per process every third of the TTL, whatever
//!   the number of leases.
//!
//! # Choosing the lease TTL
//!
//! The TTL is how long the fleet waits for a process that died before it hands its places to
//! others, so shorter is better, down to what pauses allow: a lease is extended every TTL/3,
//! so a process that stops for longer than about two thirds of the TTL (a long GC-like pause, a
//! frozen VM, Redis unreachable) loses its leases. The default, 10 s, gives back a dead
//! replica's places within 10 s and tolerates pauses of about 6 s. Keep it at least three times
//! the [call timeout](RedisLimitBuilder::call_timeout) (the builder checks), give every replica
//! the same TTL (a place handed to a waiter gets the TTL of the process that frees it), and
//! remember that the refresh costs one call per process per TTL/3.
//!
//! # Failures, and how each is answered
//!
//! Never a panic, never a hang. Every call to Redis has a timeout
//! ([`call_timeout`](RedisLimitBuilder::call_timeout), default 500 ms). After the first call
//! that fails, the limit answers every caller at once, without asking Redis, until the
//! background task reaches it again (it asks at once, then every
//! [fallback poll](RedisLimitBuilder::fallback_poll)); each outage is logged once, with the
//! address and the cause, and its end once ([`RedisLimit::is_reachable`] says which it is).
//!
//! | what happens | what the caller gets |
//! |---|---|
//! | Redis unreachable or slow (taking a place, or while waiting for one) | failing closed (the default): turned away as [`Rejection::Unavailable`]: HTTP `503`, gRPC `UNAVAILABLE`, `Err(Rejected)`, counted in `gym.resources.operation.rejected{rejection="unavailable"}`. Failing open ([`fail_open`](RedisLimitBuilder::fail_open)): admitted without the fleet limit, counted in `gym.resources.limit.failed_open`. A caller whose call is under way when Redis goes waits at most that call's timeout; the callers after the first failure are answered at once; a waiter hears within the fallback poll and two call timeouts, whatever other callers do |
//! | the fleet queue is full ([`max_queued`](RedisLimitBuilder::max_queued)) | turned away at once as [`Rejection::QueueFull`], as a `Limit`'s full queue |
//! | waited longer than a queue timeout ([`Acquire::queue_timeout`], a layer's `queue_timeout`) | turned away as [`Rejection::QueueTimeout`]; its ticket goes back |
//! | a lease lost while its operation runs (Redis restarted, a long pause) | the operation runs on; the loss is counted in `gym.resources.limit.leases_lost`; the lease is taken back if its place is still free and nobody waits, and never otherwise, so no place is knowingly given twice |
//! | Redis restarted in the middle of a load | callers get the configured answer while it is down; the connection comes back by itself, the capacity is stored again from the builder's, and each process's books (`queued`, `active`) stay balanced. Without persistence, operations admitted before the restart and after it may together exceed the capacity until the earlier ones end |
//! | a release that cannot reach Redis | retried with the refresh for up to a TTL; the lease expires within the TTL anyway |
//! | a process killed (`kill -9`) | its leases and tickets expire within the TTL, and their places go to the next waiters |
//!
//! Failing closed by default is a choice: Envoy's global rate limit fails open unless told
//! otherwise, but a limit that protects a shared resource (a quota, a GPU pool) should not be
//! lifted without a word when its store goes away. A failing-closed limit says it
//! [may reject](Acquire::may_reject), so a layer that cannot answer a rejection (the `Plain`
//! protocol) refuses it when it makes its service; failing open without a queue bound it never
//! rejects, and such a layer takes it.
//!
//! The limit's own calls ([`ready`](RedisLimit::ready), [`set_capacity`](RedisLimit::set_capacity),
//! [`fleet`](RedisLimit::fleet)) return this crate's [`Error`]: its [`kind`](Error::kind), the
//! limit, the address (without its password) and the cause. No `redis` type is in this crate's
//! API; the `redis` crate's error is only an error's [`source`](std::error::Error::source).
//!
//! # What the metrics mean across a fleet
//!
//! Each replica reports its own operations: `queue_duration_ms` (its operations' wait for the
//! fleet's places, including the round trip to Redis), `duration_ms`, `queued` and `active`
//! (its waiters and its lease holders), `rejected` and `abandoned`. The `limit` gauge, and
//! `gym.resources.limit.capacity`, are the *fleet's* capacity, as last read from Redis (each
//! call returns it; a change is published to every replica). These come through
//! `tower-resources-operation`'s metrics, as for any limit. So:
//!
//! - `sum(gym_resources_operation_active) without (instance)` against
//!   `max(gym_resources_operation_limit) without (instance)` is the fleet's saturation;
//! - the fleet's queue time is the histogram summed over instances;
//! - this crate's own instruments, [`gym.resources.limit.failed_open`](metrics::FAILED_OPEN_INSTRUMENT)
//!   and [`gym.resources.limit.leases_lost`](metrics::LEASES_LOST_INSTRUMENT), per replica and
//!   per limit name, say when the fleet ran without its limit, or lost track of a place. They
//!   are registered only when asked: [`RedisLimitBuilder::meter`],
//!   [`RedisLimit::register_metrics`] (see [`metrics`]).
//!
//! # Why the `redis` crate
//!
//! `redis` 0.32 (redis-rs) builds on the MSRV, 1.85 (its 1.x needs 1.88, `fred` 10 needs about
//! the same), brings only what a limit needs with its `tokio-comp`, `connection-manager` and
//! `script` features, and its `ConnectionManager` reconnects by itself and, over RESP3, carries
//! the subscription on the same connection as the commands and re-subscribes after a reconnect.
//! `fred` has its own pool and reconnect policies, more than one connection per limit needs, at
//! a larger build. It is a private dependency: it can change without a major release here.
//!
//! # Features
//!
//! - `tracing` (default): the outage, recovery and capacity warnings through `tracing` (target
//!   `tower_resources_operation_redis`, with the limit's name as the field `limit`); without
//!   it, the warnings on standard error.
#![forbid(unsafe_code)]
#![warn(
    missing_docs,
    missing_debug_implementations,
    unreachable_pub,
    rust_2018_idioms
)]
#![deny(rustdoc::broken_intra_doc_links)]

mod builder;
mod core;
mod error;
mod health;
mod keeper;
mod limit;
pub mod metrics;
mod scripts;
mod transport;
mod waiters;

pub use builder::RedisLimitBuilder;
pub use error::{Error, ErrorKind};
pub use keeper::Background;
pub use limit::{Fleet, RedisLimit, RedisPermit};

#[cfg(doc)]
use tower_resources_operation::{Acquire, Rejection};

/// The README's snippets, compiled with the doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeSnippets;
