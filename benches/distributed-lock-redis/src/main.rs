//! The fleet limit next to the `distributed-lock-redis` semaphore (0.2), each through this
//! crate's `Acquire`, on a `redis-server` of its own: script calls per uncontended operation
//! (from `INFO commandstats`), and the throughput of 3 replicas (3 handles, each with its own
//! connection) sharing a limit of 6, 8 workers each, operations of 2 ms.

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use distributed_lock_core::traits::{DistributedSemaphore, LockHandle, SemaphoreProvider};
use distributed_lock_redis::{RedisDistributedSemaphore, RedisLockProvider, RedisSemaphoreHandle};
use tower_resources_operation::limit::redis::RedisLimit;
use tower_resources_operation::limit::AcquireError;
use tower_resources_operation::Acquire;

/// The semaphore as a limit. Its handle does not give its ticket back when dropped (the ticket
/// expires), so the permit releases it on a task, as a user would have to.
#[derive(Clone)]
struct Semaphore(Arc<RedisDistributedSemaphore>);

struct Ticket(Option<RedisSemaphoreHandle>);

impl Drop for Ticket {
    fn drop(&mut self) {
        if let Some(handle) = self.0.take() {
            tokio::spawn(async move {
                let _ = handle.release().await;
            });
        }
    }
}

impl Acquire for Semaphore {
    type Permit = Ticket;

    async fn acquire(&self) -> Result<Ticket, AcquireError> {
        self.0
            .acquire(None)
            .await
            .map(|handle| Ticket(Some(handle)))
            .map_err(AcquireError::failed)
    }
}

fn start_redis() -> (Child, u16) {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let child = Command::new("redis-server")
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args(["--save", "", "--appendonly", "no", "--loglevel", "warning"])
        .stdout(Stdio::null())
        .spawn()
        .expect("redis-server (apt-get install redis-server)");
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        std::thread::sleep(Duration::from_millis(10));
    }
    (child, port)
}

fn script_calls(url: &str) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query(&mut redis::Client::open(url).unwrap().get_connection().unwrap())
        .unwrap();
    ["cmdstat_evalsha:calls=", "cmdstat_eval:calls="]
        .iter()
        .filter_map(|prefix| info.lines().find_map(|line| line.strip_prefix(prefix)))
        .filter_map(|rest| rest.split(',').next()?.parse::<u64>().ok())
        .sum()
}

async fn settled_calls(url: &str) -> u64 {
    let mut last = script_calls(url);
    loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let now = script_calls(url);
        if now == last {
            return now;
        }
        last = now;
    }
}

async fn uncontended<A: Acquire>(url: &str, limit: &A) -> f64 {
    drop(limit.acquire().await.unwrap());
    let before = settled_calls(url).await;
    for _ in 0..500 {
        drop(limit.acquire().await.unwrap());
    }
    (settled_calls(url).await - before) as f64 / 500.0
}

async fn throughput<A>(url: &str, limits: Vec<A>) -> (f64, f64)
where
    A: Acquire + Clone + Send + Sync + 'static,
    A::Permit: Send,
{
    const WORKERS: usize = 8;
    const OPS: usize = 600;
    let before = settled_calls(url).await;
    let started = Instant::now();
    let mut tasks = Vec::new();
    let replicas = limits.len();
    for limit in limits {
        let remaining = Arc::new(std::sync::atomic::AtomicUsize::new(OPS));
        for _ in 0..WORKERS {
            let (limit, remaining) = (limit.clone(), Arc::clone(&remaining));
            tasks.push(tokio::spawn(async move {
                use std::sync::atomic::Ordering::Relaxed;
                while remaining
                    .fetch_update(Relaxed, Relaxed, |left| left.checked_sub(1))
                    .is_ok()
                {
                    let permit = limit.acquire().await.expect("a place");
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    drop(permit);
                }
            }));
        }
    }
    for task in tasks {
        task.await.unwrap();
    }
    let elapsed = started.elapsed();
    let total = (replicas * OPS) as f64;
    let calls = settled_calls(url).await - before;
    (total / elapsed.as_secs_f64(), calls as f64 / total)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let (mut server, port) = start_redis();
    let url = format!("redis://127.0.0.1:{port}/");

    let fleet: Vec<RedisLimit> = (0..3)
        .map(|_| {
            RedisLimit::builder("compare", 6)
                .build(url.as_str())
                .unwrap()
        })
        .collect();
    let mut semaphores = Vec::new();
    for _ in 0..3 {
        let provider = RedisLockProvider::builder()
            .url(url.clone())
            .expiry(Duration::from_secs(10))
            .extension_cadence(Duration::from_millis(3_333))
            .build()
            .await
            .unwrap();
        semaphores.push(Semaphore(Arc::new(provider.create_semaphore("compare", 6))));
    }

    println!("script calls per uncontended operation:");
    println!(
        "  RedisLimit:             {:.2}",
        uncontended(&url, &fleet[0]).await
    );
    println!(
        "  distributed-lock-redis: {:.2}",
        uncontended(&url, &semaphores[0]).await
    );
    println!("3 replicas, a fleet limit of 6, 8 workers each, 600 operations each of 2 ms:");
    let (rate, calls) = throughput(&url, fleet).await;
    println!(
        "  RedisLimit:             {rate:>6.0} operations/s, {calls:.2} script calls per operation"
    );
    let (rate, calls) = throughput(&url, semaphores).await;
    println!(
        "  distributed-lock-redis: {rate:>6.0} operations/s, {calls:.2} script calls per operation"
    );
    let _ = server.kill();
    let _ = server.wait();
}
