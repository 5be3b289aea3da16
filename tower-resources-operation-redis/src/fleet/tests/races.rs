//! Interleavings that real servers cannot be made to reach in a test, made here by slowing one
//! member's calls on their way to the store.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tower_resources_operation::adaptive::{Adaptive, Vegas};

use super::{until, Fleet, CLAIM, TTL};
use crate::fleet::control::AdaptiveSettings;
use crate::fleet::store::{Event, Known};

/// An adaptive member that never ticks on its own: its windows are what the test says.
fn still() -> Option<AdaptiveSettings> {
    Some(AdaptiveSettings {
        adaptive: Adaptive::new(Vegas::default(), 1..=1),
        tick: Duration::from_secs(3600),
    })
}

/// Every member hears that the fleet is in window `epoch` now, and the store is.
fn window(fleet: &Fleet, epoch: u64) {
    fleet.store.set_epoch(epoch);
    fleet.store.announce(Event::Decided(Known {
        epoch,
        ..Known::default()
    }));
}

/// A waiter handed a place in window 5 whose claim lapses (its call came too late) waits again;
/// later, in window 9, its ticket gone, it asks again and is granted a place directly: it was
/// admitted in the window it knew as it asked, 9, not in the one its lapsed claim was handed
/// over in.
#[tokio::test(start_paused = true)]
async fn a_waiter_granted_directly_after_its_claim_lapsed_is_admitted_in_the_window_it_asked_in() {
    let fleet = Fleet::new(1);
    let (a, b, c) = (
        fleet.replica_with(|_| {}, still()),
        fleet.replica_with(|_| {}, still()),
        fleet.replica_with(|_| {}, still()),
    );
    window(&fleet, 5);
    let held = a.acquire().await.unwrap();
    let admitted = Arc::new(AtomicUsize::new(0));
    let waiter = b.waiter(&admitted);
    until("it queues", Duration::from_secs(1), || b.queued() == 1).await;
    let id = fleet.store.queue()[0].clone();
    let behind = c.waiter(&admitted);
    until("behind it", Duration::from_secs(1), || c.queued() == 1).await;
    // B's takes reach the store after its claim lapsed: the place goes to C's waiter.
    b.handle.member.store.set_latency("take", CLAIM + CLAIM / 2);
    drop(held);
    let behind = behind.await.unwrap();
    until("queued again", Duration::from_secs(1), || {
        fleet.store.queue() == vec![id.clone()]
    })
    .await;
    b.handle.member.store.set_latency("take", Duration::ZERO);
    window(&fleet, 9);
    fleet.store.drop_ticket(&id);
    drop(behind);
    let place = waiter.await.unwrap();
    assert_eq!(place.epoch, 9, "admitted in the window it knew as it asked");
}

/// A refresh that read a lease just before its permit let go reaches the store after the
/// release: the lease it names is gone, and the place free. It is neither counted lost nor taken
/// back: the place stays free for the waiter that asks next.
#[tokio::test(start_paused = true)]
async fn a_refresh_that_crosses_a_release_takes_nothing_back() {
    let fleet = Fleet::new(1);
    let (a, b) = (fleet.replica(), fleet.replica());
    let place = a.acquire().await.unwrap();
    // A's refreshes take a while on their way; its releases none.
    a.handle
        .member
        .store
        .set_latency("refresh", Duration::from_millis(50));
    let refresh = tokio::spawn({
        let member = Arc::clone(&a.handle.member);
        async move { member.refresh().await }
    });
    tokio::time::sleep(Duration::from_millis(10)).await;
    drop(place);
    until("released", Duration::from_secs(1), || {
        fleet.store.holders().is_empty()
    })
    .await;
    refresh.await.unwrap();
    assert_eq!(
        a.handle.member.counts.leases_lost.load(Ordering::SeqCst),
        0,
        "a lease let go is not lost"
    );
    assert!(fleet.store.holders().is_empty(), "nothing taken back");
    let next = b.acquire().await.unwrap();
    drop(next);
    until("given back", TTL, || fleet.store.holders().is_empty()).await;
}
