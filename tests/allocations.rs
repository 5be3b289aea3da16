//! No heap allocation per operation in steady state, with metrics disabled or enabled: through
//! the layer (head-end and body-end forms, reused and `clone().oneshot()`, per-request tags,
//! rejections answered), and through `resources_operation`.
//!
//! A counting global allocator counts the allocations made by this thread while operations run
//! on a current-thread runtime (a count, not a time). The first operations are a warm-up: the
//! SDK allocates the first time it sees an attribute set, and tokio sets up its thread state.

mod support;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::convert::Infallible;
use std::future::{ready, Future, Ready};
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use support::Telemetry;
use tower::{Layer, Service, ServiceExt};
use tower_resources_operation::adaptive::{Adaptive, Algorithm, Sample};
use tower_resources_operation::names::{
    DURATION_INSTRUMENT, OPERATION_ATTRIBUTE, OUTCOME_ATTRIBUTE, REJECTED_INSTRUMENT,
};
use tower_resources_operation::per_request::{Choice, ChooseFn};
use tower_resources_operation::protocol::RejectAsError;
use tower_resources_operation::{
    resources_operation, set_outcome, Acquire, Executor, Limit, Operation, OperationMetrics,
    Outcome, Rejected, ResourcesOperationLayer,
};

/// Counts allocations of the current thread, so other test threads do not disturb the count.
struct CountingAllocator;

thread_local! {
    static ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
}

// SAFETY: every call goes straight to the system allocator; counting touches only a `const`
// thread-local `Cell<u64>`, which never allocates.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = ALLOCATIONS.try_with(|n| n.set(n.get() + 1));
        System.alloc(layout)
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let _ = ALLOCATIONS.try_with(|n| n.set(n.get() + 1));
        System.alloc_zeroed(layout)
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let _ = ALLOCATIONS.try_with(|n| n.set(n.get() + 1));
        System.realloc(ptr, layout, new_size)
    }
}

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

fn allocations() -> u64 {
    ALLOCATIONS.with(Cell::get)
}

#[derive(Clone, Copy)]
struct Noop;

impl Service<u32> for Noop {
    type Response = u32;
    type Error = Infallible;
    type Future = Ready<Result<u32, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: u32) -> Self::Future {
        if request % 3 == 0 {
            set_outcome(Outcome::Timeout);
        }
        ready(Ok(request))
    }
}

const WARM_UP: u32 = 100;
const MEASURED: u32 = 1_000;

/// Allocations made by `MEASURED` rounds of `round` (given the round's number) after `WARM_UP`
/// rounds, on a current-thread runtime.
fn steady_state<F: Future<Output = ()>>(round: impl FnMut(u32) -> F) -> u64 {
    steady_state_of(MEASURED, round)
}

/// [`steady_state`], measured over `measured` rounds.
fn steady_state_of<F: Future<Output = ()>>(measured: u32, mut round: impl FnMut(u32) -> F) -> u64 {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    rt.block_on(async {
        for n in 0..WARM_UP {
            round(n).await;
        }
        let before = allocations();
        for n in 0..measured {
            round(n).await;
        }
        allocations() - before
    })
}

/// Asserts that `allocations_with` counts no allocation with metrics disabled, then with metrics
/// enabled; returns the telemetry the enabled run recorded into.
fn assert_no_allocation_with_metrics_disabled_or_enabled(
    allocations_with: impl Fn(OperationMetrics) -> u64,
) -> Telemetry {
    assert_eq!(
        allocations_with(OperationMetrics::disabled()),
        0,
        "metrics disabled"
    );
    let telemetry = Telemetry::new();
    assert_eq!(
        allocations_with(telemetry.metrics.clone()),
        0,
        "metrics enabled"
    );
    telemetry
}

