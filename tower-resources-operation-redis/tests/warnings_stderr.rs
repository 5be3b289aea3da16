//! The fleet limit's warnings reach a person in the default setup: a process with no `tracing`
//! subscriber (the `tracing` feature on or off) prints each on standard error, once. The test
//! runs itself again as a child process, which has no subscriber, and reads what it printed:
//!
//! - `ready()` says at startup that the capacity this replica was built with is not the
//!   fleet's, and that a replica with a fixed capacity joined a fleet whose capacity a
//!   controller sets, each once, before any operation;
//! - an outage is said once, with the address, the cause and the share the replica runs at,
//!   however many callers and probes meet it, and its end once.

mod support;

use std::process::{Command, Stdio};
use std::time::Duration;

use support::redis_server::RedisServer;
use support::replicas::{replica_or, this_test, REPLICA};
use tower_resources_operation::adaptive::{Adaptive, Vegas};
use tower_resources_operation::Acquire;
use tower_resources_operation_redis::RedisLimit;

const NAME: &str = "said-once";
const ADAPTIVE: &str = "said-once-adaptive";

/// The child: no subscriber is installed here.
fn child(_: support::replicas::Settings) {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
        .block_on(async {
            let mut redis = RedisServer::start_required();
            let build = |name: &'static str, capacity| {
                RedisLimit::builder(name, capacity)
                    .lease_ttl(Duration::from_secs(3))
                    .call_timeout(Duration::from_millis(200))
                    .fallback_poll(Duration::from_millis(200))
            };
            // The fleet's capacity is 3; this replica was built with 7: said at `ready`.
            let first = build(NAME, 3).build(redis.url()).unwrap();
            first.ready().await.unwrap();
            let later = build(NAME, 7).build(redis.url()).unwrap();
            later.ready().await.unwrap();
            eprintln!("MARK ready done {}", later.capacity());
            for _ in 0..5 {
                drop(later.acquire().await.unwrap());
            }
            // A controller sets this fleet's capacity: a fixed replica joining it is told.
            let adaptive = build(ADAPTIVE, 1)
                .adaptive(Adaptive::new(Vegas::default(), 1..=8))
                .build(redis.url())
                .unwrap();
            adaptive.ready().await.unwrap();
            tokio::time::sleep(Duration::from_millis(300)).await; // it ticks
            let fixed = build(ADAPTIVE, 4).build(redis.url()).unwrap();
            fixed.ready().await.unwrap();
            drop((adaptive, fixed, first));

            // An outage, met by many callers and probes: said once, then its end once.
            redis.stop();
            for _ in 0..20 {
                let _ = later.acquire().await;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            redis.restart();
            while !later.is_reachable() {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            eprintln!("MARK done");
        });
}

#[test]
#[ignore = "needs redis-server on PATH (apt-get install redis-server): cargo test -- --include-ignored runs it"]
fn without_a_subscriber_each_warning_is_printed_once_on_standard_error() {
    replica_or(child, || {
        let output = Command::new(std::env::current_exe().unwrap())
            .args([
                this_test().as_str(),
                "--exact",
                "--include-ignored",
                "--nocapture",
            ])
            .env(REPLICA, "child=1")
            .stdin(Stdio::null())
            .output()
            .expect("the child runs");
        let stderr = String::from_utf8_lossy(&output.stderr);
        println!("{stderr}");
        assert!(output.status.success(), "the child failed: {stderr}");
        let lines: Vec<&str> = stderr.lines().collect();
        let said = |what: &[&str]| -> Vec<&str> {
            lines
                .iter()
                .copied()
                .filter(|line| what.iter().all(|part| line.contains(part)))
                .collect()
        };
        let ready = lines
            .iter()
            .position(|line| line.contains("MARK ready done"))
            .expect("the child got past ready");

        let mismatch = said(&["WARN", "\"said-once\"", "capacity of 7", "is 3"]);
        assert_eq!(mismatch.len(), 1, "{mismatch:#?}");
        assert!(
            lines.iter().position(|line| *line == mismatch[0]) < Some(ready),
            "said at ready, before any operation"
        );
        let joined = said(&["WARN", "\"said-once-adaptive\"", "fixed capacity"]);
        assert_eq!(joined.len(), 1, "{joined:#?}");

        let outage = said(&["WARN", "\"said-once\"", "cannot be reached"]);
        assert_eq!(outage.len(), 1, "once, however many met it: {outage:#?}");
        assert!(
            outage[0].contains("127.0.0.1:"),
            "the address: {}",
            outage[0]
        );
        assert!(
            outage[0].contains("share") && outage[0].contains("3 over"),
            "the share it runs at: {}",
            outage[0]
        );
        let back = said(&["INFO", "\"said-once\"", "again"]);
        assert_eq!(back.len(), 1, "{back:#?}");
        assert!(stderr.contains("MARK done"));
    });
}
