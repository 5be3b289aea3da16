//! `gym.resources.operation.limit`: each series reports the sum of the capacities of the distinct
//! limits it draws from. A `Limit` reports its own capacity (resizes show at the next
//! collection, a limit that is gone stops counting); a semaphore reports only the `Capacity` it
//! is given (fixed or read at each collection); one limit reached through several layers or
//! scoped calls counts once per series (a limit's identity is its `Capacity`'s id, shared by
//! clones and never reused, so a limit made after a dropped one counts anew); and
//! `active <= limit` holds at every collection, except while a lowered capacity drains, which
//! shows as `active > limit`.

mod support;

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt as _;
use tokio::sync::{oneshot, Semaphore};
use tower::{service_fn, Layer as _, ServiceExt as _};

use support::{held, settle, spawn_held, Telemetry};
use tower_resources_operation::classify::DefaultClassifier;
use tower_resources_operation::limit::Capacity;
use tower_resources_operation::names::{
    ACTIVE_INSTRUMENT, EXECUTOR_ATTRIBUTE, LIMIT_ACTIVE_INSTRUMENT, LIMIT_ATTRIBUTE,
    LIMIT_INSTRUMENT, LIMIT_QUEUED_INSTRUMENT, OPERATION_ATTRIBUTE, QUEUED_INSTRUMENT,
};
use tower_resources_operation::{
    Acquire, Executor, Limit, Operation, OperationMetrics, Rejected, ResourcesOperationLayer,
};

/// `(operation, executor)` of a series.
type SeriesKey = (String, String);

/// What `name` reports now, per series.
fn per_series(t: &Telemetry, name: &str) -> BTreeMap<SeriesKey, i64> {
    t.live(name)
        .into_iter()
        .map(|p| {
            (
                (
                    p.attributes[OPERATION_ATTRIBUTE].clone(),
                    p.attributes[EXECUTOR_ATTRIBUTE].clone(),
                ),
                p.value,
            )
        })
        .collect()
}

/// The limit gauge, per series.
fn limits(t: &Telemetry) -> BTreeMap<SeriesKey, i64> {
    per_series(t, LIMIT_INSTRUMENT)
}

fn key(operation: &str, executor: &str) -> SeriesKey {
    (operation.to_owned(), executor.to_owned())
}

/// The gauge of exactly the given series, and no other.
fn only(series: &[(&str, &str, i64)]) -> BTreeMap<SeriesKey, i64> {
    series
        .iter()
        .map(|&(operation, executor, value)| (key(operation, executor), value))
        .collect()
}

/// A service that answers at once.
fn instant() -> impl tower::Service<(), Response = (), Error = Infallible, Future: Send> + Clone {
    service_fn(|()| async { Ok::<_, Infallible>(()) })
}

/// A layer on `limit` tagged `operation`/`executor`, reporting to `t`.
fn tagged<L>(
    t: &Telemetry,
    limit: L,
    operation: Operation,
    executor: Executor,
) -> ResourcesOperationLayer<DefaultClassifier, L>
where
    L: Acquire + Clone,
{
    ResourcesOperationLayer::new(limit)
        .operation(operation)
        .executor(executor)
        .metrics(t.metrics.clone())
}

// ---------------------------------------------------------------------------------------------
// A `Limit`
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn a_series_reports_the_capacity_of_its_limit() {
    let t = Telemetry::new();
    assert!(limits(&t).is_empty(), "no layer, no limit");
    let _service =
        tagged(&t, Limit::new(3), Operation::Verify, Executor::Subprocess).layer(instant());
    assert_eq!(limits(&t), only(&[("verify", "subprocess", 3)]));
}

#[tokio::test]
async fn a_limit_shared_by_two_series_reports_its_full_capacity_under_each() {
    let t = Telemetry::new();
    let shared = Limit::new(4);
    let _verify =
        tagged(&t, shared.clone(), Operation::Verify, Executor::Subprocess).layer(instant());
    let _judge = tagged(&t, shared, Operation::Judge, Executor::Inline).layer(instant());
    assert_eq!(
        limits(&t),
        only(&[("verify", "subprocess", 4), ("judge", "inline", 4)])
    );
}

