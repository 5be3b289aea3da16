//! The in-memory store on its own: the scenarios both stores run.

use super::*;
use crate::store_scenarios::{self, CAPACITY, CLAIM, TTL};

/// A member of a fresh in-memory store, as the scenarios' stores are made.
pub(crate) fn store() -> (MemoryStore, UnboundedReceiver<Event>) {
    let fleet = Arc::new(MemoryFleet::default());
    fleet.member(&Arc::from("scenarios"), CAPACITY, TTL, CLAIM, None)
}

/// The scenario of places on the in-memory store, on paused time.
pub(crate) async fn places() -> Vec<String> {
    let (store, mut heard) = store();
    let pause = |duration| tokio::time::sleep(duration);
    store_scenarios::places(&store, &mut heard, pause, Duration::from_millis(1)).await
}

/// The scenario of windows on the in-memory store, on paused time.
pub(crate) async fn windows() -> Vec<String> {
    let (store, mut heard) = store();
    store_scenarios::windows(&store, &mut heard, Duration::from_millis(1)).await
}

#[tokio::test(start_paused = true)]
async fn places_are_taken_queued_handed_over_and_a_lapsed_claim_takes_its_members_tickets() {
    let log = places().await;
    let said = |step: &str| log.iter().find(|line| line.starts_with(step)).unwrap();
    assert!(said("c:1").contains("Queued"), "{log:#?}");
    assert!(said("release a:1").contains(r#"Handed { window: 0, ids: ["b:1"] }"#));
    assert!(said("b:1 takes").contains("Granted"));
    assert!(said("release a:2").contains(r#"ids: ["b:2"]"#));
    // b's claim lapsed: b is gone, and the place went to c:1.
    assert!(said("state after").contains(r#"ids: ["c:1"]"#), "{log:#?}");
    assert!(said("c refreshes").contains("waiting: [Holds]"), "{log:#?}");
    assert!(said("capacity 3").contains("Capacity(3)"));
    assert!(said("d:1").contains("Granted"));
}

#[tokio::test(start_paused = true)]
async fn a_fleets_windows_keep_failures_from_before_a_decrease_stale_and_drop_a_crossed_decision() {
    let log = windows().await;
    let said = |step: &str| log.iter().find(|line| line.starts_with(step)).unwrap();
    assert!(said("a lowers:").contains("Some(1)"), "{log:#?}");
    assert!(said("a lowers again").contains("None"), "{log:#?}");
    let last_tick = said("a ticks: Ticked { capacity: 1");
    assert!(
        last_tick.contains("congested: 1") && last_tick.contains("stale: 2"),
        "{log:#?}"
    );
    assert!(
        said("release p:1").contains(r#"Handed { window: 4, ids: ["q:1"] }"#),
        "{log:#?}"
    );
}