/// Operations that `telemetry` recorded as `outcome`, among those matching `filter`.
fn recorded_as(telemetry: &Telemetry, outcome: &str, filter: &[(&str, &str)]) -> u64 {
    let mut filter = filter.to_vec();
    filter.push((OUTCOME_ATTRIBUTE, outcome));
    telemetry.count(DURATION_INSTRUMENT, &filter)
}

/// Rounds of the warm-up and the measurement whose number is a multiple of 3 (their work chose
/// `timeout`).
fn multiples_of_3() -> u64 {
    (0..WARM_UP)
        .chain(0..MEASURED)
        .filter(|n| n % 3 == 0)
        .count() as u64
}

/// Allocations made by operations through the layer, in both the reused-service and the
/// `clone().oneshot()` patterns.
fn steady_state_allocations(metrics: OperationMetrics) -> u64 {
    let layer = ResourcesOperationLayer::new(4)
        .operation(Operation::Tool)
        .executor(Executor::Thread)
        .metrics(metrics);
    // Alive across the measurement.
    let service = layer.layer(Noop);
    steady_state(|n| {
        let mut service = service.clone();
        async move {
            service.ready().await.unwrap().call(n).await.unwrap();
            service.clone().oneshot(n).await.unwrap();
        }
    })
}

#[test]
fn no_allocation_per_operation_with_metrics_disabled() {
    assert_eq!(steady_state_allocations(OperationMetrics::disabled()), 0);
}

#[test]
fn no_allocation_per_operation_with_metrics_enabled() {
    let telemetry = Telemetry::new();
    assert_eq!(steady_state_allocations(telemetry.metrics.clone()), 0);
    // The operations really were recorded: 2 per round, a third of them as timeouts.
    let rounds = u64::from(WARM_UP + MEASURED);
    let timeouts = 2 * multiples_of_3();
    let count = |outcome| recorded_as(&telemetry, outcome, &[(OPERATION_ATTRIBUTE, "tool")]);
    assert_eq!(count("timeout"), timeouts);
    assert_eq!(count("ok"), 2 * rounds - timeouts);
}

/// Allocations made by scoped operations through `metrics` (or the free function, on the global
/// provider, when `None`), on a `Limit` and on a `Semaphore`.
fn scoped_steady_state_allocations(metrics: Option<OperationMetrics>) -> u64 {
    let limit = Limit::new(4);
    let semaphore = tokio::sync::Semaphore::new(4);
    steady_state(|n| {
        let metrics = metrics.clone();
        let (limit, semaphore) = (&limit, &semaphore);
        async move {
            let work = async move {
                if n % 3 == 0 {
                    set_outcome(Outcome::Timeout);
                }
                Ok::<_, Infallible>(n)
            };
            let output = match &metrics {
                Some(metrics) => {
                    let on_limit = metrics
                        .resources_operation(limit, Operation::Judge, Executor::Inline, work)
                        .await;
                    let on_semaphore = metrics
                        .resources_operation(semaphore, Operation::Judge, Executor::Inline, async {
                            Ok::<_, Infallible>(n)
                        })
                        .await;
                    assert_eq!(on_semaphore.unwrap().unwrap(), n);
                    on_limit
                }
                None => resources_operation(limit, Operation::Judge, Executor::Inline, work).await,
            };
            assert_eq!(output.unwrap().unwrap(), n);
        }
    })
}

#[test]
fn no_allocation_per_scoped_operation_with_metrics_disabled() {
    assert_eq!(
        scoped_steady_state_allocations(Some(OperationMetrics::disabled())),
        0
    );
}

#[test]
fn no_allocation_per_scoped_operation_with_metrics_enabled() {
    let telemetry = Telemetry::new();
    assert_eq!(
        scoped_steady_state_allocations(Some(telemetry.metrics.clone())),
        0
    );
    // The operations really were recorded: 2 per round, a third of those on the `Limit` as
    // timeouts.
    let rounds = u64::from(WARM_UP + MEASURED);
    let timeouts = multiples_of_3();
    let count = |outcome| recorded_as(&telemetry, outcome, &[]);
    assert_eq!(count("timeout"), timeouts);
    assert_eq!(count("ok"), 2 * rounds - timeouts);
}

