//! The fleet limit on a real `redis-server`, for what only Redis can show, with several handles
//! built with one name standing for several replicas: shared by name (its keys); a release wakes
//! a waiter of another handle on the channel, without polling (counted in `INFO
//! commandstats`); an uncontended operation costs two round trips; the queue bound and the
//! queue timeout answered through a layer as the local `Limit` answers them; failing closed and
//! failing open when Redis is stopped or frozen, for new callers and for waiters; a lease lost
//! when Redis forgets it (counted in the metrics, taken back only if its place is free);
//! recovery after a restart; and what the metrics say. The protocol's own rules (first come,
//! first served, cancellation, the capacity, lost leases) are checked on the in-memory store on
//! paused time (`src/fleet/tests/`).

mod support;

use std::convert::Infallible;
use std::future::Future;
use std::time::Duration;

use http::{Request, Response, StatusCode};
use tower::{service_fn, BoxError, Layer as _, ServiceExt as _};

use support::redis_server::RedisServer;
use support::{live, within, Telemetry};
use tower_resources_operation::names::{
    DURATION_INSTRUMENT, LIMIT_ACTIVE_INSTRUMENT, LIMIT_ATTRIBUTE, LIMIT_CAPACITY_INSTRUMENT,
    LIMIT_INSTRUMENT, REJECTED_INSTRUMENT, REJECTION_ATTRIBUTE,
};
use tower_resources_operation::protocol::RejectAsError;
use tower_resources_operation::{
    Acquire, Executor, Operation, Rejected, Rejection, ResourcesOperationLayer,
};
use tower_resources_operation_redis::metrics::{FAILED_OPEN_INSTRUMENT, LEASES_LOST_INSTRUMENT};
use tower_resources_operation_redis::{RedisLimit, RedisLimitBuilder, RedisPermit};

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// A limit `name` of `capacity` whose leases and calls are short, so that refreshes, expiries
/// and fallbacks happen within a test.
fn quick(name: &'static str, capacity: usize) -> RedisLimitBuilder {
    RedisLimit::builder(name, capacity)
        .lease_ttl(Duration::from_millis(900))
        .call_timeout(Duration::from_millis(300))
        .fallback_poll(Duration::from_millis(300))
}

/// A limit `name` of `capacity` whose refreshes and fallback polls are far off (20 s): whatever
/// happens within a test happens by a call or a wake-up.
fn patient(name: &'static str, capacity: usize) -> RedisLimitBuilder {
    RedisLimit::builder(name, capacity)
        .lease_ttl(Duration::from_secs(60))
        .call_timeout(Duration::from_secs(5))
        .fallback_poll(Duration::from_secs(20))
}

/// A permit of `limit`, which must admit.
async fn take(limit: &RedisLimit) -> RedisPermit {
    within("a free place", limit.acquire())
        .await
        .expect("a place")
}