#[tokio::test]
async fn a_series_served_by_two_limits_reports_the_sum_of_their_capacities() {
    let t = Telemetry::new();
    let _a = tagged(&t, Limit::new(2), Operation::Tool, Executor::Thread).layer(instant());
    let _b = tagged(&t, Limit::new(3), Operation::Tool, Executor::Thread).layer(instant());
    assert_eq!(limits(&t), only(&[("tool", "thread", 5)]));
}

#[tokio::test]
async fn one_limit_reached_through_two_layers_with_the_same_tags_counts_once() {
    let t = Telemetry::new();
    let limit = Limit::new(4);
    let first = tagged(&t, limit.clone(), Operation::Verify, Executor::Process);
    let second = tagged(&t, limit.clone(), Operation::Verify, Executor::Process);
    // Several services of each layer, as axum makes them per route and per connection.
    let services: Vec<_> = (0..3)
        .flat_map(|_| [first.layer(instant()), second.layer(instant())])
        .collect();
    for service in &services {
        service.clone().oneshot(()).await.unwrap();
    }
    // And the scoped API on the same limit and series.
    t.metrics
        .resources_operation(&limit, Operation::Verify, Executor::Process, async {})
        .await
        .unwrap();
    assert_eq!(limits(&t), only(&[("verify", "process", 4)]));
}

#[tokio::test]
async fn set_capacity_changes_the_gauge_at_the_next_collection() {
    let t = Telemetry::new();
    let limit = Limit::new(2);
    let _service = tagged(&t, limit.clone(), Operation::Judge, Executor::Inline).layer(instant());
    assert_eq!(limits(&t), only(&[("judge", "inline", 2)]));
    limit.set_capacity(7).unwrap();
    assert_eq!(limits(&t), only(&[("judge", "inline", 7)]));
    limit.set_capacity(1).unwrap();
    assert_eq!(limits(&t), only(&[("judge", "inline", 1)]));
}

#[tokio::test]
async fn a_limit_that_is_gone_stops_counting() {
    let t = Telemetry::new();
    let staying = Limit::new(3);
    let going = Limit::new(2);
    let staying_layer = tagged(&t, staying.clone(), Operation::Verify, Executor::Inline);
    let going_layer = tagged(&t, going.clone(), Operation::Verify, Executor::Inline);
    let staying_service = staying_layer.layer(instant());
    let going_service = going_layer.layer(instant());
    going_service.clone().oneshot(()).await.unwrap();
    let judge_layer = tagged(&t, going.clone(), Operation::Judge, Executor::Inline);
    let judge_service = judge_layer.layer(instant());
    assert_eq!(
        limits(&t),
        only(&[("verify", "inline", 5), ("judge", "inline", 2)])
    );

    // While any clone, layer or service of it lives, it counts.
    drop((going, going_layer, judge_layer));
    assert_eq!(
        limits(&t),
        only(&[("verify", "inline", 5), ("judge", "inline", 2)])
    );
    drop((going_service, judge_service));
    assert_eq!(
        limits(&t),
        only(&[("verify", "inline", 3)]),
        "the gone limit no longer counts, and a series with no limit left reports none"
    );

    drop((staying, staying_layer, staying_service));
    assert_eq!(limits(&t), only(&[]));
}

#[tokio::test]
async fn a_new_limit_after_a_gone_one_counts_again() {
    let t = Telemetry::new();
    for capacity in [2, 5, 3] {
        let service =
            tagged(&t, Limit::new(capacity), Operation::Tool, Executor::Other).layer(instant());
        service.clone().oneshot(()).await.unwrap();
        assert_eq!(limits(&t), only(&[("tool", "other", capacity as i64)]));
        drop(service);
        assert_eq!(limits(&t), only(&[]));
    }
}

