//! A verifier subprocess under the layer, on a real axum server on 127.0.0.1, whose caller hangs
//! up while it runs. tokio does not kill a child when its handle is dropped, so a handler that
//! spawns one without `kill_on_drop(true)` leaves it running after its request is gone: work the
//! limit no longer sees (`active` counts places, and the place went back with the request). With
//! `kill_on_drop(true)`, as every example and doc snippet of the crate sets it, the process ends
//! with its operation.
#![cfg(unix)]

mod support;

use std::time::{Duration, Instant};

use axum::routing::get;
use axum::Router;
use tokio::sync::mpsc;

use support::http::{get_request, serve, Client};
use support::{live, Telemetry};
use tower_resources_operation::names::{DURATION_INSTRUMENT, OPERATION_ATTRIBUTE};
use tower_resources_operation::{Executor, Limit, Operation, ResourcesOperationLayer};

/// Whether process `pid` still runs: its `/proc` entry is there and it is not a zombie.
fn running(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    // The state follows the command, which is in parentheses.
    let state = stat
        .rsplit(')')
        .next()
        .and_then(|rest| rest.split_whitespace().next());
    !matches!(state, Some("Z" | "X"))
}

/// Waits until nothing waits or runs (the hung-up operation has ended), for at most 10 s after
/// `hung_up`.
async fn until_idle(t: &Telemetry, hung_up: Instant) {
    while live(t) != (0, 0) {
        assert!(hung_up.elapsed() < Duration::from_secs(10), "{:?}", live(t));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A `/verify` route whose handler runs `sleep 3` under a layer on a limit of 2, reporting each
/// child's id on `pids`; the request is sent, and its caller hangs up once the child runs.
/// Returns the child's id.
async fn hang_up_on_a_running_verifier(t: &Telemetry, limit: &Limit, kill_on_drop: bool) -> u32 {
    let (pids, mut started) = mpsc::unbounded_channel();
    let verify = get(move || {
        let pids = pids.clone();
        async move {
            let mut command = tokio::process::Command::new("sleep");
            command.arg("3").kill_on_drop(kill_on_drop);
            let child = command.spawn().expect("sleep runs");
            pids.send(child.id().expect("a running child")).unwrap();
            let output = child.wait_with_output().await.expect("the verifier ends");
            if output.status.success() {
                "verified"
            } else {
                "failed"
            }
        }
    });
    let app = Router::new().route(
        "/verify",
        verify.layer(
            ResourcesOperationLayer::new_for_http(limit.clone())
                .operation(Operation::Verify)
                .executor(Executor::Subprocess)
                .metrics(t.metrics.clone()),
        ),
    );
    let addr = serve(app).await;
    let mut client = Client::open(addr).await;
    let answer = client.send(get_request("/verify")).await;
    let pid = started.recv().await.expect("the verifier started");
    assert!(running(pid));
    assert_eq!(live(t), (0, 1), "the verifier holds its place");
    // The caller hangs up: hyper drops the request's future, and the handler's with it.
    drop(answer);
    client.hang_up();
    pid
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_verifier_spawned_with_kill_on_drop_ends_with_its_operation_when_the_caller_hangs_up() {
    let t = Telemetry::new();
    let limit = Limit::new(2);
    let pid = hang_up_on_a_running_verifier(&t, &limit, true).await;
    let hung_up = Instant::now();
    while running(pid) {
        assert!(
            hung_up.elapsed() < Duration::from_millis(100),
            "the verifier still runs 100 ms after its caller hung up"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Its place is back, and the operation ended as its caller did.
    until_idle(&t, hung_up).await;
    assert_eq!(limit.available(), 2);
    assert_eq!(
        t.outcomes(&[(OPERATION_ATTRIBUTE, "verify")]),
        support::only("cancelled")
    );
    assert_eq!(t.count(DURATION_INSTRUMENT, &[]), 1);
}

/// The trap the docs warn of: without `kill_on_drop(true)` the child outlives its request, while
/// the limit reads its place as free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_kill_on_drop_a_verifier_outlives_its_operation() {
    let t = Telemetry::new();
    let limit = Limit::new(2);
    let pid = hang_up_on_a_running_verifier(&t, &limit, false).await;
    let hung_up = Instant::now();
    until_idle(&t, hung_up).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(running(pid), "tokio does not kill a dropped child");
    assert_eq!(limit.available(), 2, "the limit no longer sees it");
    let _ = std::process::Command::new("kill")
        .arg(pid.to_string())
        .status();
}
