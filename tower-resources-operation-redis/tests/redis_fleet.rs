//! A fleet of three replicas, each a process of its own (this test binary, started again in
//! replica mode), sharing one fleet limit on one real `redis-server`:
//!
//! - a burst through all three never runs more than the fleet's capacity at once, as seen by an
//!   observer independent of the limit (each handler records its entry and exit on a second
//!   `redis-server`), and every replica's books balance;
//! - with Redis stopped and restarted in the middle of a load, no caller hangs, each gets the
//!   answer its replica is configured for (turned away as `unavailable`, or admitted without the
//!   fleet limit), and every replica takes places again once Redis is back.

mod support;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use support::redis_server::RedisServer;
use support::replicas::{replica_or, say, this_test, within_thread, Replica};
use support::{live, Telemetry};
use tower_resources_operation::names::{
    DURATION_INSTRUMENT, REJECTED_INSTRUMENT, REJECTION_ATTRIBUTE,
};
use tower_resources_operation::{Acquire, Executor, Operation, Rejection};
use tower_resources_operation_redis::{RedisLimit, Unreachable};

/// The limit every replica names.
const NAME: &str = "fleet-test";

// ---------------------------------------------------------------------------------------------
// The replica
// ---------------------------------------------------------------------------------------------

/// What a replica is told, as `key=value` pairs separated by spaces.
#[derive(Clone, Debug)]
struct Settings {
    redis: String,
    observer: String,
    capacity: usize,
    ttl_ms: u64,
    /// The replica's call timeout, and fallback poll.
    call_ms: u64,
    /// `burst`: run `ops` operations, `concurrency` at once, each arriving `spread_ms` after
    /// the one before, each working `work_ms`; `hold`: take `capacity` places and keep them.
    mode: String,
    ops: usize,
    concurrency: usize,
    work_ms: u64,
    spread_ms: u64,
    /// What the replica answers while Redis is away: `closed`, `open` or `share`.
    unreachable: String,
}

impl Settings {
    fn encode(&self) -> String {
        format!(
            "redis={} observer={} capacity={} ttl_ms={} call_ms={} mode={} ops={} concurrency={} \
             work_ms={} spread_ms={} unreachable={}",
            self.redis,
            self.observer,
            self.capacity,
            self.ttl_ms,
            self.call_ms,
            self.mode,
            self.ops,
            self.concurrency,
            self.work_ms,
            self.spread_ms,
            self.unreachable
        )
    }

    fn decode(encoded: &str) -> Self {
        let pairs: BTreeMap<&str, &str> = encoded
            .split(',')
            .filter_map(|pair| pair.split_once('='))
            .collect();
        let number = |key: &str| pairs[key].parse::<u64>().expect(key);
        Self {
            redis: pairs["redis"].to_owned(),
            observer: pairs["observer"].to_owned(),
            capacity: number("capacity") as usize,
            ttl_ms: number("ttl_ms"),
            call_ms: number("call_ms"),
            mode: pairs["mode"].to_owned(),
            ops: number("ops") as usize,
            concurrency: number("concurrency") as usize,
            work_ms: number("work_ms"),
            spread_ms: number("spread_ms"),
            unreachable: pairs["unreachable"].to_owned(),
        }
    }
}

/// A replica of the test running: its settings are this file's `Settings`, as one setting.
fn replica(settings: support::replicas::Settings) {
    let settings = Settings::decode(&settings["fleet"]);
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
        .block_on(run_replica(settings));
}

/// The test's own runtime (a replica makes its own: one runtime per process).
fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

