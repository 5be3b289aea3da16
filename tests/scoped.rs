//! `resources_operation`: NeMo Gym's context manager for work that is not a tower service; and
//! parsing the attribute values.

mod support;

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::str::FromStr;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;

use support::{live, only, panic_message, settle, Telemetry};
use tokio::sync::{oneshot, Semaphore};
use tokio_test::{assert_pending, assert_ready, task};
use tower::BoxError;
use tower_resources_operation::names::{
    DURATION_INSTRUMENT, OPERATION_ATTRIBUTE, QUEUE_DURATION_INSTRUMENT, REJECTED_INSTRUMENT,
    REJECTION_ATTRIBUTE,
};
use tower_resources_operation::{
    resources_operation, set_outcome, ConfigError, Executor, Operation, OperationMetrics, Outcome,
    Rejected, Rejection,
};

const TOLERANCE_MS: f64 = 3.0;

fn assert_close(actual: f64, expected: f64, what: &str) {
    assert!(
        (actual - expected).abs() <= TOLERANCE_MS,
        "{what}: {actual} ms, expected {expected} ms (± {TOLERANCE_MS})"
    );
}

fn outcomes(t: &Telemetry) -> BTreeMap<String, u64> {
    t.outcomes(&[])
}

// ---------------------------------------------------------------------------------------------
// Output and outcomes
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn returns_the_output_of_the_work() {
    let t = Telemetry::new();
    let limit = Semaphore::new(1);
    let output: Result<&str, Infallible> = t
        .metrics
        .resources_operation(&limit, Operation::Verify, Executor::Inline, async {
            Ok("verdict")
        })
        .await
        .unwrap();
    assert_eq!(output, Ok("verdict"));
    let unit: () = t
        .metrics
        .resources_operation(&limit, Operation::Verify, Executor::Inline, async {})
        .await
        .unwrap();
    assert_eq!(unit, ());
    assert_eq!(
        outcomes(&t),
        BTreeMap::from([("ok".to_owned(), 2)]),
        "a `()` output is ok too"
    );
    assert_eq!(limit.available_permits(), 1);
}

#[tokio::test]
async fn ok_output_is_ok() {
    let t = Telemetry::new();
    let limit = Semaphore::new(1);
    let output = t
        .metrics
        .resources_operation(&limit, Operation::Tool, Executor::Thread, async {
            Ok::<_, BoxError>(1)
        })
        .await
        .unwrap();
    assert_eq!(output.unwrap(), 1);
    assert_eq!(outcomes(&t), only("ok"));
}

#[tokio::test]
async fn err_output_is_error() {
    let t = Telemetry::new();
    let limit = Semaphore::new(1);
    let output = t
        .metrics
        .resources_operation(&limit, Operation::Tool, Executor::Thread, async {
            Err::<(), BoxError>("boom".into())
        })
        .await
        .unwrap();
    assert_eq!(output.unwrap_err().to_string(), "boom");
    assert_eq!(outcomes(&t), only("error"));
}

#[tokio::test(start_paused = true)]
async fn tokio_elapsed_error_output_is_timeout() {
    let t = Telemetry::new();
    let limit = Semaphore::new(1);
    let output = t
        .metrics
        .resources_operation(
            &limit,
            Operation::Judge,
            Executor::Process,
            tokio::time::timeout(
                Duration::from_millis(100),
                tokio::time::sleep(Duration::from_secs(10)),
            ),
        )
        .await
        .unwrap();
    assert!(output.is_err());
    assert_eq!(outcomes(&t), only("timeout"));
}

#[tokio::test]
async fn dropped_while_running_is_cancelled() {
    let t = Telemetry::new();
    let limit = Semaphore::new(1);
    let mut op = task::spawn(t.metrics.resources_operation(
        &limit,
        Operation::Verify,
        Executor::Subprocess,
        std::future::pending::<Result<(), Infallible>>(),
    ));
    assert_pending!(op.poll());
    assert_eq!(live(&t), (0, 1));
    drop(op);

    assert_eq!(outcomes(&t), only("cancelled"));
    assert_eq!(live(&t), (0, 0));
    assert_eq!(limit.available_permits(), 1);
}

