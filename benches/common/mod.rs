//! What the benchmarks share: the inner services, the peer-style layer, the floor, and the
//! ways to drive a service: reused, `clone().oneshot()`, and the contended run.
#![allow(dead_code, unreachable_pub)]

use std::convert::Infallible;
use std::future::{ready, Future, Ready};
use std::pin::Pin;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use opentelemetry::metrics::{Histogram, Meter, MeterProvider as _, UpDownCounter};
use opentelemetry::KeyValue;
use opentelemetry_sdk::metrics::{InMemoryMetricExporterBuilder, PeriodicReader, SdkMeterProvider};
use tokio::runtime::Runtime;
use tower::limit::ConcurrencyLimit;
use tower::{Service, ServiceExt};
use tower_resources_operation::names::{
    DURATION_INSTRUMENT, EXECUTOR_ATTRIBUTE, OPERATION_ATTRIBUTE, OPERATION_BOUNDARIES_MS,
    OUTCOME_ATTRIBUTE, QUEUE_DURATION_INSTRUMENT,
};
use tower_resources_operation::{Executor, Operation, OperationMetrics, ResourcesOperationLayer};

/// The cheapest inner service there is.
#[derive(Clone, Copy)]
pub struct Noop;

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
pub struct YieldOnce;

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

pub fn sdk_meter() -> (SdkMeterProvider, Meter) {
    let reader = PeriodicReader::builder(InMemoryMetricExporterBuilder::new().build())
        .with_interval(Duration::from_secs(3600))
        .build();
    let provider = SdkMeterProvider::builder().with_reader(reader).build();
    let meter = provider.meter("bench");
    (provider, meter)
}

/// Criterion as the `overhead` and `adaptive` benches configure it: a second of warm-up and
/// three of measurement per case.
pub fn short_criterion() -> criterion::Criterion {
    criterion::Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
}

pub fn layer(max: usize, metrics: OperationMetrics) -> ResourcesOperationLayer {
    ResourcesOperationLayer::new(max)
        .operation(Operation::Verify)
        .executor(Executor::Subprocess)
        .metrics(metrics)
}

// ---------------------------------------------------------------------------------------------
// The naive peer-style layer and the floor, written here so they are measured the same way.

pub mod spans;

pub mod naive {
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

    impl<S> Naive<S> {
        /// `inner` behind tower's limit of `max`, recording through `instruments`.
        pub(crate) fn new(inner: S, max: usize, instruments: Instruments) -> Self {
            Self {
                inner: ConcurrencyLimit::new(inner, max),
                instruments,
            }
        }
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

/// The least a layer on this crate's [`Limit`] does with metrics off: `poll_ready` takes a
/// permit, the response future holds it, and nothing else (no operation, no check for a limit
/// its request already holds, no wait: it runs uncontended only). No layout of the layer's
/// service does less on the path of a free permit, so its ratio to tower's limit is the
/// floor of the metrics-off target.
pub mod bare {
    use super::*;
    use std::cell::Cell;
    use tower_resources_operation::limit::LimitId;
    use tower_resources_operation::{Acquire, Limit};

    thread_local! {
        /// The limit whose place the work running on this thread holds, as the layer keeps it.
        static HELD: Cell<Option<LimitId>> = const { Cell::new(None) };
    }

    /// `NESTED`: it also does what a layer must to find a request that reaches a limit whose
    /// place it already holds, as the layer does it: a thread-local
    /// read before taking a place, and the place published around the inner `poll_ready` and
    /// around each poll of the response future. A request found nested is not handled: the
    /// bench has none.
    pub(crate) struct Bare<S, const NESTED: bool = false> {
        inner: S,
        limit: Limit,
        permit: Option<<Limit as Acquire>::Permit>,
    }

    impl<S: Clone, const NESTED: bool> Clone for Bare<S, NESTED> {
        /// Shares the limit; the clone starts without a permit, as tower's limit does.
        fn clone(&self) -> Self {
            Self {
                inner: self.inner.clone(),
                limit: self.limit.clone(),
                permit: None,
            }
        }
    }

    impl<S, const NESTED: bool> Bare<S, NESTED> {
        pub(crate) fn new(inner: S, max: usize) -> Self {
            Self {
                inner,
                limit: Limit::new(max),
                permit: None,
            }
        }
    }

