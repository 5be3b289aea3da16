//! The fleet limit next to the `distributed-lock-redis` semaphore (0.2), each through this
//! crate's `Acquire`, on a `redis-server` of its own: script calls per uncontended operation
//! (from `INFO commandstats`), and the throughput of 3 replicas (3 handles, each with its own
//! connection) sharing a limit of 6, 8 workers each, operations of 2 ms.

// The `redis-server`, the script-call count and the drive the crate's `redis` bench uses too.
#[path = "../../common/fleet.rs"]
mod fleet;

use std::sync::Arc;
use std::time::Duration;

use distributed_lock_core::traits::{DistributedSemaphore, LockHandle, SemaphoreProvider};
use distributed_lock_redis::{RedisDistributedSemaphore, RedisLockProvider, RedisSemaphoreHandle};
use tower_resources_operation::limit::AcquireError;
use tower_resources_operation::Acquire;
use tower_resources_operation_redis::RedisLimit;

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

/// Waits until the script calls stop growing (the last releases landed); returns them.
async fn settled_calls(url: &str) -> u64 {
    fleet::settled_calls(url, Duration::from_millis(200)).await
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
    let replicas = limits.len();
    let elapsed = fleet::drive(limits, WORKERS, OPS, Duration::from_millis(2)).await;
    let total = (replicas * OPS) as f64;
    let calls = settled_calls(url).await - before;
    (total / elapsed.as_secs_f64(), calls as f64 / total)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let (mut server, port) =
        fleet::start_redis().expect("redis-server (apt-get install redis-server)");
    let url = format!("redis://127.0.0.1:{port}/");

    let fleet: Vec<RedisLimit> = (0..3)
        .map(|_| {
            RedisLimit::builder("compare", 6).build(&url).unwrap()
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
