//! The books balance on any schedule: random arrivals, run times and endings through one limit
//! shared by two layers and by `resources_operation`, with a queue bound and queue timeouts
//! drawn too, and the limit of any kind (the crate's `Limit`, a tokio `Semaphore`, or a pool of
//! the tests' own that implements only `Acquire::acquire`), on paused tokio time, so every case is
//! deterministic and replays from its seed (proptest saves failing seeds next to this file). And
//! the same for the body-end form: random arrivals, stream lengths, gaps between frames and
//! endings of streamed bodies.
//!
//! On paused time the clock moves only when every task waits on a timer, so the test side can
//! read the very instants the layer reads: from what each caller got, it knows what became of
//! each operation (admitted, after which wait, for how long, and how it ended; rejected, for
//! which reason and when; or abandoned), and besides the counts, the sums of both histograms
//! must equal the waits and run times the test itself measured.
//!
//! The operations are those of `stress` (the one driver in `support::reliability`: `run` and
//! `run_stream`); here they run in small random schedules, and the test adds what only paused
//! time can check: each wait and run time to the microsecond.

mod support;

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use proptest::prelude::*;
use tokio::time::Instant;

use support::reliability::{
    assert_books, assert_live_counts_zero, quiet_expected_panics, run_stream, series_attributes,
    AnyLimit, Books, Ending, Fate, LimitKind, Limited, Op, Pass, Ran, Series, StreamEnding,
    StreamOp, StreamRoute, Waits, LIMIT_KINDS,
};
use support::{within, Telemetry};
use tower_resources_operation::names::{
    DURATION_INSTRUMENT, OUTCOME_ATTRIBUTE, QUEUE_DURATION_INSTRUMENT,
};
use tower_resources_operation::{Executor, Limit, Operation, OperationMetrics, Outcome, Rejection};

/// The two series that share the limit.
const VERIFY: Series = (Operation::Verify, Executor::Inline);
const JUDGE: Series = (Operation::Judge, Executor::Thread);

const fn ms(ms: u64) -> Duration {
    Duration::from_millis(ms)
}

fn millis(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1_000.0
}

// ---------------------------------------------------------------------------------------------
// What the test measures of a schedule
// ---------------------------------------------------------------------------------------------

/// What the test saw of one operation.
#[derive(Debug)]
struct Record {
    series: Series,
    arrived: Instant,
    /// When it got its permit, if it did.
    admitted: Option<Instant>,
    fate: Fate,
    /// When it ended, was turned away or was given up.
    at: Instant,
}

/// Runs `operation`, of `series`, once `arrival` has passed, and says what the test saw of it.
async fn recorded(
    series: Series,
    arrival: Duration,
    operation: impl Future<Output = Ran>,
) -> Record {
    tokio::time::sleep(arrival).await;
    let arrived = Instant::now();
    let Ran { fate, admitted } = operation.await;
    Record {
        series,
        arrived,
        admitted,
        fate,
        at: Instant::now(),
    }
}

/// Runs the operations of a schedule on a fresh current-thread runtime on paused time; returns
/// their records, in order. A lost permit would leave tasks waiting on nothing: on paused time the
/// safety net then comes at once and fails the case instead of hanging it.
fn run_schedule<F>(operations: Vec<F>) -> Vec<Record>
where
    F: Future<Output = Record> + Send + 'static,
{
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap();
    runtime.block_on(async {
        let tasks: Vec<_> = operations.into_iter().map(tokio::spawn).collect();
        within("the schedule", async {
            let mut records = Vec::new();
            for task in tasks {
                records.push(task.await.unwrap());
            }
            records
        })
        .await
    })
}

/// What the test measured of a schedule: its books, and the total wait and run time of the
/// admitted operations, per series (and outcome), in ms.
struct Measured {
    books: Books,
    queue_ms: BTreeMap<Series, f64>,
    run_ms: BTreeMap<(Series, Outcome), f64>,
}

