//! What the layer costs next to tower's own `ConcurrencyLimit`, all in one run so the ratios hold
//! on a noisy machine.
//!
//! ```text
//! cargo bench --bench overhead
//! ```
//!
//! - `uncontended/*`: a current-thread runtime and a no-op inner service, per operation, in the
//!   two ways services are driven: a reused service (`ready` + `call`) and `clone().oneshot()`,
//!   as hyper and axum do per request.
//! - `contended/*`: a 2-worker runtime, 64 tasks through a limit of 4, the inner service yields
//!   once; time per operation.
//!
//! The cases: tower's limit; this layer with metrics disabled; this layer with a real SDK meter
//! provider and reader; a naive peer-style layer (up-down counters and `KeyValue`s built per
//! call, as OpenTelemetry middlewares do it today); and the floor: tower's limit plus only the
//! unavoidable work (two clock reads, two histogram records with pre-built attributes, four
//! atomic adds).

use std::convert::Infallible;
use std::future::{ready, Future, Ready};
use std::pin::Pin;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use opentelemetry::metrics::{Histogram, Meter, MeterProvider as _, UpDownCounter};
use opentelemetry::KeyValue;
use opentelemetry_sdk::metrics::{InMemoryMetricExporterBuilder, PeriodicReader, SdkMeterProvider};
use tokio::runtime::Runtime;
use tokio::sync::Semaphore;
use tower::limit::{ConcurrencyLimit, ConcurrencyLimitLayer};
use tower::{Layer, Service, ServiceExt};
use tower_resources_operation::{
    Executor, Operation, OperationMetrics, ResourcesOperationLayer, DURATION_INSTRUMENT,
    EXECUTOR_ATTRIBUTE, OPERATION_ATTRIBUTE, OPERATION_BOUNDARIES_MS, OUTCOME_ATTRIBUTE,
    QUEUE_DURATION_INSTRUMENT,
};

/// The cheapest inner service there is.
#[derive(Clone, Copy)]
struct Noop;

impl Service<()> for Noop {
    type Response = ();
    type Error = Infallible;
    type Future = Ready<Result<(), Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: ()) -> Self::Future {
        ready(Ok(()))
    }
}

/// An inner service that yields to the scheduler once, so the limit is held across a poll.
#[derive(Clone, Copy)]
struct YieldOnce;

impl Service<()> for YieldOnce {
    type Response = ();
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<(), Infallible>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: ()) -> Self::Future {
        Box::pin(async {
            tokio::task::yield_now().await;
            Ok(())
        })
    }
}

fn sdk_meter() -> (SdkMeterProvider, Meter) {
    let reader = PeriodicReader::builder(InMemoryMetricExporterBuilder::new().build())
        .with_interval(Duration::from_secs(3600))
        .build();
    let provider = SdkMeterProvider::builder().with_reader(reader).build();
    let meter = provider.meter("bench");
    (provider, meter)
}

fn layer(max: usize, metrics: OperationMetrics) -> ResourcesOperationLayer {
    ResourcesOperationLayer::new(max)
        .operation(Operation::Verify)
        .executor(Executor::Subprocess)
        .metrics(metrics)
}

// ---------------------------------------------------------------------------------------------
// The naive peer-style layer and the floor, written here so they are measured the same way.

mod naive {
    use super::*;

    /// Instruments as a typical OpenTelemetry middleware holds them.
    #[derive(Clone)]
    pub(crate) struct Instruments {
        queued: UpDownCounter<i64>,
        active: UpDownCounter<i64>,
        queue: Histogram<f64>,
        duration: Histogram<f64>,
    }

    impl Instruments {
        pub(crate) fn new(meter: &Meter) -> Self {
            Self {
                queued: meter.i64_up_down_counter("naive.queued").build(),
                active: meter.i64_up_down_counter("naive.active").build(),
                queue: meter.f64_histogram("naive.queue").build(),
                duration: meter.f64_histogram("naive.duration").build(),
            }
        }
    }

    fn attributes() -> [KeyValue; 2] {
        [
            KeyValue::new(OPERATION_ATTRIBUTE, "verify"),
            KeyValue::new(EXECUTOR_ATTRIBUTE, "subprocess"),
        ]
    }

    /// tower's limit with counters added and removed and attributes built on every call.
    #[derive(Clone)]
    pub(crate) struct Naive<S> {
        pub(crate) inner: ConcurrencyLimit<S>,
        pub(crate) instruments: Instruments,
    }