    /// Runs `work` with `held` published as the limit whose place the running work holds.
    #[inline(always)]
    fn holding<R>(held: Option<LimitId>, work: impl FnOnce() -> R) -> R {
        let previous = HELD.with(|current| current.replace(held));
        let output = work();
        HELD.with(|current| current.set(previous));
        output
    }

    impl<S: Service<()>, const NESTED: bool> Service<()> for Bare<S, NESTED>
    where
        S::Future: Unpin,
    {
        type Response = S::Response;
        type Error = S::Error;
        type Future = BareFuture<S::Future, NESTED>;

        fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
            if self.permit.is_none() {
                if NESTED && HELD.with(Cell::get) == self.limit.id() {
                    panic!("the bare case has no nested request");
                }
                match self.limit.try_acquire() {
                    Some(Ok(permit)) => self.permit = Some(permit),
                    _ => panic!("the bare case runs uncontended: a permit is always free"),
                }
            }
            match NESTED {
                true => {
                    let held = self.permit.as_ref().and_then(Limit::id_of);
                    let inner = &mut self.inner;
                    holding(held, || inner.poll_ready(cx))
                }
                false => self.inner.poll_ready(cx),
            }
        }

        fn call(&mut self, request: ()) -> Self::Future {
            BareFuture {
                inner: self.inner.call(request),
                permit: self.permit.take().expect("poll_ready before call"),
            }
        }
    }

    pub(crate) struct BareFuture<F, const NESTED: bool> {
        inner: F,
        permit: <Limit as Acquire>::Permit,
    }

    impl<F: Future + Unpin, const NESTED: bool> Future for BareFuture<F, NESTED> {
        type Output = F::Output;

        fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
            match NESTED {
                true => {
                    let this = &mut *self;
                    let (inner, held) = (&mut this.inner, Limit::id_of(&this.permit));
                    holding(held, || Pin::new(inner).poll(cx))
                }
                false => Pin::new(&mut self.inner).poll(cx),
            }
        }
    }
}

pub mod floor {
    use super::*;