#[tokio::test]
async fn dropped_while_waiting_records_nothing_and_leaves_the_queue() {
    let t = Telemetry::new();
    let limit = Semaphore::new(1);
    let held = limit.try_acquire().unwrap();

    let mut op = task::spawn(t.metrics.resources_operation(
        &limit,
        Operation::Verify,
        Executor::Subprocess,
        async { Ok::<_, Infallible>(()) },
    ));
    assert_pending!(op.poll());
    assert_eq!(live(&t), (1, 0), "it counts as queued while it waits");
    drop(op);

    assert_eq!(live(&t), (0, 0), "a dropped waiter leaves the queue");
    assert_eq!(t.count(QUEUE_DURATION_INSTRUMENT, &[]), 0);
    assert_eq!(t.count(DURATION_INSTRUMENT, &[]), 0);
    drop(held);
    assert_eq!(limit.available_permits(), 1);
}

#[tokio::test]
async fn panic_in_the_work_is_crashed_and_propagates() {
    let t = Telemetry::new();
    let limit = Arc::new(Semaphore::new(1));
    let (metrics, sem) = (t.metrics.clone(), limit.clone());
    let error = tokio::spawn(async move {
        metrics
            .resources_operation(&sem, Operation::Tool, Executor::Inline, async {
                tokio::task::yield_now().await;
                if true {
                    panic!("work panicked: {}", 3);
                }
                Ok::<_, Infallible>(())
            })
            .await
    })
    .await
    .unwrap_err();

    assert!(error.is_panic());
    assert_eq!(panic_message(&*error.into_panic()), "work panicked: 3");
    assert_eq!(outcomes(&t), only("crashed"));
    assert_eq!(live(&t), (0, 0));
    assert_eq!(limit.available_permits(), 1);
}

#[tokio::test]
async fn set_outcome_inside_the_work_wins() {
    let t = Telemetry::new();
    let limit = Semaphore::new(1);
    let output = t
        .metrics
        .resources_operation(&limit, Operation::Verify, Executor::Subprocess, async {
            tokio::task::yield_now().await;
            let set = set_outcome(Outcome::Timeout);
            tokio::task::yield_now().await;
            Ok::<_, Infallible>(set)
        })
        .await;
    assert!(
        output.unwrap().unwrap(),
        "set_outcome returns true inside the work"
    );
    assert_eq!(outcomes(&t), only("timeout"));
}

#[tokio::test]
async fn set_outcome_inside_the_work_wins_over_an_error() {
    let t = Telemetry::new();
    let limit = Semaphore::new(1);
    let output = t
        .metrics
        .resources_operation(&limit, Operation::Verify, Executor::Subprocess, async {
            set_outcome(Outcome::Cancelled);
            Err::<(), BoxError>("boom".into())
        })
        .await
        .unwrap();
    assert!(output.is_err());
    assert_eq!(outcomes(&t), only("cancelled"));
}

#[tokio::test]
async fn disabled_metrics_run_the_work_inside_the_limit_and_record_nothing() {
    let limit = Semaphore::new(1);
    let set = OperationMetrics::disabled()
        .resources_operation(&limit, Operation::Verify, Executor::Inline, async {
            assert_eq!(limit.available_permits(), 0, "inside the limit");
            Ok::<_, Infallible>(set_outcome(Outcome::Timeout))
        })
        .await
        .unwrap();
    assert!(!set.unwrap(), "nothing to set when disabled");
    assert_eq!(limit.available_permits(), 1);
}

#[tokio::test]
async fn disabled_work_is_transparent_to_set_outcome_of_the_enabled_work_around_it() {
    let t = Telemetry::new();
    let (outer_limit, inner_limit) = (Semaphore::new(1), Semaphore::new(1));
    let output = t
        .metrics
        .resources_operation(&outer_limit, Operation::Verify, Executor::Inline, async {
            OperationMetrics::disabled()
                .resources_operation(&inner_limit, Operation::Tool, Executor::Inline, async {
                    Ok::<_, Infallible>(set_outcome(Outcome::Timeout))
                })
                .await
                .unwrap()
        })
        .await;
    assert!(
        output.unwrap().unwrap(),
        "the enclosing enabled operation takes the outcome"
    );
    assert_eq!(outcomes(&t), only("timeout"));
}