/// An algorithm that moves the capacity at every window, between 3 and 5: the resize path on
/// every close.
#[derive(Clone)]
struct Toggle;

impl Algorithm for Toggle {
    fn update(&mut self, sample: &Sample) -> usize {
        match sample.capacity {
            3 => 5,
            _ => 3,
        }
    }
}

/// Allocations made by operations of an adaptive limit, through the layer and the scoped API:
/// one scoped operation in 50 ends `timeout`, windows close (the first in a while, some
/// congested), and the controller resizes the limit at each (checked). Windows last 2 ms or
/// more, so this one runs longer than the others.
fn adaptive_steady_state_allocations(metrics: OperationMetrics) -> u64 {
    let limit = Limit::builder(4)
        .adaptive(Adaptive::new(Toggle, 1..=8))
        .build();
    // The last capacity seen, and how many times it changed.
    let changes = Cell::new((limit.capacity(), 0));
    let service = ResourcesOperationLayer::new(limit.clone())
        .operation(Operation::Tool)
        .executor(Executor::Thread)
        .metrics(metrics.clone())
        .layer(Noop);
    let allocations = steady_state_of(50 * MEASURED, |n| {
        let (service, metrics, limit) = (service.clone(), metrics.clone(), &limit);
        let changes = &changes;
        async move {
            // Never a multiple of 3: `Noop` makes those `timeout`.
            service.oneshot(3 * n + 1).await.unwrap();
            let scoped = metrics
                .resources_operation(limit, Operation::Judge, Executor::Inline, async {
                    if n % 50 == 0 {
                        set_outcome(Outcome::Timeout);
                    }
                    Ok::<_, Infallible>(n)
                })
                .await;
            assert_eq!(scoped.unwrap().unwrap(), n);
            let (last, changed) = changes.get();
            let capacity = limit.capacity();
            changes.set((capacity, changed + usize::from(capacity != last)));
        }
    });
    let (_, changed) = changes.get();
    assert!(
        changed >= 20,
        "the controller resized the limit {changed} times"
    );
    allocations
}

#[test]
fn no_allocation_per_operation_of_an_adaptive_limit() {
    let telemetry =
        assert_no_allocation_with_metrics_disabled_or_enabled(adaptive_steady_state_allocations);
    // The operations really were recorded, both forms.
    let rounds = u64::from(WARM_UP + 50 * MEASURED);
    assert_eq!(telemetry.count(DURATION_INSTRUMENT, &[]), 2 * rounds);
}

#[test]
fn no_allocation_per_operation_of_the_free_function() {
    // On whatever global provider is installed (none here: the no-op one): looked up per call.
    assert_eq!(scoped_steady_state_allocations(None), 0);
}

/// Allocations made by body-end operations, each body read to its end.
fn body_end_steady_state_allocations(metrics: OperationMetrics) -> u64 {
    let layer = ResourcesOperationLayer::new_for_http(4)
        .operation(Operation::Verify)
        .metrics(metrics)
        .until_body_end();
    let service = layer.layer(tower::service_fn(|_: http::Request<()>| async {
        Ok::<_, Infallible>(http::Response::new(Full::new(Bytes::from_static(
            b"verified",
        ))))
    }));
    steady_state(|_| {
        let service = service.clone();
        async move {
            let response = service.oneshot(http::Request::new(())).await.unwrap();
            // Frame by frame: collecting would allocate a buffer of its own.
            let mut body = response.into_body();
            let mut read = 0;
            while let Some(frame) = body.frame().await {
                read += frame.unwrap().into_data().map_or(0, |data| data.len());
            }
            assert_eq!(read, b"verified".len());
        }
    })
}

