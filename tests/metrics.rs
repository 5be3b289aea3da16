//! The four instruments, read back from a real OpenTelemetry SDK pipeline: names, units,
//! boundaries, attributes, and the values they report.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::convert::Infallible;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use support::{
    held, live, panic_of, panics_in_call, pipeline, settle, spawn_held, Data, Telemetry,
};
use tokio::sync::{oneshot, Semaphore};
use tokio_test::{assert_pending, task};
use tower::{service_fn, BoxError, Layer, Service, ServiceExt};
use tower_resources_operation::names::{
    ABANDONED_INSTRUMENT, ACTIVE_INSTRUMENT, DURATION_INSTRUMENT, EXECUTORS, EXECUTOR_ATTRIBUTE,
    LIMIT_INSTRUMENT, OPERATIONS, OPERATION_ATTRIBUTE, OPERATION_BOUNDARIES_MS, OUTCOMES,
    OUTCOME_ATTRIBUTE, QUEUED_INSTRUMENT, QUEUE_DURATION_INSTRUMENT, REJECTED_INSTRUMENT,
};
use tower_resources_operation::{
    set_outcome, Executor, Operation, OperationMetrics, Outcome, ResourcesOperationLayer,
};

/// Paused time moves in whole milliseconds; a recorded duration may be off by a tick or two.
const TOLERANCE_MS: f64 = 3.0;

const NEMO_GYM_BOUNDARIES_MS: [f64; 13] = [
    1.0, 5.0, 10.0, 50.0, 100.0, 500.0, 1000.0, 5000.0, 10000.0, 30000.0, 60000.0, 300000.0,
    1800000.0,
];

fn assert_close(actual: f64, expected: f64, what: &str) {
    assert!(
        (actual - expected).abs() <= TOLERANCE_MS,
        "{what}: {actual} ms, expected {expected} ms (± {TOLERANCE_MS})"
    );
}

/// A service that sleeps the requested number of milliseconds and echoes it.
fn sleeper() -> impl Service<u64, Response = u64, Error = BoxError, Future: Send> + Clone + Send {
    service_fn(|ms: u64| async move {
        tokio::time::sleep(Duration::from_millis(ms)).await;
        Ok::<_, BoxError>(ms)
    })
}

/// Two [`sleeper`]s under layers on one semaphore of one permit: `verify`'s and `judge`'s.
fn verify_and_judge_on_one_permit(
    t: &Telemetry,
) -> [impl Service<u64, Response = u64, Error = BoxError, Future: Send + 'static> + Send + 'static; 2]
{
    let slots = Arc::new(Semaphore::new(1));
    [Operation::Verify, Operation::Judge].map(|operation| {
        ResourcesOperationLayer::new(Arc::clone(&slots))
            .operation(operation)
            .metrics(t.metrics.clone())
            .layer(sleeper())
    })
}

/// Every live point is >= 0.
fn assert_never_negative(t: &Telemetry) {
    for name in [QUEUED_INSTRUMENT, ACTIVE_INSTRUMENT] {
        for point in t.live(name) {
            assert!(point.value >= 0, "{name} is negative: {point:?}");
        }
    }
}

fn set(values: &[&str]) -> BTreeSet<String> {
    values.iter().map(|v| (*v).to_owned()).collect()
}

// ---------------------------------------------------------------------------------------------
// Instruments exactly as NeMo Gym's module
// ---------------------------------------------------------------------------------------------

#[test]
fn instrument_and_attribute_names_are_the_seeds() {
    assert_eq!(
        QUEUE_DURATION_INSTRUMENT,
        "gym.resources.operation.queue_duration_ms"
    );
    assert_eq!(DURATION_INSTRUMENT, "gym.resources.operation.duration_ms");
    assert_eq!(QUEUED_INSTRUMENT, "gym.resources.operation.queued");
    assert_eq!(ACTIVE_INSTRUMENT, "gym.resources.operation.active");
    assert_eq!(OPERATION_ATTRIBUTE, "nemo.gym.resources.operation");
    assert_eq!(EXECUTOR_ATTRIBUTE, "nemo.gym.resources.executor");
    assert_eq!(OUTCOME_ATTRIBUTE, "nemo.gym.resources.operation.outcome");
}

