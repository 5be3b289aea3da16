//! What the examples `demo`, `limits` and `tonic` share: an in-memory OpenTelemetry pipeline
//! whose metrics they read back and print, so they need no collector.

use std::time::Duration;

use opentelemetry::metrics::MeterProvider as _;
use opentelemetry_sdk::metrics::data::Metric;
use opentelemetry_sdk::metrics::{
    InMemoryMetricExporter, InMemoryMetricExporterBuilder, MeterProviderBuilder, PeriodicReader,
    SdkMeterProvider,
};
use tower_resources_operation::OperationMetrics;

/// The crate's metrics on a provider with an in-memory exporter, read back on demand.
pub struct Telemetry {
    pub provider: SdkMeterProvider,
    exporter: InMemoryMetricExporter,
    pub metrics: OperationMetrics,
}

impl Telemetry {
    /// The crate's metrics on the meter `meter` of a provider of their own.
    #[allow(dead_code)] // The tonic example adds a Prometheus reader: `with_provider`.
    pub fn new(meter: &'static str) -> Self {
        Self::with_provider(meter, SdkMeterProvider::builder())
    }

    /// [`Telemetry::new`], on a provider built from `provider`, with whatever readers it has
    /// already (the tonic example's Prometheus exporter, for its `/metrics`).
    pub fn with_provider(meter: &'static str, provider: MeterProviderBuilder) -> Self {
        let exporter = InMemoryMetricExporterBuilder::new().build();
        // An hour apart: in practice the reader exports only when `read` flushes it.
        let reader = PeriodicReader::builder(exporter.clone())
            .with_interval(Duration::from_secs(3600))
            .build();
        let provider = provider.with_reader(reader).build();
        let metrics = OperationMetrics::new(&provider.meter(meter));
        Self {
            provider,
            exporter,
            metrics,
        }
    }

    /// Flushes the instruments and hands each one's data as of now (cumulative) to `read`.
    pub fn read(&self, read: impl FnMut(&Metric)) {
        self.exporter.reset();
        self.provider.force_flush().expect("flush metrics");
        let exported = self.exporter.get_finished_metrics().expect("read metrics");
        exported
            .iter()
            .flat_map(|resource| resource.scope_metrics())
            .flat_map(|scope| scope.metrics())
            .for_each(read);
    }
}
