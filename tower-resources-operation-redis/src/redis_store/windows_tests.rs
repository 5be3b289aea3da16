//! Every script on a real `redis-server`, its reply decoded, through the scenarios both stores
//! run (`store_scenarios`): what Redis answers and pushes is what the in-memory store does.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use super::{Keys, RedisStore, Settings, Transport};
use crate::fleet::store::{Event, Store};
use crate::memory_store;
use crate::store_scenarios::{self, CAPACITY, CLAIM, TTL};

#[allow(dead_code, unreachable_pub)]
#[path = "../../tests/support/redis_server.rs"]
mod redis_server;

use redis_server::RedisServer;

fn store(redis: &RedisServer, name: &str) -> (RedisStore, UnboundedReceiver<Event>) {
    let name: Arc<str> = Arc::from(name);
    let keys = Keys::new("tro-test", &name);
    let (events, heard) = unbounded_channel();
    let transport = Transport::open(
        Arc::clone(&name),
        &redis.url().into(),
        keys.channel.clone(),
        Duration::from_secs(1),
        events,
    )
    .unwrap();
    let settings = Settings {
        capacity: CAPACITY,
        lease_ttl: TTL,
        claim_timeout: CLAIM,
        max_queued: None,
    };
    (RedisStore::new(name, keys, transport, settings), heard)
}

/// A pushed message takes this long to arrive from Redis.
const SETTLE: Duration = Duration::from_millis(100);

/// `log` with what depends on the clock (a window's age) left out.
fn timeless(log: Vec<String>) -> Vec<String> {
    log.into_iter()
        .map(|line| {
            let mut out = String::new();
            let mut rest = line.as_str();
            while let Some(at) = rest.find("age_ms: ") {
                out += &rest[..at + "age_ms: ".len()];
                rest =
                    rest[at + "age_ms: ".len()..].trim_start_matches(|c: char| c.is_ascii_digit());
                out += "_";
            }
            out + rest
        })
        .collect()
}

/// The two logs are the same, step by step.
fn agree(on_redis: Vec<String>, on_memory: Vec<String>) {
    for (redis, memory) in on_redis.iter().zip(&on_memory) {
        assert_eq!(redis, memory, "Redis, then the in-memory store");
    }
    assert_eq!(on_redis.len(), on_memory.len());
}

/// What the in-memory store answers to `scenario`, on paused time.
fn on_memory<F: std::future::Future<Output = Vec<String>>>(
    scenario: impl FnOnce() -> F,
) -> Vec<String> {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap()
        .block_on(scenario())
}

#[tokio::test]
#[ignore = "needs redis-server on PATH (apt-get install redis-server): cargo test -- --include-ignored runs it"]
async fn places_on_redis_are_what_they_are_on_the_in_memory_store() {
    let redis = RedisServer::start_required();
    let (store, mut heard) = store(&redis, "places");
    store.connect().await.unwrap();
    let pause = |duration| tokio::time::sleep(duration);
    let on_redis = store_scenarios::places(&store, &mut heard, pause, SETTLE).await;
    let on_memory = tokio::task::spawn_blocking(|| on_memory(memory_store::tests::places))
        .await
        .unwrap();
    agree(timeless(on_redis), timeless(on_memory));
}

#[tokio::test]
#[ignore = "needs redis-server on PATH (apt-get install redis-server): cargo test -- --include-ignored runs it"]
async fn a_fleets_windows_on_redis_are_what_they_are_on_the_in_memory_store() {
    let redis = RedisServer::start_required();
    let (store, mut heard) = store(&redis, "windows");
    store.connect().await.unwrap();
    let on_redis = store_scenarios::windows(&store, &mut heard, SETTLE).await;
    let on_memory = tokio::task::spawn_blocking(|| on_memory(memory_store::tests::windows))
        .await
        .unwrap();
    agree(timeless(on_redis), timeless(on_memory));
}