/// A limit's identity in the metrics is an id that is never reused, not an address (which is).
/// Each round makes a new `Limit`, and a new semaphore told a new `Capacity::fixed`, right after
/// the previous round's were dropped and before any collection forgot them: in memory, the new
/// ones likely take the old ones' places. Each must still count as a new limit, with its own
/// capacity, and the old one must be forgotten.
#[tokio::test]
async fn a_limit_made_after_the_last_one_of_its_series_was_dropped_counts_as_a_new_limit() {
    let t = Telemetry::new();
    for round in 0..50 {
        let capacity = 1 + round % 7;
        let limit = Limit::new(capacity);
        let service =
            tagged(&t, limit.clone(), Operation::Judge, Executor::Process).layer(instant());
        service.oneshot(()).await.unwrap();
        t.metrics
            .resources_operation(&limit, Operation::Judge, Executor::Process, async {})
            .await
            .unwrap();
        let told = ResourcesOperationLayer::new(Arc::new(Semaphore::new(capacity)))
            .operation(Operation::Tool)
            .metrics(t.metrics.clone())
            .capacity(Capacity::fixed(capacity + 10))
            .layer(instant());
        told.clone().oneshot(()).await.unwrap();
        let capacity = capacity as i64;
        assert_eq!(
            limits(&t),
            only(&[
                ("judge", "process", capacity),
                ("tool", "other", capacity + 10)
            ]),
            "round {round}: only this round's limits count, each with its own capacity"
        );
        drop((limit, told));
    }
    assert_eq!(
        limits(&t),
        only(&[]),
        "the last round's limits are gone too"
    );
}

// ---------------------------------------------------------------------------------------------
// `active <= limit`
// ---------------------------------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn active_is_at_most_the_limit_at_every_collection_while_operations_run() {
    let t = Telemetry::new();
    let limit = Limit::new(3);
    let sleeper = service_fn(|ms: u64| async move {
        tokio::time::sleep(Duration::from_millis(ms)).await;
        Ok::<_, Infallible>(())
    });
    let verify = tagged(&t, limit.clone(), Operation::Verify, Executor::Subprocess).layer(sleeper);
    let judge = tagged(&t, limit.clone(), Operation::Judge, Executor::Inline).layer(sleeper);
    let tool = tagged(&t, Limit::new(2), Operation::Tool, Executor::Thread).layer(sleeper);

    let mut tasks = Vec::new();
    for i in 0..30u64 {
        let ms = 10 + (i * 13) % 40;
        tasks.push(match i % 3 {
            0 => tokio::spawn(verify.clone().oneshot(ms)),
            1 => tokio::spawn(judge.clone().oneshot(ms)),
            _ => tokio::spawn(tool.clone().oneshot(ms)),
        });
    }

    let mut sampled = 0;
    let mut busiest = 0;
    for _ in 0..20 {
        tokio::time::sleep(Duration::from_millis(7)).await;
        let gauge = limits(&t);
        let active = per_series(&t, ACTIVE_INSTRUMENT);
        for (series, running) in &active {
            let capacity = gauge.get(series).copied().unwrap_or(0);
            assert!(
                *running <= capacity,
                "{series:?}: {running} active above its limit of {capacity}"
            );
            busiest = busiest.max(*running);
        }
        let shared = active[&key("verify", "subprocess")] + active[&key("judge", "inline")];
        assert!(shared <= 3, "{shared} active on a limit of 3");
        sampled += 1;
    }
    for task in tasks {
        task.await.unwrap().unwrap();
    }
    assert_eq!(sampled, 20);
    assert!(busiest > 0, "the samples saw operations running");
    assert_eq!(
        limits(&t),
        only(&[
            ("verify", "subprocess", 3),
            ("judge", "inline", 3),
            ("tool", "thread", 2)
        ])
    );
}

#[tokio::test]
async fn while_a_lowered_capacity_drains_active_above_the_limit_shows() {
    let t = Telemetry::new();
    let limit = Limit::new(3);
    let service = tagged(&t, limit.clone(), Operation::Verify, Executor::Inline).layer(held());
    let (releases, running): (Vec<_>, Vec<_>) = (0..3).map(|_| spawn_held(&service)).unzip();
    settle().await;
    let active = || per_series(&t, ACTIVE_INSTRUMENT)[&key("verify", "inline")];
    assert_eq!((active(), limits(&t)[&key("verify", "inline")]), (3, 3));

    limit.set_capacity(1).unwrap();
    let mut expected_active = 3;
    for (release, task) in releases.into_iter().zip(running) {
        assert_eq!(
            (active(), limits(&t)[&key("verify", "inline")]),
            (expected_active, 1),
            "nothing is revoked: {expected_active} run above the new limit of 1"
        );
        release.send(()).unwrap();
        task.await.unwrap().unwrap();
        expected_active -= 1;
    }
    assert_eq!((active(), limits(&t)[&key("verify", "inline")]), (0, 1));
    assert_eq!(limit.available(), 1);
}

