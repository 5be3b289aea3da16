//! Scenarios of the store's protocol, written once against [`Store`] and run on both stores:
//! on the in-memory one on paused time (`memory_store`'s tests), and on a real `redis-server`
//! (`redis_store`'s). Each returns what the store answered and pushed, step by step, and the
//! Redis run checks that it is what the in-memory store answers: the two stores agree.

use std::future::Future;
use std::time::Duration;

use tokio::sync::mpsc::UnboundedReceiver;
use tower_resources_operation::adaptive::Window;

use crate::fleet::store::{Decision, Event, Known, Refresh, Store, Tick};

/// The capacity, lease TTL and claim timeout the scenarios' stores are made with.
pub(crate) const CAPACITY: usize = 2;
pub(crate) const TTL: Duration = Duration::from_secs(10);
pub(crate) const CLAIM: Duration = Duration::from_millis(200);

/// What was pushed since the last step, in order: waiting `settle` for it to arrive.
async fn pushed(heard: &mut UnboundedReceiver<Event>, settle: Duration) -> Vec<String> {
    let mut events = Vec::new();
    let until = tokio::time::Instant::now() + settle;
    while let Ok(Some(event)) = tokio::time::timeout_at(until, heard.recv()).await {
        // A connection's news, not the protocol's: Redis's client says so as it connects.
        if event != Event::Reconnected {
            events.push(format!("{event:?}"));
        }
    }
    events
}

/// Takes, queues, hands over, takes up, a claim that lapses taking its member's tickets with it,
/// a refresh that takes up a claim and reports the fleet's places, and a capacity raised.
/// `pause(d)` lets `d` pass on the store's clock; `settle` is how long a push takes to arrive.
pub(crate) async fn places<S, P, F>(
    store: &S,
    heard: &mut UnboundedReceiver<Event>,
    pause: P,
    settle: Duration,
) -> Vec<String>
where
    S: Store,
    P: Fn(Duration) -> F,
    F: Future<Output = ()>,
{
    let mut log = Vec::new();
    macro_rules! step {
        ($what:expr, $call:expr) => {{
            let answer = $call.await.expect($what);
            let pushed = pushed(heard, settle).await.join("; ");
            log.push(format!("{}: {answer:?} [{pushed}]", $what));
        }};
    }
    step!("state", store.state("m"));
    for id in ["a:1", "a:2", "b:1", "b:2", "c:1"] {
        step!(id, store.take(id));
    }
    step!("release a:1", store.release(&["a:1".to_owned()]));
    step!("b:1 takes its claim up", store.take("b:1"));
    step!("release a:2", store.release(&["a:2".to_owned()]));
    // b:2 never takes its claim up: its member is gone.
    pause(CLAIM + CLAIM / 2).await;
    step!("state after the claim lapsed", store.state("m"));
    let waiting = ["c:1".to_owned()];
    let refresh = Refresh {
        process: "c",
        held: &[],
        unheard: &[],
        waiting: &waiting,
    };
    step!("c refreshes", store.refresh(&refresh));
    step!("capacity 3", store.set_capacity(3));
    step!("d:1", store.take("d:1"));
    step!("state", store.state("m"));
    log
}

/// A process's tick: `ended` own ends and `congested` failures judged news against the
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

/// An adaptive fleet's windows: failures from before a decrease are stale however late they are
/// counted, a place handed over says the window it was handed over in, and a decision made
/// against a window that is no longer open (another decision crossed it) is dropped.
pub(crate) async fn windows<S: Store>(
    store: &S,
    heard: &mut UnboundedReceiver<Event>,
    settle: Duration,
) -> Vec<String> {
    let mut log = Vec::new();
    macro_rules! step {
        ($what:expr, $call:expr) => {{
            let answer = $call.await.expect($what);
            let pushed = pushed(heard, settle).await.join("; ");
            log.push(format!("{}: {answer:?} [{pushed}]", $what));
            answer
        }};
    }
    // `a` leads, and takes the first window (a failure makes it due): window 2 opens.
    step!("a ticks", store.tick(&tick("a", 0, 1, 1, 0)));
    // `b` counts a failure and an own end into window 2 before the leader decides.
    step!("b ticks", store.tick(&tick("b", 2, 1, 1, 0)));
    // The leader lowers the capacity: a window of its own opens (3), the first after it.
    let lowered = Known {
        epoch: 3,
        decreased: 3,
        ..Known::default()
    };
    let decision = Decision {
        leader: "a",
        window: 2,
        capacity: 1,
        known: lowered,
        handover: "",
    };
    step!("a lowers", store.decide(&decision));
    // The same decision again, crossed by the first: its window is no longer open.
    step!("a lowers again", store.decide(&decision));
    // `b` had not heard: its failure is stale. `a` judged its own against the decrease: news.
    step!("b ticks, unaware", store.tick(&tick("b", 2, 0, 1, 0)));
    step!("a ticks", store.tick(&tick("a", 3, 1, 1, 2)));
    // A place handed over says its window.
    step!("p:1", store.take("p:1"));
    step!("q:1", store.take("q:1"));
    step!("release p:1", store.release(&["p:1".to_owned()]));
    log
}
