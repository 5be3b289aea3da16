//! Thousands of operations of every kind through shared limits on a multi-threaded runtime: every
//! operation that asks for a permit ends up exactly one of admitted (and ended with the outcome
//! the test expects), rejected (by reason) or abandoned, the books the test keeps of that match
//! the metrics exactly, per series, every permit comes back, the inner work never runs above its
//! limit, and the live counts return to 0.
//!
//! Each rule is checked with each kind of limit (the crate's `Limit`, a tokio `Semaphore`, and a
//! pool of reusable resources implemented in the shared reliability module as an `Acquire`),
//! through layers and through `resources_operation`; then under bounded waiting (a queue bound
//! shared by layers and scoped calls, queue timeouts, callers giving up while they wait), with
//! `Limit::set_capacity` raising and lowering the limit while it serves, with a limit closed
//! under its waiters, and in the body-end form, where a streamed body ends its operation in every
//! way a body can end.
//!
//! The operations are those of `properties` (the one driver in `support::reliability`: `run`
//! and `run_stream`); here they run by the thousand on real time and two threads, and the test
//! adds what only load brings: waits given up in full queues, gates that hold every permit, a
//! limit resized and one closed under their waiters.

mod support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http::Request;
use tokio::sync::{mpsc, oneshot, watch};
use tower::ServiceExt as _;

use support::reliability::{
    admitted_at, assert_books, assert_live_counts_zero, drain, layer_on, layered, live_count,
    quiet_closed_limit_panics, quiet_expected_panics, run_stream, until_body_end, Admission,
    AnyLimit, Books, BoxError, Drained, Ending, Fate, LimitKind, Limited, Load, Op, Pass, Rng,
    Route, Script, Series, StreamEnding, StreamOp, StreamRoute, Then, Waits, Work, FOREVER,
    LIMIT_CLOSED_PANIC,
};
use support::Telemetry;
use support::{eventually, panic_message, within};
use tower_resources_operation::names::LIMIT_INSTRUMENT;
use tower_resources_operation::{
    Executor, Limit, Operation, OperationMetrics, Outcome, Rejection, ResourcesOperationLayer,
};

/// Work that ends `ok` at once.
fn ok() -> Work {
    Work::Run(Duration::ZERO, Then::Ok)
}

// ---------------------------------------------------------------------------------------------
// The limits, and the mix
// ---------------------------------------------------------------------------------------------

/// Routes to `limit`: a layer for each of `layers`, and `resources_operation` (by value) for
/// `scoped`.
fn routes(
    limit: &AnyLimit,
    metrics: &OperationMetrics,
    layers: &[Series],
    scoped: Series,
) -> Vec<(Series, Route)> {
    let mut routes: Vec<_> = layers
        .iter()
        .map(|series| (*series, limit.layer(*series, metrics, Waits::Unbounded)))
        .collect();
    routes.push((scoped, limit.scoped(scoped, metrics, Pass::Owned)));
    routes
}

/// Three limits, one of each kind, ten series, one `OperationMetrics`: the crate's `Limit` (made
/// by `ResourcesOperationLayer::new`), an `Arc<Semaphore>` and a `Pool`, each reached through
/// layers and through `resources_operation`.
fn limits(metrics: &OperationMetrics) -> Vec<Limited> {
    let limited = |limit: AnyLimit, capacity, layers: &[Series], scoped: Series| {
        let routes = routes(&limit, metrics, layers, scoped);
        Limited::new(limit, capacity, routes)
    };
    let verify = (Operation::Verify, Executor::Subprocess);
    let first = layer_on(3, verify, metrics);
    let limit = AnyLimit::Limit(first.limit().clone());
    let mut on_limit = limited(
        limit,
        3,
        &[(Operation::Judge, Executor::Inline)],
        (Operation::Other, Executor::Inline),
    );
    on_limit.routes.insert(0, (verify, layered(first)));
    let on_semaphore = limited(
        AnyLimit::new(LimitKind::Semaphore, 2, None),
        2,
        &[
            (Operation::Tool, Executor::Thread),
            (Operation::Other, Executor::Process),
            (Operation::Verify, Executor::Thread),
        ],
        (Operation::Tool, Executor::Other),
    );
    let on_pool = limited(
        AnyLimit::new(LimitKind::Pool, 2, None),
        2,
        &[
            (Operation::Judge, Executor::Process),
            (Operation::Tool, Executor::Subprocess),
        ],
        (Operation::Verify, Executor::Other),
    );
    vec![on_limit, on_semaphore, on_pool]
}

