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
//!   extending them: its places come back within the TTL (2 s by default).
//! - **A fair queue across the fleet.** An operation that finds no free place takes a ticket:
//!   an id in a second sorted set, scored by order of arrival (with its own expiry in a third).
//!   A place that frees up goes to the first ticket, whichever process holds it: first come,
//!   first served over the fleet.
//! - **Places handed over are claimed.** The script that frees a place hands it to the first
//!   waiter there and then, as a *claim* that lasts the [claim timeout](RedisLimitBuilder::claim_timeout)
//!   (250 ms), and publishes the waiter's id on the limit's channel. Each process subscribes
//!   once (on the connection it sends its commands on, in RESP3); the waiter hears, asks again
//!   with its id, and the claim becomes its lease: one round trip. A wake-up lost (the
//!   connection dropped, a message missed) is covered by the refresh, which takes up a claim as
//!   well, and tells each waiter what became of its ticket, at least every
//!   [`fallback_poll`](RedisLimitBuilder::fallback_poll) while anything waits.
//! - **Live replicas.** Each refresh (and each first call) counts its process alive until a
//!   lease TTL later: the fleet knows how many replicas it has, and each replica its share of
//!   the capacity ([while Redis is away](#while-redis-is-away)).
//! - **Cancellation.** A caller that goes away (its request dropped, its queue timeout passed)
//!   gives its ticket back, or the place handed to it meanwhile, at once (releases are
//!   batched). If that call cannot be made, it is retried with the refresh, and the ticket or
//!   lease expires within the TTL anyway.
//! - **Atomic steps, server time.** Every step that must be atomic is one Lua script, loaded
//!   once and called by its SHA; every expiry is computed from `redis.call('TIME')`, never from
//!   a replica's clock. An uncontended operation costs two round trips: one to take its lease,
//!   one to give it back (a queued one, a third: its claim); the refresh is one call per
//!   process every third of the TTL, whatever the number of leases (and, for an
//!   [adaptive](#an-adaptive-fleet-limit) limit, one per tick).
//!
//! # Members that die
//!
//! A replica killed while it has tickets in the fleet's queue stalls nobody: the first place
//! handed to one of its tickets is a claim that nobody takes up, and when it expires (the claim
//! timeout, far below the lease TTL) the place goes back to the fleet, and every ticket of
//! that process leaves the queue with it (ids name their process). The replicas that wait
//! refresh a claim timeout after a place went to another process's waiter, so the place is
//! found then, not at the next fallback poll. `tests/fleet_changes.rs` kills a replica with six
//! tickets queued, with and without places held, under two replicas that stream: their
//! longest time without a success is about 390 ms, with a TTL of 3 s or of 10 s (before the
//! claims, the whole TTL).
//!
//! A replica killed while it holds places gives them back when their leases expire: within a
//! lease TTL of its last refresh, 2 s by default. Until then its places read in
//! `gym.resources.limit.unheard` (places held by members the fleet has not heard from within
//! half a TTL, in every replica's metrics), so the stall reads as what it is, not as a saturated
//! limit with nothing running. `tests/fleet_changes.rs` kills a replica holding every place
//! of the fleet: with the defaults the survivors' next success comes when the last lease
//! expires, found by their next refresh (a waiting member refreshes every third of the TTL):
//! 1.3 to 2.7 s after the kill, by where in its refresh cycle the replica died (1.67 s in
//! each of three runs).
//!
//! # Choosing the lease TTL
//!
//! The TTL is how long the fleet waits for a member that stopped refreshing before it hands its
//! places to others: a member that died, or one that paused. A lease is extended every TTL/3,
//! so a member that stops for longer than about two thirds of the TTL (a frozen VM, a runtime
//! whose threads are all blocked, Redis unreachable) loses its leases: they go to waiters, its
//! running operations finish above the capacity, and each loss is counted in
//! `gym.resources.limit.leases_lost` (no place is knowingly given twice). The default, 2 s,
//! gives back a dead replica's places within 2 s and tolerates pauses of about 1.3 s, at one
//! refresh per member every 667 ms. A fleet whose members pause longer (a stop-the-world
//! runtime, a host that freezes) should take a longer TTL, and pay for it after a death. Keep
//! it at least three [call timeouts](RedisLimitBuilder::call_timeout) (the builder checks), and
//! give every replica the same TTL (a place handed to a waiter gets the TTL of the member that
//! frees it).
//!
//! # Failures, and how each is answered
//!
//! Once built, never a panic, never a hang (a bad setting panics when the limit is built, as
//! in `tower-resources-operation`). Every call to Redis has a timeout
//! ([`call_timeout`](RedisLimitBuilder::call_timeout), default 500 ms). After the first call
//! that fails, the limit answers every caller at once, without asking Redis, until the
//! background task reaches it again (it asks at once, then every quarter of a
//! [fallback poll](RedisLimitBuilder::fallback_poll)); each outage is said once, with the
//! address, the cause and the answer the limit gives meanwhile, and its end once
//! ([`RedisLimit::is_reachable`] says which it is).
//!
//! | what happens | what the caller gets |
//! |---|---|
//! | Redis unreachable or slow (taking a place, or while waiting for one) | as [`when_unreachable`](RedisLimitBuilder::when_unreachable) says: on this replica's share ([`Unreachable::Share`], the default, [below](#while-redis-is-away)); turned away ([`Unreachable::Closed`]: [`Rejection::Unavailable`], HTTP `503`, gRPC `UNAVAILABLE`, counted in `gym.resources.operation.rejected{rejection="unavailable"}`); or admitted without the fleet limit ([`Unreachable::Open`], counted in `gym.resources.limit.failed_open`). A caller whose call is under way when Redis goes waits at most that call's timeout; the callers after the first failure are answered at once; a waiter hears within the fallback poll and two call timeouts, whatever other callers do |
//! | the fleet queue is full ([`max_queued`](RedisLimitBuilder::max_queued)) | turned away at once as [`Rejection::QueueFull`], as a `Limit`'s full queue |
//! | waited longer than a queue timeout (a layer's `queue_timeout`) | turned away as [`Rejection::QueueTimeout`]; its ticket goes back |
//! | a lease lost while its operation runs (Redis restarted, a long pause) | the operation runs on; the loss is counted in `gym.resources.limit.leases_lost`; the lease is taken back if its place is still free and nobody waits, and never otherwise, so no place is knowingly given twice |
//! | Redis restarted in the middle of a load | callers get the configured answer while it is down; the connection comes back by itself (found at the first probe), the capacity is stored again from the builder's, places run on the shares become leases, and each process's books (`queued`, `active`) stay balanced. Without persistence, leases taken before the restart and not refreshed since are lost: operations admitted before it and after may together exceed the capacity until the earlier ones end |
//! | a release that cannot reach Redis | retried with the refresh for up to a TTL; the lease expires within the TTL anyway |
//! | a process killed (`kill -9`) | its tickets leave the queue within a claim timeout of its first unclaimed place, its leases expire within the TTL, 2 s by default, and read as `unheard` until then ([above](#members-that-die)) |
//!
//! A limit whose answer may be a turning away says it [may reject](Acquire::may_reject), so a
//! layer that cannot answer a rejection (the `Plain` protocol) refuses it when it makes its
//! service; only failing open without a queue bound it never rejects, and such a layer takes
//! it.
//!
//! The limit's own calls ([`ready`](RedisLimit::ready), [`set_capacity`](RedisLimit::set_capacity),
//! [`fleet`](RedisLimit::fleet)) return this crate's [`Error`]: its [`kind`](Error::kind), the
//! limit, the address (without its password) and the cause. No `redis` type is in this crate's
//! API; the `redis` crate's error is only an error's [`source`](std::error::Error::source). An
//! operation turned away because Redis could not be reached carries the same [`Error`] as the
//! source of the core crate's `AcquireError`.
//!
//! # While Redis is away
//!
//! Failing closed stops the fleet for as long as Redis is out (every caller turned away);
//! failing open lifts the limit, unbounded. Google's Doorman hands each client a safe capacity
//! to fall back on; a fleet limit works its own out. With [`Unreachable::Share`], the default:
//!
//! - **The share.** Each replica admits up to its share of the fleet's last capacity: that
//!   capacity divided by the replicas alive when it last reached Redis (rounded down, and at
//!   least 1), and queues the rest locally, as a `Limit` would (a queue bound, if any, shared
//!   alike). A replica that never reached Redis has no share, and turns operations away. The
//!   places it runs, the places it held before the outage included, count against its share.
//! - **What the fleet runs.** At most the last capacity at once, once the operations admitted
//!   before the outage have ended: until then, a replica that held more than its share runs
//!   them on (it admits nothing new until it is below its share), while the others fill theirs.
//!   With more replicas than places, each still has 1: the fleet may then run as many as it
//!   has replicas. A replica that alone cannot reach Redis (a partition, its own timeouts)
//!   runs its share beside a fleet that runs the whole capacity.
//! - **In the metrics.** The capacity it reports is its share, with
//!   `nemo.gym.resources.limit.scope` = `share` (`fleet` otherwise): the dashboards add the
//!   shares up. [`RedisLimit::is_on_share`] and [`RedisLimit::share`] say the same in code.
//! - **The return.** Each replica asks Redis every quarter of a fallback poll while it is
//!   away. Once it answers, the replica tells it of the places it runs on its share (they
//!   become leases, whatever the capacity: they run), admits nothing new for half a fallback
//!   poll, by when every other replica has reached Redis too and told it of its own, and is
//!   back on the fleet limit: within a fallback poll of Redis's return.
//!
//! `tests/fleet_changes.rs` kills Redis for 2 s under three replicas that stream, and starts it
//! again empty: at most the capacity ran at once on the shares and after the return, about 120
//! operations ran meanwhile (6 with failing closed), nobody was turned away, and every replica
//! was back on the fleet limit about 440 ms after Redis (its fallback poll: 800 ms).
//!
//! # An adaptive fleet limit
//!
//! Given a controller, the fleet limit sets the fleet's capacity from what every replica
//! observes, as `LimitBuilder::adaptive` of `tower-resources-operation` does for one process:
//!
//! ```no_run
//! use tower_resources_operation::adaptive::{Adaptive, Vegas};
//! use tower_resources_operation_redis::RedisLimit;
//!
//! # #[tokio::main]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // From 1, where the run times and the failures of the whole fleet say, up to 64.
//! let judges = RedisLimit::builder("judges", 1)
//!     .adaptive(Adaptive::new(Vegas::default(), 1..=64))
//!     .build("redis://redis.internal:6379/")?;
//! # drop(judges);
//! # Ok(())
//! # }
//! ```
//!
//! - **The same controller as one process's.** Each replica counts its ends in the core's
//!   `adaptive::Tally`, with the core's `News` rule, and the leader turns the fleet's summed
//!   `adaptive::Counts` into the [`Sample`] with `Counts::sample`, as a `Limit`'s controller
//!   does; [`adaptive`](RedisLimitBuilder::adaptive) takes the core's `Adaptive`.
//!   So mixed work is read kind by kind in a fleet too: each operation's series (its operation
//!   and executor) has its counts in the fleet's window, and its run times are compared with
//!   what is normal for its kind.
//! - **What each replica counts.** The limit [hears each end](Acquire::hears_ends) and adds it
//!   to the tally, a handful of relaxed atomics of its process: per series, ends, ends `ok`,
//!   what was served, the sum and the sum of squares of the run times, the shortest; failures
//!   (`timeout`, `error`, `crashed`) that are news and those that are not, and its queue's
//!   rejections. Nothing on an operation's path talks to Redis for the controller: an
//!   uncontended operation costs the same two round trips as with a fixed capacity.
//! - **One call per process per tick.** Every [`adaptive_tick`](RedisLimitBuilder::adaptive_tick)
//!   (50 ms), the background task sends those counts in one script call, which adds them into
//!   the fleet's window (a hash in Redis), samples the fleet's leases held (the load the window
//!   ran at, and its peak), and keeps or takes the leader's lease. So the controller costs one
//!   call per process per tick, whatever the load, plus the leader's decision once per window.
//! - **One decision per window, by one leader.** The leader is the process that holds a lease
//!   key (`SET NX PX`, extended by each of its ticks, for the longer of three call timeouts and
//!   ten ticks, at most the lease TTL). When the window is due, it takes and resets it in the
//!   same script (the window's number goes up), runs the algorithm on the [`Sample`] of the
//!   whole fleet, and writes the capacity it names (as [`set_capacity`](RedisLimit::set_capacity)
//!   does: new places go to the fleet's waiters at once, and every process is told) with the
//!   algorithm's baseline and estimate. That write is dropped if the leader lost its lease
//!   meanwhile, or another took the window: no window is decided twice.
//! - **When a window is due**, as for one process: once as many of the operations admitted in
//!   it as the capacity have ended (and it is at least two ticks and 100 ms old), or once it is
//!   more than twice the last round trip old with half of them, or a second old with half of
//!   them (a second and a half with one: the first to end are the fastest); or at
//!   once at the first sign of congestion that is news: the replica that sees it ticks at once,
//!   and its tick tells the leader (on the limit's channel) to tick at once too.
//! - **What a window measures, and cuts that never compound.** Each permit carries the
//!   window its process knew when it was admitted (every process hears each decision on the
//!   channel, and each tick's answer). Only the operations admitted in the current window give
//!   it run times (they ran at the capacity it opened with); earlier ones count only as ends,
//!   what was served, and failures. A failure of an operation admitted before the fleet's last decrease is not news
//!   ([`Sample::stale_congested`]; the core's `News` rule, its marks the fleet's window
//!   numbers): so a backend that fails everything above its capacity gets one decrease per
//!   window, however many replicas see its failures.
//! - **A replica that dies takes no decision with it.** What it counted since its last tick is
//!   lost (part of one window's sample), nothing more. If it led, its lease expires and the
//!   next process to tick takes it (within about 0.6 s with a call timeout of 200 ms); the
//!   capacity it set stays in Redis. The new leader's algorithm is made anew and
//!   [resumed](Algorithm::resume) at that capacity: no slow start (0.4's new leader
//!   slow-started from it: 8 → 12 → 18 with a backend of 8), and for one lease TTL after it
//!   takes over (while the dead leader's places lapse, and the fleet looks busier than its
//!   backend is) at most one place above it. A window in which fewer operations ended than
//!   half the capacity, whenever admitted, raises nothing: it measured too little. Measured
//!   with `Vegas` (`fleet_adaptive`'s leader-kill test): at most one place above
//!   where the fleet stood, and fewer failures per success in the 3 s after the hand-over than
//!   settled. Each decision also stores the algorithm's [hand-over](Algorithm::handover) (its baselines,
//!   series by series: the run time at low load of each kind of work), and the new leader
//!   [resumes](Algorithm::resume) from it and from the last estimate: its first windows, which
//!   may run with a queue at the backend, are read as a queue, not as the run time at low
//!   load (`fleet_adaptive`'s queue-through-a-hand-over test: the fleet's baseline stays at
//!   51 ms where, without them, the algorithms of 0.5 took the queued 58-205 ms for it).
//!   [`set_capacity`](RedisLimit::set_capacity) works as for a fixed limit: the algorithm
//!   goes on from the capacity set.
//! - **Redis errors in the controller's path reach no request.** Its calls are not counted in
//!   the limit's [health](RedisLimit::is_reachable); a tick that fails drops its counts, and
//!   while Redis is down there is none.
//! - **What every replica reports.** Each process reports the fleet's capacity, and the fleet's
//!   baseline and estimate (`gym.resources.limit.adaptive.{baseline,estimate}_ms`, as a named
//!   adaptive `Limit` does), as it last heard them: the same series on every replica.
//!   [`RedisLimit::is_leader`], [`decisions`](RedisLimit::decisions) and
//!   [`measured`](RedisLimit::measured) say the same in code.
//!
//! **Why one leader, rather than each replica's proposal merged in a script.** An algorithm is
//! a stateful Rust value ([`Algorithm`]: Vegas keeps its baseline, its slow start, where it last
//! had to shrink), not a Lua function, so a script cannot run it; merging proposals would mean
//! every replica deciding on its own share of the ends (a third of them, on three replicas:
//! noisier run times, congestion seen a third as often) and a merge rule (the lowest? the
//! median?) that is no algorithm's. One leader running the algorithm on the fleet's summed
//! window is the single-process controller run on the fleet's figures: one decision per window,
//! taken on everything the fleet saw. The price is the leader's lease: decisions pause for up
//! to that lease when the leader dies (the capacity stays where it was meanwhile).
//!
//! **What a fleet's sample does not have.** [`Sample::overdue`] is 0: the window's ends reach
//! Redis up to a tick late, so the operations still running from before the window cannot be
//! told from the window's own, and counting them would show places overdue that are not. A
//! backend that drops what is above its capacity is found by the timeouts of the requests it
//! dropped instead. The tolerance is `Adaptive::tolerance`'s (0 unless set).
//!
//! **How it does** (`tests/fleet_adaptive.rs`): three replica processes, 16 clients each, on one
//! `redis-server`, against a backend that serves K requests at once in 50 ms and defers (an
//! error after 50 ms) what is above K, K = 12 for 5 s, then 6, then 12. In the last half of each
//! phase the fleet holds 0.92 to 0.99 K in flight, at 0.01 to 0.04 failures per success; three
//! replicas each with a `Vegas` limit of its own hold 1.01 to 1.14 K at 0.04 to 0.21. Over the
//! whole run the fleet fails 0.05 to 0.06 per success against 0.09 to 0.10, for 5 to 10% less
//! throughput (161 to 166 against 172 to 185 successes a second): after K rose it takes 1 to
//! 1.8 s to come within 15% of it, against 0.5 to 0.75 s for three limits that each slow-start
//! and step on their own (one decision per window for the fleet, rather than three), and a
//! place handed over through Redis stays empty for the round trip to it (0.92 to 0.95 K in
//! flight at a capacity of K).
//!
//! # What the metrics mean across a fleet
//!
//! Each replica reports its own operations: `queue_duration_ms` (its operations' wait for the
//! fleet's places, including the round trip to Redis), `duration_ms`, `queued` and `active`
//! (its waiters and its places), `rejected` and `abandoned`. The `limit` gauge, and
//! `gym.resources.limit.capacity`, are the *fleet's* capacity, as last read from Redis (each
//! call returns it; a change is published to every replica), and so, for an adaptive limit,
//! are `gym.resources.limit.adaptive.baseline_ms` and `.estimate_ms` (the fleet's controller's,
//! as last heard). These come through `tower-resources-operation`'s metrics, as for any limit,
//! with `nemo.gym.resources.limit.scope` = `fleet`: a capacity to read once, not to add up over
//! the replicas (`share` while a replica runs on its share: to add up). So:
//!
//! - the shipped dashboard (`dashboards/grafana`) reads each capacity by its scope: a fleet
//!   limit's utilisation is every replica's `active` added up, over the fleet's capacity
//!   (`tests/fleet_dashboard.rs`: a saturated fleet limit of 4 on three replicas reads 0.96 to
//!   1.06, where adding up the capacities read a third);
//! - the shipped alerts (`dashboards/prometheus/alerts.yml`) have a rule of their own for a
//!   fleet limit: `ResourcesOperationLimitSaturated` with `scope: fleet`, on operations queued
//!   for it across the fleet (a fleet limit queues only while every place is held), grouped by
//!   the limit's name alone;
//! - the fleet's queue time is the histogram summed over instances;
//! - this crate's own instruments, [`gym.resources.limit.failed_open`](metrics::FAILED_OPEN_INSTRUMENT)
//!   and [`gym.resources.limit.leases_lost`](metrics::LEASES_LOST_INSTRUMENT), per replica and
//!   per limit name, say when the fleet ran without its limit, or lost track of a place. They
//!   are registered only when asked: [`RedisLimitBuilder::meter`],
//!   [`RedisLimit::register_metrics`] (see [`metrics`]).
//!
//! # Redis Cluster
//!
//! Every key of a limit, and its channel, share one hash slot (`{prefix:name}`), so one shard
//! of a Redis Cluster serves each limit, and every script stays on it. With the `cluster`
//! feature, [`Address::cluster`] reaches it through the `redis` crate's cluster client, with
//! sharded pub/sub (`SSUBSCRIBE`, `SPUBLISH`), followed across a failover:
//!
//! ```no_run
//! # #[cfg(feature = "cluster")]
//! # async fn run() -> Result<(), tower_resources_operation_redis::Error> {
//! use tower_resources_operation_redis::{Address, RedisLimit};
//!
//! let judges = RedisLimit::builder("judges", 8)
//!     .build(Address::cluster(["redis://10.0.0.1:7000/", "redis://10.0.0.2:7000/"]))?;
//! # drop(judges);
//! # Ok(())
//! # }
//! ```
//!
//! **What a failover costs.** While the shard's master is gone and its replica not yet
//! promoted (Redis Cluster's node timeout, 15 s by default, plus an election), the limit
//! cannot reach its store, and answers as it does for any outage (on its share, by default).
//! And Redis replicates asynchronously: leases and tickets written to the old master in its
//! last moments may be missing on the new one. A missing lease is found by the next refresh
//! (counted in `gym.resources.limit.leases_lost`, taken back if its place is free), a missing
//! ticket makes its waiter join the queue again, at its end: for a moment the fleet may run
//! more than its capacity, and a waiter may lose its turn. A fencing token would not help: what
//! the limit protects does not check one. `tests/redis_cluster.rs` kills the master of a
//! limit's slot under a stream of callers on a cluster of three masters and three replicas
//! (node timeout 1 s): the replica is promoted within 2 to 3 s, the limit is back within
//! 0.8 s of that, and at most the capacity runs at once after.
//!
//! # One seam for the store
//!
//! Everything of a fleet limit but Redis (each process's books, its waiters and places, its
//! health and share, its background work, its controller) is written once against a small
//! trait of what a fleet limit asks of its store: take a place or queue, give places back,
//! refresh a process's leases and tickets (and say it is alive), set the capacity, read the
//! fleet's state, the controller's tick and decision, and a stream of what the store pushes.
//! Redis implements it, and is the only code of this crate that knows Redis. On paper, etcd
//! implements it with a lease per process (its leases and tickets attached, so that its death
//! drops them at once), one transaction a step, and a watch on the limit's prefix for the
//! wake-ups; PostgreSQL with rows of leases, tickets and processes, a transaction a step on the
//! server's `now()`, and `LISTEN`/`NOTIFY`. The trait stays private in this release: one store
//! is built against it, and a seam is proved by its second user. When one comes, the fleet half
//! of this crate moves to a crate of its own with the trait public there, as
//! opentelemetry-otlp writes its exporter once against a client trait of its own.
//!
//! # Why the `redis` crate
//!
//! `redis` 0.32 (redis-rs) builds on the MSRV, 1.85 (its 1.x needs 1.88, `fred` 10 needs about
//! the same), brings only what a limit needs with its `tokio-comp`, `connection-manager` and
//! `script` features (and `cluster-async` with this crate's `cluster` feature), and its
//! `ConnectionManager` reconnects by itself and, over RESP3, carries the subscription on the
//! same connection as the commands and re-subscribes after a reconnect. `fred` has its own pool
//! and reconnect policies, more than one connection per limit needs, at a larger build. It is a
//! private dependency: it can change without a major release here.
//!
//! # Features
//!
//! - `tracing` (default): the outage, recovery and capacity warnings through `tracing` when a
//!   subscriber is installed, under this crate's target, `tower_resources_operation_redis`,
//!   each message naming the limit; with no subscriber, or without the feature, on standard
//!   error. Each is said once (an outage once, however many callers meet it). It turns on the
//!   core's `tracing` feature too: each operation's wait and run spans.
//! - `cluster`: [`Address::cluster`], a Redis Cluster.
#![forbid(unsafe_code)]
#![warn(
    missing_docs,
    missing_debug_implementations,
    unreachable_pub,
    rust_2018_idioms
)]
#![deny(rustdoc::broken_intra_doc_links)]

mod builder;
mod error;
mod fleet;
mod guard;
mod limit;
mod log;
#[cfg(test)]
mod memory_store;
pub mod metrics;
mod redis_store;
#[cfg(test)]
mod store_scenarios;

pub use builder::RedisLimitBuilder;
pub use error::{Error, ErrorKind};
pub use fleet::background::Background;
pub use fleet::share::Unreachable;
pub use limit::{Fleet, RedisLimit, RedisPermit};
pub use redis_store::Address;

#[cfg(doc)]
use tower_resources_operation::adaptive::{Algorithm, Sample};
#[cfg(doc)]
use tower_resources_operation::{Acquire, Rejection};

/// The README's snippets, compiled with the doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeSnippets;