    /// What the floor records through: two histograms of one series and its live counts.
    pub(crate) trait Record: Send + Sync + 'static {
        fn queue(&self, ms: f64);
        fn duration(&self, ms: f64);
        fn queued(&self) -> &AtomicI64;
        fn active(&self) -> &AtomicI64;
    }

    /// The SDK's histograms, recorded with pre-built attributes; bound to them in the
    /// `experimental-bound-instruments` build, as the layer's are there.
    pub(crate) struct Shared {
        queue: Histogram<f64>,
        duration: Histogram<f64>,
        series: [KeyValue; 2],
        ok: [KeyValue; 3],
        #[cfg(feature = "experimental-bound-instruments")]
        bound: [opentelemetry::metrics::BoundHistogram<f64>; 2],
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
            let queue = histogram(QUEUE_DURATION_INSTRUMENT);
            let duration = histogram(DURATION_INSTRUMENT);
            let series = [op.clone(), ex.clone()];
            let ok = [op, ex, KeyValue::new(OUTCOME_ATTRIBUTE, "ok")];
            Arc::new(Self {
                #[cfg(feature = "experimental-bound-instruments")]
                bound: [queue.bind(&series), duration.bind(&ok)],
                queue,
                duration,
                series,
                ok,
                queued: AtomicI64::new(0),
                active: AtomicI64::new(0),
            })
        }
    }

    impl Record for Shared {
        #[cfg(not(feature = "experimental-bound-instruments"))]
        fn queue(&self, ms: f64) {
            self.queue.record(ms, &self.series);
        }

        #[cfg(not(feature = "experimental-bound-instruments"))]
        fn duration(&self, ms: f64) {
            self.duration.record(ms, &self.ok);
        }

        #[cfg(feature = "experimental-bound-instruments")]
        fn queue(&self, ms: f64) {
            self.bound[0].record(ms);
        }

        #[cfg(feature = "experimental-bound-instruments")]
        fn duration(&self, ms: f64) {
            self.bound[1].record(ms);
        }

        fn queued(&self) -> &AtomicI64 {
            &self.queued
        }

        fn active(&self) -> &AtomicI64 {
            &self.active
        }
    }

    /// Only the work nobody can avoid: tower's limit, two records with pre-built attributes,
    /// the live counts (`active`; `queued` while an operation waits), and the clock read when an
    /// operation is admitted and when it ends, and once more when its wait begins: a queue time
    /// is the wait's, so an operation that waits is timed from its first `Pending`.
    ///
    /// `TIMES_WAIT = false` is the floor of 0.5 before it timed the wait: it recorded 0 for every
    /// queue time and counted every operation in and out of `queued` in `call`, waiting or not
    /// (the `floor_untimed` case).
    pub(crate) struct Floor<S, R = Shared, const TIMES_WAIT: bool = true> {
        pub(crate) inner: ConcurrencyLimit<S>,
        pub(crate) shared: Arc<R>,
        wait: Wait,
    }

    /// Where the next operation's wait stands.
    enum Wait {
        /// It has not waited.
        Free,
        /// It waits, since then.
        Since(tokio::time::Instant),
        /// It waited `queued_ms` and was admitted `at`.
        Ended {
            at: tokio::time::Instant,
            queued_ms: f64,
        },
    }

    impl<S, R> Floor<S, R> {
        /// `inner` behind tower's limit of `max`, recording into `shared`.
        pub(crate) fn new(inner: S, max: usize, shared: Arc<R>) -> Self {
            Self {
                inner: ConcurrencyLimit::new(inner, max),
                shared,
                wait: Wait::Free,
            }
        }
    }

    impl<S, R> Floor<S, R, false> {
        /// The floor as it was before it timed the wait.
        pub(crate) fn untimed(inner: S, max: usize, shared: Arc<R>) -> Self {
            Self {
                inner: ConcurrencyLimit::new(inner, max),
                shared,
                wait: Wait::Free,
            }
        }
    }

    impl<S: Clone, R, const TIMES_WAIT: bool> Clone for Floor<S, R, TIMES_WAIT> {
        fn clone(&self) -> Self {
            Self {
                inner: self.inner.clone(),
                shared: Arc::clone(&self.shared),
                wait: Wait::Free,
            }
        }
    }

    impl<S: Service<()>, R: Record, const TIMES_WAIT: bool> Service<()> for Floor<S, R, TIMES_WAIT>
    where
        S::Future: Unpin,
    {
        type Response = S::Response;
        type Error = S::Error;
        type Future = FloorFuture<<ConcurrencyLimit<S> as Service<()>>::Future, R>;

        fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
            let polled = self.inner.poll_ready(cx);
            if TIMES_WAIT {
                match (&polled, &self.wait) {
                    (Poll::Pending, Wait::Free) => {
                        self.shared.queued().fetch_add(1, Ordering::Relaxed);
                        self.wait = Wait::Since(tokio::time::Instant::now());
                    }
                    (Poll::Ready(_), &Wait::Since(since)) => {
                        let at = tokio::time::Instant::now();
                        self.shared.queued().fetch_sub(1, Ordering::Relaxed);
                        let queued_ms = (at - since).as_secs_f64() * 1e3;
                        self.wait = Wait::Ended { at, queued_ms };
                    }
                    _ => {}
                }
            }
            polled
        }

        fn call(&mut self, request: ()) -> Self::Future {
            let s = &self.shared;
            let (start, queued_ms) = match std::mem::replace(&mut self.wait, Wait::Free) {
                Wait::Ended { at, queued_ms } => (Some(at), queued_ms),
                _ => (None, 0.0),
            };
            if !TIMES_WAIT {
                s.queued().fetch_add(1, Ordering::Relaxed);
                s.queued().fetch_sub(1, Ordering::Relaxed);
            }
            s.queue(queued_ms);
            s.active().fetch_add(1, Ordering::Relaxed);
            FloorFuture {
                inner: self.inner.call(request),
                shared: Arc::clone(s),
                // The clock the layer reads (tokio's, so that a paused clock is followed). The
                // benches build tokio with `test-util`, as the tests need, which makes each read
                // dearer than in a user's build: the floor pays that too. An operation that
                // waited runs from its admission, read as its wait ended.
                start: start.unwrap_or_else(tokio::time::Instant::now),
            }
        }
    }

    pub(crate) struct FloorFuture<F, R> {
        inner: F,
        shared: Arc<R>,
        start: tokio::time::Instant,
    }

    impl<F: Future + Unpin, R: Record> Future for FloorFuture<F, R> {
        type Output = F::Output;

        fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
            let out = std::task::ready!(Pin::new(&mut self.inner).poll(cx));
            let s = &self.shared;
            s.duration(self.start.elapsed().as_secs_f64() * 1e3);
            s.active().fetch_sub(1, Ordering::Relaxed);
            Poll::Ready(out)
        }
    }
}