/// A place passes from an operation that ends to the one that waited longest at once: the named
/// limit counts it as held throughout. The series count the waiter from the poll that sees its
/// place, so a collection in between reads one fewer active and the waiter still queued (what a
/// scrape during a burst can catch, for as long as the waiter's task takes to be polled).
#[tokio::test]
async fn a_place_handed_to_a_waiter_is_the_limits_at_once_and_the_series_from_the_waiters_poll() {
    let t = Telemetry::new();
    let limit = Limit::builder(1).name("handover").build();
    let service = tagged(&t, limit.clone(), Operation::Verify, Executor::Inline).layer(held());
    let series = [
        (OPERATION_ATTRIBUTE, "verify"),
        (EXECUTOR_ATTRIBUTE, "inline"),
    ];
    let named = [(LIMIT_ATTRIBUTE, "handover")];
    // (series active, series queued, limit active, limit queued)
    let read = || {
        (
            t.live_value(ACTIVE_INSTRUMENT, &series),
            t.live_value(QUEUED_INSTRUMENT, &series),
            t.live_value(LIMIT_ACTIVE_INSTRUMENT, &named),
            t.live_value(LIMIT_QUEUED_INSTRUMENT, &named),
        )
    };

    let (release_first, first) = spawn_held(&service);
    settle().await;
    assert_eq!(read(), (1, 0, 1, 0), "the first runs");

    // The second, polled by hand: it waits.
    let (release_second, second) = oneshot::channel();
    let mut second = tokio_test::task::spawn(service.clone().oneshot(second));
    assert!(second.poll().is_pending());
    assert_eq!(read(), (1, 1, 1, 1), "the second waits");

    // The first ends; its place goes to the second, which has not been polled since.
    release_first.send(()).unwrap();
    first.await.unwrap().unwrap();
    assert!(second.is_woken(), "the waiter is woken with its place");
    assert_eq!(
        read(),
        (0, 1, 1, 1),
        "handed over: the limit's place is held, the series' waiter not yet running"
    );
    assert_eq!(limit.available(), 0, "the place is the waiter's, not free");

    assert!(second.poll().is_pending(), "admitted, its work runs");
    assert_eq!(read(), (1, 0, 1, 0), "the second runs");
    release_second.send(()).unwrap();
    assert!(matches!(second.poll(), std::task::Poll::Ready(Ok(()))));
    assert_eq!(read(), (0, 0, 0, 0));
}

/// How a streamed body ends, in the body-end form.
#[derive(Clone, Copy, Debug)]
enum BodyEnd {
    /// The stream ends: `ok`.
    Ends,
    /// The stream fails midway: `error`.
    Fails,
    /// The client hangs up: the body is dropped, `cancelled`.
    HungUp,
}

/// A response body the test feeds, frame by frame.
struct Fed(tokio::sync::mpsc::UnboundedReceiver<Result<bytes::Bytes, std::io::Error>>);

/// An empty body, as a rejection is answered.
impl Default for Fed {
    fn default() -> Self {
        Fed(tokio::sync::mpsc::unbounded_channel().1)
    }
}

impl http_body::Body for Fed {
    type Data = bytes::Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<bytes::Bytes>, std::io::Error>>> {
        self.0
            .poll_recv(cx)
            .map(|item| item.map(|item| item.map(http_body::Frame::data)))
    }
}

