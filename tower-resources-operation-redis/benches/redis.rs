//! What the fleet limit costs, on a real `redis-server` of its own (127.0.0.1, no persistence).
//!
//! ```text
//! cargo bench -p tower-resources-operation-redis --bench redis
//! ```
//!
//! 1. **Round trips per operation**, read from Redis's `INFO commandstats`: uncontended
//!    operations that hold their place for no time (the target: 2, one call to take the lease
//!    and one to give it back), then operations that hold it across several refreshes (the
//!    target: 2 plus one refresh per third of the TTL that the work runs, shared by every lease
//!    of the process).
//! 2. **Acquire latency against a bare round trip**: an uncontended acquire next to a `PING` on
//!    a connection of the same kind (`redis` 0.32's `ConnectionManager`, RESP3) to the same
//!    server, interleaved; the ratio of the medians (the aim: 1.5 or less).
//! 3. **A fleet of 3 replicas doing short operations** (3 handles, each with its own connection
//!    and tasks, in one process): throughput with a fleet limit of 6 against the same replicas
//!    each with a local `Limit` of 2.

/// The `redis-server` and the drive, shared with the `distributed-lock-redis` comparison.
#[path = "common/fleet.rs"]
mod fleet;

use std::time::{Duration, Instant};

use fleet::{admin, drive, start_redis};
use tower_resources_operation::{Acquire, Limit};
use tower_resources_operation_redis::RedisLimit;

fn main() {
    // `cargo bench` passes `--bench`; a filter is not supported: every section is short.
    let Some((mut server, port)) = start_redis() else {
        eprintln!(
            "redis-server was not found on PATH: install it (Debian/Ubuntu: `apt-get install \
             redis-server`) to run this benchmark."
        );
        return;
    };
    let url = format!("redis://127.0.0.1:{port}/");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        round_trips(&url).await;
        latency(&url).await;
        fleet(&url).await;
    });
    let _ = server.kill();
    let _ = server.wait();
}

/// Waits until the script calls stop growing (the last releases landed); returns them.
async fn settled_calls(url: &str) -> u64 {
    fleet::settled_calls(url, Duration::from_millis(100)).await
}