/// The floor with the SDK's histograms swapped for lock-free ones (an atomic count per bucket,
/// an atomic count and total), as a lock-free SDK aggregator would record: what the contended
/// floor would be if the SDK took no lock per record. It exports nothing.
pub mod lock_free_floor {
    use super::*;
    use std::sync::atomic::AtomicU64;

    /// One explicit-bucket histogram of one series, updated with atomics only.
    pub(crate) struct AtomicHistogram {
        buckets: Box<[AtomicU64]>,
        count: AtomicU64,
        /// The f64 total's bits, updated by compare-and-swap.
        total: AtomicU64,
    }

    impl AtomicHistogram {
        fn new() -> Self {
            Self {
                buckets: (0..=OPERATION_BOUNDARIES_MS.len())
                    .map(|_| AtomicU64::new(0))
                    .collect(),
                count: AtomicU64::new(0),
                total: AtomicU64::new(0f64.to_bits()),
            }
        }

        fn record(&self, value: f64) {
            let bucket = OPERATION_BOUNDARIES_MS.partition_point(|&bound| bound < value);
            self.buckets[bucket].fetch_add(1, Ordering::Relaxed);
            self.count.fetch_add(1, Ordering::Relaxed);
            let _ = self
                .total
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| {
                    Some((f64::from_bits(bits) + value).to_bits())
                });
        }

        pub(crate) fn count(&self) -> u64 {
            self.count.load(Ordering::Relaxed)
        }

        /// The sum of the values recorded.
        pub(crate) fn total(&self) -> f64 {
            f64::from_bits(self.total.load(Ordering::Relaxed))
        }
    }

    /// Aligned so that the histograms and the live counts do not share a cache line by
    /// accident of layout.
    #[repr(align(64))]
    pub(crate) struct Aligned<T>(pub(crate) T);

    pub(crate) struct Shared {
        pub(crate) queue: Aligned<AtomicHistogram>,
        pub(crate) duration: Aligned<AtomicHistogram>,
        queued: Aligned<AtomicI64>,
        active: Aligned<AtomicI64>,
    }

    impl Shared {
        pub(crate) fn new() -> Arc<Self> {
            Arc::new(Self {
                queue: Aligned(AtomicHistogram::new()),
                duration: Aligned(AtomicHistogram::new()),
                queued: Aligned(AtomicI64::new(0)),
                active: Aligned(AtomicI64::new(0)),
            })
        }
    }

    impl floor::Record for Shared {
        fn queue(&self, ms: f64) {
            self.queue.0.record(ms);
        }

        fn duration(&self, ms: f64) {
            self.duration.0.record(ms);
        }

        fn queued(&self) -> &AtomicI64 {
            &self.queued.0
        }

        fn active(&self) -> &AtomicI64 {
            &self.active.0
        }
    }
}

// ---------------------------------------------------------------------------------------------

/// Time per operation of a reused service: `ready` then `call`, awaited.
pub fn reused<S>(rt: &Runtime, mut service: S, iters: u64) -> Duration
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
pub fn oneshot<S>(rt: &Runtime, service: S, iters: u64) -> Duration
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

/// Time per operation with 64 tasks through one limit of 4 on `rt`, a current-thread runtime:
/// most operations wait for their permit, as in the contended run, but nothing runs in
/// parallel. So no worker is descheduled while it holds a lock, and what is left is the cost of
/// the waiting path itself, the same instructions run after run (for callgrind). Each task runs
/// `iters / 64` operations, rounded up; the time is scaled back to `iters`.
pub fn queued_run<S>(rt: &Runtime, service: S, iters: u64) -> Duration
where
    S: Service<()> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: std::fmt::Debug,
{
    rt.block_on(tasks_through(service, 64, iters, 1))
}

