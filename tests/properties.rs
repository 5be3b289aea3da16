//! The books balance on any schedule: random arrivals, run times and endings through one limit
//! shared by two layers, on paused tokio time, so every case is deterministic and replays from
//! its seed (proptest saves failing seeds next to this file).
//!
//! On paused time the clock moves only when every task waits on a timer, so the test side can
//! read the very instants the layer reads: besides the counts, the sums of both histograms must
//! equal the waits and run times the test itself measured.

mod reliability;
mod support;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use proptest::prelude::*;
use tokio::sync::oneshot;
use tokio::time::Instant;
use tower::util::BoxService;
use tower::{service_fn, Layer as _, ServiceBuilder, ServiceExt as _};

use reliability::{quiet_expected_panics, Books, Load, Series, EXPECTED_PANIC};
use support::Telemetry;
use tower_resources_operation::{
    set_outcome, Executor, Operation, Outcome, ResourcesOperationLayer, ACTIVE_INSTRUMENT,
    DURATION_INSTRUMENT, EXECUTOR_ATTRIBUTE, OPERATION_ATTRIBUTE, OUTCOME_ATTRIBUTE,
    QUEUED_INSTRUMENT, QUEUE_DURATION_INSTRUMENT,
};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The layer of these tests: the default limit, with tower's and tokio's `Elapsed` as `timeout`.
type TimeoutLayer = ResourcesOperationLayer<
    tower_resources_operation::SharedClassifier<tower_resources_operation::TimeoutClassifier>,
>;

/// The two series that share the limit.
const VERIFY: Series = (Operation::Verify, Executor::Inline);
const JUDGE: Series = (Operation::Judge, Executor::Thread);

/// How an operation ends.
#[derive(Clone, Copy, Debug)]
enum Ending {
    /// The work runs, then answers `Ok`.
    Ok,
    /// The work runs, then answers `Err`.
    Err,
    /// The work runs, then panics (in a task of its own).
    Panic,
    /// The work runs, chooses `timeout` with `set_outcome`, and answers `Ok`.
    SetTimeout,
    /// The work never ends; the caller drops it this many ms after it started.
    DropInFlight(u64),
    /// The caller gives up this many ms after it arrived (`tokio::time::timeout`): in the queue,
    /// in flight, or never, if the work ended first.
    GiveUpAfter(u64),
    /// tower's `TimeoutLayer` of this many ms, inside the limit, races the work.
    TowerTimeout(u64),
    /// `poll_ready` takes the permit; the service is dropped unused this many ms later.
    ReadyUnused(u64),
}

#[derive(Clone, Copy, Debug)]
struct Op {
    arrival_ms: u64,
    run_ms: u64,
    ending: Ending,
    judge: bool,
}