    impl<S: Service<()>> Service<()> for Naive<S>
    where
        S::Future: Unpin,
    {
        type Response = S::Response;
        type Error = S::Error;
        type Future = NaiveFuture<<ConcurrencyLimit<S> as Service<()>>::Future>;

        fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
            self.inner.poll_ready(cx)
        }

        fn call(&mut self, request: ()) -> Self::Future {
            let i = &self.instruments;
            // A peer counts the request as queued, then running, building attributes each time.
            let waited = Instant::now();
            i.queued.add(1, &attributes());
            let future = self.inner.call(request);
            i.queued.add(-1, &attributes());
            i.queue
                .record(waited.elapsed().as_secs_f64() * 1e3, &attributes());
            i.active.add(1, &attributes());
            NaiveFuture {
                inner: future,
                instruments: i.clone(),
                start: Instant::now(),
            }
        }
    }

    pub(crate) struct NaiveFuture<F> {
        inner: F,
        instruments: Instruments,
        start: Instant,
    }

    impl<F: Future<Output = Result<T, E>> + Unpin, T, E> Future for NaiveFuture<F> {
        type Output = F::Output;

        fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
            let out = std::task::ready!(Pin::new(&mut self.inner).poll(cx));
            let i = &self.instruments;
            let outcome = if out.is_ok() { "ok" } else { "error" };
            let [op, ex] = attributes();
            i.duration.record(
                self.start.elapsed().as_secs_f64() * 1e3,
                &[op, ex, KeyValue::new(OUTCOME_ATTRIBUTE, outcome)],
            );
            i.active.add(-1, &attributes());
            Poll::Ready(out)
        }
    }
}

mod floor {
    use super::*;

    /// Only the work nobody can avoid: tower's limit, two clock reads, two records with
    /// pre-built attributes, four atomic adds.
    pub(crate) struct Shared {
        queue: Histogram<f64>,
        duration: Histogram<f64>,
        series: [KeyValue; 2],
        ok: [KeyValue; 3],
        queued: AtomicI64,
        active: AtomicI64,
    }

    impl Shared {
        pub(crate) fn new(meter: &Meter) -> Arc<Self> {
            let histogram = |name| {
                meter
                    .f64_histogram(name)
                    .with_unit("ms")
                    .with_boundaries(OPERATION_BOUNDARIES_MS.to_vec())
                    .build()
            };
            let op = KeyValue::new(OPERATION_ATTRIBUTE, "verify");
            let ex = KeyValue::new(EXECUTOR_ATTRIBUTE, "subprocess");
            Arc::new(Self {
                queue: histogram(QUEUE_DURATION_INSTRUMENT),
                duration: histogram(DURATION_INSTRUMENT),
                series: [op.clone(), ex.clone()],
                ok: [op, ex, KeyValue::new(OUTCOME_ATTRIBUTE, "ok")],
                queued: AtomicI64::new(0),
                active: AtomicI64::new(0),
            })
        }
    }

    #[derive(Clone)]
    pub(crate) struct Floor<S> {
        pub(crate) inner: ConcurrencyLimit<S>,
        pub(crate) shared: Arc<Shared>,
    }

    impl<S: Service<()>> Service<()> for Floor<S>
    where
        S::Future: Unpin,
    {
        type Response = S::Response;
        type Error = S::Error;
        type Future = FloorFuture<<ConcurrencyLimit<S> as Service<()>>::Future>;

        fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
            self.inner.poll_ready(cx)
        }

        fn call(&mut self, request: ()) -> Self::Future {
            let s = &self.shared;
            s.queued.fetch_add(1, Ordering::Relaxed);
            s.queued.fetch_sub(1, Ordering::Relaxed);
            s.queue.record(0.0, &s.series);
            s.active.fetch_add(1, Ordering::Relaxed);
            FloorFuture {
                inner: self.inner.call(request),
                shared: Arc::clone(s),
                start: Instant::now(),
            }
        }
    }

    pub(crate) struct FloorFuture<F> {
        inner: F,
        shared: Arc<Shared>,
        start: Instant,
    }

    impl<F: Future + Unpin> Future for FloorFuture<F> {
        type Output = F::Output;

        fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
            let out = std::task::ready!(Pin::new(&mut self.inner).poll(cx));
            let s = &self.shared;
            s.duration
                .record(self.start.elapsed().as_secs_f64() * 1e3, &s.ok);
            s.active.fetch_sub(1, Ordering::Relaxed);
            Poll::Ready(out)
        }
    }
}