/// Time per operation with 64 tasks through one limit of 4 on 2 workers.
///
/// Each sample gets a fresh runtime and runs long enough to reach a steady state: short samples
/// on a runtime that is starting up measured up to 2x slower, and unevenly from case to case.
pub fn contended_run<S>(service: S, iters: u64) -> Duration
where
    S: Service<()> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: std::fmt::Debug,
{
    contended_on(2, 64, service, iters)
}

/// A server's setup: 8 worker threads (more than the cores, as a server configured for its
/// largest host runs on a smaller one) and 256 requests in flight, each a task.
pub fn server_run<S>(service: S, iters: u64) -> Duration
where
    S: Service<()> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: std::fmt::Debug,
{
    contended_on(8, 256, service, iters)
}

/// `tasks` tasks on `workers` worker threads, through `service`, for `iters` operations.
fn contended_on<S>(workers: usize, tasks: u64, service: S, iters: u64) -> Duration
where
    S: Service<()> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: std::fmt::Debug,
{
    // At least this many operations per task and sample, so a sample measures the steady state
    // rather than a runtime starting up.
    const MIN_PER_TASK: u64 = 256;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .build()
        .unwrap();
    let elapsed = rt.block_on(tasks_through(service, tasks, iters, MIN_PER_TASK));
    // Wait for the workers to stop, so they do not compete with the next sample's.
    drop(rt);
    elapsed
}

/// `tasks` tasks, each running `iters / tasks` operations (rounded up, and at least
/// `min_per_task`) through its own `clone().oneshot()` of `service`: the time, scaled back to
/// `iters`.
async fn tasks_through<S>(service: S, tasks: u64, iters: u64, min_per_task: u64) -> Duration
where
    S: Service<()> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: std::fmt::Debug,
{
    let per_task = iters.div_ceil(tasks).max(min_per_task);
    let start = Instant::now();
    let handles: Vec<_> = (0..tasks)
        .map(|_| {
            let service = service.clone();
            tokio::spawn(async move {
                for _ in 0..per_task {
                    service.clone().oneshot(()).await.unwrap();
                }
            })
        })
        .collect();
    for handle in handles {
        handle.await.unwrap();
    }
    start
        .elapsed()
        .mul_f64(iters as f64 / (per_task * tasks) as f64)
}

// ---------------------------------------------------------------------------------------------
// HTTP cases: rejections and the body-end form.

/// An HTTP service that answers at once, with a body of `frames` one-byte frames.
#[derive(Clone, Copy)]
pub struct HttpFrames {
    pub frames: u8,
}

impl Service<http::Request<()>> for HttpFrames {
    type Response = http::Response<Frames>;
    type Error = Infallible;
    type Future = Ready<Result<http::Response<Frames>, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: http::Request<()>) -> Self::Future {
        ready(Ok(http::Response::new(Frames { left: self.frames })))
    }
}

/// A body of `left` one-byte frames, ready at once; allocates nothing.
#[derive(Default)]
pub struct Frames {
    left: u8,
}

impl http_body::Body for Frames {
    type Data = bytes::Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<bytes::Bytes>, Infallible>>> {
        if self.left == 0 {
            return Poll::Ready(None);
        }
        self.left -= 1;
        Poll::Ready(Some(Ok(http_body::Frame::data(bytes::Bytes::from_static(
            b"x",
        )))))
    }

    fn is_end_stream(&self) -> bool {
        self.left == 0
    }
}

/// Time per operation of `clone().oneshot()` on an HTTP service, its body read to the end frame
/// by frame.
pub fn http_oneshot<S, B>(rt: &Runtime, service: S, iters: u64) -> Duration
where
    S: Service<http::Request<()>, Response = http::Response<B>> + Clone,
    S::Error: std::fmt::Debug,
    B: http_body::Body + Unpin,
    B::Error: std::fmt::Debug,
{
    use http_body_util::BodyExt;
    rt.block_on(async {
        let start = Instant::now();
        for _ in 0..iters {
            let response = service
                .clone()
                .oneshot(http::Request::new(()))
                .await
                .unwrap();
            let mut body = response.into_body();
            while let Some(frame) = body.frame().await {
                frame.unwrap();
            }
        }
        start.elapsed()
    })
}