#[test]
fn operation_executor_and_outcome_values_are_nemo_gyms_sets() {
    let nemo_gym_operations = ["verify", "tool", "judge", "other"];
    let nemo_gym_executors = ["inline", "thread", "process", "subprocess", "other"];
    let nemo_gym_outcomes = ["ok", "error", "timeout", "cancelled", "crashed"];

    // Sets as in NeMo Gym's frozensets, and no duplicates.
    assert_eq!(set(OPERATIONS), set(&nemo_gym_operations));
    assert_eq!(OPERATIONS.len(), nemo_gym_operations.len());
    assert_eq!(set(EXECUTORS), set(&nemo_gym_executors));
    assert_eq!(EXECUTORS.len(), nemo_gym_executors.len());
    assert_eq!(set(OUTCOMES), set(&nemo_gym_outcomes));
    assert_eq!(OUTCOMES.len(), nemo_gym_outcomes.len());

    // The enums export exactly those strings.
    let ops: Vec<&str> = Operation::ALL.iter().map(|o| o.as_str()).collect();
    let exs: Vec<&str> = Executor::ALL.iter().map(|e| e.as_str()).collect();
    let outs: Vec<&str> = Outcome::ALL.iter().map(|o| o.as_str()).collect();
    assert_eq!(ops, OPERATIONS);
    assert_eq!(exs, EXECUTORS);
    assert_eq!(outs, OUTCOMES);
}

#[test]
fn boundaries_constant_is_nemo_gyms_thirteen_boundaries() {
    assert_eq!(OPERATION_BOUNDARIES_MS, NEMO_GYM_BOUNDARIES_MS);
}

#[tokio::test]
async fn exported_instruments_have_the_names_units_bounds_and_kinds_of_nemo_gym_and_three_more() {
    let t = Telemetry::new();
    // The layer holds the limit: a limit that is gone no longer counts in `limit`.
    let layer = ResourcesOperationLayer::new(1).metrics(t.metrics.clone());
    layer.layer(sleeper()).oneshot(0).await.unwrap();

    let exported = t.collect();
    let names: BTreeSet<&str> = exported.iter().map(|m| m.name.as_str()).collect();
    assert_eq!(
        names,
        BTreeSet::from([
            "gym.resources.operation.queue_duration_ms",
            "gym.resources.operation.duration_ms",
            "gym.resources.operation.queued",
            "gym.resources.operation.active",
            // This crate's additions.
            "gym.resources.operation.limit",
            "gym.resources.operation.rejected",
            "gym.resources.operation.abandoned",
        ])
    );

    for m in &exported {
        match m.name.as_str() {
            QUEUE_DURATION_INSTRUMENT | DURATION_INSTRUMENT => {
                assert_eq!(m.unit, "ms", "unit of {}", m.name);
                let Data::Histogram(points) = &m.data else {
                    panic!("{} is not an f64 histogram: {:?}", m.name, m.data)
                };
                assert!(!points.is_empty(), "{} exported no point", m.name);
                for p in points {
                    assert_eq!(p.bounds, NEMO_GYM_BOUNDARIES_MS, "bounds of {}", m.name);
                    assert_eq!(p.bucket_counts.len(), NEMO_GYM_BOUNDARIES_MS.len() + 1);
                }
            }
            QUEUED_INSTRUMENT | ACTIVE_INSTRUMENT => {
                assert_eq!(m.unit, "{operation}", "unit of {}", m.name);
                let Data::Sum { monotonic, points } = &m.data else {
                    panic!("{} is not an i64 sum: {:?}", m.name, m.data)
                };
                assert!(!monotonic, "{} must be an up-down counter", m.name);
                assert!(!points.is_empty(), "{} exported no point", m.name);
            }
            LIMIT_INSTRUMENT => {
                assert_eq!(m.unit, "{operation}", "unit of {}", m.name);
                let Data::Gauge(points) = &m.data else {
                    panic!("{} is not an i64 gauge: {:?}", m.name, m.data)
                };
                assert_eq!(points.len(), 1, "{}: {points:?}", m.name);
                assert_eq!(points[0].value, 1, "the limit's capacity");
            }
            REJECTED_INSTRUMENT | ABANDONED_INSTRUMENT => {
                assert_eq!(m.unit, "{operation}", "unit of {}", m.name);
                let Data::Sum { monotonic, points } = &m.data else {
                    panic!("{} is not a sum: {:?}", m.name, m.data)
                };
                assert!(monotonic, "{} must be a counter", m.name);
                assert!(
                    points.iter().all(|p| p.value == 0),
                    "{}: {points:?}",
                    m.name
                );
            }
            other => panic!("unexpected instrument {other}"),
        }
        assert!(!m.description.is_empty(), "{} has no description", m.name);
    }
}