fn ending() -> impl Strategy<Value = Ending> {
    prop_oneof![
        Just(Ending::Ok),
        Just(Ending::Err),
        Just(Ending::Panic),
        Just(Ending::SetTimeout),
        (0..20u64).prop_map(Ending::DropInFlight),
        (0..40u64).prop_map(Ending::GiveUpAfter),
        (0..20u64).prop_map(Ending::TowerTimeout),
        (0..20u64).prop_map(Ending::ReadyUnused),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    (0..50u64, 0..20u64, ending(), any::<bool>()).prop_map(|(arrival_ms, run_ms, ending, judge)| {
        Op {
            arrival_ms,
            run_ms,
            ending,
            judge,
        }
    })
}

/// What the inner service does.
enum Behavior {
    /// Sleeps, then ends as `then` says.
    Run { run: Duration, then: Ending },
    /// Says it started, then never ends.
    Hang(oneshot::Sender<()>),
}

/// The inner service of one operation: notes the instant it is called (the operation's
/// admission: `oneshot` calls in the very poll that takes the permit) and counts on `load`.
fn inner(
    called: Arc<Mutex<Option<Instant>>>,
    load: Arc<Load>,
) -> BoxService<Behavior, (), BoxError> {
    BoxService::new(service_fn(move |behavior: Behavior| {
        *called.lock().unwrap() = Some(Instant::now());
        let guard = load.enter();
        async move {
            let _guard = guard;
            match behavior {
                Behavior::Hang(started) => {
                    let _ = started.send(());
                    std::future::pending().await
                }
                Behavior::Run { run, then } => {
                    tokio::time::sleep(run).await;
                    match then {
                        Ending::Err => Err("boom".into()),
                        Ending::Panic => panic!("{EXPECTED_PANIC}"),
                        Ending::SetTimeout => {
                            assert!(set_outcome(Outcome::Timeout));
                            Ok(())
                        }
                        _ => Ok(()),
                    }
                }
            }
        }
    }))
}

/// What the test saw of one operation.
#[derive(Debug)]
struct Record {
    series: Series,
    arrived: Instant,
    /// When it got its permit, if it did.
    admitted: Option<Instant>,
    /// How and when it ended, if it was admitted.
    ended: Option<(Outcome, Instant)>,
}

fn ms(ms: u64) -> Duration {
    Duration::from_millis(ms)
}

/// Runs `op` through `layer` and says what happened to it.
async fn run(op: Op, layer: TimeoutLayer, load: Arc<Load>) -> Record {
    tokio::time::sleep(ms(op.arrival_ms)).await;
    let arrived = Instant::now();
    let called = Arc::new(Mutex::new(None));
    let inner = inner(Arc::clone(&called), load);
    let run = ms(op.run_ms);
    let outcome = match op.ending {
        Ending::Panic => {
            let service = layer.layer(inner);
            let behavior = Behavior::Run {
                run,
                then: op.ending,
            };
            let joined = tokio::task::spawn_local(service.oneshot(behavior)).await;
            assert!(joined.expect_err("the work panicked").is_panic());
            Some(Outcome::Crashed)
        }
        Ending::Ok | Ending::Err | Ending::SetTimeout => {
            let behavior = Behavior::Run {
                run,
                then: op.ending,
            };
            let answer = layer.layer(inner).oneshot(behavior).await;
            Some(match op.ending {
                Ending::Ok => {
                    answer.unwrap();
                    Outcome::Ok
                }
                Ending::Err => {
                    answer.unwrap_err();
                    Outcome::Error
                }
                _ => {
                    answer.unwrap();
                    Outcome::Timeout
                }
            })
        }
        Ending::DropInFlight(after) => {
            let (started_tx, started_rx) = oneshot::channel();
            let mut operation = Box::pin(layer.layer(inner).oneshot(Behavior::Hang(started_tx)));
            tokio::select! {
                biased;
                answer = &mut operation => panic!("hanging work answered: {answer:?}"),
                started = started_rx => started.unwrap(),
            }
            tokio::time::sleep(ms(after)).await;
            drop(operation);
            Some(Outcome::Cancelled)
        }
        Ending::GiveUpAfter(after) => {
            let behavior = Behavior::Run {
                run,
                then: Ending::Ok,
            };
            let operation = layer.layer(inner).oneshot(behavior);
            match tokio::time::timeout(ms(after), operation).await {
                Ok(answer) => {
                    answer.unwrap();
                    Some(Outcome::Ok)
                }
                Err(_) if called.lock().unwrap().is_some() => Some(Outcome::Cancelled),
                Err(_) => None,
            }
        }
        Ending::TowerTimeout(deadline) => {
            let service = ServiceBuilder::new()
                .layer(layer)
                .timeout(ms(deadline))
                .service(inner);
            let behavior = Behavior::Run {
                run,
                then: Ending::Ok,
            };
            match service.oneshot(behavior).await {
                Ok(()) => Some(Outcome::Ok),
                Err(error) => {
                    assert!(error.is::<tower::timeout::error::Elapsed>(), "{error}");
                    Some(Outcome::Timeout)
                }
            }
        }
        Ending::ReadyUnused(after) => {
            let mut service = layer.layer(inner);
            service.ready().await.unwrap();
            *called.lock().unwrap() = Some(Instant::now());
            tokio::time::sleep(ms(after)).await;
            drop(service);
            Some(Outcome::Cancelled)
        }
    };
    let now = Instant::now();
    let admitted = *called.lock().unwrap();
    assert_eq!(
        admitted.is_some(),
        outcome.is_some(),
        "{op:?}: admitted {admitted:?}, ended {outcome:?}"
    );
    Record {
        series: if op.judge { JUDGE } else { VERIFY },
        arrived,
        admitted,
        ended: outcome.map(|outcome| (outcome, now)),
    }
}

fn millis(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1_000.0
}

/// Runs one schedule on a fresh paused runtime and checks the books, the sums, the live counts,
/// the permits and the peak load.
fn check(limit: usize, ops: &[Op]) -> Result<(), TestCaseError> {
    quiet_expected_panics();
    let telemetry = Telemetry::new();
    let layer = ResourcesOperationLayer::new(limit)
        .classifier(tower_resources_operation::TimeoutClassifier::new())
        .metrics(telemetry.metrics.clone());
    let semaphore = layer.limit().clone();
    let verify = layer.clone().operation(VERIFY.0).executor(VERIFY.1);
    let judge = layer.operation(JUDGE.0).executor(JUDGE.1);
    let load = Arc::new(Load::default());

    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap();
    let local = tokio::task::LocalSet::new();
    let records = local.block_on(&runtime, async {
        let tasks: Vec<_> = ops
            .iter()
            .map(|op| {
                let layer = if op.judge {
                    judge.clone()
                } else {
                    verify.clone()
                };
                tokio::task::spawn_local(run(*op, layer, Arc::clone(&load)))
            })
            .collect();
        // A lost permit would leave tasks waiting on nothing: on paused time this deadline then
        // comes at once and fails the case instead of hanging it.
        tokio::time::timeout(Duration::from_secs(24 * 3600), async {
            let mut records = Vec::new();
            for task in tasks {
                records.push(task.await.unwrap());
            }
            records
        })
        .await
        .expect("the schedule never finished")
    });

    prop_assert_eq!(semaphore.available(), limit);
    prop_assert!(
        load.max() <= limit,
        "{} ran under a limit of {}",
        load.max(),
        limit
    );
    prop_assert_eq!(load.running(), 0);

    let mut books = Books::default();
    let mut queue_ms: BTreeMap<Series, f64> = BTreeMap::new();
    let mut run_ms: BTreeMap<(Series, Outcome), f64> = BTreeMap::new();
    for record in &records {
        if let (Some(admitted), Some((outcome, ended))) = (record.admitted, record.ended) {
            books.ended(record.series, outcome);
            *queue_ms.entry(record.series).or_default() += millis(admitted - record.arrived);
            *run_ms.entry((record.series, outcome)).or_default() += millis(ended - admitted);
        }
    }
    let exported = Books::exported(&telemetry);
    prop_assert_eq!(&exported.ended, &books.ended, "duration samples");
    prop_assert_eq!(&exported.admitted, &books.admitted, "queue samples");

    for ((operation, executor), expected) in &queue_ms {
        let series = [
            (OPERATION_ATTRIBUTE, operation.as_str()),
            (EXECUTOR_ATTRIBUTE, executor.as_str()),
        ];
        let sum = telemetry.sum(QUEUE_DURATION_INSTRUMENT, &series);
        prop_assert!(
            (sum - expected).abs() < 1e-6,
            "queue time of {:?}: recorded {} ms, waited {} ms",
            series,
            sum,
            expected
        );
    }
    for (((operation, executor), outcome), expected) in &run_ms {
        let series = [
            (OPERATION_ATTRIBUTE, operation.as_str()),
            (EXECUTOR_ATTRIBUTE, executor.as_str()),
            (OUTCOME_ATTRIBUTE, outcome.as_str()),
        ];
        let sum = telemetry.sum(DURATION_INSTRUMENT, &series);
        prop_assert!(
            (sum - expected).abs() < 1e-6,
            "run time of {:?}: recorded {} ms, ran {} ms",
            series,
            sum,
            expected
        );
    }

    for instrument in [QUEUED_INSTRUMENT, ACTIVE_INSTRUMENT] {
        for (operation, executor) in [VERIFY, JUDGE] {
            let series = [
                (OPERATION_ATTRIBUTE, operation.as_str()),
                (EXECUTOR_ATTRIBUTE, executor.as_str()),
            ];
            prop_assert_eq!(
                telemetry.live_value(instrument, &series),
                0,
                "{}",
                instrument
            );
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn any_schedule_records_each_admitted_operation_once_with_its_wait_and_run_time(
        limit in 1usize..=4,
        ops in proptest::collection::vec(op(), 1..=30),
    ) {
        check(limit, &ops)?;
    }
}

/// One fixed schedule that exercises every ending under contention, as a plain test.
#[test]
fn a_fixed_schedule_with_every_ending_balances_the_books() {
    let endings = [
        Ending::Ok,
        Ending::Err,
        Ending::Panic,
        Ending::SetTimeout,
        Ending::DropInFlight(3),
        Ending::GiveUpAfter(1),
        Ending::GiveUpAfter(30),
        Ending::TowerTimeout(2),
        Ending::TowerTimeout(30),
        Ending::ReadyUnused(4),
    ];
    let ops: Vec<Op> = (0..30)
        .map(|i| Op {
            arrival_ms: (i % 4) as u64,
            run_ms: 5 + (i % 3) as u64,
            ending: endings[i % endings.len()],
            judge: i % 2 == 1,
        })
        .collect();
    check(2, &ops).unwrap();
}
