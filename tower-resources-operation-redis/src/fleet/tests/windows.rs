//! An adaptive fleet's leader: the hand-over when it dies, and a decision that crosses one.

use std::sync::atomic::Ordering;
use std::time::Duration;

use tower_resources_operation::adaptive::{Adaptive, Vegas, Window};

use super::{until, Fleet, TTL};
use crate::fleet::control::AdaptiveSettings;
use crate::fleet::store::{Decision, Known, Store, Tick};

fn adaptive() -> Option<AdaptiveSettings> {
    Some(AdaptiveSettings {
        adaptive: Adaptive::new(Vegas::default(), 1..=8),
        tick: Duration::from_millis(50),
    })
}

#[tokio::test(start_paused = true)]
async fn when_the_leader_dies_another_member_leads_within_the_leaders_lease_and_keeps_the_capacity()
{
    let fleet = Fleet::new(4);
    let members: Vec<_> = (0..3)
        .map(|_| fleet.replica_with(|_| {}, adaptive()))
        .collect();
    until("one leads", Duration::from_secs(1), || {
        members
            .iter()
            .filter(|m| m.handle.member.control.as_ref().unwrap().leads())
            .count()
            == 1
    })
    .await;
    let leader = members
        .iter()
        .position(|m| m.handle.member.control.as_ref().unwrap().leads())
        .unwrap();
    let lease = members[leader]
        .handle
        .member
        .control
        .as_ref()
        .unwrap()
        .leader_ttl;
    let mut members = members;
    members.remove(leader).kill();
    until("another leads", lease + Duration::from_millis(200), || {
        members
            .iter()
            .any(|m| m.handle.member.control.as_ref().unwrap().leads())
    })
    .await;
    tokio::time::sleep(TTL).await;
    for member in &members {
        assert_eq!(member.handle.member.capacity.load(Ordering::SeqCst), 4);
    }
}

#[tokio::test(start_paused = true)]
async fn a_decision_the_old_leader_makes_after_the_hand_over_is_dropped() {
    let fleet = Fleet::new(4);
    let member = fleet.replica();
    let store = &member.handle.member.store;
    let lease = Duration::from_secs(1);
    let tick = |candidate, seen| Tick {
        candidate,
        leader_ttl: lease,
        seen,
        counts: Window::from_fields([("ended", 1), ("congested", 1)]),
        judged: 0,
        shortest: Duration::from_millis(100),
        longest: Duration::from_secs(1),
        tolerance: 0.0,
        starting: false,
    };
    let taken = store.tick(&tick("a", 0)).await.unwrap();
    assert!(taken.leads && taken.taken.is_some());
    // The old leader stalls past its lease; another member takes it, and a window.
    tokio::time::sleep(lease + Duration::from_millis(100)).await;
    let new = store.tick(&tick("b", taken.known.epoch)).await.unwrap();
    assert!(new.leads, "the lease lapsed: b leads");
    let late = Decision {
        leader: "a",
        window: taken.known.epoch,
        capacity: 1,
        known: Known {
            epoch: taken.known.epoch + 1,
            decreased: taken.known.epoch + 1,
            ..Known::default()
        },
        handover: "",
    };
    assert_eq!(store.decide(&late).await.unwrap(), None, "dropped");
    assert_eq!(store.state("c").await.unwrap().capacity, 4, "not lowered");
}