#[tokio::test]
async fn exported_attributes_are_exactly_nemo_gyms_keys_and_values() {
    let t = Telemetry::new();
    // One operation per (operation, executor, outcome).
    for &operation in Operation::ALL {
        for &executor in Executor::ALL {
            let layer = ResourcesOperationLayer::new(1)
                .operation(operation)
                .executor(executor)
                .metrics(t.metrics.clone());
            for &outcome in Outcome::ALL {
                let svc = layer.layer(service_fn(move |()| async move {
                    assert!(set_outcome(outcome));
                    Ok::<_, Infallible>(())
                }));
                svc.oneshot(()).await.unwrap();
            }
        }
    }

    let series_keys = set(&[OPERATION_ATTRIBUTE, EXECUTOR_ATTRIBUTE]);
    let outcome_keys = set(&[OPERATION_ATTRIBUTE, EXECUTOR_ATTRIBUTE, OUTCOME_ATTRIBUTE]);
    let mut expected_series = BTreeSet::new();
    let mut expected_outcomes = BTreeSet::new();
    for op in ["verify", "tool", "judge", "other"] {
        for ex in ["inline", "thread", "process", "subprocess", "other"] {
            expected_series.insert((op.to_owned(), ex.to_owned()));
            for out in ["ok", "error", "timeout", "cancelled", "crashed"] {
                expected_outcomes.insert((op.to_owned(), ex.to_owned(), out.to_owned()));
            }
        }
    }
    let series_of = |a: &BTreeMap<String, String>| {
        (
            a["nemo.gym.resources.operation"].clone(),
            a["nemo.gym.resources.executor"].clone(),
        )
    };

    for name in [QUEUE_DURATION_INSTRUMENT] {
        let points = t.histogram(name);
        for p in &points {
            assert_eq!(
                p.attributes.keys().cloned().collect::<BTreeSet<_>>(),
                series_keys,
                "{name}"
            );
            assert_eq!(p.count, 5, "{name}: one sample per operation: {p:?}");
        }
        let got: BTreeSet<_> = points.iter().map(|p| series_of(&p.attributes)).collect();
        assert_eq!(got, expected_series, "{name}");
        assert_eq!(points.len(), expected_series.len(), "{name}");
    }

    for name in [QUEUED_INSTRUMENT, ACTIVE_INSTRUMENT] {
        let points = t.live(name);
        for p in &points {
            assert_eq!(
                p.attributes.keys().cloned().collect::<BTreeSet<_>>(),
                series_keys,
                "{name}"
            );
        }
        let got: BTreeSet<_> = points.iter().map(|p| series_of(&p.attributes)).collect();
        assert_eq!(got, expected_series, "{name}");
        assert_eq!(points.len(), expected_series.len(), "{name}");
    }

    let points = t.histogram(DURATION_INSTRUMENT);
    for p in &points {
        assert_eq!(
            p.attributes.keys().cloned().collect::<BTreeSet<_>>(),
            outcome_keys
        );
        assert_eq!(p.count, 1, "one sample per operation: {p:?}");
    }
    let got: BTreeSet<_> = points
        .iter()
        .map(|p| {
            let (op, ex) = series_of(&p.attributes);
            (
                op,
                ex,
                p.attributes["nemo.gym.resources.operation.outcome"].clone(),
            )
        })
        .collect();
    assert_eq!(got, expected_outcomes);
    assert_eq!(points.len(), expected_outcomes.len());
}

// ---------------------------------------------------------------------------------------------
// Queue duration
// ---------------------------------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn queue_duration_is_zero_for_an_immediate_permit_and_the_wait_for_a_queued_one() {
    let t = Telemetry::new();
    let [mut first, second] = verify_and_judge_on_one_permit(&t);

    // A takes the only permit now and holds it for 300 ms; B has to wait for it.
    let a = tokio::spawn(first.ready().await.unwrap().call(300));
    let b = tokio::spawn(second.oneshot(0));
    assert_eq!(a.await.unwrap().unwrap(), 300);
    assert_eq!(b.await.unwrap().unwrap(), 0);

    let a = t.points(
        QUEUE_DURATION_INSTRUMENT,
        &[(OPERATION_ATTRIBUTE, "verify")],
    );
    assert_eq!(a.len(), 1);
    assert_eq!(a[0].count, 1);
    assert_eq!(a[0].sum, 0.0, "an immediate permit records 0");

    let b = t.points(QUEUE_DURATION_INSTRUMENT, &[(OPERATION_ATTRIBUTE, "judge")]);
    assert_eq!(b.len(), 1);
    assert_eq!(b[0].count, 1);
    assert_close(b[0].sum, 300.0, "B's queue time");
    assert_close(b[0].max.unwrap(), 300.0, "B's queue time (max)");
}