/// The mix: every ending, each with its work ending at once (tower's timeout races work that
/// never ends by itself).
const MIX: [Op; 9] = [
    Op::new(Ending::Ok),
    Op::new(Ending::Err),
    Op::new(Ending::PanicInCall),
    Op::new(Ending::PanicInPoll),
    Op::new(Ending::SetTimeout),
    Op::new(Ending::SetOkThenErr),
    Op {
        ending: Ending::TowerTimeout(Duration::from_millis(1)),
        run: FOREVER,
    },
    Op::new(Ending::DropInFlight(Duration::ZERO)),
    Op::new(Ending::ReadyUnused(Duration::ZERO)),
];

/// An operation of [`MIX`], or (one time in ten, if `give_ups`) one whose caller gives up after
/// 0 to 3 ms.
fn pick(rng: &mut Rng, give_ups: bool) -> Op {
    if give_ups && rng.below(10) == 0 {
        Op::new(Ending::GiveUpAfter(Duration::from_micros(rng.below(3_000))))
    } else {
        MIX[rng.below(MIX.len() as u64) as usize]
    }
}

/// Records `fate` of an operation of `series` on a limit that never turns one away.
fn record_unbounded(books: &mut Books, series: Series, fate: Fate) {
    assert!(
        !matches!(fate, Fate::Rejected(_)),
        "an unbounded limit turned {series:?} away"
    );
    books.record(series, fate);
}

/// Operations that wait on a gate, started through routes of `limit` picked by `rng` until
/// `count` hold a permit.
struct Gates {
    open: watch::Sender<bool>,
    held: Vec<(Series, tokio::task::JoinHandle<Result<String, BoxError>>)>,
}

impl Gates {
    async fn fill(limits: &[(&Limited, usize)], rng: &mut Rng) -> Self {
        let (open, open_rx) = watch::channel(false);
        let (started_tx, mut started_rx) = mpsc::unbounded_channel();
        let mut held = Vec::new();
        for (limit, count) in limits {
            for _ in 0..*count {
                let (series, route) = limit.pick(rng);
                let work = Work::Gate {
                    started: started_tx.clone(),
                    open: open_rx.clone(),
                };
                let answer = limit.serve(&route, work, &Admission::default());
                held.push((series, tokio::spawn(answer)));
            }
        }
        for _ in 0..held.len() {
            within("a gate operation", started_rx.recv()).await;
        }
        Self { open, held }
    }

