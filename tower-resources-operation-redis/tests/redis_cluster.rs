//! The fleet limit on a real Redis Cluster (three masters and a replica of each, on loopback,
//! made with `redis-cli --cluster create`), reached through the cluster client (feature
//! `cluster`): every key of a limit shares one hash slot, so one shard serves it.
//!
//! - at most N at once, and first come, first served;
//! - the master serving the limit's slot killed under a stream of callers: none hangs, each
//!   gets the configured answer while the shard has no master, and once its replica is
//!   promoted the limit serves again, at most N at once. What a failover loses, and why, is
//!   printed (and said in the crate docs): the replication is asynchronous, so leases and
//!   tickets written to the old master just before it died may be missing on the new one.
#![cfg(feature = "cluster")]

mod support;

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use support::redis_cluster::RedisCluster;
use support::within;
use tower_resources_operation::Acquire;
use tower_resources_operation_redis::{Address, RedisLimit, RedisLimitBuilder, Unreachable};

/// One cluster at a time in this binary: six servers each, on two cores.
static ONE_CLUSTER: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn limit(cluster: &RedisCluster, name: &'static str, capacity: usize) -> RedisLimitBuilder {
    let _ = cluster;
    RedisLimit::builder(name, capacity)
        .lease_ttl(Duration::from_secs(6))
        .call_timeout(Duration::from_millis(500))
        .fallback_poll(Duration::from_millis(400))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs redis-server and redis-cli on PATH (apt-get install redis-server): cargo test --all-features -- --include-ignored runs it"]
async fn on_a_redis_cluster_it_admits_at_most_n_first_come_first_served() {
    let _one = ONE_CLUSTER.lock().await;
    let cluster = RedisCluster::start(Duration::from_millis(1_000));
    let address = Address::cluster(cluster.urls());
    let judges = limit(&cluster, "cluster-judges", 2)
        .build(address.clone())
        .unwrap();
    judges.ready().await.unwrap();
    assert!(
        judges.address().contains("cluster of"),
        "{}",
        judges.address()
    );

    // First come, first served: two places held, four waiters in order of arrival.
    let held = [
        within("a place", judges.acquire()).await.unwrap(),
        within("a place", judges.acquire()).await.unwrap(),
    ];
    let order = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut waiters = Vec::new();
    for index in 0..4 {
        let (waiting, order) = (judges.clone(), Arc::clone(&order));
        waiters.push(tokio::spawn(async move {
            let permit = waiting.acquire().await.unwrap();
            order.lock().unwrap().push(index);
            tokio::time::sleep(Duration::from_millis(50)).await;
            drop(permit);
        }));
        within("queued", async {
            while judges.queued() < index + 1 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await;
    }
    // One place at a time, so that each handover is heard before the next.
    let [first, second] = held;
    drop(first);
    within("the first admitted", async {
        while order.lock().unwrap().is_empty() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    drop(second);
    for waiter in waiters {
        within("a waiter", waiter).await.unwrap();
    }
    assert_eq!(*order.lock().unwrap(), [0, 1, 2, 3], "in order of arrival");

    // At most 2 at once, through a burst from two handles (two connections).
    let other = limit(&cluster, "cluster-judges", 2).build(address).unwrap();
    let running = Arc::new(AtomicI64::new(0));
    let most = Arc::new(AtomicI64::new(0));
    let burst: Vec<_> = (0..40)
        .map(|i| {
            let limit = if i % 2 == 0 {
                judges.clone()
            } else {
                other.clone()
            };
            let (running, most) = (Arc::clone(&running), Arc::clone(&most));
            tokio::spawn(async move {
                let permit = limit.acquire().await.unwrap();
                let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(now, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(10)).await;
                running.fetch_sub(1, Ordering::SeqCst);
                drop(permit);
            })
        })
        .collect();
    for operation in burst {
        within("the burst", operation).await.unwrap();
    }
    let most = most.load(Ordering::SeqCst);
    println!("on the cluster: at most {most} at once");
    assert!((1..=2).contains(&most), "{most} at once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs redis-server and redis-cli on PATH (apt-get install redis-server): cargo test --all-features -- --include-ignored runs it"]
async fn a_master_failed_over_under_a_stream_of_callers_hangs_nobody_and_the_limit_serves_again() {
    const NAME: &str = "cluster-failover";
    const CAPACITY: usize = 4;
    let _one = ONE_CLUSTER.lock().await;
    let mut cluster = RedisCluster::start(Duration::from_millis(1_000));
    let share = limit(&cluster, NAME, CAPACITY)
        .build(Address::cluster(cluster.urls()))
        .unwrap();
    let closed = limit(&cluster, NAME, CAPACITY)
        .when_unreachable(Unreachable::Closed)
        .build(Address::cluster(cluster.urls()))
        .unwrap();
    share.ready().await.unwrap();
    closed.ready().await.unwrap();

    let stop = Arc::new(AtomicBool::new(false));
    let running = Arc::new(AtomicI64::new(0));
    let most_after = Arc::new(AtomicI64::new(0));
    let settled = Arc::new(AtomicBool::new(false));
    // admitted, turned away, for each of the two
    let counts: Arc<[AtomicU64; 4]> = Arc::default();
    let callers: Vec<_> = (0..8)
        .map(|i| {
            let limit = if i % 2 == 0 {
                share.clone()
            } else {
                closed.clone()
            };
            let slot = (i % 2) * 2;
            let (stop, running, most_after, settled, counts) = (
                Arc::clone(&stop),
                Arc::clone(&running),
                Arc::clone(&most_after),
                Arc::clone(&settled),
                Arc::clone(&counts),
            );
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    match limit.acquire().await {
                        Ok(permit) => {
                            let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                            if settled.load(Ordering::SeqCst) {
                                most_after.fetch_max(now, Ordering::SeqCst);
                            }
                            tokio::time::sleep(Duration::from_millis(20)).await;
                            running.fetch_sub(1, Ordering::SeqCst);
                            drop(permit);
                            counts[slot].fetch_add(1, Ordering::Relaxed);
                        }
                        Err(_) => {
                            counts[slot + 1].fetch_add(1, Ordering::Relaxed);
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                    }
                }
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(800)).await;

    let key = format!("{{tro:{NAME}}}");
    let master = cluster.master_of(&key);
    let before: Vec<u64> = counts.iter().map(|c| c.load(Ordering::Relaxed)).collect();
    let killed = Instant::now();
    cluster.kill(master);
    let promoted = tokio::task::spawn_blocking({
        let key = key.clone();
        // The cluster is moved into the blocking task and back.
        move || {
            let port = cluster.failed_over(&key, master);
            (cluster, port)
        }
    });
    let (cluster, new_master) = within("the failover", promoted).await.unwrap();
    let failed_over = killed.elapsed();
    // Back on the fleet limit, every handle.
    within("served again", async {
        while !(share.is_reachable() && closed.is_reachable() && !share.is_on_share()) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    let back = killed.elapsed();
    let during: Vec<u64> = counts
        .iter()
        .zip(&before)
        .map(|(c, before)| c.load(Ordering::Relaxed) - before)
        .collect();
    // Places held before the kill may still run: at most N once they have ended.
    tokio::time::sleep(Duration::from_millis(200)).await;
    settled.store(true, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    stop.store(true, Ordering::Relaxed);
    for caller in callers {
        within("a caller", caller).await.unwrap();
    }
    let most = most_after.load(Ordering::SeqCst);
    let fleet = share.fleet().await.unwrap();
    println!(
        "the master {master} killed: {new_master} promoted after {failed_over:?}, the limit back \
         after {back:?}; meanwhile on its share {} admitted and {} turned away, failing closed {} \
         admitted and {} turned away; leases lost {} and {}; then at most {most} at once; {fleet:?}",
        during[0],
        during[1],
        during[2],
        during[3],
        share.leases_lost(),
        closed.leases_lost(),
    );
    drop(cluster);
    assert!(most <= CAPACITY as i64, "{most} at once after the failover");
    assert!(during[0] > 0, "the replica on its share served meanwhile");
    assert_eq!(during[1], 0, "nobody turned away on the share");
    assert!(
        during[3] > 0,
        "failing closed, callers were turned away meanwhile"
    );
    let after: Vec<u64> = counts.iter().map(|c| c.load(Ordering::Relaxed)).collect();
    assert!(
        after[0] > before[0] + during[0] && after[2] > before[2] + during[2],
        "served again"
    );
}