#[tokio::test(start_paused = true)]
async fn queue_duration_is_recorded_once_per_admitted_operation() {
    let t = Telemetry::new();
    let svc = ResourcesOperationLayer::new(2)
        .metrics(t.metrics.clone())
        .layer(sleeper());

    let tasks: Vec<_> = (0..5)
        .map(|_| tokio::spawn(svc.clone().oneshot(100)))
        .collect();
    for task in tasks {
        task.await.unwrap().unwrap();
    }

    let points = t.points(QUEUE_DURATION_INSTRUMENT, &[]);
    assert_eq!(points.len(), 1);
    assert_eq!(
        points[0].count, 5,
        "one queue sample per admitted operation"
    );
    // Two ran at once, then two waited 100 ms, then one waited 200 ms.
    assert_close(points[0].sum, 400.0, "total queue time");
    assert_close(points[0].max.unwrap(), 200.0, "longest queue time");
}

#[tokio::test(start_paused = true)]
async fn waiter_dropped_before_its_permit_records_no_queue_sample_and_leaves_the_queue() {
    let t = Telemetry::new();
    let svc = ResourcesOperationLayer::new(1)
        .metrics(t.metrics.clone())
        .layer(held());

    let (release, holder) = spawn_held(&svc);
    settle().await;

    // A waiter whose request future (and so its service) is dropped while it waits.
    let (_never, rx) = oneshot::channel();
    let mut waiter = task::spawn(svc.clone().oneshot(rx));
    assert_pending!(waiter.poll());
    assert_eq!(live(&t), (1, 1), "while it waits, queued reads 1");
    drop(waiter);
    assert_eq!(live(&t), (0, 1), "a dropped waiter leaves the queue");

    release.send(()).unwrap();
    holder.await.unwrap().unwrap();
    assert_eq!(live(&t), (0, 0));
    assert_eq!(
        t.count(QUEUE_DURATION_INSTRUMENT, &[]),
        1,
        "only the admitted operation has a queue sample"
    );
    assert_eq!(t.count(DURATION_INSTRUMENT, &[]), 1);
}

#[tokio::test(start_paused = true)]
async fn waiter_timed_out_on_ready_then_dropped_records_no_queue_sample() {
    let t = Telemetry::new();
    let layer = ResourcesOperationLayer::new(1).metrics(t.metrics.clone());
    let svc = layer.layer(held());

    let (release, holder) = spawn_held(&svc);
    settle().await;

    let mut waiter = svc.clone();
    let timed_out = tokio::time::timeout(
        Duration::from_millis(50),
        ServiceExt::<oneshot::Receiver<()>>::ready(&mut waiter),
    )
    .await;
    assert!(timed_out.is_err(), "the limit of 1 is taken");
    drop(waiter);
    assert_eq!(live(&t), (0, 1));

    release.send(()).unwrap();
    holder.await.unwrap().unwrap();
    assert_eq!(live(&t), (0, 0));
    assert_eq!(t.count(QUEUE_DURATION_INSTRUMENT, &[]), 1);
    assert_eq!(layer.limit().available(), 1, "the permit is back");
}

// ---------------------------------------------------------------------------------------------
// Duration
// ---------------------------------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn duration_runs_from_the_permit_to_the_end_of_the_inner_work() {
    let t = Telemetry::new();
    let [mut first, second] = verify_and_judge_on_one_permit(&t);

    let a = tokio::spawn(first.ready().await.unwrap().call(300));
    let b = tokio::spawn(second.oneshot(250));
    a.await.unwrap().unwrap();
    b.await.unwrap().unwrap();

    assert_close(
        t.sum(DURATION_INSTRUMENT, &[(OPERATION_ATTRIBUTE, "verify")]),
        300.0,
        "A's run time",
    );
    // B waited 300 ms and then ran 250 ms: only the run counts.
    assert_close(
        t.sum(DURATION_INSTRUMENT, &[(OPERATION_ATTRIBUTE, "judge")]),
        250.0,
        "B's run time",
    );
}