// ---------------------------------------------------------------------------------------------
// The limit
// ---------------------------------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn waits_for_the_limit_and_records_the_wait() {
    let t = Telemetry::new();
    let limit = Arc::new(Semaphore::new(1));
    let run = |operation: Operation, ms: u64| {
        let (metrics, limit) = (t.metrics.clone(), limit.clone());
        tokio::spawn(async move {
            metrics
                .resources_operation(&limit, operation, Executor::Inline, async move {
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                    Ok::<_, Infallible>(ms)
                })
                .await
        })
    };

    let first = run(Operation::Verify, 300);
    settle().await;
    let second = run(Operation::Judge, 250);
    settle().await;
    assert_eq!(live(&t), (1, 1), "the second waits for the first");

    assert_eq!(first.await.unwrap().unwrap().unwrap(), 300);
    assert_eq!(second.await.unwrap().unwrap().unwrap(), 250);

    let verify = [(OPERATION_ATTRIBUTE, "verify")];
    let judge = [(OPERATION_ATTRIBUTE, "judge")];
    assert_eq!(t.count(QUEUE_DURATION_INSTRUMENT, &verify), 1);
    assert_eq!(t.sum(QUEUE_DURATION_INSTRUMENT, &verify), 0.0);
    assert_eq!(t.count(QUEUE_DURATION_INSTRUMENT, &judge), 1);
    assert_close(
        t.sum(QUEUE_DURATION_INSTRUMENT, &judge),
        300.0,
        "second's wait",
    );
    assert_close(t.sum(DURATION_INSTRUMENT, &verify), 300.0, "first's run");
    assert_close(t.sum(DURATION_INSTRUMENT, &judge), 250.0, "second's run");
    assert_eq!(live(&t), (0, 0));
}

#[tokio::test]
async fn an_arc_semaphore_works_as_the_limit() {
    let t = Telemetry::new();
    let limit: Arc<Semaphore> = Arc::new(Semaphore::new(2));
    let output = t
        .metrics
        .resources_operation(&limit, Operation::Other, Executor::Other, async {
            Ok::<_, Infallible>(limit.available_permits())
        })
        .await
        .unwrap();
    assert_eq!(output.unwrap(), 1, "one of the two permits was taken");
    assert_eq!(limit.available_permits(), 2);
    assert_eq!(outcomes(&t), only("ok"));
}

#[tokio::test]
async fn a_semaphore_closed_before_the_call_turns_the_operation_away_as_unavailable() {
    let t = Telemetry::new();
    let limit = Arc::new(Semaphore::new(1));
    limit.close();
    let answer = t
        .metrics
        .resources_operation(&limit, Operation::Verify, Executor::Inline, async {
            Ok::<_, Infallible>(())
        })
        .await;

    assert_eq!(answer, Err(Rejected::new(Rejection::Unavailable)));
    assert_eq!(
        t.live_value(REJECTED_INSTRUMENT, &[(REJECTION_ATTRIBUTE, "unavailable")]),
        1
    );
    assert_eq!(live(&t), (0, 0));
    assert_eq!(t.count(QUEUE_DURATION_INSTRUMENT, &[]), 0);
}

#[tokio::test]
async fn a_semaphore_closed_while_waiting_wakes_the_waiter_to_unavailable_instead_of_hanging() {
    let t = Telemetry::new();
    let limit = Arc::new(Semaphore::new(1));
    let held = limit.clone().try_acquire_owned().unwrap();
    let (metrics, sem) = (t.metrics.clone(), limit.clone());
    let waiter = tokio::spawn(async move {
        metrics
            .resources_operation(&sem, Operation::Verify, Executor::Inline, async {
                Ok::<_, Infallible>(())
            })
            .await
    });
    settle().await;
    assert_eq!(live(&t), (1, 0));

    limit.close();
    let answer = support::within("the woken waiter", waiter).await.unwrap();
    assert_eq!(answer, Err(Rejected::new(Rejection::Unavailable)));
    assert_eq!(live(&t), (0, 0), "the waiter left the queue");
    assert_eq!(t.count(QUEUE_DURATION_INSTRUMENT, &[]), 0);
    drop(held);
}

#[tokio::test]
async fn free_function_returns_the_output_and_limits() {
    let limit = Semaphore::new(1);
    let (release, rx) = oneshot::channel::<()>();

    let mut first = task::spawn(resources_operation(
        &limit,
        Operation::Verify,
        Executor::Subprocess,
        async {
            rx.await.unwrap();
            Ok::<_, Infallible>("first")
        },
    ));
    let mut second = task::spawn(resources_operation(
        &limit,
        Operation::Verify,
        Executor::Subprocess,
        async { Ok::<_, Infallible>("second") },
    ));
    assert_pending!(first.poll());
    assert_pending!(second.poll());
    assert_eq!(limit.available_permits(), 0);

    release.send(()).unwrap();
    assert!(first.is_woken());
    assert_eq!(assert_ready!(first.poll()), Ok(Ok("first")));
    assert!(second.is_woken(), "the freed permit wakes the waiter");
    assert_eq!(assert_ready!(second.poll()), Ok(Ok("second")));
    assert_eq!(limit.available_permits(), 1);
}

// ---------------------------------------------------------------------------------------------
// Parsing attribute values
// ---------------------------------------------------------------------------------------------

