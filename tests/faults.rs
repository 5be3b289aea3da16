//! Faults in the metrics pipeline never reach requests: with the meter provider shut down or
//! dropped mid-run, an exporter that fails or hangs, or a meter that panics when it records,
//! every request still gets its own response and the limit still holds.

mod support;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use opentelemetry::metrics::{
    Histogram, HistogramBuilder, InstrumentProvider, Meter, MeterProvider as _, SyncInstrument,
};
use opentelemetry::KeyValue;
use opentelemetry_sdk::error::{OTelSdkError, OTelSdkResult};
use opentelemetry_sdk::metrics::data::ResourceMetrics;
use opentelemetry_sdk::metrics::exporter::PushMetricExporter;
use opentelemetry_sdk::metrics::{PeriodicReader, SdkMeterProvider, Temporality};
use tower::{service_fn, Layer as _, Service as _, ServiceExt as _};

use support::reliability::Load;
use support::DEADLINE;
use tower_resources_operation::{Executor, Operation, OperationMetrics, ResourcesOperationLayer};

/// The limit every test runs under.
const LIMIT: usize = 3;
/// Requests per run.
const REQUESTS: usize = 400;

/// Sends [`REQUESTS`] requests at once through `layer`, runs `fault` once half of them have
/// answered (with the rest in flight or queued), and checks that each request got its own
/// answer and that the inner service never ran more than [`LIMIT`] at once.
async fn run_through_fault(layer: ResourcesOperationLayer, fault: impl FnOnce()) {
    let load = Arc::new(Load::default());
    let tasks: Vec<_> = (0..REQUESTS)
        .map(|i| {
            let load = Arc::clone(&load);
            let service = layer.layer(service_fn(move |n: usize| {
                let guard = load.enter();
                async move {
                    let _guard = guard;
                    tokio::time::sleep(Duration::from_micros(200)).await;
                    Ok::<_, std::convert::Infallible>(n * 2)
                }
            }));
            tokio::spawn(service.oneshot(i))
        })
        .collect();

    let mut fault = Some(fault);
    for (i, task) in tasks.into_iter().enumerate() {
        if i == REQUESTS / 2 {
            (fault.take().unwrap())();
        }
        let answer = tokio::time::timeout(DEADLINE, task)
            .await
            .expect("a request hung")
            .expect("a request failed");
        assert_eq!(answer.unwrap(), i * 2, "request {i} got another's answer");
    }

    assert!(
        load.max() <= LIMIT,
        "{} ran at once under a limit of {LIMIT}",
        load.max()
    );
    assert_eq!(load.running(), 0);
    assert_eq!(layer.limit().available(), LIMIT);
}