#[tokio::test(start_paused = true)]
async fn duration_is_recorded_once_per_admitted_operation_with_its_outcome() {
    let t = Telemetry::new();
    let svc = ResourcesOperationLayer::new(2)
        .metrics(t.metrics.clone())
        .layer(service_fn(|fail: bool| async move {
            tokio::time::sleep(Duration::from_millis(250)).await;
            if fail {
                Err::<(), BoxError>("boom".into())
            } else {
                Ok(())
            }
        }));

    let tasks: Vec<_> = [false, true, false, false]
        .into_iter()
        .map(|fail| tokio::spawn(svc.clone().oneshot(fail)))
        .collect();
    for task in tasks {
        let _ = task.await.unwrap();
    }

    let ok = t.points(DURATION_INSTRUMENT, &[(OUTCOME_ATTRIBUTE, "ok")]);
    let error = t.points(DURATION_INSTRUMENT, &[(OUTCOME_ATTRIBUTE, "error")]);
    assert_eq!(
        t.histogram(DURATION_INSTRUMENT).len(),
        2,
        "ok and error only"
    );
    assert_eq!(ok[0].count, 3);
    assert_eq!(error[0].count, 1);
    assert_close(ok[0].sum, 750.0, "three runs of 250 ms");
    assert_close(ok[0].max.unwrap(), 250.0, "one run");
    assert_close(ok[0].min.unwrap(), 250.0, "one run");
    assert_close(error[0].sum, 250.0, "one run of 250 ms");
}

// ---------------------------------------------------------------------------------------------
// Live counts
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn live_counts_show_the_operations_running_and_waiting_now() {
    let t = Telemetry::new();
    let svc = ResourcesOperationLayer::new(2)
        .metrics(t.metrics.clone())
        .layer(held());

    assert_eq!(live(&t), (0, 0), "an idle limit reports 0, not nothing");
    for name in [QUEUED_INSTRUMENT, ACTIVE_INSTRUMENT] {
        assert_eq!(
            t.live(name).len(),
            1,
            "{name}: given metrics report the series from the moment the layer makes a service"
        );
    }

    let (mut releases, tasks): (Vec<_>, Vec<_>) = (0..3).map(|_| spawn_held(&svc)).unzip();
    settle().await;
    assert_eq!(live(&t), (1, 2), "two run, one waits");
    assert_never_negative(&t);

    releases.remove(0).send(()).unwrap();
    settle().await;
    assert_eq!(live(&t), (0, 2), "the waiter took the freed permit");
    assert_never_negative(&t);

    releases.remove(0).send(()).unwrap();
    settle().await;
    assert_eq!(live(&t), (0, 1));

    releases.remove(0).send(()).unwrap();
    for task in tasks {
        task.await.unwrap().unwrap();
    }
    assert_eq!(live(&t), (0, 0));
}

#[tokio::test]
async fn live_counts_of_two_limits_with_the_same_series_add_up() {
    let t = Telemetry::new();
    let layer = |t: &Telemetry| {
        ResourcesOperationLayer::new(1)
            .operation(Operation::Tool)
            .executor(Executor::Thread)
            .metrics(t.metrics.clone())
    };
    let one = layer(&t).layer(held());
    let two = layer(&t).layer(held());

    let (releases, tasks): (Vec<_>, Vec<_>) =
        [&one, &two, &one, &two].into_iter().map(spawn_held).unzip();
    settle().await;

    let tool_thread = [
        (OPERATION_ATTRIBUTE, "tool"),
        (EXECUTOR_ATTRIBUTE, "thread"),
    ];
    assert_eq!(t.live(ACTIVE_INSTRUMENT).len(), 1, "one series");
    assert_eq!(t.live_value(ACTIVE_INSTRUMENT, &tool_thread), 2, "1 + 1");
    assert_eq!(t.live_value(QUEUED_INSTRUMENT, &tool_thread), 2, "1 + 1");

    for tx in releases {
        let _ = tx.send(());
    }
    for task in tasks {
        task.await.unwrap().unwrap();
    }
    assert_eq!(live(&t), (0, 0));
}

