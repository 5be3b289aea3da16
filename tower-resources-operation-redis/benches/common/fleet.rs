//! What the fleet-limit benches share: a `redis-server` of their own, the count of script calls
//! it has served, and the drive of a fleet of limits. Included by the `redis` bench and by the
//! `distributed-lock-redis` package (each through a `#[path]` include), so it needs nothing but
//! `std`, `redis`, `tokio` and `tower-resources-operation`'s `Acquire`.

use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tower_resources_operation::Acquire;

/// A `redis-server` on a free port of 127.0.0.1, with no persistence, or `None` if it could not
/// be started (not on `PATH`) or did not listen within 10 s.
pub fn start_redis() -> Option<(Child, u16)> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .ok()?
        .local_addr()
        .ok()?
        .port();
    let child = Command::new("redis-server")
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args(["--save", "", "--appendonly", "no", "--loglevel", "warning"])
        .stdout(Stdio::null())
        .spawn()
        .ok()?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        if Instant::now() > deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Some((child, port))
}

/// The bench's own connection, for `INFO` and `CONFIG RESETSTAT`.
pub fn admin(url: &str) -> redis::Connection {
    redis::Client::open(url)
        .unwrap()
        .get_connection()
        .expect("the bench's redis-server")
}

/// Calls of every script (`EVALSHA`, `EVAL`) since the last reset.
pub fn script_calls(url: &str) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query(&mut admin(url))
        .unwrap();
    ["cmdstat_evalsha:calls=", "cmdstat_eval:calls="]
        .iter()
        .filter_map(|prefix| info.lines().find_map(|line| line.strip_prefix(prefix)))
        .filter_map(|rest| rest.split(',').next()?.parse::<u64>().ok())
        .sum()
}

/// Waits until the script calls stop growing for `quiet` (the last releases landed); returns
/// them.
pub async fn settled_calls(url: &str, quiet: Duration) -> u64 {
    let mut last = script_calls(url);
    loop {
        tokio::time::sleep(quiet).await;
        let now = script_calls(url);
        if now == last {
            return now;
        }
        last = now;
    }
}

/// Runs `ops` operations of `work` through each of `limits` (the replicas), `workers` at once
/// on each; returns the time until all are done.
pub async fn drive<A>(limits: Vec<A>, workers: usize, ops: usize, work: Duration) -> Duration
where
    A: Acquire + Clone + Send + Sync + 'static,
    A::Permit: Send,
{
    let started = Instant::now();
    let mut tasks = Vec::new();
    for limit in limits {
        let remaining = Arc::new(AtomicUsize::new(ops));
        for _ in 0..workers {
            let (limit, remaining) = (limit.clone(), Arc::clone(&remaining));
            tasks.push(tokio::spawn(async move {
                while remaining
                    .fetch_update(Relaxed, Relaxed, |left| left.checked_sub(1))
                    .is_ok()
                {
                    let permit = limit.acquire().await.expect("a place");
                    tokio::time::sleep(work).await;
                    drop(permit);
                }
            }));
        }
    }
    for task in tasks {
        task.await.unwrap();
    }
    started.elapsed()
}