/// Checks every record against what it says happened, and returns what the test measured.
fn books_of(
    records: &[Record],
    queue_timeouts: &BTreeMap<Series, Duration>,
) -> Result<Measured, TestCaseError> {
    let mut books = Books::default();
    let mut queue_ms: BTreeMap<Series, f64> = BTreeMap::new();
    let mut run_ms: BTreeMap<(Series, Outcome), f64> = BTreeMap::new();
    for record in records {
        match (record.fate, record.admitted) {
            (Fate::Ended(outcome), Some(admitted)) => {
                *queue_ms.entry(record.series).or_default() += millis(admitted - record.arrived);
                *run_ms.entry((record.series, outcome)).or_default() +=
                    millis(record.at - admitted);
            }
            (Fate::Ended(_), None) => {
                return Err(TestCaseError::fail(format!("ended unadmitted: {record:?}")));
            }
            (_, Some(_)) => {
                return Err(TestCaseError::fail(format!(
                    "admitted, not ended: {record:?}"
                )));
            }
            (Fate::Rejected(Rejection::QueueFull), None) => {
                // A full queue turns an operation away the moment it asks.
                prop_assert_eq!(record.at, record.arrived, "{:?}", record);
            }
            (Fate::Rejected(Rejection::QueueTimeout), None) => {
                // Exactly its layer's queue timeout after it started to wait.
                prop_assert_eq!(
                    Some(&(record.at - record.arrived)),
                    queue_timeouts.get(&record.series),
                    "{:?}",
                    record
                );
            }
            (Fate::Rejected(Rejection::Unavailable), None) => {
                return Err(TestCaseError::fail(format!(
                    "no limit of these schedules closes or fails: {record:?}"
                )));
            }
            (Fate::Rejected(Rejection::Deadline), None) => {
                return Err(TestCaseError::fail(format!(
                    "no layer of these schedules knows a server deadline: {record:?}"
                )));
            }
            (Fate::Abandoned, None) => {}
        }
        books.record(record.series, record.fate);
    }
    Ok(Measured {
        books,
        queue_ms,
        run_ms,
    })
}

/// The books the metrics exported are the test's, the histograms' sums are the waits and run
/// times the test measured, and the live counts are back to 0.
fn check_metrics(telemetry: &Telemetry, measured: &Measured) -> Result<(), TestCaseError> {
    assert_books(telemetry, &measured.books);
    for (series, expected) in &measured.queue_ms {
        let sum = telemetry.sum(QUEUE_DURATION_INSTRUMENT, &series_attributes(*series));
        prop_assert!(
            (sum - expected).abs() < 1e-6,
            "queue time of {:?}: recorded {} ms, waited {} ms",
            series,
            sum,
            expected
        );
    }
    for ((series, outcome), expected) in &measured.run_ms {
        let [operation, executor] = series_attributes(*series);
        let filter = [operation, executor, (OUTCOME_ATTRIBUTE, outcome.as_str())];
        let sum = telemetry.sum(DURATION_INSTRUMENT, &filter);
        prop_assert!(
            (sum - expected).abs() < 1e-6,
            "run time of {:?}: recorded {} ms, ran {} ms",
            filter,
            sum,
            expected
        );
    }
    assert_live_counts_zero(telemetry);
    Ok(())
}

/// Runs the `operations` of a schedule through `limited` ([`run_schedule`]) and checks them:
/// every permit back, the peak load, one fate per operation, each rejection when it should come
/// (a layer's queue timeout from `queue_timeouts`), the books, the sums and the live counts;
/// returns the books.
fn run_and_check<F>(
    telemetry: &Telemetry,
    limited: &Limited,
    operations: Vec<F>,
    queue_timeouts: &BTreeMap<Series, Duration>,
) -> Result<Books, TestCaseError>
where
    F: Future<Output = Record> + Send + 'static,
{
    let planned = operations.len();
    let records = run_schedule(operations);
    limited.assert_idle();
    let measured = books_of(&records, queue_timeouts)?;
    prop_assert_eq!(measured.books.asked_total(), planned as u64);
    check_metrics(telemetry, &measured)?;
    Ok(measured.books)
}

// ---------------------------------------------------------------------------------------------
// Schedules, with bounded waiting
// ---------------------------------------------------------------------------------------------

/// One operation of a schedule: when it arrives, what it does, and its route (the series, and a
/// layer or `resources_operation`).
#[derive(Clone, Copy, Debug)]
struct Planned {
    arrival_ms: u64,
    op: Op,
    judge: bool,
    scoped: bool,
}

impl Planned {
    /// Its route among those of [`limited`].
    fn route(&self) -> usize {
        usize::from(self.judge) + 2 * usize::from(self.scoped)
    }
}

/// How waits on the limit are bounded: its queue, and each layer's queue timeout, in ms.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Bounds {
    max_queued: Option<usize>,
    verify_timeout_ms: Option<u64>,
    judge_timeout_ms: Option<u64>,
}