/// The body-end form hands a place over as the head-end form does: the series stops counting
/// the operation whose body ended (or failed, or was dropped) before its place goes to the
/// waiter, so the series never reads more active than the limit's capacity, and counts the
/// waiter from the poll that sees its place.
#[tokio::test]
async fn a_body_end_operation_hands_its_place_over_after_its_series_stops_counting_it() {
    use http_body_util::BodyExt as _;
    for end in [BodyEnd::Ends, BodyEnd::Fails, BodyEnd::HungUp] {
        let t = Telemetry::new();
        let limit = Limit::builder(1).name("handover").build();
        let feeds = Arc::new(std::sync::Mutex::new(std::collections::VecDeque::new()));
        let service = ResourcesOperationLayer::new_for_http(limit.clone())
            .operation(Operation::Verify)
            .executor(Executor::Inline)
            .metrics(t.metrics.clone())
            .until_body_end()
            .layer(service_fn({
                let feeds = Arc::clone(&feeds);
                move |_: http::Request<()>| {
                    let fed = feeds.lock().unwrap().pop_front().expect("a body to stream");
                    async move { Ok::<_, Infallible>(http::Response::new(Fed(fed))) }
                }
            }));
        let feed = |feeds: &std::sync::Mutex<std::collections::VecDeque<_>>| {
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            feeds.lock().unwrap().push_back(rx);
            tx
        };
        let series = [
            (OPERATION_ATTRIBUTE, "verify"),
            (EXECUTOR_ATTRIBUTE, "inline"),
        ];
        let named = [(LIMIT_ATTRIBUTE, "handover")];
        // (series active, series queued, limit active, limit queued)
        let read = || {
            (
                t.live_value(ACTIVE_INSTRUMENT, &series),
                t.live_value(QUEUED_INSTRUMENT, &series),
                t.live_value(LIMIT_ACTIVE_INSTRUMENT, &named),
                t.live_value(LIMIT_QUEUED_INSTRUMENT, &named),
            )
        };

        // The first streams: its head is out, its body holds the place.
        let first_feed = feed(&feeds);
        let mut first = service
            .clone()
            .oneshot(http::Request::new(()))
            .await
            .unwrap()
            .into_body();
        first_feed
            .send(Ok(bytes::Bytes::from_static(b"a")))
            .unwrap();
        assert!(first.frame().await.unwrap().unwrap().is_data());
        assert_eq!(read(), (1, 0, 1, 0), "{end:?}: the first streams");

        // The second, polled by hand: it waits.
        let _second_feed = feed(&feeds);
        let mut second = tokio_test::task::spawn(service.clone().oneshot(http::Request::new(())));
        assert!(second.poll().is_pending());
        assert_eq!(read(), (1, 1, 1, 1), "{end:?}: the second waits");

        // The first body ends; its place goes to the second, not polled since.
        match end {
            BodyEnd::Ends => {
                drop(first_feed);
                assert!(first.frame().await.is_none());
            }
            BodyEnd::Fails => {
                first_feed
                    .send(Err(std::io::Error::other("midway")))
                    .unwrap();
                assert!(first.frame().await.unwrap().is_err());
            }
            BodyEnd::HungUp => drop(first),
        }
        assert!(
            second.is_woken(),
            "{end:?}: the waiter is woken with its place"
        );
        assert_eq!(
            read(),
            (0, 1, 1, 1),
            "{end:?}: the series stopped counting the first before the place was handed over"
        );
        let std::task::Poll::Ready(Ok(second)) = second.poll() else {
            panic!("{end:?}: the second's head");
        };
        assert_eq!(read(), (1, 0, 1, 0), "{end:?}: the second streams");
        drop(second);
        assert_eq!(read(), (0, 0, 0, 0), "{end:?}: the second hung up");
    }
}