async fn run_replica(settings: Settings) {
    let mut builder = RedisLimit::builder(NAME, settings.capacity)
        .lease_ttl(Duration::from_millis(settings.ttl_ms))
        .call_timeout(Duration::from_millis(settings.call_ms))
        .fallback_poll(Duration::from_millis(settings.call_ms));
    builder = builder.when_unreachable(match settings.unreachable.as_str() {
        "open" => Unreachable::Open,
        "closed" => Unreachable::Closed,
        _ => Unreachable::Share,
    });
    let limit = builder.build(&settings.redis).unwrap();
    limit.ready().await.expect("Redis at the start");
    if settings.mode == "hold" {
        let mut held = Vec::new();
        for _ in 0..settings.capacity {
            held.push(limit.acquire().await.expect("a place"));
        }
        say("HOLDING");
        // Until killed.
        tokio::time::sleep(Duration::from_secs(3600)).await;
        return;
    }

    let observer = ::redis::Client::open(settings.observer.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .expect("the observer");
    let t = Arc::new(Telemetry::new());
    let slots = Arc::new(tokio::sync::Semaphore::new(settings.concurrency));
    say("READY");
    let mut operations = Vec::new();
    let on_share = Arc::new(std::sync::atomic::AtomicU64::new(0));
    for _ in 0..settings.ops {
        let slot = Arc::clone(&slots).acquire_owned().await.unwrap();
        let (t, limit, mut observer) = (Arc::clone(&t), limit.clone(), observer.clone());
        let on_share = Arc::clone(&on_share);
        let work = Duration::from_millis(settings.work_ms);
        operations.push(tokio::spawn(async move {
            let answer = t
                .metrics
                .resources_operation(&limit, Operation::Verify, Executor::Process, async {
                    if limit.is_on_share() {
                        on_share.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                    enter(&mut observer).await;
                    tokio::time::sleep(work).await;
                    leave(&mut observer).await;
                })
                .await;
            drop(slot);
            answer.map_err(|rejected| rejected.rejection())
        }));
        tokio::time::sleep(Duration::from_millis(settings.spread_ms)).await;
    }
    let (mut admitted, mut unavailable, mut other) = (0, 0, 0);
    for operation in operations {
        // A caller that hangs fails the test that waits for this replica.
        match operation.await.unwrap() {
            Ok(()) => admitted += 1,
            Err(Rejection::Unavailable) => unavailable += 1,
            Err(_) => other += 1,
        }
    }
    // Once Redis answers, this replica takes places again.
    let mut recovered = false;
    for _ in 0..200 {
        if let Ok(permit) = limit.acquire().await {
            if !permit.failed_open() {
                recovered = true;
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (queued, active) = live(&t);
    let recorded = t.count(DURATION_INSTRUMENT, &[]);
    let counted_unavailable =
        t.live_value(REJECTED_INSTRUMENT, &[(REJECTION_ATTRIBUTE, "unavailable")]);
    say(&format!(
        "RESULT admitted={admitted} unavailable={unavailable} other={other} \
         failed_open={} leases_lost={} queued={queued} active={active} recorded={recorded} \
         counted_unavailable={counted_unavailable} recovered={recovered} on_share={}",
        limit.failed_open(),
        limit.leases_lost(),
        on_share.load(std::sync::atomic::Ordering::Relaxed),
    ));
}

/// The observer's record of a handler's entry: how many run now, and the most ever.
async fn enter(observer: &mut ::redis::aio::MultiplexedConnection) {
    let _: i64 = ::redis::Script::new(
        "local n = redis.call('INCR', KEYS[1]) \
         if n > tonumber(redis.call('GET', KEYS[2]) or '0') then redis.call('SET', KEYS[2], n) end \
         return n",
    )
    .key("running")
    .key("most")
    .invoke_async(observer)
    .await
    .expect("the observer");
}

/// The observer's record of a handler's exit.
async fn leave(observer: &mut ::redis::aio::MultiplexedConnection) {
    let _: i64 = ::redis::cmd("DECR")
        .arg("running")
        .query_async(observer)
        .await
        .expect("the observer");
}

// ---------------------------------------------------------------------------------------------
// The tests
// ---------------------------------------------------------------------------------------------

/// A replica process with `settings`, of the test running on this thread.
fn start(settings: &Settings) -> Replica {
    let mut encoded = support::replicas::Settings::new();
    encoded.insert("test".to_owned(), this_test());
    encoded.insert("fleet".to_owned(), settings.encode().replace(' ', ","));
    Replica::start(&encoded)
}

/// A count in a replica's result.
fn count(result: &BTreeMap<String, String>, key: &str) -> u64 {
    result[key].parse().expect(key)
}

/// The observer's highest count of handlers running at once.
fn most_at_once(observer: &RedisServer) -> u64 {
    ::redis::cmd("GET")
        .arg("most")
        .query::<Option<u64>>(&mut observer.connection())
        .unwrap()
        .unwrap_or(0)
}

/// A handle on the fleet limit for the test itself.
fn test_handle(redis: &RedisServer, capacity: usize) -> RedisLimit {
    // It polls for a freed place every 200 ms: a place freed by a lease that expired (no
    // release to hear) reaches its waiter within that.
    RedisLimit::builder(NAME, capacity)
        .lease_ttl(Duration::from_secs(60))
        .fallback_poll(Duration::from_millis(200))
        .build(redis.url())
        .unwrap()
}

/// `(capacity, active, queued)` of the fleet once every lease is back: a replica that exits
/// right after its last operation may not have sent its release, whose lease then expires
/// within the replica's TTL (1.5 or 3 s here).
async fn settled(handle: &RedisLimit) -> (usize, usize, usize) {
    let since = Instant::now();
    loop {
        let fleet = handle.fleet().await.unwrap();
        if fleet.active == 0 || since.elapsed() > Duration::from_secs(10) {
            return (fleet.capacity, fleet.active, fleet.queued);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn burst(redis: &RedisServer, observer: &RedisServer, capacity: usize) -> Settings {
    Settings {
        redis: redis.url(),
        observer: observer.url(),
        capacity,
        ttl_ms: 1_500,
        call_ms: 200,
        mode: "burst".to_owned(),
        ops: 30,
        concurrency: 8,
        work_ms: 20,
        spread_ms: 0,
        unreachable: "closed".to_owned(),
    }
}

#[test]
#[ignore = "needs redis-server on PATH (apt-get install redis-server): cargo test -- --include-ignored runs it"]
fn three_replicas_never_run_more_than_the_fleets_capacity_at_once() {
    replica_or(replica, || {
        runtime().block_on(three_replicas_never_run_more_than_the_fleets_capacity_at_once_body())
    });
}

async fn three_replicas_never_run_more_than_the_fleets_capacity_at_once_body() {
    const CAPACITY: usize = 4;
    let (redis, observer) = (RedisServer::start_required(), RedisServer::start_required());
    let mut settings = burst(&redis, &observer, CAPACITY);
    // This test is about the bound, not about outages: calls may take a second (a replica
    // stalled on a loaded machine), so none fails.
    (settings.call_ms, settings.ttl_ms) = (1_000, 3_000);
    let replicas: Vec<Replica> = (0..3).map(|_| start(&settings)).collect();
    let results = within_thread("the fleet", Duration::from_secs(120), move || {
        replicas
            .into_iter()
            .map(Replica::result)
            .collect::<Vec<_>>()
    });

    let most = most_at_once(&observer);
    println!("at most {most} at once across the fleet; {results:?}");
    assert!(
        most <= CAPACITY as u64,
        "{most} ran at once, above {CAPACITY}"
    );
    assert!(most >= 2, "the replicas ran side by side ({most})");
    for result in &results {
        assert_eq!(count(result, "admitted"), settings.ops as u64, "{result:?}");
        assert_eq!(count(result, "recorded"), settings.ops as u64, "{result:?}");
        assert_eq!(count(result, "unavailable") + count(result, "other"), 0);
        assert_eq!((count(result, "queued"), count(result, "active")), (0, 0));
    }
    let handle = test_handle(&redis, CAPACITY);
    assert_eq!(settled(&handle).await, (CAPACITY, 0, 0));
}

#[test]
#[ignore = "needs redis-server on PATH (apt-get install redis-server): cargo test -- --include-ignored runs it"]
fn with_redis_restarted_mid_load_no_caller_hangs_and_each_gets_its_configured_answer() {
    replica_or(replica, || {
        runtime().block_on(
            with_redis_restarted_mid_load_no_caller_hangs_and_each_gets_its_configured_answer_body(
            ),
        )
    });
}

async fn with_redis_restarted_mid_load_no_caller_hangs_and_each_gets_its_configured_answer_body() {
    const CAPACITY: usize = 4;
    let (mut redis, observer) = (RedisServer::start_required(), RedisServer::start_required());
    // One replica fails closed, one fails open, one runs on its share; operations arrive over
    // 3 s, Redis is away for one of them.
    let mut settings = burst(&redis, &observer, CAPACITY);
    settings.ops = 60;
    settings.concurrency = 6;
    settings.spread_ms = 50;
    settings.work_ms = 30;
    let mut open = settings.clone();
    open.unreachable = "open".to_owned();
    let mut share = settings.clone();
    share.unreachable = "share".to_owned();
    let mut replicas = vec![start(&settings), start(&open), start(&share)];
    replicas = within_thread("the replicas start", Duration::from_secs(60), move || {
        for replica in &mut replicas {
            replica.until("READY");
        }
        replicas
    });
    tokio::time::sleep(Duration::from_millis(700)).await;
    redis.stop();
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    redis.restart();

    let results = within_thread("the fleet", Duration::from_secs(120), move || {
        replicas
            .into_iter()
            .map(Replica::result)
            .collect::<Vec<_>>()
    });
    println!("{results:?}");
    for (index, result) in results.iter().enumerate() {
        let answered = count(result, "admitted") + count(result, "unavailable");
        assert_eq!(
            answered, settings.ops as u64,
            "every caller answered: {result:?}"
        );
        assert_eq!(count(result, "other"), 0, "{result:?}");
        assert_eq!(
            result["recovered"], "true",
            "back once Redis is: {result:?}"
        );
        assert_eq!(
            (count(result, "queued"), count(result, "active")),
            (0, 0),
            "the books balance: {result:?}"
        );
        assert_eq!(count(result, "recorded"), count(result, "admitted"));
        assert_eq!(
            count(result, "counted_unavailable"),
            count(result, "unavailable")
        );
        match index {
            0 => {
                assert!(
                    count(result, "unavailable") > 0,
                    "failing closed: {result:?}"
                );
                assert_eq!(count(result, "failed_open"), 0);
            }
            1 => {
                assert_eq!(count(result, "unavailable"), 0, "failing open: {result:?}");
                assert!(count(result, "failed_open") > 0, "{result:?}");
            }
            _ => {
                assert_eq!(count(result, "unavailable"), 0, "on its share: {result:?}");
                assert_eq!(count(result, "failed_open"), 0, "{result:?}");
                assert!(count(result, "on_share") > 0, "{result:?}");
            }
        }
    }
    let handle = test_handle(&redis, CAPACITY);
    assert_eq!(settled(&handle).await, (CAPACITY, 0, 0));
}