impl Bounds {
    /// These bounds as a limit of `kind` takes them: only the crate's `Limit` bounds its queue.
    fn for_kind(self, kind: LimitKind) -> Self {
        match kind {
            LimitKind::Limit => self,
            LimitKind::Semaphore | LimitKind::Pool => Self {
                max_queued: None,
                ..self
            },
        }
    }

    /// How a layer with a queue timeout of `timeout_ms` waits on a limit so bounded: a limit
    /// that may turn operations away needs layers that answer rejections.
    fn waits(&self, timeout_ms: Option<u64>) -> Waits {
        match (timeout_ms, self.max_queued) {
            (Some(timeout), _) => Waits::AtMost(ms(timeout)),
            (None, Some(_)) => Waits::Answered,
            (None, None) => Waits::Unbounded,
        }
    }

    /// Each layer's queue timeout.
    fn queue_timeouts(&self) -> BTreeMap<Series, Duration> {
        [
            (VERIFY, self.verify_timeout_ms),
            (JUDGE, self.judge_timeout_ms),
        ]
        .into_iter()
        .filter_map(|(series, timeout)| Some((series, ms(timeout?))))
        .collect()
    }
}

fn ending() -> impl Strategy<Value = Ending> {
    prop_oneof![
        Just(Ending::Ok),
        Just(Ending::Err),
        Just(Ending::PanicInCall),
        Just(Ending::PanicInPoll),
        Just(Ending::SetTimeout),
        Just(Ending::SetOkThenErr),
        (0..20u64).prop_map(|after| Ending::DropInFlight(ms(after))),
        (0..40u64).prop_map(|after| Ending::GiveUpAfter(ms(after))),
        (0..20u64).prop_map(|deadline| Ending::TowerTimeout(ms(deadline))),
        (0..20u64).prop_map(|after| Ending::ReadyUnused(ms(after))),
    ]
}

fn planned() -> impl Strategy<Value = Planned> {
    (
        0..50u64,
        0..20u64,
        ending(),
        any::<bool>(),
        proptest::bool::weighted(0.2),
    )
        .prop_map(|(arrival_ms, run_ms, ending, judge, scoped)| Planned {
            arrival_ms,
            op: Op {
                ending,
                run: ms(run_ms),
            },
            judge,
            scoped,
        })
}

fn bounds() -> impl Strategy<Value = Bounds> {
    use proptest::option::weighted;
    (
        weighted(0.5, 0..6usize),
        weighted(0.4, 0..25u64),
        weighted(0.4, 0..25u64),
    )
        .prop_map(|(max_queued, verify_timeout_ms, judge_timeout_ms)| Bounds {
            max_queued,
            verify_timeout_ms,
            judge_timeout_ms,
        })
}

fn kind() -> impl Strategy<Value = LimitKind> {
    prop_oneof![
        Just(LimitKind::Limit),
        Just(LimitKind::Semaphore),
        Just(LimitKind::Pool)
    ]
}

/// A limit of `kind` and its routes: a layer per series, bounded as `bounds` say, then
/// `resources_operation` per series, given the limit by reference.
fn limited(
    kind: LimitKind,
    capacity: usize,
    bounds: &Bounds,
    metrics: &OperationMetrics,
) -> Limited {
    let limit = AnyLimit::new(kind, capacity, bounds.max_queued);
    let layer = |series, timeout_ms| {
        (
            series,
            limit.layer(series, metrics, bounds.waits(timeout_ms)),
        )
    };
    let scoped = |series| (series, limit.scoped(series, metrics, Pass::Borrowed));
    let routes = vec![
        layer(VERIFY, bounds.verify_timeout_ms),
        layer(JUDGE, bounds.judge_timeout_ms),
        scoped(VERIFY),
        scoped(JUDGE),
    ];
    Limited::new(limit, capacity, routes)
}

