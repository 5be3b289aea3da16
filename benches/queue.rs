//! What a queued operation costs: heap bytes per waiter, and the time to drain the queue, with
//! tower's `ConcurrencyLimit` beside this layer (metrics off and on).
//!
//! ```text
//! cargo bench --bench queue
//! ```
//!
//! Each case holds the only permit of a limit of 1 with one clone of the service (its
//! `poll_ready` took it), then spawns N tasks on a current-thread runtime, each
//! `tokio::spawn(service.clone().oneshot(()))` on a `service_fn` that captures one `Arc`: what
//! hyper and axum do per request, with nothing else allocated per task. The heap in use once
//! all of them wait, less the heap before, divided by N, is the memory per queued operation;
//! the time for the queue to drain once the holder lets go, divided by N, is the drain time.

use std::alloc::{GlobalAlloc, Layout, System};
use std::convert::Infallible;
use std::sync::atomic::{AtomicIsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tower::{service_fn, Layer, Service, ServiceExt};
use tower_resources_operation::{OperationMetrics, ResourcesOperationLayer};

mod common;

/// Counts the bytes in use on the heap.
struct Counting;

static IN_USE: AtomicIsize = AtomicIsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        IN_USE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        IN_USE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        IN_USE.fetch_add(
            new_size as isize - layout.size() as isize,
            Ordering::Relaxed,
        );
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Bytes per queued operation and drain time per operation, for `waiters` operations queued
/// behind a clone that holds the only permit: each waiter is `tokio::spawn(service.clone()
/// .oneshot(()))`, as hyper and axum drive a service, and nothing else is allocated per
/// waiter. The heap in use once all of them wait, less the heap before, divided by `waiters`,
/// is the memory per queued operation (its task, its future, the service's clone, the limit's
/// wait). Then the holder lets go and the queue drains, one operation at a time: that time,
/// divided by `waiters`, is the drain time per operation.
fn measure<S>(service: S, waiters: usize) -> (f64, Duration)
where
    S: Service<(), Response = ()> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: std::fmt::Debug + Send,
{
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    rt.block_on(async move {
        let mut holder = service.clone();
        holder.ready().await.unwrap();
        // Room for every handle first, so the vector's growth is not counted.
        let mut tasks = Vec::with_capacity(waiters);
        let before = IN_USE.load(Ordering::Relaxed);
        for _ in 0..waiters {
            tasks.push(tokio::spawn(service.clone().oneshot(())));
        }
        // Every task runs until it waits for the permit (the scheduler polls a batch per tick).
        for _ in 0..waiters.div_ceil(32) + 64 {
            tokio::task::yield_now().await;
        }
        let queued = IN_USE.load(Ordering::Relaxed) - before;
        let started = Instant::now();
        drop(holder);
        for task in tasks {
            task.await.unwrap().unwrap();
        }
        let drained = started.elapsed();
        (queued as f64 / waiters as f64, drained / waiters as u32)
    })
}

/// Bytes per queued operation when the waiting futures are held directly (boxed, each polled
/// once until it waits), without a task around each: the future and the limit's wait alone.
fn measure_futures<S>(service: S, waiters: usize) -> f64
where
    S: Service<(), Response = ()> + Clone,
    S::Error: std::fmt::Debug,
{
    use std::future::Future;
    use std::task::{Context, Poll, Waker};
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let _entered = rt.enter();
    let mut cx = Context::from_waker(Waker::noop());
    let mut holder = service.clone();
    assert!(matches!(holder.poll_ready(&mut cx), Poll::Ready(Ok(()))));
    let mut futures = Vec::with_capacity(waiters);
    let reserved = IN_USE.load(Ordering::Relaxed);
    for _ in 0..waiters {
        let mut future = Box::pin(service.clone().oneshot(()));
        assert!(matches!(future.as_mut().poll(&mut cx), Poll::Pending));
        futures.push(future);
    }
    let queued = IN_USE.load(Ordering::Relaxed) - reserved;
    drop(futures);
    drop(holder);
    queued as f64 / waiters as f64
}

fn main() {
    if !std::env::args().any(|arg| arg == "--bench") {
        return;
    }
    // A service that captures one `Arc`, and answers at once.
    let shared = Arc::new(0_u64);
    let inner = || {
        let shared = Arc::clone(&shared);
        service_fn(move |()| {
            let _ = &shared;
            std::future::ready(Ok::<_, Infallible>(()))
        })
    };
    let (_provider, meter) = common::sdk_meter();
    let metrics = OperationMetrics::new(&meter);
    // The layer on a limit of 1 over `inner`, recording nothing or through the SDK.
    let layer_disabled = || {
        ResourcesOperationLayer::new(1)
            .metrics(OperationMetrics::disabled())
            .layer(inner())
    };
    let layer_metrics = || {
        ResourcesOperationLayer::new(1)
            .metrics(metrics.clone())
            .layer(inner())
    };
    for waiters in [10_000, 100_000] {
        println!("\n{waiters} operations queued behind a limit of 1");
        let tower = measure(tower::limit::ConcurrencyLimit::new(inner(), 1), waiters);
        let cases = [
            ("tower_limit", tower),
            ("layer_disabled", measure(layer_disabled(), waiters)),
            ("layer_metrics", measure(layer_metrics(), waiters)),
        ];
        for (name, (bytes, drain)) in cases {
            println!(
                "  {name:<16} {bytes:>6.0} bytes/op ({:.2}x)   drain {:>7.1} ns/op ({:.2}x)",
                bytes / tower.0,
                drain.as_nanos() as f64,
                drain.as_nanos() as f64 / tower.1.as_nanos() as f64,
            );
        }
        let tower = measure_futures(tower::limit::ConcurrencyLimit::new(inner(), 1), waiters);
        let futures = [
            ("tower_limit", tower),
            ("layer_disabled", measure_futures(layer_disabled(), waiters)),
            ("layer_metrics", measure_futures(layer_metrics(), waiters)),
        ];
        println!("  the waiting futures alone, boxed, no task each:");
        for (name, bytes) in futures {
            println!("  {name:<16} {bytes:>6.0} bytes/op ({:.2}x)", bytes / tower);
        }
    }
}
