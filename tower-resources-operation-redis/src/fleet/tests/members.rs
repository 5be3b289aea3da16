//! At most N across members, first come first served across members, and members that die:
//! with tickets queued, and holding places.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use super::{until, Fleet, CLAIM, TTL};

#[tokio::test(start_paused = true)]
async fn members_never_hold_more_than_the_capacity_and_are_served_first_come_first_served() {
    let fleet = Fleet::new(2);
    let replicas = [fleet.replica(), fleet.replica(), fleet.replica()];
    let holding: Vec<_> = vec![
        replicas[0].acquire().await.unwrap(),
        replicas[1].acquire().await.unwrap(),
    ];
    // Nine waiters, three per member, each queued before the next asks.
    let order = Arc::new(Mutex::new(Vec::new()));
    let running = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let mut waiters = Vec::new();
    for i in 0..9 {
        let replica = &replicas[i % 3];
        let queued = replica.queued();
        let handle = Arc::clone(&replica.handle);
        let (order, running, most) = (Arc::clone(&order), Arc::clone(&running), Arc::clone(&most));
        waiters.push(tokio::spawn(async move {
            let place = super::acquire(handle).await.unwrap();
            let now = running.fetch_add(1, Ordering::SeqCst) + 1;
            most.fetch_max(now, Ordering::SeqCst);
            order.lock().unwrap().push(i);
            tokio::time::sleep(Duration::from_millis(20)).await;
            running.fetch_sub(1, Ordering::SeqCst);
            drop(place);
        }));
        until("queued", Duration::from_secs(1), || {
            replica.queued() > queued
        })
        .await;
    }
    drop(holding);
    for waiter in waiters {
        waiter.await.unwrap();
    }
    assert_eq!(
        *order.lock().unwrap(),
        (0..9).collect::<Vec<_>>(),
        "in the order they asked"
    );
    assert!(
        most.load(Ordering::SeqCst) <= 2,
        "at most the capacity at once"
    );
    until("every place back", TTL, || fleet.store.holders().is_empty()).await;
}

#[tokio::test(start_paused = true)]
async fn a_member_killed_with_tickets_queued_stalls_nobody_past_a_claim_timeout() {
    let fleet = Fleet::new(1);
    let (survivor, victim, next) = (fleet.replica(), fleet.replica(), fleet.replica());
    let held = survivor.acquire().await.unwrap();
    let admitted = Arc::new(AtomicUsize::new(0));
    // The victim's three tickets first in line, then another member's.
    let _victims: Vec<_> = (0..3).map(|_| victim.waiter(&admitted)).collect();
    until("the victim queues", Duration::from_secs(1), || {
        victim.queued() == 3
    })
    .await;
    let waiting = next.waiter(&admitted);
    until("the next queues", Duration::from_secs(1), || {
        next.queued() == 1
    })
    .await;
    victim.kill();
    let released = Instant::now();
    drop(held);
    let place = waiting.await.unwrap();
    let stalled = released.elapsed();
    assert!(
        stalled < CLAIM * 2,
        "the place handed to a dead member's ticket came back within its claim timeout: {stalled:?}"
    );
    drop(place);
}