/// Runs one schedule through a limit of `kind` on a fresh paused runtime and checks the books,
/// the sums, the live counts, the permits and the peak load; returns the books. `bounds` must
/// suit `kind` ([`Bounds::for_kind`]).
fn check(
    kind: LimitKind,
    capacity: usize,
    bounds: Bounds,
    schedule: &[Planned],
) -> Result<Books, TestCaseError> {
    quiet_expected_panics();
    assert_eq!(
        bounds,
        bounds.for_kind(kind),
        "{kind:?} cannot bound its queue"
    );
    let telemetry = Telemetry::new();
    let limited = limited(kind, capacity, &bounds, &telemetry.metrics);
    let operations = schedule
        .iter()
        .map(|planned| {
            let (series, route) = limited.routes[planned.route()].clone();
            let operation = limited.run(planned.op, route);
            recorded(series, ms(planned.arrival_ms), operation)
        })
        .collect();
    let books = run_and_check(&telemetry, &limited, operations, &bounds.queue_timeouts())?;
    if bounds.max_queued.is_none() {
        prop_assert_eq!(books.rejected_total(Rejection::QueueFull), 0);
    }
    Ok(books)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn any_schedule_records_each_operation_once_as_admitted_with_its_wait_and_run_time_rejected_or_abandoned(
        kind in kind(),
        limit in 1usize..=4,
        bounds in bounds(),
        schedule in proptest::collection::vec(planned(), 1..=30),
    ) {
        let bounds = bounds.for_kind(kind);
        let books = check(kind, limit, bounds, &schedule)?;
        if bounds == Bounds::default() {
            prop_assert_eq!(books.rejected.len(), 0, "unbounded waits were turned away");
        }
    }
}

/// The endings of the fixed schedules, each under contention, and whether each goes through
/// `resources_operation`.
const FIXED_ENDINGS: [(Ending, bool); 12] = [
    (Ending::Ok, false),
    (Ending::Err, false),
    (Ending::PanicInPoll, false),
    (Ending::SetTimeout, false),
    (Ending::DropInFlight(ms(3)), false),
    (Ending::GiveUpAfter(ms(1)), false),
    (Ending::GiveUpAfter(ms(30)), false),
    (Ending::TowerTimeout(ms(2)), false),
    (Ending::TowerTimeout(ms(30)), false),
    (Ending::ReadyUnused(ms(4)), false),
    (Ending::Ok, true),
    (Ending::Err, true),
];

/// 36 operations, `spread` ms apart in groups of four.
fn fixed_schedule(spread: u64) -> Vec<Planned> {
    (0..36)
        .map(|i| {
            let (ending, scoped) = FIXED_ENDINGS[i % FIXED_ENDINGS.len()];
            Planned {
                arrival_ms: (i % 4) as u64 + spread * (i / 4) as u64,
                op: Op {
                    ending,
                    run: ms(5 + (i % 3) as u64),
                },
                judge: i % 2 == 1,
                scoped,
            }
        })
        .collect()
}

/// Runs [`fixed_schedule`] of `spread` through a limit of `kind` of 2, bounded as `bounds` say,
/// and checks it: under contention, some operations are given up while they wait, and some are
/// admitted. Returns the books.
fn check_fixed(kind: LimitKind, bounds: Bounds, spread: u64) -> Books {
    let books = check(kind, 2, bounds, &fixed_schedule(spread)).unwrap();
    assert!(
        books.abandoned_total() > 0,
        "{kind:?}: none abandoned: {books:?}"
    );
    assert!(
        books.admitted_total() > 0,
        "{kind:?}: none admitted: {books:?}"
    );
    books
}

/// One fixed schedule that exercises every ending under contention, as a plain test, through
/// each kind of limit.
#[test]
fn a_fixed_schedule_with_every_ending_balances_the_books_with_each_kind_of_limit() {
    for kind in LIMIT_KINDS {
        check_fixed(kind, Bounds::default(), 0);
    }
}

/// The same schedule on a bounded queue, with a queue timeout on one layer: some are turned away
/// for a full queue, some for waiting too long, some are given up while they wait.
#[test]
fn a_fixed_schedule_on_a_bounded_queue_balances_the_books_by_reason() {
    let bounds = Bounds {
        max_queued: Some(4),
        verify_timeout_ms: Some(6),
        judge_timeout_ms: None,
    };
    let books = check_fixed(LimitKind::Limit, bounds, 4);
    // The schedule covers every fate.
    for rejection in [Rejection::QueueFull, Rejection::QueueTimeout] {
        assert!(
            books.rejected_total(rejection) > 0,
            "no {rejection}: {books:?}"
        );
    }
}

/// A queue timeout on one layer, through each kind of limit: the semaphore and the pool cannot
/// bound their queues, yet their waits time out, are given up and are admitted by the same rules.
#[test]
fn a_fixed_schedule_with_a_queue_timeout_balances_the_books_with_each_kind_of_limit() {
    let bounds = Bounds {
        max_queued: None,
        verify_timeout_ms: Some(6),
        judge_timeout_ms: None,
    };
    for kind in LIMIT_KINDS {
        let books = check_fixed(kind, bounds, 4);
        assert!(
            books.rejected_total(Rejection::QueueTimeout) > 0,
            "{kind:?}: none timed out: {books:?}"
        );
        assert_eq!(books.rejected_total(Rejection::QueueFull), 0, "{kind:?}");
    }
}