// ---------------------------------------------------------------------------------------------

/// Time per operation of a reused service: `ready` then `call`, awaited.
fn reused<S>(rt: &Runtime, mut service: S, iters: u64) -> Duration
where
    S: Service<()>,
    S::Error: std::fmt::Debug,
{
    rt.block_on(async {
        let start = Instant::now();
        for _ in 0..iters {
            let ready = service.ready().await.unwrap();
            ready.call(()).await.unwrap();
        }
        start.elapsed()
    })
}

/// Time per operation of `clone().oneshot()`, as hyper and axum drive a service per request.
fn oneshot<S>(rt: &Runtime, service: S, iters: u64) -> Duration
where
    S: Service<()> + Clone,
    S::Error: std::fmt::Debug,
{
    rt.block_on(async {
        let start = Instant::now();
        for _ in 0..iters {
            service.clone().oneshot(()).await.unwrap();
        }
        start.elapsed()
    })
}

fn uncontended(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let (_provider, meter) = sdk_meter();
    let metrics = OperationMetrics::new(&meter);
    let naive = naive::Instruments::new(&meter);
    let floor = floor::Shared::new(&meter);

    let tower = ConcurrencyLimitLayer::new(64).layer(Noop);
    let disabled = layer(64, OperationMetrics::disabled()).layer(Noop);
    let enabled = layer(64, metrics).layer(Noop);
    let naive = naive::Naive {
        inner: ConcurrencyLimit::new(Noop, 64),
        instruments: naive,
    };
    let floor = floor::Floor {
        inner: ConcurrencyLimit::new(Noop, 64),
        shared: floor,
    };

    let mut group = c.benchmark_group("uncontended");
    for pattern in ["reused", "oneshot"] {
        macro_rules! case {
            ($name:literal, $service:expr) => {
                group.bench_function(BenchmarkId::new($name, pattern), |b| {
                    b.iter_custom(|iters| match pattern {
                        "reused" => reused(&rt, $service.clone(), iters),
                        _ => oneshot(&rt, $service.clone(), iters),
                    })
                });
            };
        }
        case!("tower_limit", tower);
        case!("layer_disabled", disabled);
        case!("layer_metrics", enabled);
        case!("floor", floor);
        case!("naive_peer", naive);
    }
    group.finish();
}

/// Time per operation with 64 tasks through one limit of 4 on 2 workers.
fn contended_run<S>(rt: &Runtime, service: S, iters: u64) -> Duration
where
    S: Service<()> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: std::fmt::Debug,
{
    const TASKS: u64 = 64;
    rt.block_on(async {
        let per_task = iters.div_ceil(TASKS);
        let start = Instant::now();
        let tasks: Vec<_> = (0..TASKS)
            .map(|_| {
                let service = service.clone();
                tokio::spawn(async move {
                    for _ in 0..per_task {
                        service.clone().oneshot(()).await.unwrap();
                    }
                })
            })
            .collect();
        for task in tasks {
            task.await.unwrap();
        }
        // Scale back to the number of operations criterion asked for.
        start
            .elapsed()
            .mul_f64(iters as f64 / (per_task * TASKS) as f64)
    })
}

fn contended(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .build()
        .unwrap();
    let (_provider, meter) = sdk_meter();
    let metrics = OperationMetrics::new(&meter);

    let tower = ConcurrencyLimit::with_semaphore(YieldOnce, Arc::new(Semaphore::new(4)));
    let disabled = layer(4, OperationMetrics::disabled()).layer(YieldOnce);
    let enabled = layer(4, metrics).layer(YieldOnce);
    let floor = floor::Floor {
        inner: ConcurrencyLimit::new(YieldOnce, 4),
        shared: floor::Shared::new(&meter),
    };

    let mut group = c.benchmark_group("contended");
    group.bench_function("tower_limit", |b| {
        b.iter_custom(|iters| contended_run(&rt, tower.clone(), iters))
    });
    group.bench_function("layer_disabled", |b| {
        b.iter_custom(|iters| contended_run(&rt, disabled.clone(), iters))
    });
    group.bench_function("layer_metrics", |b| {
        b.iter_custom(|iters| contended_run(&rt, enabled.clone(), iters))
    });
    group.bench_function("floor", |b| {
        b.iter_custom(|iters| contended_run(&rt, floor.clone(), iters))
    });
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    targets = uncontended, contended
}
criterion_main!(benches);