async fn round_trips(url: &str) {
    println!("== round trips per operation (INFO commandstats)");
    let limit = RedisLimit::builder("bench-round-trips", 4)
        .build(url)
        .unwrap();
    drop(limit.acquire().await.unwrap()); // the scripts loaded
    settled_calls(url).await;
    let _: () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query(&mut admin(url))
        .unwrap();
    const OPS: u64 = 2_000;
    for _ in 0..OPS {
        drop(limit.acquire().await.unwrap());
    }
    let calls = settled_calls(url).await;
    println!(
        "uncontended, no work:          {OPS} operations, {calls} script calls: {:.3} per \
         operation (target 2)",
        calls as f64 / OPS as f64
    );
    // Its background work ends with it: its refreshes are not counted in the next section.
    drop(limit);

    // Leases held across refreshes: TTL 600 ms, so one refresh every 200 ms.
    let ttl = Duration::from_millis(600);
    let limit = RedisLimit::builder("bench-refresh", 4)
        .lease_ttl(ttl)
        .call_timeout(Duration::from_millis(200))
        .build(url)
        .unwrap();
    drop(limit.acquire().await.unwrap());
    settled_calls(url).await;
    let _: () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query(&mut admin(url))
        .unwrap();
    let (ops, work) = (10, Duration::from_millis(500));
    let started = Instant::now();
    for _ in 0..ops {
        let permit = limit.acquire().await.unwrap();
        tokio::time::sleep(work).await;
        drop(permit);
    }
    let held = started.elapsed();
    let calls = settled_calls(url).await;
    let refreshes = held.as_secs_f64() / (ttl / 3).as_secs_f64();
    println!(
        "each holding {} ms, TTL {} ms: {ops} operations, {calls} script calls: {:.2} per \
         operation (target 2 + {:.2} refreshes = {:.2})",
        work.as_millis(),
        ttl.as_millis(),
        calls as f64 / ops as f64,
        refreshes / ops as f64,
        2.0 + refreshes / ops as f64
    );
    drop(limit);
    let (many, concurrent) = (40, Duration::from_millis(500));
    settled_calls(url).await;
    let _: () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query(&mut admin(url))
        .unwrap();
    let limit = RedisLimit::builder("bench-refresh-many", 64)
        .lease_ttl(ttl)
        .call_timeout(Duration::from_millis(200))
        .build(url)
        .unwrap();
    let started = Instant::now();
    let tasks: Vec<_> = (0..many)
        .map(|_| {
            let limit = limit.clone();
            tokio::spawn(async move {
                let permit = limit.acquire().await.unwrap();
                tokio::time::sleep(concurrent).await;
                drop(permit);
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    let held = started.elapsed();
    let calls = settled_calls(url).await;
    let refreshes = held.as_secs_f64() / (ttl / 3).as_secs_f64();
    println!(
        "{many} at once, holding {} ms:    {calls} script calls ({:.2} per operation): the \
         refreshes ({refreshes:.1} over that time) are one call per process, not per lease\n",
        concurrent.as_millis(),
        calls as f64 / many as f64,
    );
}

/// The median and the 90th percentile of `samples`, in microseconds.
fn summary(samples: &mut [Duration]) -> (f64, f64) {
    samples.sort();
    let at = |q: f64| samples[((samples.len() - 1) as f64 * q) as usize].as_secs_f64() * 1e6;
    (at(0.5), at(0.9))
}

async fn latency(url: &str) {
    println!("== acquire latency, uncontended, against PING (interleaved, same server)");
    let mut info: redis::ConnectionInfo =
        redis::IntoConnectionInfo::into_connection_info(url).unwrap();
    info.redis.protocol = redis::ProtocolVersion::RESP3;
    let mut ping = redis::Client::open(info)
        .unwrap()
        .get_connection_manager()
        .await
        .unwrap();
    let limit = RedisLimit::builder("bench-latency", 4).build(url).unwrap();
    drop(limit.acquire().await.unwrap());
    const ROUNDS: usize = 5_000;
    let (mut pings, mut acquires) = (Vec::with_capacity(ROUNDS), Vec::with_capacity(ROUNDS));
    for round in 0..ROUNDS + 500 {
        let at = Instant::now();
        let _: String = redis::cmd("PING").query_async(&mut ping).await.unwrap();
        let pinged = at.elapsed();
        let at = Instant::now();
        let permit = limit.acquire().await.unwrap();
        let acquired = at.elapsed();
        drop(permit);
        // Let the release go out before the next round, as between two operations.
        tokio::time::sleep(Duration::from_micros(200)).await;
        if round >= 500 {
            pings.push(pinged);
            acquires.push(acquired);
        }
    }
    let (ping_median, ping_p90) = summary(&mut pings);
    let (acquire_median, acquire_p90) = summary(&mut acquires);
    println!(
        "PING     median {ping_median:>6.1} us, p90 {ping_p90:>6.1} us\n\
         acquire  median {acquire_median:>6.1} us, p90 {acquire_p90:>6.1} us\n\
         ratio of medians: {:.2} (aim 1.5 or less)\n",
        acquire_median / ping_median
    );
}

async fn fleet(url: &str) {
    const REPLICAS: usize = 3;
    const CAPACITY: usize = 6;
    const WORKERS: usize = 8;
    const OPS: usize = 600;
    let work = Duration::from_millis(2);
    println!(
        "== {REPLICAS} replicas, {WORKERS} workers each, {OPS} operations each of {} ms",
        work.as_millis()
    );
    let local: Vec<Limit> = (0..REPLICAS)
        .map(|_| Limit::new(CAPACITY / REPLICAS))
        .collect();
    let local_time = drive(local, WORKERS, OPS, work).await;

    let fleet: Vec<RedisLimit> = (0..REPLICAS)
        .map(|_| {
            RedisLimit::builder("bench-fleet", CAPACITY)
                .build(url)
                .unwrap()
        })
        .collect();
    for limit in &fleet {
        limit.ready().await.unwrap();
    }
    let before = settled_calls(url).await;
    let fleet_time = drive(fleet, WORKERS, OPS, work).await;
    let calls = settled_calls(url).await - before;
    let total = (REPLICAS * OPS) as f64;
    let (local_rate, fleet_rate) = (
        total / local_time.as_secs_f64(),
        total / fleet_time.as_secs_f64(),
    );
    println!(
        "local Limit of {} each:  {local_rate:>7.0} operations/s\n\
         fleet limit of {CAPACITY}:       {fleet_rate:>7.0} operations/s ({:.2} of local), \
         {:.2} script calls per operation",
        CAPACITY / REPLICAS,
        fleet_rate / local_rate,
        calls as f64 / total
    );
}