/// A caller that leaves after its place was handed over, before its operation's first poll
/// after admission: the operation is abandoned, with no queue sample and no outcome, and the
/// place goes to the next waiter. In tower's terms, two moments: the place handed to a waiter
/// whose future is then dropped unpolled, and a permit taken by `poll_ready` whose service is
/// dropped before `call`.
#[tokio::test]
async fn a_caller_that_left_before_its_operation_was_polled_after_admission_is_abandoned() {
    let t = Telemetry::new();
    let limit = Limit::builder(1).name("handover").build();
    let layer = tagged(&t, limit.clone(), Operation::Verify, Executor::Inline);
    let service = layer.layer(held());
    let samples = || {
        (
            t.count(
                tower_resources_operation::names::QUEUE_DURATION_INSTRUMENT,
                &[],
            ),
            t.count(tower_resources_operation::names::DURATION_INSTRUMENT, &[]),
            t.live_value(tower_resources_operation::names::ABANDONED_INSTRUMENT, &[]),
        )
    };

    // The first holds the place; the second and the third wait.
    let (release_first, first) = spawn_held(&service);
    settle().await;
    let (_release_second, second) = oneshot::channel();
    let mut second = tokio_test::task::spawn(service.clone().oneshot(second));
    assert!(second.poll().is_pending());
    let (release_third, third) = oneshot::channel();
    let mut third = tokio_test::task::spawn(service.clone().oneshot(third));
    assert!(third.poll().is_pending());
    assert_eq!(samples(), (1, 0, 0), "the first ran at once");

    // The first ends: its place is handed to the second, whose caller then leaves unpolled.
    release_first.send(()).unwrap();
    first.await.unwrap().unwrap();
    assert!(second.is_woken());
    drop(second);
    assert_eq!(
        samples(),
        (1, 1, 1),
        "abandoned: no queue sample, no outcome"
    );
    assert!(third.is_woken(), "the place went on to the next waiter");
    assert!(third.poll().is_pending(), "the third runs");
    assert_eq!(samples(), (2, 1, 1));

    // A caller that takes its permit with `ready` and leaves before it calls: abandoned too,
    // and its place goes to the next waiter.
    let mut ready = service.clone();
    let mut waiting_ready = tokio_test::task::spawn(std::future::poll_fn(|cx| {
        tower::Service::<oneshot::Receiver<()>>::poll_ready(&mut ready, cx)
    }));
    assert!(waiting_ready.poll().is_pending());
    let (release_fourth, fourth) = oneshot::channel();
    let mut fourth = tokio_test::task::spawn(service.clone().oneshot(fourth));
    assert!(fourth.poll().is_pending());
    release_third.send(()).unwrap();
    assert!(matches!(third.poll(), std::task::Poll::Ready(Ok(()))));
    assert!(matches!(
        waiting_ready.poll(),
        std::task::Poll::Ready(Ok(()))
    ));
    drop(waiting_ready);
    assert_eq!(
        samples(),
        (2, 2, 1),
        "admitted by poll_ready: not yet sampled"
    );
    drop(ready);
    assert_eq!(samples(), (2, 2, 2), "left before it called: abandoned");
    assert!(fourth.is_woken(), "the place went on to the next waiter");
    assert!(fourth.poll().is_pending());
    release_fourth.send(()).unwrap();
    assert!(matches!(fourth.poll(), std::task::Poll::Ready(Ok(()))));
    assert_eq!(samples(), (3, 3, 2));
    assert_eq!(limit.available(), 1);
}

// ---------------------------------------------------------------------------------------------
// Semaphores and `Capacity`
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn a_semaphore_layer_reports_no_limit_unless_given_a_capacity() {
    let t = Telemetry::new();
    let semaphore = Arc::new(Semaphore::new(5));
    let bare = ResourcesOperationLayer::new(Arc::clone(&semaphore))
        .operation(Operation::Verify)
        .metrics(t.metrics.clone())
        .layer(instant());
    bare.clone().oneshot(()).await.unwrap();
    assert_eq!(
        limits(&t),
        only(&[]),
        "a semaphore does not know its capacity"
    );
    assert!(
        per_series(&t, ACTIVE_INSTRUMENT).contains_key(&key("verify", "other")),
        "the series itself is reported"
    );

    let told = ResourcesOperationLayer::new(semaphore)
        .operation(Operation::Judge)
        .metrics(t.metrics.clone())
        .capacity(Capacity::fixed(5))
        .layer(instant());
    assert_eq!(limits(&t), only(&[("judge", "other", 5)]));
    drop((bare, told));
}

/// As a router does: the layer value is a temporary, and its services outlive it. They keep the
/// capacity they were given counted, and when the last of them goes, it stops counting.
#[tokio::test]
async fn a_capacity_given_to_a_layer_counts_while_its_services_live() {
    let t = Telemetry::new();
    let service = ResourcesOperationLayer::new(Arc::new(Semaphore::new(3)))
        .operation(Operation::Tool)
        .metrics(t.metrics.clone())
        .capacity(Capacity::fixed(3))
        .layer(instant());
    let clone = service.clone();
    drop(service);
    clone.clone().oneshot(()).await.unwrap();
    assert_eq!(limits(&t), only(&[("tool", "other", 3)]));
    drop(clone);
    assert_eq!(
        limits(&t),
        only(&[]),
        "no service describes that limit any more"
    );
}

