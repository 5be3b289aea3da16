//! The Redis store's scripts against a real `redis-server`: an adaptive limit's windows stay
//! exact although processes hear of a decision late (the rules in `fleet::store`).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};
use tower_resources_operation::adaptive::Window;

use super::{Keys, RedisStore, Settings, Transport};
use crate::fleet::control::Known;
use crate::fleet::store::{Answer, Decision, Event, Store, Tick};

#[allow(dead_code, unreachable_pub)]
#[path = "../../tests/support/redis_server.rs"]
mod redis_server;

use redis_server::RedisServer;

const TTL: Duration = Duration::from_secs(10);

fn store(redis: &RedisServer) -> (RedisStore, UnboundedReceiver<Event>) {
    let name: Arc<str> = Arc::from("windows");
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
        capacity: 4,
        lease_ttl: TTL,
        claim_timeout: Duration::from_secs(1),
        max_queued: None,
    };
    (RedisStore::new(name, keys, transport, settings), heard)
}

/// One process's tick: `ended` own ends and `congested` failures judged news against the
/// decrease of window `judged`, taken in window `seen`. Any failure makes the window due.
fn tick(candidate: &str, seen: u64, ended: u64, congested: u64, judged: u64) -> Tick<'_> {
    let counts = Window::from_fields([("ended", ended), ("congested", congested)]);
    Tick {
        candidate,
        leader_ttl: TTL,
        seen,
        counts,
        judged,
        shortest: Duration::from_millis(100),
        longest: Duration::from_secs(1),
        tolerance: 0.0,
        starting: false,
    }
}

/// The next event of `kind`, skipping the others.
async fn next(heard: &mut UnboundedReceiver<Event>, kind: fn(&Event) -> bool) -> Event {
    tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            let event = heard.recv().await.expect("the channel is open");
            if kind(&event) {
                return event;
            }
        }
    })
    .await
    .expect("the event within 5 s")
}

#[tokio::test]
#[ignore = "needs redis-server on PATH (apt-get install redis-server): cargo test -- --include-ignored runs it"]
async fn failures_from_before_a_decrease_are_stale_however_late_they_are_counted() {
    let redis = RedisServer::start_required();
    let (store, mut heard) = store(&redis);
    store.connect().await.unwrap();

    // Process `a` leads, and takes the first window (a failure makes it due).
    let first = store.tick(&tick("a", 0, 1, 1, 0)).await.unwrap();
    assert!(first.leads);
    assert_eq!(first.known.epoch, 2, "taken: window 2 opened");
    assert_eq!(first.taken.unwrap().counts.congested(), 1);

    // `b` counts a failure and an own end into window 2 before the leader decides on window 1.
    let counted = store.tick(&tick("b", 2, 1, 1, 0)).await.unwrap();
    assert!(!counted.leads && counted.taken.is_none());

    // The leader lowers the capacity: a window of its own opens (3), the first after the
    // decrease, and every process is told.
    let known = Known {
        epoch: 3,
        decreased: 3,
        ..Known::default()
    };
    let decision = Decision {
        leader: "a",
        window: 2,
        capacity: 2,
        known,
        handover: "",
    };
    assert_eq!(store.decide(&decision).await.unwrap(), Some(2));
    let Event::Decided(told) = next(&mut heard, |e| matches!(e, Event::Decided(_))).await else {
        unreachable!()
    };
    assert_eq!((told.epoch, told.decreased), (3, 3));

    // `b` had not heard: a failure it judged against no decrease is stale. `a` judged its own
    // against the decrease of window 2 (the one decided as window 3 opened): news.
    store.tick(&tick("b", 2, 0, 1, 0)).await.unwrap();
    let taken = store.tick(&tick("a", 3, 1, 1, 2)).await.unwrap();
    let counts = taken.taken.expect("a failure that is news: due").counts;
    let stale = counts.into_stale().into_next().fields();
    let stale = stale
        .iter()
        .find(|(name, _)| name == "stale")
        .map_or(0, |(_, v)| *v);
    assert_eq!(
        (counts.congested(), stale - counts.congested()),
        (1, 2),
        "news: `a`'s; stale: `b`'s counted before the decrease, and `b`'s judged too kindly"
    );
    assert_eq!(counts.ended(), 1, "window 2's own ends are not window 3's");
}

#[tokio::test]
#[ignore = "needs redis-server on PATH (apt-get install redis-server): cargo test -- --include-ignored runs it"]
async fn a_place_handed_over_says_the_window_it_was_handed_over_in() {
    let redis = RedisServer::start_required();
    let (store, mut heard) = store(&redis);
    store.connect().await.unwrap();
    // Window 2, by one tick that took the first.
    assert_eq!(
        store
            .tick(&tick("a", 0, 1, 1, 0))
            .await
            .unwrap()
            .known
            .epoch,
        2
    );
    for id in ["p:1", "p:2", "p:3", "p:4"] {
        assert_eq!(store.take(id).await.unwrap().answer, Answer::Granted);
    }
    assert_eq!(store.take("q:1").await.unwrap().answer, Answer::Queued);
    store.release(&["p:1".to_owned()]).await.unwrap();
    let handed = next(&mut heard, |e| matches!(e, Event::Handed { .. })).await;
    assert_eq!(
        handed,
        Event::Handed {
            window: 2,
            ids: vec!["q:1".to_owned()]
        }
    );
}