/// Runs `end` on a limit of one that also has a second operation waiting, and checks that the
/// live counts are never negative and come back to 0 once everything ended.
async fn live_counts_return_to_zero_after<F>(end: F)
where
    F: AsyncFnOnce(&Telemetry, ResourcesOperationLayer),
{
    let t = Telemetry::new();
    let layer = ResourcesOperationLayer::new(1).metrics(t.metrics.clone());
    end(&t, layer.clone()).await;
    settle().await;
    assert_never_negative(&t);
    assert_eq!(live(&t), (0, 0));
    assert_eq!(layer.limit().available(), 1, "the permit is back");
}

#[tokio::test]
async fn live_counts_return_to_zero_after_ok() {
    live_counts_return_to_zero_after(async |t, layer| {
        let svc = layer.layer(held());
        let (tx, task) = spawn_held(&svc);
        settle().await;
        assert_eq!(live(t), (0, 1));
        tx.send(()).unwrap();
        task.await.unwrap().unwrap();
    })
    .await;
}

#[tokio::test]
async fn live_counts_return_to_zero_after_an_error() {
    live_counts_return_to_zero_after(async |t, layer| {
        let svc = layer.layer(service_fn(|release: oneshot::Receiver<()>| async move {
            let _ = release.await;
            Err::<(), BoxError>("boom".into())
        }));
        let (tx, task) = spawn_held(&svc);
        settle().await;
        assert_eq!(live(t), (0, 1));
        tx.send(()).unwrap();
        assert!(task.await.unwrap().is_err());
    })
    .await;
}

#[tokio::test]
async fn live_counts_return_to_zero_after_a_dropped_response_future() {
    live_counts_return_to_zero_after(async |t, layer| {
        let mut svc = layer.layer(held());
        let (_tx, rx) = oneshot::channel();
        let mut fut = task::spawn(svc.ready().await.unwrap().call(rx));
        assert_pending!(fut.poll());
        assert_eq!(live(t), (0, 1));
        drop(fut);
    })
    .await;
}

#[tokio::test]
async fn live_counts_return_to_zero_after_a_service_holding_an_unused_permit_is_dropped() {
    live_counts_return_to_zero_after(async |t, layer| {
        let mut svc = layer.layer(held());
        ServiceExt::<oneshot::Receiver<()>>::ready(&mut svc)
            .await
            .unwrap();
        assert_eq!(live(t), (0, 1));
        drop(svc);
    })
    .await;
}

#[tokio::test]
async fn live_counts_return_to_zero_after_a_dropped_waiting_service() {
    live_counts_return_to_zero_after(async |t, layer| {
        let mut holder = layer.layer(held());
        ServiceExt::<oneshot::Receiver<()>>::ready(&mut holder)
            .await
            .unwrap();
        let mut waiter = layer.layer(held());
        {
            let mut ready = task::spawn(ServiceExt::<oneshot::Receiver<()>>::ready(&mut waiter));
            assert!(ready.poll().is_pending());
        }
        assert_eq!(live(t), (1, 1));
        drop(waiter);
        assert_eq!(live(t), (0, 1));
        drop(holder);
    })
    .await;
}

#[tokio::test]
async fn live_counts_return_to_zero_after_a_panic_in_call() {
    live_counts_return_to_zero_after(async |t, layer| {
        let mut svc = layer.layer(panics_in_call(None));
        svc.ready().await.unwrap();
        assert_eq!(live(t), (0, 1));
        let panicked = catch_unwind(AssertUnwindSafe(|| svc.call(())));
        assert!(panicked.is_err());
    })
    .await;
}

#[tokio::test]
async fn live_counts_return_to_zero_after_a_panic_in_the_response_future() {
    live_counts_return_to_zero_after(async |t, layer| {
        let svc = layer.layer(service_fn(|release: oneshot::Receiver<()>| async move {
            let _ = release.await;
            if true {
                panic!("future panicked");
            }
            Ok::<(), Infallible>(())
        }));
        let (tx, rx) = oneshot::channel();
        let task = tokio::spawn(svc.oneshot(rx));
        settle().await;
        assert_eq!(live(t), (0, 1));
        tx.send(()).unwrap();
        assert!(task.await.unwrap_err().is_panic());
    })
    .await;
}

#[tokio::test]
async fn live_counts_return_to_zero_after_the_semaphore_closes_under_a_waiter() {
    let t = Telemetry::new();
    let slots = Arc::new(Semaphore::new(1));
    let layer = ResourcesOperationLayer::new(slots.clone()).metrics(t.metrics.clone());
    let taken = slots.clone().try_acquire_owned().unwrap();

    let waiter = tokio::spawn(layer.layer(held()).oneshot(oneshot::channel().1));
    settle().await;
    assert_eq!(live(&t), (1, 0));

    slots.close();
    let message = panic_of("the woken waiter", waiter).await;
    assert!(message.contains("the limit is closed"), "{message}");
    assert_never_negative(&t);
    assert_eq!(live(&t), (0, 0));
    assert_eq!(t.count(QUEUE_DURATION_INSTRUMENT, &[]), 0);
    drop(taken);
}