fn layer(metrics: OperationMetrics) -> ResourcesOperationLayer {
    ResourcesOperationLayer::new(LIMIT)
        .operation(Operation::Verify)
        .executor(Executor::Subprocess)
        .metrics(metrics)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_keep_their_answers_and_the_limit_when_the_provider_is_shut_down_mid_run() {
    let (provider, _exporter) = support::pipeline();
    let metrics = OperationMetrics::new(&provider.meter("faults"));
    run_through_fault(layer(metrics.clone()), || {
        provider.shutdown().expect("first shutdown");
    })
    .await;

    // The fault was real: the provider refuses to flush.
    assert!(matches!(
        provider.force_flush(),
        Err(OTelSdkError::AlreadyShutdown)
    ));
    // A limit built on the dead provider's metrics still limits.
    run_through_fault(layer(metrics), || {}).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_keep_their_answers_and_the_limit_when_the_provider_is_dropped_mid_run() {
    let (provider, _exporter) = support::pipeline();
    let metrics = OperationMetrics::new(&provider.meter("faults"));
    let provider = Mutex::new(Some(provider));
    run_through_fault(layer(metrics.clone()), || {
        drop(provider.lock().unwrap().take());
    })
    .await;
    assert!(provider.lock().unwrap().is_none());
    run_through_fault(layer(metrics), || {}).await;
}

/// An exporter whose every export fails.
#[derive(Debug, Default)]
struct FailingExporter {
    exports: Arc<AtomicUsize>,
}

impl PushMetricExporter for FailingExporter {
    async fn export(&self, _metrics: &ResourceMetrics) -> OTelSdkResult {
        self.exports.fetch_add(1, Ordering::SeqCst);
        Err(OTelSdkError::InternalFailure(
            "the collector is down".into(),
        ))
    }

    fn force_flush(&self) -> OTelSdkResult {
        Err(OTelSdkError::InternalFailure(
            "the collector is down".into(),
        ))
    }

    fn shutdown_with_timeout(&self, _timeout: Duration) -> OTelSdkResult {
        Err(OTelSdkError::InternalFailure(
            "the collector is down".into(),
        ))
    }

    fn temporality(&self) -> Temporality {
        Temporality::Cumulative
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_keep_their_answers_and_the_limit_when_every_export_fails() {
    let exporter = FailingExporter::default();
    let exports = Arc::clone(&exporter.exports);
    let reader = PeriodicReader::builder(exporter)
        .with_interval(Duration::from_millis(5))
        .build();
    let provider = SdkMeterProvider::builder().with_reader(reader).build();
    let metrics = OperationMetrics::new(&provider.meter("faults"));

    run_through_fault(layer(metrics), || {
        // A flush in the middle of the run collects (running the live-count callbacks while
        // requests change the counts) and fails in the exporter.
        assert!(
            provider.force_flush().is_err(),
            "the failing exporter flushed"
        );
    })
    .await;

    assert!(exports.load(Ordering::SeqCst) >= 1, "no export was tried");
    let _ = provider.shutdown();
}

/// An exporter whose first export blocks until the test releases it.
#[derive(Debug)]
struct StuckExporter {
    entered: Mutex<mpsc::Sender<()>>,
    release: Mutex<mpsc::Receiver<()>>,
}

impl PushMetricExporter for StuckExporter {
    async fn export(&self, _metrics: &ResourceMetrics) -> OTelSdkResult {
        let _ = self.entered.lock().unwrap().send(());
        // Blocks the reader's thread, as a collector that never answers would.
        let _ = self.release.lock().unwrap().recv();
        Ok(())
    }

    fn force_flush(&self) -> OTelSdkResult {
        Ok(())
    }

    fn shutdown_with_timeout(&self, _timeout: Duration) -> OTelSdkResult {
        Ok(())
    }

    fn temporality(&self) -> Temporality {
        Temporality::Cumulative
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_keep_their_answers_and_the_limit_while_an_export_hangs() {
    let (entered_tx, entered_rx) = mpsc::channel();
    let (release_tx, release_rx) = mpsc::channel();
    let exporter = StuckExporter {
        entered: Mutex::new(entered_tx),
        release: Mutex::new(release_rx),
    };
    let reader = PeriodicReader::builder(exporter)
        .with_interval(Duration::from_millis(5))
        .build();
    let provider = SdkMeterProvider::builder().with_reader(reader).build();
    // A service made by the layer puts its series on the live counts (at 0), so the reader has
    // data to export before any request.
    let layer = layer(OperationMetrics::new(&provider.meter("faults")));
    drop(layer.layer(service_fn(|()| async {
        Ok::<_, std::convert::Infallible>(())
    })));

    let entered = tokio::task::spawn_blocking(move || entered_rx.recv_timeout(DEADLINE));
    entered
        .await
        .unwrap()
        .expect("the periodic reader never exported");

    // The whole run happens while the reader's thread is stuck in the exporter.
    run_through_fault(layer, || {}).await;

    // Let every later export through too, then shut down (which joins the reader's thread).
    drop(release_tx);
    tokio::task::spawn_blocking(move || {
        let _ = provider.shutdown();
    })
    .await
    .unwrap();
}

/// A meter whose histograms panic on every record once `panicking` is set, and count the
/// records they were asked for.
#[derive(Debug, Default)]
struct PanickingMeter {
    panicking: AtomicBool,
    records: AtomicUsize,
}

impl PanickingMeter {
    fn record(&self) {
        self.records.fetch_add(1, Ordering::SeqCst);
        if self.panicking.load(Ordering::SeqCst) {
            panic!("this meter panics when it records");
        }
    }
}

struct PanickingHistogram(Arc<PanickingMeter>);

impl SyncInstrument<f64> for PanickingHistogram {
    fn measure(&self, _value: f64, _attributes: &[KeyValue]) {
        self.0.record();
    }

    #[cfg(feature = "experimental-bound-instruments")]
    fn bind(
        &self,
        _attributes: &[KeyValue],
    ) -> Box<dyn opentelemetry::metrics::BoundSyncInstrument<f64> + Send + Sync> {
        Box::new(PanickingHistogram(Arc::clone(&self.0)))
    }
}

#[cfg(feature = "experimental-bound-instruments")]
impl opentelemetry::metrics::BoundSyncInstrument<f64> for PanickingHistogram {
    fn measure(&self, _value: f64) {
        self.0.record();
    }
}

struct PanickingProvider(Arc<PanickingMeter>);

impl InstrumentProvider for PanickingProvider {
    fn f64_histogram(&self, _builder: HistogramBuilder<'_, Histogram<f64>>) -> Histogram<f64> {
        Histogram::new(Arc::new(PanickingHistogram(Arc::clone(&self.0))))
    }
}

fn panicking_meter() -> (Arc<PanickingMeter>, Meter) {
    let state = Arc::new(PanickingMeter::default());
    let meter = Meter::new(Arc::new(PanickingProvider(Arc::clone(&state))));
    (state, meter)
}

#[tokio::test]
async fn a_meter_that_panics_costs_its_measurements_not_the_requests() {
    let (state, meter) = panicking_meter();
    state.panicking.store(true, Ordering::SeqCst);
    let layer = ResourcesOperationLayer::new(1).metrics(OperationMetrics::new(&meter));

    // Answered: the queue time and the run time each panic in the meter.
    let service = layer.layer(service_fn(|n: u32| async move {
        Ok::<_, std::convert::Infallible>(n + 1)
    }));
    for n in 0..5 {
        assert_eq!(service.clone().oneshot(n).await.unwrap(), n + 1);
    }
    assert_eq!(state.records.load(Ordering::SeqCst), 10);

    // Waited for the permit: the wait is timed too, and its record panics as well.
    let mut holder = layer.layer(service_fn(|()| std::future::pending::<Result<(), ()>>()));
    let held = holder.ready().await.unwrap().call(());
    let waiter = tokio::spawn(service.clone().oneshot(7));
    tokio::task::yield_now().await;
    // Cancelled: dropping the future records `cancelled`, which panics in the meter, inside a
    // drop, where a panic would be worst.
    drop(held);
    assert_eq!(waiter.await.expect("the waiter panicked").unwrap(), 8);
    assert_eq!(state.records.load(Ordering::SeqCst), 14);
    assert_eq!(layer.limit().available(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_keep_their_answers_and_the_limit_when_the_meter_starts_panicking_mid_run() {
    let (state, meter) = panicking_meter();
    run_through_fault(layer(OperationMetrics::new(&meter)), || {
        state.panicking.store(true, Ordering::SeqCst);
    })
    .await;
    // Every request was measured: a queue time and a run time each.
    assert_eq!(state.records.load(Ordering::SeqCst), 2 * REQUESTS);
}
