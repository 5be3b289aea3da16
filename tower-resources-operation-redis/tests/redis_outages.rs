//! A Redis that goes away under load, on a real `redis-server`, with a steady stream of other
//! callers each time (not an idle process):
//!
//! - frozen (SIGSTOP), slow (busy with `DEBUG SLEEP`, so each command answers later than the
//!   call timeout), or killed and refusing connections until it is started again, it starves no
//!   waiter: each hears within the fallback poll and two call timeouts, whether its process
//!   also sends a stream of releases, only waits, or takes a stream of new callers; and every
//!   place comes back once it answers again;
//! - after the first failure, callers are answered at once (turned away, or admitted failing
//!   open) while Redis is asked again in the background, and each outage is logged once, with
//!   the address and the cause;
//! - a configured capacity that is not the fleet's stored one: the stored one is kept, with one
//!   warning that names both, unless the limit is built to overwrite it.
//!
//! Each test names its limits apart: the `tracing` subscriber is the binary's.

mod support;

use std::error::Error as _;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use support::redis_server::RedisServer;
use support::within;
use tower_resources_operation::{Acquire, Rejection};
use tower_resources_operation_redis::{Error, RedisLimit, RedisPermit};

/// Waits until `name`'s fleet queue has `queued` tickets.
async fn until_queued(limit: &RedisLimit, queued: usize) {
    within("the fleet's queue", async {
        while limit.fleet().await.expect("the fleet").queued != queued {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
}

/// A stream of callers on `limit`, one every `every`, each giving its place back at once and
/// waiting for one at most `patience`: how many were admitted and turned away, until `stop`.
fn stream_of_callers(
    limit: &RedisLimit,
    every: Duration,
    patience: Duration,
    stop: &Arc<AtomicBool>,
) -> tokio::task::JoinHandle<(usize, usize)> {
    let (limit, stop) = (limit.clone(), Arc::clone(stop));
    tokio::spawn(async move {
        let admitted = Arc::new(AtomicUsize::new(0));
        let turned_away = Arc::new(AtomicUsize::new(0));
        let mut callers = Vec::new();
        while !stop.load(Ordering::Relaxed) {
            let limit = limit.clone();
            let (admitted, turned_away) = (Arc::clone(&admitted), Arc::clone(&turned_away));
            callers.push(tokio::spawn(async move {
                match tokio::time::timeout(patience, limit.acquire()).await {
                    Ok(Ok(_)) => admitted.fetch_add(1, Ordering::Relaxed),
                    Ok(Err(_)) | Err(_) => turned_away.fetch_add(1, Ordering::Relaxed),
                };
            }));
            tokio::time::sleep(every).await;
        }
        for caller in callers {
            caller.await.expect("a caller");
        }
        (
            admitted.load(Ordering::Relaxed),
            turned_away.load(Ordering::Relaxed),
        )
    })
}

/// How Redis goes away.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Fault {
    /// SIGSTOP: connections stay open, nothing answers.
    Frozen,
    /// Busy with `DEBUG SLEEP`, back to back: each command answers, later than the call timeout.
    Slow,
    /// SIGKILL, then refusing connections until started again (empty) on its port.
    Killed,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs redis-server on PATH (apt-get install redis-server): cargo test -- --include-ignored runs it"]
async fn a_frozen_redis_answers_every_waiter_within_the_fallback_poll_and_two_call_timeouts() {
    waiters_hear_within_their_bound_through(Fault::Frozen).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs redis-server on PATH (apt-get install redis-server): cargo test -- --include-ignored runs it"]
async fn a_slow_redis_answers_every_waiter_within_the_fallback_poll_and_two_call_timeouts() {
    waiters_hear_within_their_bound_through(Fault::Slow).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs redis-server on PATH (apt-get install redis-server): cargo test -- --include-ignored runs it"]
async fn a_killed_redis_answers_every_waiter_within_the_fallback_poll_and_two_call_timeouts() {
    waiters_hear_within_their_bound_through(Fault::Killed).await;
}

/// Three processes' worth of limits on one fleet (one sending a stream of releases, one only
/// waiting, one taking a stream of new callers), four waiters queued, then `fault`: each waiter
/// is answered within the fallback poll and two call timeouts; then Redis answers again, and
/// every place comes back.
async fn waiters_hear_within_their_bound_through(fault: Fault) {
    let name = match fault {
        Fault::Frozen => "frozen-waiters",
        Fault::Slow => "slow-waiters",
        Fault::Killed => "killed-waiters",
    };
    const CALL: Duration = Duration::from_millis(200);
    const POLL: Duration = Duration::from_millis(300);
    // Far above the bound: a waiter that heard only by its own TTL fallback would fail.
    const TTL: Duration = Duration::from_secs(6);
    // What each waiter must hear within, and room for a loaded machine: still far below the
    // TTL, the wait of a waiter that nothing told.
    let bound = POLL + CALL * 2;
    let slack = Duration::from_millis(1_500);
    let mut redis = RedisServer::start_required();
    let replica = || {
        RedisLimit::builder(name, 24)
            .lease_ttl(TTL)
            .call_timeout(CALL)
            .fallback_poll(POLL)
            .fail_closed()
            .build(redis.url())
            .unwrap()
    };
    // `busy` will send a stream of releases while Redis is frozen; `idle` only waits; `callers`
    // takes a stream of new callers throughout.
    let (busy, idle, callers) = (replica(), replica(), replica());
    let mut busy_permits: Vec<RedisPermit> = Vec::new();
    for _ in 0..20 {
        busy_permits.push(within("a place", busy.acquire()).await.unwrap());
    }
    let mut idle_permits = Vec::new();
    for _ in 0..4 {
        idle_permits.push(within("a place", idle.acquire()).await.unwrap());
    }
    let waiters: Vec<_> = [&busy, &busy, &idle, &idle]
        .into_iter()
        .enumerate()
        .map(|(index, limit)| {
            let limit = limit.clone();
            tokio::spawn(async move {
                let answer = limit.acquire().await.map(drop);
                (index, answer, Instant::now())
            })
        })
        .collect();
    until_queued(&busy, 4).await;
    let stop = Arc::new(AtomicBool::new(false));
    let stream = stream_of_callers(
        &callers,
        Duration::from_millis(20),
        Duration::from_millis(150),
        &stop,
    );
    tokio::time::sleep(Duration::from_millis(300)).await;

    let slow = match fault {
        Fault::Frozen => {
            redis.pause();
            None
        }
        Fault::Slow => Some(redis.slow_down(CALL + CALL / 2)),
        Fault::Killed => {
            redis.stop();
            None
        }
    };
    let frozen = Instant::now();
    // A steady stream of releases to `busy`'s background task while Redis is away.
    let releases = tokio::spawn(async move {
        for permit in busy_permits {
            drop(permit);
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    });
    for waiter in waiters {
        let (index, answer, at) = within("a waiter", waiter).await.unwrap();
        let heard = at.duration_since(frozen);
        println!("{fault:?}: waiter {index} heard after {heard:?}");
        // Failing closed, turned away; a slow Redis answers some calls in time, and a release
        // that got through may admit it.
        match answer {
            Err(error) => assert_eq!(error.rejection(), Rejection::Unavailable),
            Ok(()) => assert_eq!(fault, Fault::Slow, "admitted through {fault:?}"),
        }
        assert!(
            heard <= bound + slack,
            "{fault:?}: waiter {index} heard {heard:?} after the fault, the bound is {bound:?}"
        );
    }
    assert_eq!((busy.queued(), idle.queued()), (0, 0));
    // The stream goes on against the fault for a while (a killed one refuses connections).
    tokio::time::sleep(Duration::from_millis(500)).await;

    match fault {
        Fault::Frozen => redis.resume(),
        Fault::Slow => drop(slow),
        Fault::Killed => redis.restart(),
    }
    stop.store(true, Ordering::Relaxed);
    within("the releases", releases).await.unwrap();
    let (admitted, turned_away) = within("the stream", stream).await.unwrap();
    println!("the stream of callers: {admitted} admitted, {turned_away} turned away");
    assert!(turned_away > 0);
    // Redis answers again: the releases kept meanwhile go out, and every place comes back.
    drop(idle_permits);
    within("every place back", async {
        loop {
            if let Ok(fleet) = callers.fleet().await {
                if (fleet.active, fleet.queued) == (0, 0) {
                    break;
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    for limit in [&busy, &idle, &callers] {
        within("admitted again", async {
            while limit.acquire().await.is_err() {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs redis-server on PATH (apt-get install redis-server): cargo test -- --include-ignored runs it"]
async fn after_the_first_failure_callers_are_answered_at_once_and_each_outage_is_logged_once() {
    const CLOSED: &str = "short-circuit-closed";
    const OPEN: &str = "short-circuit-open";
    const CALL: Duration = Duration::from_millis(500);
    const POLL: Duration = Duration::from_millis(300);
    #[cfg(feature = "tracing")]
    support::captured::start();
    let redis = RedisServer::start_required();
    let build = |name| {
        RedisLimit::builder(name, 4)
            .lease_ttl(Duration::from_secs(3))
            .call_timeout(CALL)
            .fallback_poll(POLL)
    };
    let closed = build(CLOSED).fail_closed().build(redis.url()).unwrap();
    let open = build(OPEN).fail_open().build(redis.url()).unwrap();
    // A steady stream of other callers, before, during and after the outage.
    let stop = Arc::new(AtomicBool::new(false));
    let streams = [
        stream_of_callers(&closed, Duration::from_millis(15), CALL, &stop),
        stream_of_callers(&open, Duration::from_millis(15), CALL, &stop),
    ];
    drop(within("a place", closed.acquire()).await.unwrap());
    drop(within("a place", open.acquire()).await.unwrap());

    for outage in 1..=2 {
        // Counts what was said (with `tracing`).
        let _ = outage;
        // Redis answers for a while, with the streams going.
        tokio::time::sleep(Duration::from_millis(300)).await;
        redis.pause();
        // The first failure takes a call timeout...
        let first = within("the first failure", closed.acquire())
            .await
            .unwrap_err();
        let cause = first
            .source()
            .and_then(|source| source.downcast_ref::<Error>())
            .expect("this crate's error");
        assert!(cause.is_unavailable(), "{cause:?}");
        support::eventually("the outage seen", || {
            !closed.is_reachable() && !open.is_reachable()
        })
        .await;
        // ...the callers after it are answered at once, whatever the stream does: well within
        // a call timeout (half of one leaves room for a loaded machine).
        let failed_open_before = open.failed_open();
        for _ in 0..20 {
            let started = Instant::now();
            let error = closed.acquire().await.unwrap_err();
            assert!(
                started.elapsed() < CALL / 2,
                "turned away after {:?}",
                started.elapsed()
            );
            assert_eq!(error.rejection(), Rejection::Unavailable);
            let started = Instant::now();
            let permit = open.acquire().await.unwrap();
            assert!(
                started.elapsed() < CALL / 2,
                "admitted after {:?}",
                started.elapsed()
            );
            assert!(permit.failed_open());
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(open.failed_open() >= failed_open_before + 20);
        // Several probes fail meanwhile; the outage is still said once.
        tokio::time::sleep(POLL * 3).await;
        #[cfg(feature = "tracing")]
        for name in [CLOSED, OPEN] {
            let warnings = support::captured::said(name, tracing::Level::WARN);
            assert_eq!(warnings.len(), outage, "{name}: {warnings:#?}");
            let said = &warnings[outage - 1].message;
            let address = redis.url();
            let address = address.trim_start_matches("redis://").trim_end_matches('/');
            assert!(said.contains(address), "the address, in {said}");
            assert!(said.contains("did not answer"), "the cause, in {said}");
            assert!(said.contains(&format!("{POLL:?}")), "the retry, in {said}");
        }

        redis.resume();
        // Back once the background probe reaches it, with nobody asking.
        support::eventually("reachable again", || {
            closed.is_reachable() && open.is_reachable()
        })
        .await;
        drop(within("a place", closed.acquire()).await.unwrap());
        let permit = within("a place", open.acquire()).await.unwrap();
        assert!(!permit.failed_open());
        drop(permit);
        #[cfg(feature = "tracing")]
        for name in [CLOSED, OPEN] {
            let infos = support::captured::said(name, tracing::Level::INFO);
            assert_eq!(infos.len(), outage, "{name}: {infos:#?}");
            assert!(infos[outage - 1].message.contains("again"));
        }
    }
    stop.store(true, Ordering::Relaxed);
    for stream in streams {
        let (admitted, turned_away) = within("a stream", stream).await.unwrap();
        assert!(admitted > 0, "the stream ran");
        println!("a stream of callers: {admitted} admitted, {turned_away} turned away");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs redis-server on PATH (apt-get install redis-server): cargo test -- --include-ignored runs it"]
async fn a_configured_capacity_that_is_not_the_fleets_is_kept_with_one_warning_unless_overwritten()
{
    const NAME: &str = "capacity-rule";
    #[cfg(feature = "tracing")]
    support::captured::start();
    let redis = RedisServer::start_required();
    let build = |capacity| {
        RedisLimit::builder(NAME, capacity)
            .lease_ttl(Duration::from_secs(60))
            .call_timeout(Duration::from_secs(5))
    };
    let first = build(3).build(redis.url()).unwrap();
    first.ready().await.unwrap();
    assert_eq!(
        first.fleet().await.unwrap().capacity,
        3,
        "stored by the first"
    );
    let stop = Arc::new(AtomicBool::new(false));
    let stream = stream_of_callers(
        &first,
        Duration::from_millis(5),
        Duration::from_secs(5),
        &stop,
    );

    // Another capacity: the fleet's is kept, with one warning, however many calls it makes.
    let later = build(7).build(redis.url()).unwrap();
    for _ in 0..10 {
        drop(within("a place", later.acquire()).await.unwrap());
    }
    assert_eq!(later.capacity(), 3);
    assert_eq!(later.fleet().await.unwrap().capacity, 3);
    #[cfg(feature = "tracing")]
    {
        let warnings = support::captured::said(NAME, tracing::Level::WARN);
        assert_eq!(warnings.len(), 1, "{warnings:#?}");
        let said = &warnings[0].message;
        assert!(
            said.contains("capacity of 7") && said.contains("is 3"),
            "both named: {said}"
        );
        assert!(said.contains("overwrite_capacity"), "the way out: {said}");
    }

    // Built to overwrite: its first call makes its capacity the fleet's, and every replica
    // hears it.
    let overwriting = build(5).overwrite_capacity().build(redis.url()).unwrap();
    drop(within("a place", overwriting.acquire()).await.unwrap());
    assert_eq!(overwriting.fleet().await.unwrap().capacity, 5);
    support::eventually("every replica hears it", || {
        first.capacity() == 5 && later.capacity() == 5
    })
    .await;
    // A capacity set by the first call is the caller's choice: nothing to warn about.
    let operator = build(9).build(redis.url()).unwrap();
    operator.set_capacity(4).await.unwrap();
    drop(within("a place", operator.acquire()).await.unwrap());
    assert_eq!(operator.capacity(), 4);
    #[cfg(feature = "tracing")]
    assert_eq!(
        support::captured::said(NAME, tracing::Level::WARN).len(),
        1,
        "no other warning"
    );

    stop.store(true, Ordering::Relaxed);
    let (admitted, turned_away) = within("the stream", stream).await.unwrap();
    assert!(admitted > 0);
    assert_eq!(turned_away, 0, "the stream was never turned away");
}