#[tokio::test(start_paused = true)]
async fn a_member_killed_holding_every_place_stalls_the_fleet_a_lease_ttl_and_reads_as_unheard() {
    let fleet = Fleet::new(2);
    let (victim, survivor) = (fleet.replica(), fleet.replica());
    let held = [
        victim.acquire().await.unwrap(),
        victim.acquire().await.unwrap(),
    ];
    let admitted = Arc::new(AtomicUsize::new(0));
    let waiting = survivor.waiter(&admitted);
    until("it queues", Duration::from_secs(1), || {
        survivor.queued() == 1
    })
    .await;
    victim.kill();
    let killed = Instant::now();
    // What the survivor reads meanwhile: the dead member's places, as held by a member not
    // heard from.
    let member = Arc::clone(&survivor.handle.member);
    let unheard = tokio::spawn(async move {
        let mut most = 0;
        while member.counts.active.load(Ordering::SeqCst) == 0 {
            most = most.max(member.places.unheard.load(Ordering::SeqCst));
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        most
    });
    let place = waiting.await.unwrap();
    let stalled = killed.elapsed();
    assert!(
        stalled <= TTL + TTL / 3,
        "within a lease TTL and a refresh of the kill: {stalled:?}"
    );
    assert_eq!(
        unheard.await.unwrap(),
        2,
        "read as held by a member not heard from"
    );
    std::mem::forget(held);
    drop(place);
}

#[tokio::test(start_paused = true)]
async fn raising_the_capacity_admits_waiters_at_once_and_lowering_it_revokes_nobody() {
    let fleet = Fleet::new(1);
    let (a, b) = (fleet.replica(), fleet.replica());
    let first = a.acquire().await.unwrap();
    let admitted = Arc::new(AtomicUsize::new(0));
    let waiters: Vec<_> = (0..2).map(|_| b.waiter(&admitted)).collect();
    until("queued", Duration::from_secs(1), || b.queued() == 2).await;
    a.handle.member.set_capacity(3).await.unwrap();
    until("admitted at once", Duration::from_millis(50), || {
        admitted.load(Ordering::SeqCst) == 2
    })
    .await;
    let mut places = vec![first];
    for waiter in waiters {
        places.push(waiter.await.unwrap());
    }
    // Lowered below what runs: nobody is revoked, and the places come out as they end.
    a.handle.member.set_capacity(1).await.unwrap();
    assert_eq!(fleet.store.holders().len(), 3);
    assert_eq!(a.active() + b.active(), 3);
    let admitted = Arc::new(AtomicUsize::new(0));
    let late = b.waiter(&admitted);
    until("queued", Duration::from_secs(1), || b.queued() == 1).await;
    places.pop();
    places.pop();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        admitted.load(Ordering::SeqCst),
        0,
        "still at the capacity of 1"
    );
    places.pop();
    drop(late.await.unwrap());
}

#[tokio::test(start_paused = true)]
async fn the_first_member_stores_the_capacity_and_a_later_one_built_otherwise_keeps_it() {
    let fleet = Fleet::new(3);
    let first = fleet.replica();
    first.handle.member.connect().await.unwrap();
    let later = fleet.replica_with(|settings| settings.capacity = 5, None);
    later.handle.member.connect().await.unwrap();
    assert_eq!(later.handle.member.capacity.load(Ordering::SeqCst), 3);
    let overwriting = fleet.replica_with(
        |settings| {
            settings.capacity = 5;
            settings.overwrite = true;
        },
        None,
    );
    overwriting.handle.member.connect().await.unwrap();
    first.handle.member.state().await.unwrap();
    assert_eq!(first.handle.member.capacity.load(Ordering::SeqCst), 5);
}

#[tokio::test(start_paused = true)]
async fn a_waiter_that_goes_away_leaves_no_ticket_and_one_handed_a_place_as_it_goes_gives_it_back()
{
    let fleet = Fleet::new(1);
    let (a, b) = (fleet.replica(), fleet.replica());
    let holding = a.acquire().await.unwrap();
    let admitted = Arc::new(AtomicUsize::new(0));
    let gone = b.waiter(&admitted);
    until("queued", Duration::from_secs(1), || b.queued() == 1).await;
    gone.abort();
    until("its ticket gone", Duration::from_secs(1), || {
        fleet.store.queue().is_empty()
    })
    .await;
    assert_eq!(b.queued(), 0);
    // One that goes away just as the place is handed to it gives the place back too.
    let racing = b.waiter(&admitted);
    until("queued", Duration::from_secs(1), || b.queued() == 1).await;
    drop(holding);
    racing.abort();
    until("every place back", TTL, || fleet.store.holders().is_empty()).await;
    assert_eq!((a.active(), b.active()), (0, 0));
    drop(a.acquire().await.unwrap());
}

#[tokio::test(start_paused = true)]
async fn a_lost_lease_whose_place_was_given_to_another_is_counted_and_never_taken_back() {
    let fleet = Fleet::new(1);
    let (a, b) = (fleet.replica(), fleet.replica());
    let running = a.acquire().await.unwrap();
    // The store forgets the lease (a restart without persistence), and the place looks free.
    fleet.store.wipe();
    let taken = b.acquire().await.unwrap();
    until("the loss seen", TTL, || {
        a.handle.member.counts.leases_lost.load(Ordering::SeqCst) == 1
    })
    .await;
    assert_eq!(fleet.store.holders().len(), 1, "the place is given once");
    // The operation that lost its lease runs on; its end gives back nothing of another's.
    drop(running);
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(fleet.store.holders().len(), 1);
    drop(taken);
    until("every place back", TTL, || fleet.store.holders().is_empty()).await;
}