// ---------------------------------------------------------------------------------------------
// The body-end form
// ---------------------------------------------------------------------------------------------

/// One streamed operation of a schedule: when it arrives, what it does, and whether it goes
/// through the gRPC layer (or the HTTP one).
#[derive(Clone, Copy, Debug)]
struct PlannedStream {
    arrival_ms: u64,
    op: StreamOp,
    grpc: bool,
}

fn stream_ending() -> impl Strategy<Value = StreamEnding> {
    prop_oneof![
        2 => Just(StreamEnding::ReadToEnd),
        1 => Just(StreamEnding::Fail),
        1 => prop_oneof![Just("0"), Just("1"), Just("4"), Just("13")]
            .prop_map(StreamEnding::Trailers),
        1 => Just(StreamEnding::Panic),
        1 => Just(StreamEnding::SetTimeout),
        1 => Just(StreamEnding::HeadError),
        1 => Just(StreamEnding::ServiceError),
        1 => (0..6usize, 0..10u64).prop_map(|(read, wait)| StreamEnding::DropAfter(read, ms(wait))),
        1 => Just(StreamEnding::DropBeforeHead),
        1 => (0..60u64).prop_map(|after| StreamEnding::GiveUpAfter(ms(after))),
    ]
}

fn planned_stream() -> impl Strategy<Value = PlannedStream> {
    (0..40u64, 0..5usize, 0..6u64, stream_ending(), any::<bool>()).prop_map(
        |(arrival_ms, frames, gap_ms, ending, grpc)| PlannedStream {
            arrival_ms,
            op: StreamOp {
                frames,
                gap: ms(gap_ms),
                ending,
            },
            grpc,
        },
    )
}

/// Runs one schedule of streamed operations on a fresh paused runtime and checks the books, the
/// sums (each run ends when its body does), the live counts, the permits and the peak load.
fn check_streams(capacity: usize, schedule: &[PlannedStream]) -> Result<(), TestCaseError> {
    quiet_expected_panics();
    let telemetry = Telemetry::new();
    let metrics = &telemetry.metrics;
    let limit = Limit::new(capacity);
    let http = StreamRoute::http(&limit, VERIFY, metrics);
    let grpc = StreamRoute::grpc(&limit, JUDGE, metrics);
    let limited = Limited::new(AnyLimit::Limit(limit), capacity, Vec::new());
    let operations = schedule
        .iter()
        .map(|planned| {
            let route = if planned.grpc { &grpc } else { &http };
            let operation = run_stream(route.clone(), planned.op, Arc::clone(&limited.load));
            recorded(route.series, ms(planned.arrival_ms), operation)
        })
        .collect();
    let books = run_and_check(&telemetry, &limited, operations, &BTreeMap::new())?;
    prop_assert_eq!(books.rejected.len(), 0, "nothing bounds these waits");
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn any_schedule_of_streamed_bodies_runs_each_operation_from_admission_to_the_end_of_its_body(
        limit in 1usize..=3,
        schedule in proptest::collection::vec(planned_stream(), 1..=24),
    ) {
        check_streams(limit, &schedule)?;
    }
}

/// One fixed schedule of streamed operations with every ending, over both protocols.
#[test]
fn a_fixed_schedule_of_streamed_bodies_with_every_ending_balances_the_books() {
    let endings = [
        StreamEnding::ReadToEnd,
        StreamEnding::Fail,
        StreamEnding::Trailers("0"),
        StreamEnding::Trailers("4"),
        StreamEnding::Trailers("13"),
        StreamEnding::Panic,
        StreamEnding::SetTimeout,
        StreamEnding::HeadError,
        StreamEnding::ServiceError,
        StreamEnding::DropAfter(1, ms(3)),
        StreamEnding::DropBeforeHead,
        StreamEnding::GiveUpAfter(ms(2)),
        StreamEnding::GiveUpAfter(ms(12)),
    ];
    let schedule: Vec<_> = (0..48)
        .map(|i| PlannedStream {
            arrival_ms: (i % 5) as u64,
            op: StreamOp {
                frames: i % 4,
                gap: ms(1 + (i % 3) as u64),
                ending: endings[i % endings.len()],
            },
            grpc: (i / endings.len()) % 2 == 1,
        })
        .collect();
    check_streams(2, &schedule).unwrap();
}