    /// Opens the gates; each gate operation ends `ok`.
    async fn open(self, books: &mut Books) {
        self.open.send(true).unwrap();
        for (series, gate) in self.held {
            let answer = within("a gate operation", gate).await.unwrap().unwrap();
            assert_eq!(answer, "gate");
            books.ended(series, Outcome::Ok);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Unbounded waiting, every kind of limit
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_thousand_mixed_operations_on_shared_limits_are_each_recorded_exactly_once() {
    const WAVES: usize = 20;
    const OPS_PER_WAVE: usize = 190;
    const QUEUE_DROPS_PER_WAVE: usize = 10;

    quiet_expected_panics();
    let telemetry = Telemetry::new();
    let limits = limits(&telemetry.metrics);
    let mut rng = Rng::new(0x5eed_0001);
    let mut books = Books::default();
    let mut dropped_in_queue = 0;

    for _ in 0..WAVES {
        // Fill every limit with operations that wait on a gate, so that the waits given up below
        // are certain to be given up in the queue.
        let full: Vec<_> = limits.iter().map(|limit| (limit, limit.capacity)).collect();
        let gates = Gates::fill(&full, &mut rng).await;
        for limit in &limits {
            assert_eq!(limit.limit.available(), 0, "{} is full", limit.limit.name());
        }

        let mut drops = Vec::new();
        for _ in 0..QUEUE_DROPS_PER_WAVE {
            let limit = &limits[rng.below(limits.len() as u64) as usize];
            let (series, route) = limit.pick(&mut rng);
            let admitted = Admission::default();
            let answer = limit.serve(&route, ok(), &admitted);
            drops.push((
                series,
                tokio::spawn(async move {
                    let waited = tokio::time::timeout(Duration::from_millis(1), answer).await;
                    assert!(waited.is_err(), "got a permit of a full limit: {waited:?}");
                    assert!(admitted_at(&admitted).is_none());
                }),
            ));
        }

        let mut operations = Vec::new();
        for _ in 0..OPS_PER_WAVE {
            let limit = &limits[rng.below(limits.len() as u64) as usize];
            let (series, route) = limit.pick(&mut rng);
            operations.push((
                series,
                tokio::spawn(limit.run(pick(&mut rng, false), route)),
            ));
        }

        for (series, dropped) in drops {
            within("a wait given up", dropped).await.unwrap();
            books.abandoned(series);
            dropped_in_queue += 1;
        }
        gates.open(&mut books).await;
        for (series, operation) in operations {
            let ran = within("an operation", operation).await.unwrap();
            record_unbounded(&mut books, series, ran.fate);
        }
    }

    for limit in &limits {
        limit.assert_idle();
        // The gates filled each limit, so the work did run at the limit.
        assert_eq!(limit.load.max(), limit.capacity, "{}", limit.limit.name());
    }
    assert_eq!(dropped_in_queue, WAVES * QUEUE_DROPS_PER_WAVE);
    // Abandoned: the waits given up, and the permits taken by `ready` and never called.
    let unused = books.abandoned_total() - dropped_in_queue as u64;
    assert!(unused > 0, "the mix never took a permit it did not use");
    let operations = (WAVES * OPS_PER_WAVE) as u64;
    let gates = (WAVES * limits.iter().map(|l| l.capacity).sum::<usize>()) as u64;
    assert_eq!(books.admitted_total(), operations - unused + gates);
    assert_eq!(
        books.asked_total(),
        operations + gates + dropped_in_queue as u64
    );
    for outcome in Outcome::ALL {
        assert!(
            books.outcome_total(*outcome) > 0,
            "the mix never ended an operation as {outcome}"
        );
    }
    for limit in &limits {
        for (series, _) in &limit.routes {
            assert!(
                books.asked(*series) > 0,
                "{}: {series:?} was never asked",
                limit.limit.name()
            );
        }
    }
    assert_books(&telemetry, &books);
    assert_live_counts_zero(&telemetry);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drops_and_timeouts_racing_admission_are_recorded_as_what_happened() {
    const OPS: usize = 2000;

    let telemetry = Telemetry::new();
    let limits = limits(&telemetry.metrics);
    let mut rng = Rng::new(0x5eed_0002);

    let mut operations = Vec::new();
    for i in 0..OPS {
        let limit = &limits[rng.below(limits.len() as u64) as usize];
        let (series, route) = limit.pick(&mut rng);
        let run = Duration::from_micros(rng.below(2_000));
        let deadline = Duration::from_micros(rng.below(2_000));
        // Arrivals spread over half a second keep the queue short enough that deadlines land
        // before admission, in flight and after the end alike (a few hundred of each).
        let arrival = Duration::from_micros(rng.below(500_000));
        // Half the callers give up after `deadline`: before the permit (abandoned), in flight
        // (cancelled), or not at all; for the other half tower's timeout races the work.
        let ending = if i % 2 == 0 {
            Ending::GiveUpAfter(deadline)
        } else {
            Ending::TowerTimeout(deadline)
        };
        let operation = limit.run(Op { ending, run }, route);
        operations.push((
            series,
            tokio::spawn(async move {
                tokio::time::sleep(arrival).await;
                operation.await
            }),
        ));
    }

    let mut books = Books::default();
    for (series, operation) in operations {
        let ran = within("an operation", operation).await.unwrap();
        record_unbounded(&mut books, series, ran.fate);
    }

    for limit in &limits {
        limit.assert_idle();
    }
    assert_eq!(books.asked_total(), OPS as u64);
    assert_books(&telemetry, &books);
    assert_live_counts_zero(&telemetry);
}

// ---------------------------------------------------------------------------------------------
// Bounded waiting, a resized limit, a closed limit
// ---------------------------------------------------------------------------------------------

/// Raises and lowers `limit` at random moments until `stop`; returns how many times it raised
/// and lowered it.
async fn resize(
    limit: Limit,
    smallest: usize,
    largest: usize,
    seed: u64,
    stop: Arc<AtomicBool>,
) -> (usize, usize) {
    let mut rng = Rng::new(seed);
    let (mut raised, mut lowered) = (0, 0);
    while !stop.load(Ordering::SeqCst) {
        let before = limit.capacity();
        let capacity = smallest + rng.below((largest - smallest + 1) as u64) as usize;
        limit.set_capacity(capacity).unwrap();
        if capacity > before {
            raised += 1;
        } else if capacity < before {
            lowered += 1;
        }
        if rng.below(2) == 0 {
            tokio::task::yield_now().await;
        } else {
            tokio::time::sleep(Duration::from_micros(rng.below(1_500))).await;
        }
    }
    (raised, lowered)
}

/// What became of an operation of the closing limit whose task panicked: its limit was closed
/// under it, under a layer that cannot answer, and the panic says so and names the limit. It
/// was counted as turned away, `unavailable`, before the panic.
fn closed_under(joined: tokio::task::JoinError) -> Fate {
    let message = panic_message(&*joined.into_panic());
    assert!(message.contains(LIMIT_CLOSED_PANIC), "{message}");
    assert!(
        message.contains(std::any::type_name::<Limit>()),
        "the panic names the limit: {message}"
    );
    Fate::Rejected(Rejection::Unavailable)
}

/// Runs `op`s through routes of `limit` picked by `rng`, at once; returns each one's series and
/// task.
fn spawn_picked(
    limit: &Limited,
    rng: &mut Rng,
    count: usize,
) -> Vec<(Series, tokio::task::JoinHandle<support::reliability::Ran>)> {
    (0..count)
        .map(|_| {
            let (series, route) = limit.pick(rng);
            (series, tokio::spawn(limit.run(pick(rng, false), route)))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bounded_waits_resized_and_closed_limits_under_load_end_each_operation_admitted_rejected_or_abandoned(
) {
    const WAVES: usize = 20;
    const OPS_PER_WAVE: usize = 150;
    const BASE: usize = 3;
    const LARGEST: usize = 6;
    const MAX_QUEUED: usize = 8;
    const OVERFLOW: usize = 3;
    const TIMED_OUT: usize = 2;
    const CLOSE_WAVE: usize = WAVES / 2;
    const CLOSING: usize = 2;
    const CLOSE_WAITERS: usize = 5;

    quiet_closed_limit_panics();
    let telemetry = Telemetry::new();
    let metrics = &telemetry.metrics;

    // One bounded queue for every layer and scoped call on `bounded`; two layers also bound
    // their own waits.
    let bounded = Limit::with_max_queued(BASE, MAX_QUEUED);
    let patient = (Operation::Verify, Executor::Subprocess);
    let impatient = (Operation::Judge, Executor::Inline);
    let hasty = (Operation::Tool, Executor::Thread);
    let by_hand = (Operation::Other, Executor::Process);
    let on_bounded = AnyLimit::Limit(bounded.clone());
    let waits = |series, waits| (series, on_bounded.layer(series, metrics, waits));
    let shared = Limited::new(
        on_bounded.clone(),
        LARGEST,
        vec![
            waits(patient, Waits::Answered),
            waits(impatient, Waits::AtMost(Duration::from_millis(2))),
            waits(hasty, Waits::AtMost(Duration::from_millis(1))),
            (by_hand, on_bounded.scoped(by_hand, metrics, Pass::Owned)),
        ],
    );
    // The routes that never stop waiting by themselves, and those that do.
    let waiting_for_ever = [shared.routes[0].clone(), shared.routes[3].clone()];
    let timing_out = [shared.routes[1].clone(), shared.routes[2].clone()];

    // A limit that is closed halfway, under its waiters.
    let closing = Limit::new(CLOSING);
    let closing_layer = (Operation::Verify, Executor::Thread);
    let closing_scoped = (Operation::Tool, Executor::Process);
    let on_closing = AnyLimit::Limit(closing.clone());
    let doomed = Limited::new(
        on_closing.clone(),
        CLOSING,
        routes(&on_closing, metrics, &[closing_layer], closing_scoped),
    );
    let is_closing = |series: Series| series == closing_layer || series == closing_scoped;

    let mut rng = Rng::new(0x5eed_0003);
    let mut books = Books::default();
    let (mut raised, mut lowered) = (0, 0);

    for wave in 0..WAVES {
        // Phase A, with the capacity fixed: certain queue_full, abandoned and queue_timeout.
        assert_eq!((bounded.capacity(), bounded.available()), (BASE, BASE));
        let gates = Gates::fill(&[(&shared, BASE)], &mut rng).await;
        assert_eq!(bounded.available(), 0);

        // Waiters that hold every place of the queue until told to give up.
        let mut give_ups = Vec::new();
        let mut held = Vec::new();
        for i in 0..MAX_QUEUED {
            let (series, route) = waiting_for_ever[i % 2].clone();
            let (give_up_tx, give_up_rx) = oneshot::channel::<()>();
            let admitted = Admission::default();
            let answer = shared.serve(&route, ok(), &admitted);
            give_ups.push(give_up_tx);
            held.push((
                series,
                tokio::spawn(async move {
                    tokio::select! {
                        biased;
                        answer = answer => panic!("a full limit answered {answer:?}"),
                        _ = give_up_rx => {}
                    }
                    assert!(admitted_at(&admitted).is_none());
                    Fate::Abandoned
                }),
            ));
        }
        eventually("the queue full", || bounded.queued() == MAX_QUEUED).await;

        // The queue is full: any more are turned away at once, whatever their route and kind.
        for (series, operation) in spawn_picked(&shared, &mut rng, OVERFLOW) {
            let ran = within("an overflowing operation", operation).await.unwrap();
            assert_eq!(ran.fate, Fate::Rejected(Rejection::QueueFull), "{series:?}");
            books.record(series, ran.fate);
        }

        drop(give_ups);
        for (series, waiter) in held {
            let fate = within("a waiter giving up", waiter).await.unwrap();
            books.record(series, fate);
        }
        assert_eq!(bounded.queued(), 0, "the abandoned waits left the queue");

        // Room in the queue, none at the limit: the layers with a queue timeout time out.
        let mut timeouts = Vec::new();
        for i in 0..TIMED_OUT {
            let (series, route) = timing_out[i % 2].clone();
            timeouts.push((series, tokio::spawn(shared.run(Op::new(Ending::Ok), route))));
        }
        for (series, operation) in timeouts {
            let ran = within("a timed-out wait", operation).await.unwrap();
            assert_eq!(
                ran.fate,
                Fate::Rejected(Rejection::QueueTimeout),
                "{series:?}"
            );
            books.record(series, ran.fate);
        }

        if wave == CLOSE_WAVE {
            // The closing limit, full, with waiters: closed under them.
            let closing_gates = Gates::fill(&[(&doomed, CLOSING)], &mut rng).await;
            let waiters = spawn_picked(&doomed, &mut rng, CLOSE_WAITERS);
            eventually("the closing limit's waiters queued", || {
                closing.queued() == CLOSE_WAITERS
            })
            .await;
            closing.close();
            for (series, waiter) in waiters {
                // The layer (which cannot answer) panics; the scoped call is turned away.
                let fate = match within("a waiter of the closed limit", waiter).await {
                    Ok(ran) => ran.fate,
                    Err(joined) => closed_under(joined),
                };
                assert_eq!(fate, Fate::Rejected(Rejection::Unavailable), "{series:?}");
                books.record(series, fate);
            }
            // Operations that hold a permit finish normally.
            closing_gates.open(&mut books).await;
        }
        gates.open(&mut books).await;

        // Phase B: a mix over both limits while the bounded one is resized at random moments.
        let stop = Arc::new(AtomicBool::new(false));
        let resizer = tokio::spawn(resize(
            bounded.clone(),
            1,
            LARGEST,
            0x5eed_0300 + wave as u64,
            Arc::clone(&stop),
        ));
        let mut operations = Vec::new();
        for _ in 0..OPS_PER_WAVE {
            let limit = if rng.below(4) == 0 { &doomed } else { &shared };
            let (series, route) = limit.pick(&mut rng);
            let operation = limit.run(pick(&mut rng, true), route);
            let arrival = Duration::from_micros(rng.below(4_000));
            operations.push((
                series,
                tokio::spawn(async move {
                    tokio::time::sleep(arrival).await;
                    operation.await
                }),
            ));
        }
        for (series, operation) in operations {
            let fate = match within("an operation", operation).await {
                Ok(ran) => ran.fate,
                Err(joined) => {
                    assert!(
                        is_closing(series) && wave >= CLOSE_WAVE,
                        "{series:?} panicked: {}",
                        panic_message(&*joined.into_panic())
                    );
                    closed_under(joined)
                }
            };
            books.record(series, fate);
        }
        stop.store(true, Ordering::SeqCst);
        let (up, down) = within("the resizer", resizer).await.unwrap();
        raised += up;
        lowered += down;

        // Every operation is over: restored, the limit has every place free again.
        bounded.set_capacity(BASE).unwrap();
        assert_eq!(bounded.available(), bounded.capacity(), "wave {wave}");
        assert_eq!(bounded.queued(), 0);
    }

    assert!(
        raised > 0 && lowered > 0,
        "raised {raised}, lowered {lowered}"
    );
    assert_eq!((bounded.capacity(), bounded.available()), (BASE, BASE));
    assert_eq!((closing.available(), closing.queued()), (CLOSING, 0));
    assert!(
        shared.load.max() >= BASE,
        "the gates filled the bounded limit"
    );
    assert!(
        shared.load.max() <= LARGEST,
        "{} ran at once; the capacity never went above {LARGEST}",
        shared.load.max()
    );
    assert!(doomed.load.max() <= CLOSING);
    assert_eq!(shared.load.running() + doomed.load.running(), 0);
    let gauge = live_count(&telemetry, LIMIT_INSTRUMENT, patient);
    assert_eq!(gauge, BASE as i64, "the limit gauge follows set_capacity");

    println!("books: {books:?}");
    assert!(books.rejected_total(Rejection::QueueFull) >= (WAVES * OVERFLOW) as u64);
    assert!(books.rejected_total(Rejection::QueueTimeout) >= (WAVES * TIMED_OUT) as u64);
    assert!(books.abandoned_total() >= (WAVES * MAX_QUEUED) as u64);
    assert!(books.rejected_total(Rejection::Unavailable) >= CLOSE_WAITERS as u64);
    for series in [closing_layer, closing_scoped] {
        assert!(
            books
                .rejected
                .contains_key(&(series, Rejection::Unavailable)),
            "{series:?} was turned away once its limit closed"
        );
        for rejection in [Rejection::QueueFull, Rejection::QueueTimeout] {
            assert!(
                !books.rejected.contains_key(&(series, rejection)),
                "the closing limit has no bound, yet {series:?} was turned away"
            );
        }
    }
    for series in [patient, by_hand] {
        assert!(
            !books
                .rejected
                .contains_key(&(series, Rejection::QueueTimeout)),
            "{series:?} has no queue timeout"
        );
    }
    for outcome in Outcome::ALL {
        assert!(
            books.outcome_total(*outcome) > 0,
            "the mix never ended an operation as {outcome}"
        );
    }
    assert_books(&telemetry, &books);
    assert_live_counts_zero(&telemetry);
}

// ---------------------------------------------------------------------------------------------
// The body-end form
// ---------------------------------------------------------------------------------------------

/// A streamed operation of the mix: its ending and its length picked by `rng`.
fn pick_streamed(rng: &mut Rng) -> StreamOp {
    let choice = rng.below(11);
    let ending = match choice {
        0 => StreamEnding::ReadToEnd,
        1 => StreamEnding::Fail,
        2 => StreamEnding::Trailers(["0", "1", "4", "13"][rng.below(4) as usize]),
        3 => StreamEnding::Panic,
        4 => StreamEnding::SetTimeout,
        5 => StreamEnding::HeadError,
        6 => StreamEnding::ServiceError,
        8 => StreamEnding::DropBeforeHead,
        9 => StreamEnding::GiveUpAfter(Duration::from_micros(rng.below(6_000))),
        _ => StreamEnding::ReadToEnd,
    };
    let frames = rng.below(5) as usize;
    if choice == 7 {
        // Dropped mid-stream, after all but one of its frames.
        return StreamOp {
            frames: frames + 1,
            gap: Duration::ZERO,
            ending: StreamEnding::DropAfter(frames, Duration::ZERO),
        };
    }
    StreamOp {
        frames,
        gap: Duration::ZERO,
        ending,
    }
}

/// A stream of `frames` frames read to its end.
fn read_to_end(frames: usize) -> StreamOp {
    StreamOp {
        frames,
        gap: Duration::ZERO,
        ending: StreamEnding::ReadToEnd,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_bodies_under_load_hold_their_permits_to_the_end_and_end_every_way_a_body_can() {
    const WAVES: usize = 16;
    const OPS_PER_WAVE: usize = 150;
    const CAPACITY: usize = 3;
    const HELD_GIVE_UPS: usize = 4;
    const TIMED_OUT: usize = 2;

    quiet_expected_panics();
    let telemetry = Telemetry::new();
    let metrics = &telemetry.metrics;
    let limit = Limit::new(CAPACITY);
    let streams = Arc::new(Load::default());
    let verify = (Operation::Verify, Executor::Subprocess);
    let http = StreamRoute::http(&limit, verify, metrics);
    let judge = (Operation::Judge, Executor::Thread);
    let grpc = StreamRoute::grpc(&limit, judge, metrics);
    let tool = (Operation::Tool, Executor::Inline);
    let layer = ResourcesOperationLayer::new_for_http(limit.clone());
    let layer = until_body_end(layer.queue_timeout(Duration::from_millis(3)), tool, metrics);
    let impatient = StreamRoute::new(tool, false, layer).rejecting(Rejection::QueueTimeout);
    let routes = [http.clone(), grpc.clone(), impatient.clone()];
    let http_or_grpc = |i: usize| if i % 2 == 0 { &http } else { &grpc };
    let mut rng = Rng::new(0x5eed_0004);
    let mut books = Books::default();

    for _ in 0..WAVES {
        // Streams that hold every permit until the gate opens, their heads already answered.
        let (open_tx, open_rx) = watch::channel(false);
        let (started_tx, mut started_rx) = mpsc::unbounded_channel();
        let mut gates = Vec::new();
        for i in 0..CAPACITY {
            let route = http_or_grpc(i);
            let service = route.service();
            let mut script = Script::new(read_to_end(2), Arc::clone(&streams));
            script.gate = Some((started_tx.clone(), open_rx.clone()));
            gates.push((
                route.series,
                tokio::spawn(async move {
                    let response = service.oneshot(Request::new(script)).await.unwrap();
                    drain(&mut response.into_body()).await
                }),
            ));
        }
        for _ in 0..CAPACITY {
            within("a gate stream", started_rx.recv()).await;
        }
        assert_eq!(limit.available(), 0, "the streams hold every permit");

        // Waiters given up while they wait.
        let mut give_ups = Vec::new();
        let mut held = Vec::new();
        for i in 0..HELD_GIVE_UPS {
            let route = http_or_grpc(i);
            let (give_up_tx, give_up_rx) = oneshot::channel::<()>();
            let service = route.service();
            let script = Script::new(read_to_end(1), Arc::clone(&streams));
            let admitted = Arc::clone(&script.admitted);
            give_ups.push(give_up_tx);
            held.push((
                route.series,
                tokio::spawn(async move {
                    tokio::select! {
                        biased;
                        _ = service.oneshot(Request::new(script)) => panic!("a full limit answered"),
                        _ = give_up_rx => {}
                    }
                    assert!(admitted_at(&admitted).is_none());
                    Fate::Abandoned
                }),
            ));
        }
        eventually("the give-ups queued", || limit.queued() == HELD_GIVE_UPS).await;
        drop(give_ups);
        for (series, waiter) in held {
            books.record(series, within("a give-up", waiter).await.unwrap());
        }

        // The limit stays full: the bounded layer's waits time out.
        let timeouts: Vec<_> = (0..TIMED_OUT)
            .map(|_| {
                let run = run_stream(impatient.clone(), read_to_end(1), Arc::clone(&streams));
                tokio::spawn(run)
            })
            .collect();
        for timeout in timeouts {
            let ran = within("a timed-out wait", timeout).await.unwrap();
            assert_eq!(ran.fate, Fate::Rejected(Rejection::QueueTimeout));
            books.record(impatient.series, ran.fate);
        }

        // The mix, queued behind the gates.
        let mut operations = Vec::new();
        for _ in 0..OPS_PER_WAVE {
            let route = routes[rng.below(routes.len() as u64) as usize].clone();
            let series = route.series;
            let run = run_stream(route, pick_streamed(&mut rng), Arc::clone(&streams));
            operations.push((series, tokio::spawn(run)));
        }

        open_tx.send(true).unwrap();
        for (series, gate) in gates {
            let drained = within("a gate stream", gate).await.unwrap();
            assert_eq!(drained, (2, Drained::End));
            books.ended(series, Outcome::Ok);
        }
        for (series, operation) in operations {
            let ran = within("a streamed operation", operation).await.unwrap();
            books.record(series, ran.fate);
        }
        assert_eq!(
            limit.available(),
            CAPACITY,
            "every permit back after the wave"
        );
    }

    assert_eq!((limit.available(), limit.queued()), (CAPACITY, 0));
    assert_eq!(streams.running(), 0);
    assert_eq!(
        streams.max(),
        CAPACITY,
        "the gates streamed at the limit, never above"
    );
    println!("books: {books:?}");
    for outcome in Outcome::ALL {
        assert!(
            books.outcome_total(*outcome) > 0,
            "the mix never ended an operation as {outcome}"
        );
    }
    assert!(books.rejected_total(Rejection::QueueTimeout) >= (WAVES * TIMED_OUT) as u64);
    assert!(books.abandoned_total() >= (WAVES * HELD_GIVE_UPS) as u64);
    assert_books(&telemetry, &books);
    assert_live_counts_zero(&telemetry);
}