// ---------------------------------------------------------------------------------------------
// OperationMetrics handles
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn operation_metrics_on_different_providers_are_independent() {
    let one = Telemetry::new();
    let two = Telemetry::new();
    let on = |t: &Telemetry| {
        ResourcesOperationLayer::new(2)
            .metrics(t.metrics.clone())
            .layer(held())
    };
    let (svc_one, svc_two) = (on(&one), on(&two));

    let (tx1, a) = spawn_held(&svc_one);
    let (tx2, b) = spawn_held(&svc_one);
    let (tx3, c) = spawn_held(&svc_two);
    settle().await;
    assert_eq!(live(&one), (0, 2));
    assert_eq!(live(&two), (0, 1));

    for tx in [tx1, tx2, tx3] {
        tx.send(()).unwrap();
    }
    for task in [a, b, c] {
        task.await.unwrap().unwrap();
    }
    assert_eq!(one.count(DURATION_INSTRUMENT, &[]), 2);
    assert_eq!(two.count(DURATION_INSTRUMENT, &[]), 1);
    assert_eq!(one.count(QUEUE_DURATION_INSTRUMENT, &[]), 2);
    assert_eq!(two.count(QUEUE_DURATION_INSTRUMENT, &[]), 1);
}

#[tokio::test]
async fn clones_of_operation_metrics_share_instruments_and_live_counts() {
    let t = Telemetry::new();
    let clone = t.metrics.clone();
    assert!(clone.is_enabled());
    let original = ResourcesOperationLayer::new(1)
        .metrics(t.metrics.clone())
        .layer(held());
    let cloned = ResourcesOperationLayer::new(1).metrics(clone).layer(held());

    let (tx1, rx1) = oneshot::channel();
    let (tx2, rx2) = oneshot::channel();
    let a = tokio::spawn(original.oneshot(rx1));
    let b = tokio::spawn(cloned.oneshot(rx2));
    settle().await;
    assert_eq!(live(&t), (0, 2));

    tx1.send(()).unwrap();
    tx2.send(()).unwrap();
    a.await.unwrap().unwrap();
    b.await.unwrap().unwrap();
    assert_eq!(t.count(DURATION_INSTRUMENT, &[]), 2);
    assert_eq!(live(&t), (0, 0));
}

#[tokio::test]
async fn disabled_metrics_still_limit() {
    let metrics = OperationMetrics::disabled();
    assert!(!metrics.is_enabled());
    let layer = ResourcesOperationLayer::new(1).metrics(metrics);
    let mut first = layer.layer(held());
    let mut second = layer.layer(held());

    ServiceExt::<oneshot::Receiver<()>>::ready(&mut first)
        .await
        .unwrap();
    {
        let mut waiting = task::spawn(ServiceExt::<oneshot::Receiver<()>>::ready(&mut second));
        assert!(waiting.poll().is_pending());
        drop(first);
        assert!(waiting.is_woken());
        assert!(matches!(waiting.poll(), Poll::Ready(Ok(_))));
    }
    assert_eq!(layer.limit().available(), 0);
    let (tx, rx) = oneshot::channel();
    tx.send(()).unwrap();
    second.call(rx).await.unwrap();
    assert_eq!(layer.limit().available(), 1);
}

#[tokio::test]
async fn set_outcome_returns_false_behind_a_disabled_layer() {
    let svc = ResourcesOperationLayer::new(1)
        .metrics(OperationMetrics::disabled())
        .layer(service_fn(|()| async {
            Ok::<_, Infallible>(set_outcome(Outcome::Timeout))
        }));
    assert!(!svc.oneshot(()).await.unwrap());
}

// ---------------------------------------------------------------------------------------------
// Metrics never change a response
// ---------------------------------------------------------------------------------------------

fn echo_or_fail() -> impl Service<i32, Response = String, Error = BoxError, Future: Send> + Clone {
    service_fn(|n: i32| async move {
        if n < 0 {
            Err::<String, BoxError>(format!("negative: {n}").into())
        } else {
            Ok(format!("got {n}"))
        }
    })
}