#[test]
fn no_allocation_per_body_end_operation_with_metrics_enabled_or_disabled() {
    let telemetry =
        assert_no_allocation_with_metrics_disabled_or_enabled(body_end_steady_state_allocations);
    assert_eq!(
        telemetry.count(DURATION_INSTRUMENT, &[]),
        u64::from(WARM_UP + MEASURED)
    );
}

/// Allocations made by operations of a layer over many routes, each request choosing its
/// operation: odd ones as `verify`, even ones unlimited (neither limited nor recorded).
fn per_request_steady_state_allocations(metrics: OperationMetrics) -> u64 {
    let layer = ResourcesOperationLayer::new(4)
        .metrics(metrics)
        .per_request(ChooseFn::new(|n: &u32| match n % 2 {
            1 => Choice::limited(Operation::Verify, Executor::Inline),
            _ => Choice::Unlimited,
        }));
    let service = layer.layer(Noop);
    steady_state(|n| {
        let service = service.clone();
        async move {
            assert_eq!(service.clone().oneshot(n).await.unwrap(), n);
            assert_eq!(service.oneshot(n + 1).await.unwrap(), n + 1);
        }
    })
}

#[test]
fn no_allocation_per_operation_chosen_per_request_with_metrics_enabled_or_disabled() {
    let telemetry =
        assert_no_allocation_with_metrics_disabled_or_enabled(per_request_steady_state_allocations);
    // One limited operation per round, recorded as `verify`.
    assert_eq!(
        telemetry.count(DURATION_INSTRUMENT, &[(OPERATION_ATTRIBUTE, "verify")]),
        u64::from(WARM_UP + MEASURED)
    );
    assert_eq!(
        telemetry.count(DURATION_INSTRUMENT, &[]),
        u64::from(WARM_UP + MEASURED)
    );
}

/// An error of a service that answers rejections with it, made without allocating.
#[derive(Debug)]
enum Busy {
    Rejected,
}

impl From<Rejected> for Busy {
    fn from(_: Rejected) -> Self {
        Busy::Rejected
    }
}

/// Allocations made by operations turned away at once (the limit full, no room to wait), through
/// a generic layer answering with an error and an HTTP layer answering 503.
fn rejected_steady_state_allocations(metrics: OperationMetrics) -> u64 {
    let full = Limit::with_max_queued(1, 0);
    let held = full.try_acquire().unwrap().unwrap();
    let generic = ResourcesOperationLayer::new(full.clone())
        .metrics(metrics.clone())
        .protocol(RejectAsError)
        .layer(tower::service_fn(|n: u32| async move { Ok::<_, Busy>(n) }));
    let http = ResourcesOperationLayer::new_for_http(full.clone())
        .metrics(metrics)
        .layer(tower::service_fn(|_: http::Request<()>| async {
            Ok::<_, Infallible>(http::Response::new(()))
        }));
    let made = steady_state(|_| {
        let (generic, http) = (generic.clone(), http.clone());
        async move {
            assert!(matches!(generic.oneshot(1).await, Err(Busy::Rejected)));
            let answer = http.oneshot(http::Request::new(())).await.unwrap();
            assert_eq!(answer.status(), 503);
        }
    });
    drop(held);
    made
}

#[test]
fn no_allocation_per_rejected_operation() {
    let telemetry =
        assert_no_allocation_with_metrics_disabled_or_enabled(rejected_steady_state_allocations);
    assert_eq!(
        telemetry.live_value(REJECTED_INSTRUMENT, &[]),
        i64::from(2 * (WARM_UP + MEASURED)),
        "every operation was turned away, and counted"
    );
}

#[test]
fn the_counter_sees_allocations() {
    // Guards the tests above against a counter that never counts.
    let before = allocations();
    let boxed = std::hint::black_box(Box::new(7_u64));
    assert_eq!(*boxed, 7);
    assert!(allocations() > before);
}