#[tokio::test]
async fn two_semaphore_layers_given_clones_of_one_capacity_count_it_once() {
    let t = Telemetry::new();
    let semaphore = Arc::new(Semaphore::new(5));
    let capacity = Capacity::fixed(5);
    let layer = |capacity: Capacity, operation| {
        ResourcesOperationLayer::new(Arc::clone(&semaphore))
            .operation(operation)
            .metrics(t.metrics.clone())
            .capacity(capacity)
            .layer(instant())
    };
    let _a = layer(capacity.clone(), Operation::Tool);
    let _b = layer(capacity.clone(), Operation::Tool);
    assert_eq!(limits(&t), only(&[("tool", "other", 5)]));

    // Another `Capacity` made anew is another limit, even with the same number.
    assert!(capacity.same_limit(&capacity.clone()));
    assert!(!capacity.same_limit(&Capacity::fixed(5)));
    let _c = layer(Capacity::fixed(5), Operation::Tool);
    assert_eq!(limits(&t), only(&[("tool", "other", 10)]));
}

#[tokio::test]
async fn a_capacity_from_fn_is_read_at_each_collection() {
    let t = Telemetry::new();
    let size = Arc::new(AtomicUsize::new(2));
    let read = Arc::clone(&size);
    let capacity = Capacity::from_fn(move || read.load(Ordering::SeqCst));
    let _service = ResourcesOperationLayer::new(Arc::new(Semaphore::new(2)))
        .operation(Operation::Judge)
        .executor(Executor::Process)
        .metrics(t.metrics.clone())
        .capacity(capacity.clone())
        .layer(instant());
    assert_eq!(limits(&t), only(&[("judge", "process", 2)]));
    size.store(6, Ordering::SeqCst);
    assert_eq!(capacity.get(), Some(6));
    assert_eq!(limits(&t), only(&[("judge", "process", 6)]));
}

#[tokio::test]
async fn a_capacity_read_that_panics_costs_its_own_series_not_the_collection() {
    let t = Telemetry::new();
    let _fine = tagged(&t, Limit::new(3), Operation::Verify, Executor::Inline).layer(instant());
    let _broken = ResourcesOperationLayer::new(Arc::new(Semaphore::new(2)))
        .operation(Operation::Judge)
        .metrics(t.metrics.clone())
        .capacity(Capacity::from_fn(|| {
            panic!("the pool's size cannot be read")
        }))
        .layer(instant());
    assert_eq!(
        limits(&t),
        only(&[("verify", "inline", 3)]),
        "the other series still report, and the broken one reports nothing"
    );
    assert!(
        per_series(&t, ACTIVE_INSTRUMENT).contains_key(&key("judge", "other")),
        "the broken series' other instruments still report"
    );
}

#[tokio::test]
async fn a_layers_capacity_overrides_what_its_limit_reports() {
    let t = Telemetry::new();
    let _service = tagged(&t, Limit::new(3), Operation::Verify, Executor::Thread)
        .capacity(Capacity::fixed(8))
        .layer(instant());
    assert_eq!(limits(&t), only(&[("verify", "thread", 8)]));
}

/// A limit of the user's own that reports its capacity with a `Capacity::fixed` made with it,
/// as `Acquire::capacity` asks.
#[derive(Clone)]
struct OwnLimit {
    places: Arc<Semaphore>,
    capacity: Capacity,
}

impl OwnLimit {
    fn new(places: usize) -> Self {
        Self {
            places: Arc::new(Semaphore::new(places)),
            capacity: Capacity::fixed(places),
        }
    }
}

impl Acquire for OwnLimit {
    type Permit = tokio::sync::OwnedSemaphorePermit;

    fn acquire(&self) -> impl std::future::Future<Output = Result<Self::Permit, Rejected>> + Send {
        Arc::clone(&self.places)
            .acquire_owned()
            .map(|acquired| acquired.map_err(|_| Rejected::closed()))
    }

    fn capacity(&self) -> Option<Capacity> {
        Some(self.capacity.clone())
    }
}

