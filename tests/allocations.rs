//! No heap allocation per operation in steady state, with metrics disabled or enabled: through
//! the layer (head-end and body-end forms, reused and `clone().oneshot()`), and through
//! `resources_operation`.
//!
//! A counting global allocator counts the allocations made by this thread while operations run
//! on a current-thread runtime (a count, not a time). The first operations are a warm-up: the
//! SDK allocates the first time it sees an attribute set, and tokio sets up its thread state.

mod support;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::convert::Infallible;
use std::future::{ready, Ready};
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use tower::{Layer, Service, ServiceExt};
use tower_resources_operation::{
    resources_operation, set_outcome, Executor, Limit, Operation, OperationMetrics, Outcome,
    ResourcesOperationLayer,
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

/// Allocations made by `MEASURED` operations after `WARM_UP`, in both the reused-service and
/// the `clone().oneshot()` patterns.
fn steady_state_allocations(metrics: OperationMetrics) -> u64 {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let layer = ResourcesOperationLayer::new(4)
        .operation(Operation::Tool)
        .executor(Executor::Thread)
        .metrics(metrics);
    let mut service = layer.layer(Noop);
    rt.block_on(async {
        let run = |n: u32| {
            let mut service = service.clone();
            async move {
                service.ready().await.unwrap().call(n).await.unwrap();
                service.clone().oneshot(n).await.unwrap();
            }
        };
        for n in 0..WARM_UP {
            run(n).await;
        }
        let before = allocations();
        for n in 0..MEASURED {
            run(n).await;
        }
        let after = allocations();
        // Keep the service alive across the measurement.
        service.ready().await.unwrap();
        after - before
    })
}

#[test]
fn no_allocation_per_operation_with_metrics_disabled() {
    assert_eq!(steady_state_allocations(OperationMetrics::disabled()), 0);
}

#[test]
fn no_allocation_per_operation_with_metrics_enabled() {
    let telemetry = support::Telemetry::new();
    assert_eq!(steady_state_allocations(telemetry.metrics.clone()), 0);
    // The operations really were recorded: 2 per round, a third of them as timeouts.
    let rounds = WARM_UP + MEASURED;
    let multiples_of_3 = |end: u32| (0..end).filter(|n| n % 3 == 0).count() as u64;
    let timeouts = 2 * (multiples_of_3(WARM_UP) + multiples_of_3(MEASURED));
    let count = |outcome| {
        telemetry.count(
            tower_resources_operation::DURATION_INSTRUMENT,
            &[
                (tower_resources_operation::OPERATION_ATTRIBUTE, "tool"),
                (tower_resources_operation::OUTCOME_ATTRIBUTE, outcome),
            ],
        )
    };
    assert_eq!(count("timeout"), timeouts);
    assert_eq!(count("ok"), u64::from(2 * rounds) - timeouts);
}

/// Allocations made by `MEASURED` scoped operations after `WARM_UP`, through `metrics` (or the
/// free function, on the global provider, when `None`), on a `Limit` and on a `Semaphore`.
fn scoped_steady_state_allocations(metrics: Option<OperationMetrics>) -> u64 {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let limit = Limit::new(4);
    let semaphore = tokio::sync::Semaphore::new(4);
    rt.block_on(async {
        let run = |n: u32| {
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
                            .resources_operation(
                                semaphore,
                                Operation::Judge,
                                Executor::Inline,
                                async { Ok::<_, Infallible>(n) },
                            )
                            .await;
                        assert_eq!(on_semaphore.unwrap().unwrap(), n);
                        on_limit
                    }
                    None => {
                        resources_operation(limit, Operation::Judge, Executor::Inline, work).await
                    }
                };
                assert_eq!(output.unwrap().unwrap(), n);
            }
        };
        for n in 0..WARM_UP {
            run(n).await;
        }
        let before = allocations();
        for n in 0..MEASURED {
            run(n).await;
        }
        allocations() - before
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
    let telemetry = support::Telemetry::new();
    assert_eq!(
        scoped_steady_state_allocations(Some(telemetry.metrics.clone())),
        0
    );
    let count = |outcome| {
        telemetry.count(
            tower_resources_operation::DURATION_INSTRUMENT,
            &[(tower_resources_operation::OUTCOME_ATTRIBUTE, outcome)],
        )
    };
    let rounds = u64::from(WARM_UP + MEASURED);
    let timeouts = (0..WARM_UP)
        .chain(0..MEASURED)
        .filter(|n| n % 3 == 0)
        .count() as u64;
    assert_eq!(count("timeout"), timeouts);
    assert_eq!(count("ok"), 2 * rounds - timeouts);
}

