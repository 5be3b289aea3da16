//! While the store is away: each member on its share, failing closed or open as told; and the
//! return, with places run on the shares made leases and a store that lost its data filled
//! again from the members' books.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tower_resources_operation::Rejection;

use super::{until, Fleet, TTL};
use crate::fleet::share::Unreachable;

#[tokio::test(start_paused = true)]
async fn with_the_store_away_each_member_runs_on_its_share_and_comes_back_on_the_fleets() {
    let fleet = Fleet::new(4);
    let members = [fleet.replica(), fleet.replica()];
    // Each has heard of the other (a refresh every third of the lease TTL).
    until("each knows of two members", TTL, || {
        members
            .iter()
            .all(|member| member.handle.member.share.replicas() == Some(2))
    })
    .await;
    fleet.store.set_away(true);
    let admitted = Arc::new(AtomicUsize::new(0));
    let mut waiters = Vec::new();
    for member in &members {
        for _ in 0..3 {
            waiters.push(member.waiter(&admitted));
        }
    }
    until("the shares are full", Duration::from_secs(1), || {
        admitted.load(Ordering::SeqCst) == 4
    })
    .await;
    for member in &members {
        assert_eq!(member.handle.member.running_on_share(), Some(2));
        assert_eq!(
            (member.active(), member.queued()),
            (2, 1),
            "its share, 4 over 2"
        );
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        admitted.load(Ordering::SeqCst),
        4,
        "never more than the fleet's capacity"
    );

    fleet.store.set_away(false);
    until("back on the fleet's capacity", TTL, || {
        members
            .iter()
            .all(|member| member.handle.member.running_on_share().is_none())
    })
    .await;
    // The places run on the shares are the fleet's leases now: the waiters still wait.
    assert_eq!(fleet.store.holders().len(), 4);
    assert_eq!(admitted.load(Ordering::SeqCst), 4);
    let first = waiters.remove(0).await.unwrap();
    drop(first);
    until("a waiter gets the place", Duration::from_secs(1), || {
        admitted.load(Ordering::SeqCst) == 5
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_store_that_lost_its_data_is_filled_again_from_the_members_books() {
    let fleet = Fleet::new(2);
    let member = fleet.replica();
    let places = [
        member.acquire().await.unwrap(),
        member.acquire().await.unwrap(),
    ];
    fleet.store.wipe();
    until("the leases are taken back", TTL, || {
        fleet.store.holders().len() == 2
    })
    .await;
    let lost = member
        .handle
        .member
        .counts
        .leases_lost
        .load(Ordering::SeqCst);
    assert_eq!(lost, 2, "each lost lease counted");
    drop(places);
    until("given back", TTL, || fleet.store.holders().is_empty()).await;
}

#[tokio::test(start_paused = true)]
async fn failing_closed_turns_away_and_failing_open_admits_without_the_limit_and_counts_it() {
    let fleet = Fleet::new(1);
    let closed = fleet.replica_with(|s| s.unreachable = Unreachable::Closed, None);
    let open = fleet.replica_with(|s| s.unreachable = Unreachable::Open, None);
    fleet.store.set_away(true);
    let refused = closed.acquire().await.err().expect("turned away");
    assert_eq!(refused.rejection(), Rejection::Unavailable);
    let admitted = [open.acquire().await.unwrap(), open.acquire().await.unwrap()];
    assert!(admitted.iter().all(|place| !place.is_limited()));
    let failed_open = open.handle.member.counts.failed_open.load(Ordering::SeqCst);
    assert_eq!(failed_open, 2);
}

#[tokio::test(start_paused = true)]
async fn a_member_that_never_reached_the_store_has_no_share() {
    let fleet = Fleet::new(4);
    let member = fleet.replica();
    fleet.store.set_away(true);
    let refused = member.acquire().await.err().expect("turned away");
    assert_eq!(refused.rejection(), Rejection::Unavailable);
}