#[tokio::test]
async fn disabled_and_enabled_metrics_give_identical_responses_and_errors() {
    let t = Telemetry::new();
    let enabled = ResourcesOperationLayer::new(1)
        .metrics(t.metrics.clone())
        .layer(echo_or_fail());
    let disabled = ResourcesOperationLayer::new(1)
        .metrics(OperationMetrics::disabled())
        .layer(echo_or_fail());

    for n in [0, 7, -3] {
        let with = enabled.clone().oneshot(n).await.map_err(|e| e.to_string());
        let without = disabled.clone().oneshot(n).await.map_err(|e| e.to_string());
        let bare = echo_or_fail().oneshot(n).await.map_err(|e| e.to_string());
        assert_eq!(with, without, "request {n}");
        assert_eq!(with, bare, "request {n}");
    }
    assert_eq!(
        t.count(DURATION_INSTRUMENT, &[]),
        3,
        "the enabled one reported"
    );
}

#[tokio::test]
async fn a_shut_down_meter_provider_changes_neither_responses_nor_the_limit() {
    let (provider, _exporter) = pipeline();
    let metrics = OperationMetrics::new(&opentelemetry::metrics::MeterProvider::meter(
        &provider, "shutdown",
    ));
    let layer = ResourcesOperationLayer::new(1).metrics(metrics);
    let svc = layer.layer(echo_or_fail());

    assert_eq!(svc.clone().oneshot(1).await.unwrap(), "got 1");
    provider.shutdown().expect("shutdown");

    assert_eq!(svc.clone().oneshot(2).await.unwrap(), "got 2");
    assert_eq!(
        svc.clone().oneshot(-2).await.unwrap_err().to_string(),
        "negative: -2"
    );

    // Still a limit of one.
    let mut first = svc.clone();
    let mut second = svc.clone();
    first.ready().await.unwrap();
    {
        let mut waiting = task::spawn(second.ready());
        assert!(waiting.poll().is_pending());
        assert_eq!(first.call(3).await.unwrap(), "got 3");
        assert!(waiting.is_woken());
        assert!(matches!(waiting.poll(), Poll::Ready(Ok(_))));
    }
    assert_eq!(second.call(4).await.unwrap(), "got 4");
    assert_eq!(layer.limit().available(), 1);
}

/// The README's recipe: a View replaces NeMo Gym's buckets for the run time, and only there.
#[tokio::test(start_paused = true)]
async fn an_opentelemetry_view_replaces_the_run_time_buckets_and_nothing_else() {
    use opentelemetry::metrics::MeterProvider as _;
    use opentelemetry_sdk::metrics::{
        Aggregation, InMemoryMetricExporterBuilder, Instrument, PeriodicReader, SdkMeterProvider,
        Stream,
    };
    const FINER: [f64; 9] = [
        50.0, 100.0, 150.0, 200.0, 225.0, 250.0, 300.0, 500.0, 1000.0,
    ];
    let exporter = InMemoryMetricExporterBuilder::new().build();
    let provider = SdkMeterProvider::builder()
        .with_reader(PeriodicReader::builder(exporter.clone()).build())
        .with_view(|instrument: &Instrument| {
            (instrument.name() == DURATION_INSTRUMENT).then(|| {
                Stream::builder()
                    .with_aggregation(Aggregation::ExplicitBucketHistogram {
                        boundaries: FINER.to_vec(),
                        record_min_max: true,
                    })
                    .build()
                    .unwrap()
            })
        })
        .build();
    let telemetry = Telemetry {
        metrics: OperationMetrics::new(&provider.meter("view")),
        provider,
        exporter,
    };
    let service = ResourcesOperationLayer::new(1)
        .operation(Operation::Verify)
        .metrics(telemetry.metrics.clone())
        .layer(sleeper());
    service.oneshot(205).await.unwrap();

    let run = telemetry.histogram(DURATION_INSTRUMENT);
    assert_eq!(run.len(), 1);
    assert_eq!(run[0].bounds, FINER);
    // 205 ms falls in (200, 225], the fifth bucket, where NeMo Gym's say (100, 500]
    assert_eq!(run[0].bucket_counts[4], 1, "{:?}", run[0].bucket_counts);
    let queue = telemetry.histogram(QUEUE_DURATION_INSTRUMENT);
    assert_eq!(queue[0].bounds, OPERATION_BOUNDARIES_MS);
}