#[test]
fn no_allocation_per_operation_of_the_free_function() {
    // On whatever global provider is installed (none here: the no-op one): looked up per call.
    assert_eq!(scoped_steady_state_allocations(None), 0);
}

/// Allocations made by `MEASURED` body-end operations after `WARM_UP`, each body read to its end.
fn body_end_steady_state_allocations(metrics: OperationMetrics) -> u64 {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let layer = ResourcesOperationLayer::new_for_http(4)
        .operation(Operation::Verify)
        .metrics(metrics)
        .until_body_end();
    let service = layer.layer(tower::service_fn(|_: http::Request<()>| async {
        Ok::<_, Infallible>(http::Response::new(Full::new(Bytes::from_static(
            b"verified",
        ))))
    }));
    rt.block_on(async {
        let run = || {
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
        };
        for _ in 0..WARM_UP {
            run().await;
        }
        let before = allocations();
        for _ in 0..MEASURED {
            run().await;
        }
        allocations() - before
    })
}

#[test]
fn no_allocation_per_body_end_operation_with_metrics_enabled_or_disabled() {
    assert_eq!(
        body_end_steady_state_allocations(OperationMetrics::disabled()),
        0
    );
    let telemetry = support::Telemetry::new();
    assert_eq!(
        body_end_steady_state_allocations(telemetry.metrics.clone()),
        0
    );
    assert_eq!(
        telemetry.count(tower_resources_operation::DURATION_INSTRUMENT, &[]),
        u64::from(WARM_UP + MEASURED)
    );
}

/// An error of a service that answers rejections with it, made without allocating.
#[derive(Debug)]
enum Busy {
    Rejected,
}

impl From<tower_resources_operation::Rejected> for Busy {
    fn from(_: tower_resources_operation::Rejected) -> Self {
        Busy::Rejected
    }
}

/// Allocations made by `MEASURED` operations turned away at once (the limit full, no room to
/// wait), through a generic layer answering with an error and an HTTP layer answering 503.
fn rejected_steady_state_allocations(metrics: OperationMetrics) -> u64 {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let full = Limit::new(1).max_queued(0);
    let held = tower_resources_operation::Acquire::try_acquire(&full)
        .unwrap()
        .unwrap();
    let generic = ResourcesOperationLayer::with_limit(full.clone())
        .metrics(metrics.clone())
        .bounded()
        .layer(tower::service_fn(|n: u32| async move { Ok::<_, Busy>(n) }));
    let http = ResourcesOperationLayer::with_limit_for_http(full.clone())
        .metrics(metrics)
        .bounded()
        .layer(tower::service_fn(|_: http::Request<()>| async {
            Ok::<_, Infallible>(http::Response::new(()))
        }));
    rt.block_on(async {
        let run = || {
            let (generic, http) = (generic.clone(), http.clone());
            async move {
                assert!(matches!(generic.oneshot(1).await, Err(Busy::Rejected)));
                let answer = http.oneshot(http::Request::new(())).await.unwrap();
                assert_eq!(answer.status(), 503);
            }
        };
        for _ in 0..WARM_UP {
            run().await;
        }
        let before = allocations();
        for _ in 0..MEASURED {
            run().await;
        }
        let made = allocations() - before;
        drop(held);
        made
    })
}

#[test]
fn no_allocation_per_rejected_operation() {
    assert_eq!(
        rejected_steady_state_allocations(OperationMetrics::disabled()),
        0
    );
    let telemetry = support::Telemetry::new();
    assert_eq!(
        rejected_steady_state_allocations(telemetry.metrics.clone()),
        0
    );
    assert_eq!(
        telemetry.live_value(tower_resources_operation::REJECTED_INSTRUMENT, &[]),
        i64::from(2 * (WARM_UP + MEASURED)),
        "every operation was turned away, and counted"
    );
}

#[test]
fn the_counter_sees_allocations() {
    // Guards the two tests above against a counter that never counts.
    let before = allocations();
    let boxed = std::hint::black_box(Box::new(7_u64));
    assert_eq!(*boxed, 7);
    assert!(allocations() > before);
}