#[tokio::test]
async fn a_user_defined_limit_that_is_gone_stops_counting() {
    let t = Telemetry::new();
    let _staying = tagged(&t, Limit::new(1), Operation::Verify, Executor::Inline).layer(instant());
    let own = OwnLimit::new(4);
    let service = tagged(&t, own.clone(), Operation::Verify, Executor::Inline).layer(instant());
    service.clone().oneshot(()).await.unwrap();
    assert_eq!(limits(&t), only(&[("verify", "inline", 5)]));

    // The limit, its layer and its services are gone: nothing draws from it any more, and
    // nothing but the metrics' registry holds its `Capacity`.
    drop((own, service));
    assert_eq!(
        limits(&t),
        only(&[("verify", "inline", 1)]),
        "a gone limit of the user's own still counts"
    );
}

#[tokio::test]
async fn a_series_whose_semaphore_layer_is_rebuilt_reports_only_the_live_semaphores_capacity() {
    // A configuration reload: each time, a new semaphore of 4 and a new layer told its capacity,
    // the old ones dropped.
    let t = Telemetry::new();
    for reload in 1..=3 {
        let service = ResourcesOperationLayer::new(Arc::new(Semaphore::new(4)))
            .operation(Operation::Tool)
            .metrics(t.metrics.clone())
            .capacity(Capacity::fixed(4))
            .layer(instant());
        service.clone().oneshot(()).await.unwrap();
        assert_eq!(
            limits(&t),
            only(&[("tool", "other", 4)]),
            "after reload {reload}, only the live semaphore of 4 counts"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// The scoped API and the global provider
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn the_scoped_api_registers_its_limit_too() {
    let t = Telemetry::new();
    let limit = Limit::new(6);
    t.metrics
        .resources_operation(&limit, Operation::Tool, Executor::Subprocess, async {})
        .await
        .unwrap();
    assert_eq!(limits(&t), only(&[("tool", "subprocess", 6)]));

    // Again with the same limit, by value this time: it still counts once.
    t.metrics
        .resources_operation(
            limit.clone(),
            Operation::Tool,
            Executor::Subprocess,
            async {},
        )
        .await
        .unwrap();
    assert_eq!(limits(&t), only(&[("tool", "subprocess", 6)]));

    // A second limit on the same series adds up; a semaphore reports nothing.
    let other = Limit::new(1);
    t.metrics
        .resources_operation(&other, Operation::Tool, Executor::Subprocess, async {})
        .await
        .unwrap();
    let semaphore = Semaphore::new(9);
    t.metrics
        .resources_operation(&semaphore, Operation::Tool, Executor::Subprocess, async {})
        .await
        .unwrap();
    assert_eq!(limits(&t), only(&[("tool", "subprocess", 7)]));

    limit.set_capacity(2).unwrap();
    assert_eq!(limits(&t), only(&[("tool", "subprocess", 3)]));
    drop(other);
    assert_eq!(limits(&t), only(&[("tool", "subprocess", 2)]));
}

#[tokio::test]
async fn a_scoped_operation_on_a_gone_limits_series_registers_the_new_limit() {
    // The scoped API remembers which limits a series has without taking a lock; a limit that is
    // gone must not hide the one that comes after it.
    let t = Telemetry::new();
    for capacity in [4, 1, 9, 2, 7, 3] {
        let limit = Limit::new(capacity);
        t.metrics
            .resources_operation(&limit, Operation::Judge, Executor::Thread, async {})
            .await
            .unwrap();
        assert_eq!(limits(&t), only(&[("judge", "thread", capacity as i64)]));
        drop(limit);
        assert_eq!(limits(&t), only(&[]));
    }
}

#[test]
fn a_layer_on_the_global_provider_registers_its_limit_when_it_first_serves() {
    // The only test of this binary that installs a global provider.
    let (provider, exporter) = support::pipeline();
    opentelemetry::global::set_meter_provider(provider.clone());
    let t = Telemetry {
        provider,
        exporter,
        metrics: OperationMetrics::disabled(),
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    runtime.block_on(async {
        let limit = Limit::new(4);
        let service = ResourcesOperationLayer::new(limit.clone())
            .operation(Operation::Verify)
            .layer(instant());
        service.clone().oneshot(()).await.unwrap();
        assert_eq!(limits(&t), only(&[("verify", "other", 4)]));
        limit.set_capacity(2).unwrap();
        assert_eq!(limits(&t), only(&[("verify", "other", 2)]));
    });
}