/// The error of parsing `input` as a `T`, checked to be about `attribute` and to name every one
/// of `valid` in its message.
fn parse_error<T: FromStr<Err = ConfigError>>(
    input: &str,
    attribute: &str,
    valid: &[&str],
) -> ConfigError {
    let Err(error) = input.parse::<T>() else {
        panic!("{input:?} parsed as a {attribute}")
    };
    let message = error.to_string();
    for value in valid {
        assert!(message.contains(value), "{message} lacks {value}");
    }
    assert_eq!(error.setting(), attribute);
    error
}

#[test]
fn operation_parse_error_names_every_valid_value() {
    let valid = ["verify", "tool", "judge", "other"];
    let error = parse_error::<Operation>("verfy", "operation", &valid);
    assert!(error.to_string().contains("verfy"), "{error}");
    assert_eq!(error.valid_values(), valid);
    assert_eq!("verify".parse::<Operation>(), Ok(Operation::Verify));
}

#[test]
fn operation_lossy_parse_maps_unknown_names_to_other() {
    assert_eq!(Operation::from_str_lossy("anything"), Operation::Other);
    assert_eq!(Operation::from_str_lossy("Verify"), Operation::Other);
    assert_eq!(Operation::from_str_lossy("judge"), Operation::Judge);
}

#[test]
fn executor_parse_error_names_every_valid_value() {
    let valid = ["inline", "thread", "process", "subprocess", "other"];
    let error = parse_error::<Executor>("threads", "executor", &valid);
    assert!(error.to_string().contains("threads"), "{error}");
    assert_eq!("subprocess".parse::<Executor>(), Ok(Executor::Subprocess));
}

#[test]
fn executor_lossy_parse_maps_unknown_names_to_other() {
    assert_eq!(Executor::from_str_lossy("anything"), Executor::Other);
    assert_eq!(Executor::from_str_lossy(""), Executor::Other);
    assert_eq!(Executor::from_str_lossy("thread"), Executor::Thread);
}

#[test]
fn outcome_parse_error_lists_the_outcomes() {
    let valid = ["ok", "error", "timeout", "cancelled", "crashed"];
    parse_error::<Outcome>("timedout", "outcome", &valid);
    assert_eq!("crashed".parse::<Outcome>(), Ok(Outcome::Crashed));
}

/// How many times an [`Awkward`] was asked its outcome.
static AWKWARD_ASKED: AtomicUsize = AtomicUsize::new(0);

/// An output whose `OperationOutput` panics.
struct Awkward(u8);

impl tower_resources_operation::classify::OperationOutput for Awkward {
    fn outcome(&self) -> Outcome {
        AWKWARD_ASKED.fetch_add(1, SeqCst);
        panic!("an OperationOutput that panics")
    }
}

#[tokio::test]
async fn a_panicking_operation_output_keeps_the_output_and_records_error() {
    let t = Telemetry::new();
    let limit = Semaphore::new(1);
    let output = t
        .metrics
        .resources_operation(&limit, Operation::Tool, Executor::Inline, async {
            Awkward(9)
        })
        .await
        .unwrap();
    assert_eq!(output.0, 9);
    assert_eq!(
        AWKWARD_ASKED.load(SeqCst),
        1,
        "the output was asked its outcome"
    );
    assert_eq!(outcomes(&t), only("error"));
    assert_eq!(live(&t), (0, 0));
    assert_eq!(limit.available_permits(), 1);
}

/// Work that calls `resources_operation` on the limit whose place it already holds runs on that
/// place, rather than wait for a second one, which a limit of 1 would never give: with a
/// `Limit`, and with an `Arc<Semaphore>`.
#[tokio::test(flavor = "current_thread")]
async fn work_that_reaches_its_own_limit_again_runs_on_the_place_it_holds() {
    async fn twice<A: tower_resources_operation::Acquire + Copy>(limit: A) -> u32 {
        let outer = resources_operation(limit, Operation::Verify, Executor::Inline, async move {
            resources_operation(limit, Operation::Judge, Executor::Inline, async {
                Ok::<u32, Infallible>(7)
            })
            .await
        });
        let answer = tokio::time::timeout(Duration::from_secs(10), outer)
            .await
            .expect("not waiting for a second place of a limit of 1");
        answer.unwrap().unwrap().unwrap()
    }
    let limit = tower_resources_operation::Limit::new(1);
    assert_eq!(twice(&limit).await, 7);
    assert_eq!(limit.available(), 1);
    let semaphore = Arc::new(Semaphore::new(1));
    assert_eq!(twice(&semaphore).await, 7);
    assert_eq!(semaphore.available_permits(), 1);
}