/// Waits until `condition` (which may call Redis) holds, failing after the support deadline.
async fn until<F, Fut>(what: &str, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    within(what, async {
        while !condition().await {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
}

/// `(capacity, active, queued)` of the whole fleet.
async fn fleet(limit: &RedisLimit) -> (usize, usize, usize) {
    let fleet = limit.fleet().await.expect("the fleet's state");
    (fleet.capacity, fleet.active, fleet.queued)
}

/// Starts a wait for a place of `limit` on a task of its own.
fn wait_for(limit: &RedisLimit) -> tokio::task::JoinHandle<RedisPermit> {
    let limit = limit.clone();
    tokio::spawn(async move { limit.acquire().await.expect("a place") })
}

/// Waits until the fleet has `queued` tickets.
async fn until_queued(limit: &RedisLimit, queued: usize) {
    until("the fleet's queue", || async {
        fleet(limit).await.2 == queued
    })
    .await;
}

/// Scripts run by SHA: `EVALSHA` calls, less the first call of each script, which Redis
/// answered `NOSCRIPT` (the script was then loaded, and called again).
fn script_calls(redis: &RedisServer) -> u64 {
    redis.calls("evalsha") - redis.calls("script|load")
}

/// The value of the per-limit instrument `name` for limit `limit`.
fn named(t: &Telemetry, name: &str, limit: &str) -> i64 {
    t.live_value(name, &[(LIMIT_ATTRIBUTE, limit)])
}

// ---------------------------------------------------------------------------------------------
// Shared by name, fair, woken
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs redis-server on PATH (apt-get install redis-server): cargo test -- --include-ignored runs it"]
async fn every_handle_built_with_one_name_shares_one_capacity_and_other_names_do_not() {
    let redis = RedisServer::start_required();
    let replica_a = patient("judges", 2).build(redis.url()).unwrap();
    let replica_b = patient("judges", 2).build(redis.url()).unwrap();
    let verifiers = patient("verifiers", 1).build(redis.url()).unwrap();

    let first = take(&replica_a).await;
    let second = take(&replica_b).await;
    assert_eq!(fleet(&replica_a).await, (2, 2, 0));
    assert_eq!((replica_a.active(), replica_b.active()), (1, 1));

    // The fleet is full: a third waits, whichever replica asks.
    let third = wait_for(&replica_b);
    until_queued(&replica_a, 1).await;
    support::eventually("counted where it waits", || replica_b.queued() == 1).await;
    assert_eq!(replica_a.queued(), 0);

    // Another name is another limit.
    let verifying = take(&verifiers).await;
    assert_eq!(fleet(&verifiers).await, (1, 1, 0));

    drop(first);
    let third = within("the third", third).await.unwrap();
    assert_eq!(fleet(&replica_a).await, (2, 2, 0));
    drop((second, third, verifying));
    until("every place back", || async {
        fleet(&replica_a).await == (2, 0, 0)
    })
    .await;
    assert_eq!((replica_a.active(), replica_b.active()), (0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs redis-server on PATH (apt-get install redis-server): cargo test -- --include-ignored runs it"]
async fn a_release_wakes_a_waiter_of_another_replica_without_a_poll() {
    let redis = RedisServer::start_required();
    let replica_a = patient("judges", 1).build(redis.url()).unwrap();
    let replica_b = patient("judges", 1).build(redis.url()).unwrap();
    replica_b.ready().await.unwrap();
    let holding = take(&replica_a).await;
    let waiter = wait_for(&replica_b);
    until_queued(&replica_a, 1).await;

    let before = script_calls(&redis);
    drop(holding);
    let admitted = within("the woken waiter", waiter).await.unwrap();
    // Two calls: the release, which handed the place over, and the waiter's, which took it up
    // as soon as it heard of it on the channel (its refresh and its fallback poll are 20 s
    // away).
    assert_eq!(script_calls(&redis) - before, 2);
    assert!(!admitted.failed_open());
    drop(admitted);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs redis-server on PATH (apt-get install redis-server): cargo test -- --include-ignored runs it"]
async fn an_uncontended_operation_costs_two_round_trips() {
    let redis = RedisServer::start_required();
    let limit = patient("judges", 4).build(redis.url()).unwrap();
    // The first operation loads the scripts (a NOSCRIPT, then SCRIPT LOAD, once per script).
    drop(take(&limit).await);
    until("the first release", || async { fleet(&limit).await.1 == 0 }).await;
    let loads = redis.calls("script|load");
    assert!(
        loads <= 4,
        "acquire, release, state, refresh: {loads} loads"
    );

    let before = redis.calls("evalsha");
    for operation in 1..=10 {
        drop(take(&limit).await);
        // Each release goes out before the next take: releases that come together would go out
        // in one call (as on a loaded machine, where the release task runs late).
        support::eventually("the release", || {
            redis.calls("evalsha") - before >= 2 * operation
        })
        .await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        redis.calls("evalsha") - before,
        20,
        "one call to take the lease, one to give it back, each"
    );
    assert_eq!(
        redis.calls("script|load"),
        loads,
        "called by SHA from then on"
    );
    assert_eq!(redis.calls("eval"), 0, "never sent whole");
}

// ---------------------------------------------------------------------------------------------
// Cancellation
// ---------------------------------------------------------------------------------------------

// ---------------------------------------------------------------------------------------------
// Capacity
// ---------------------------------------------------------------------------------------------

// ---------------------------------------------------------------------------------------------
// Bounded waiting
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs redis-server on PATH (apt-get install redis-server): cargo test -- --include-ignored runs it"]
async fn the_queue_bound_and_the_queue_timeout_are_answered_as_the_local_limits_are() {
    let redis = RedisServer::start_required();
    let t = Telemetry::new();
    let replica_a = patient("judges", 1)
        .max_queued(1)
        .build(redis.url())
        .unwrap();
    let replica_b = patient("judges", 1)
        .max_queued(1)
        .build(redis.url())
        .unwrap();
    assert_eq!(replica_a.queue_bound(), Some(1));
    assert!(replica_a.may_reject());
    let holding = take(&replica_a).await;
    let waiting = wait_for(&replica_b);
    until_queued(&replica_a, 1).await;

    // The fleet's queue is full, whichever replica asks: turned away at once.
    let service = ResourcesOperationLayer::new(replica_a.clone())
        .operation(Operation::Judge)
        .metrics(t.metrics.clone())
        .protocol(RejectAsError)
        .layer(service_fn(|()| async { Ok::<_, BoxError>(()) }));
    let error = within("a full queue", service.oneshot(()))
        .await
        .unwrap_err();
    let rejected = error.downcast_ref::<Rejected>().expect("a Rejected");
    assert_eq!(rejected.rejection(), Rejection::QueueFull);
    let full = replica_b.acquire().await.unwrap_err();
    assert_eq!(full.rejection(), Rejection::QueueFull);
    assert!(!full.is_failure());

    // With room in the queue, a queue timeout turns the wait away, and its ticket goes back.
    waiting.abort();
    until_queued(&replica_a, 0).await;
    let timed = ResourcesOperationLayer::new(replica_b.clone())
        .operation(Operation::Judge)
        .metrics(t.metrics.clone())
        .protocol(RejectAsError)
        .queue_timeout(Duration::from_millis(200))
        .layer(service_fn(|()| async { Ok::<_, BoxError>(()) }));
    let error = within("a queue timeout", timed.oneshot(()))
        .await
        .unwrap_err();
    let rejected = error.downcast_ref::<Rejected>().expect("a Rejected");
    assert_eq!(rejected.rejection(), Rejection::QueueTimeout);
    until_queued(&replica_a, 0).await;

    assert_eq!(
        t.live_value(REJECTED_INSTRUMENT, &[(REJECTION_ATTRIBUTE, "queue_full")]),
        1
    );
    assert_eq!(
        t.live_value(
            REJECTED_INSTRUMENT,
            &[(REJECTION_ATTRIBUTE, "queue_timeout")]
        ),
        1
    );
    assert_eq!(live(&t), (0, 0));
    drop(holding);
}

// ---------------------------------------------------------------------------------------------
// Failures
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs redis-server on PATH (apt-get install redis-server): cargo test -- --include-ignored runs it"]
async fn failing_closed_a_stopped_redis_turns_operations_away_as_unavailable() {
    let mut redis = RedisServer::start_required();
    let t = Telemetry::new();
    let limit = quick("judges", 2).fail_closed().build(redis.url()).unwrap();
    limit.ready().await.unwrap();
    assert!(
        limit.may_reject(),
        "failing closed, it may turn operations away"
    );
    redis.stop();

    let error = within("an acquire", limit.acquire()).await.unwrap_err();
    assert_eq!(error.rejection(), Rejection::Unavailable);
    assert!(error.is_failure());

    let http = ResourcesOperationLayer::new_for_http(limit.clone())
        .operation(Operation::Judge)
        .metrics(t.metrics.clone())
        .layer(service_fn(|_: Request<()>| async {
            Ok::<_, Infallible>(Response::new(String::new()))
        }));
    let response = within("a request", http.oneshot(Request::new(())))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    let scoped = within(
        "a scoped operation",
        t.metrics
            .resources_operation(&limit, Operation::Judge, Executor::Inline, async {}),
    )
    .await;
    assert_eq!(scoped, Err(Rejected::new(Rejection::Unavailable)));
    assert_eq!(
        t.live_value(REJECTED_INSTRUMENT, &[(REJECTION_ATTRIBUTE, "unavailable")]),
        2
    );
    assert_eq!(t.count(DURATION_INSTRUMENT, &[]), 0);
    assert_eq!(live(&t), (0, 0));
    assert_eq!(limit.failed_open(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs redis-server on PATH (apt-get install redis-server): cargo test -- --include-ignored runs it"]
async fn failing_open_a_stopped_redis_admits_operations_without_the_fleet_limit_and_counts_them() {
    let mut redis = RedisServer::start_required();
    let t = Telemetry::new();
    let limit = quick("judges", 1)
        .fail_open()
        .meter(&t.meter())
        .build(redis.url())
        .unwrap();
    assert!(
        !limit.may_reject(),
        "failing open without a queue bound it never turns an operation away"
    );
    // So a layer that cannot answer a rejection takes it.
    let service = ResourcesOperationLayer::new(limit.clone())
        .operation(Operation::Judge)
        .metrics(t.metrics.clone())
        .layer(service_fn(|()| async { Ok::<_, Infallible>("judged") }));
    assert_eq!(service.clone().oneshot(()).await.unwrap(), "judged");
    redis.stop();

    let permits = [
        within("an acquire", limit.acquire()).await.unwrap(),
        within("an acquire", limit.acquire()).await.unwrap(),
    ];
    assert!(permits.iter().all(RedisPermit::failed_open));
    assert_eq!(limit.failed_open(), 2);
    assert_eq!(limit.active(), 0, "no lease held");
    assert_eq!(
        within("a request", service.oneshot(())).await.unwrap(),
        "judged"
    );
    assert_eq!(named(&t, FAILED_OPEN_INSTRUMENT, "judges"), 3);
    assert_eq!(t.ended(&[], "ok"), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs redis-server on PATH (apt-get install redis-server): cargo test -- --include-ignored runs it"]
async fn a_waiter_gets_the_configured_answer_when_redis_stops_under_it() {
    let mut redis = RedisServer::start_required();
    let closed = quick("judges", 1).fail_closed().build(redis.url()).unwrap();
    let open = quick("judges", 1).fail_open().build(redis.url()).unwrap();
    let share = quick("judges", 1).build(redis.url()).unwrap();
    share.ready().await.unwrap();
    let holding = take(&closed).await;
    let turned_away = {
        let closed = closed.clone();
        tokio::spawn(async move { closed.acquire().await.map(drop) })
    };
    let admitted = {
        let open = open.clone();
        tokio::spawn(async move { open.acquire().await.map(|permit| permit.failed_open()) })
    };
    let on_share = {
        let share = share.clone();
        tokio::spawn(async move { share.acquire().await.map(|permit| permit.on_share()) })
    };
    until_queued(&closed, 3).await;

    redis.stop();
    let error = within("the failing-closed waiter", turned_away)
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(error.rejection(), Rejection::Unavailable);
    assert!(within("the failing-open waiter", admitted)
        .await
        .unwrap()
        .unwrap());
    // Its share of the fleet's capacity of 1 is 1 (at least 1), and it holds none.
    assert!(within("the waiter on its share", on_share)
        .await
        .unwrap()
        .unwrap());
    assert_eq!((closed.queued(), open.queued(), share.queued()), (0, 0, 0));
    drop(holding);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs redis-server on PATH (apt-get install redis-server): cargo test -- --include-ignored runs it"]
async fn a_frozen_redis_is_answered_within_the_call_timeout_not_waited_for() {
    let redis = RedisServer::start_required();
    let limit = quick("judges", 2).fail_closed().build(redis.url()).unwrap();
    limit.ready().await.unwrap();
    redis.pause();
    let error = within("an acquire", limit.acquire()).await.unwrap_err();
    assert_eq!(error.rejection(), Rejection::Unavailable);
    assert!(error.is_failure());
    redis.resume();
    until("Redis answers again", || async {
        limit.acquire().await.is_ok()
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs redis-server on PATH (apt-get install redis-server): cargo test -- --include-ignored runs it"]
async fn a_lost_lease_is_counted_and_taken_back_while_its_place_is_free() {
    let redis = RedisServer::start_required();
    let t = Telemetry::new();
    let limit = quick("judges", 1)
        .meter(&t.meter())
        .build(redis.url())
        .unwrap();
    let other = quick("judges", 1).build(redis.url()).unwrap();
    let _gauge = ResourcesOperationLayer::new_for_http(limit.clone())
        .metrics(t.metrics.clone())
        .layer(service_fn(|_: Request<()>| async {
            Ok::<_, Infallible>(Response::new(String::new()))
        }));
    let running = take(&limit).await;
    // Redis forgets the lease (as a restart without persistence would).
    let _: () = ::redis::cmd("DEL")
        .arg("{tro:judges}:holders")
        .query(&mut redis.connection())
        .unwrap();

    support::eventually("the loss seen", || limit.leases_lost() == 1).await;
    assert_eq!(
        fleet(&limit).await,
        (1, 1, 0),
        "taken back: its place was free"
    );
    let waiting = wait_for(&other);
    until_queued(&limit, 1).await;
    drop(running);
    drop(within("the waiter", waiting).await.unwrap());
    assert_eq!(named(&t, LEASES_LOST_INSTRUMENT, "judges"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs redis-server on PATH (apt-get install redis-server): cargo test -- --include-ignored runs it"]
async fn after_a_restart_the_fleet_recovers_by_itself() {
    let mut redis = RedisServer::start_required();
    let t = Telemetry::new();
    let limit = quick("judges", 2).fail_closed().build(redis.url()).unwrap();
    let service = ResourcesOperationLayer::new_for_http(limit.clone())
        .operation(Operation::Judge)
        .metrics(t.metrics.clone())
        .layer(service_fn(|_: Request<()>| async {
            Ok::<_, Infallible>(Response::new(String::new()))
        }));
    let running = take(&limit).await;

    redis.stop();
    let down = within("a request", service.clone().oneshot(Request::new(())))
        .await
        .unwrap();
    assert_eq!(down.status(), StatusCode::SERVICE_UNAVAILABLE);

    redis.restart();
    until("served again", || {
        let service = service.clone();
        async move {
            let response = service.oneshot(Request::new(())).await.unwrap();
            response.status() == StatusCode::OK
        }
    })
    .await;
    assert_eq!(fleet(&limit).await.0, 2, "the capacity stored again");
    // The lease Redis forgot is seen lost, and taken back: its place was free.
    support::eventually("the loss seen", || limit.leases_lost() == 1).await;
    until("the lease taken back", || async {
        fleet(&limit).await == (2, 1, 0)
    })
    .await;
    drop(running);
    until("every place back", || async {
        fleet(&limit).await == (2, 0, 0)
    })
    .await;
    assert_eq!(live(&t), (0, 0), "the books balance");
    assert!(t.live_value(REJECTED_INSTRUMENT, &[(REJECTION_ATTRIBUTE, "unavailable")]) >= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs redis-server on PATH (apt-get install redis-server): cargo test -- --include-ignored runs it"]
async fn work_that_reaches_its_fleet_limit_again_runs_on_the_place_it_holds() {
    let redis = RedisServer::start_required();
    let t = Telemetry::new();
    let limit = patient("judges", 1).build(redis.url()).unwrap();
    // Of a limit of 1, the outer operation holds the one place: the inner one would wait for
    // it forever, as with tower's limits, but runs on the place it holds.
    let nested = t
        .metrics
        .resources_operation(&limit, Operation::Judge, Executor::Inline, async {
            t.metrics
                .resources_operation(&limit.clone(), Operation::Judge, Executor::Inline, async {
                    "judged"
                })
                .await
        });
    assert_eq!(
        within("the nested operation", nested).await,
        Ok(Ok("judged"))
    );
    until("the place back", || async {
        fleet(&limit).await == (1, 0, 0)
    })
    .await;
}

// ---------------------------------------------------------------------------------------------
// Metrics
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs redis-server on PATH (apt-get install redis-server): cargo test -- --include-ignored runs it"]
async fn the_limit_gauge_is_the_fleets_capacity_and_active_is_this_replicas_own() {
    let redis = RedisServer::start_required();
    let t = Telemetry::new();
    let here = patient("judges", 4).build(redis.url()).unwrap();
    here.register_metrics(&t.meter());
    let elsewhere = patient("judges", 4).build(redis.url()).unwrap();
    let service = ResourcesOperationLayer::new_for_http(here.clone())
        .operation(Operation::Judge)
        .metrics(t.metrics.clone())
        .layer(service_fn(|_: Request<()>| async {
            Ok::<_, Infallible>(Response::new(String::new()))
        }));
    here.ready().await.unwrap();
    let mine = take(&here).await;
    let theirs = [take(&elsewhere).await, take(&elsewhere).await];

    assert_eq!(t.live_value(LIMIT_INSTRUMENT, &[]), 4);
    assert_eq!(named(&t, LIMIT_CAPACITY_INSTRUMENT, "judges"), 4);
    assert_eq!(
        named(&t, LIMIT_ACTIVE_INSTRUMENT, "judges"),
        1,
        "this replica's"
    );
    assert_eq!(fleet(&here).await.1, 3, "the fleet's");

    elsewhere.set_capacity(6).await.unwrap();
    support::eventually("the new capacity heard", || here.capacity() == 6).await;
    assert_eq!(t.live_value(LIMIT_INSTRUMENT, &[]), 6);
    assert_eq!(named(&t, LIMIT_CAPACITY_INSTRUMENT, "judges"), 6);
    assert_eq!(named(&t, FAILED_OPEN_INSTRUMENT, "judges"), 0);
    assert_eq!(named(&t, LEASES_LOST_INSTRUMENT, "judges"), 0);

    let response = service.oneshot(Request::new(())).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(t.ended(&[], "ok"), 1);
    drop((mine, theirs));
}
