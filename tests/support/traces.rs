//! A real tracing pipeline, for the process: `tracing-subscriber`'s registry with
//! `tracing-opentelemetry`'s layer, the OpenTelemetry SDK's batch span processor, and
//! `opentelemetry-otlp` over gRPC to an OTLP receiver on 127.0.0.1 that keeps every span it gets.
//! The receiver and the exporter's channel live on a runtime of their own, so that they outlive
//! each test's runtime.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig as _;
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::Span;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tonic::transport::server::TcpIncoming;
use tonic::transport::Server;
use tracing::Level;
use tracing_subscriber::filter::Targets;
use tracing_subscriber::layer::SubscriberExt as _;

/// Every span the receiver got, in the order it got them.
type Received = Arc<Mutex<Vec<Span>>>;

struct Receiver(Received);

#[tonic::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let spans = request
            .into_inner()
            .resource_spans
            .into_iter()
            .flat_map(|r| r.scope_spans)
            .flat_map(|s| s.spans);
        self.0.lock().unwrap().extend(spans);
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

/// The process's tracing pipeline and what its collector received.
pub struct Traces {
    provider: SdkTracerProvider,
    received: Received,
    _runtime: tokio::runtime::Runtime,
}

/// The pipeline, installed as the process's subscriber on first use: this crate's spans and
/// tower-http's at `DEBUG`, everything else at `INFO`.
pub fn traces() -> &'static Traces {
    static TRACES: OnceLock<Traces> = OnceLock::new();
    // Built on a thread of its own: a test's runtime cannot block on another.
    TRACES.get_or_init(|| {
        std::thread::spawn(install)
            .join()
            .expect("the tracing pipeline")
    })
}

fn install() -> Traces {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let received = Received::default();
    let addr = runtime.block_on(async {
        let incoming = TcpIncoming::bind("127.0.0.1:0".parse().unwrap()).expect("bind receiver");
        let addr = incoming.local_addr().unwrap();
        let receiver = TraceServiceServer::new(Receiver(Arc::clone(&received)));
        tokio::spawn(
            Server::builder()
                .add_service(receiver)
                .serve_with_incoming(incoming),
        );
        addr
    });
    let exporter = {
        let _in = runtime.enter();
        opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .with_endpoint(format!("http://{addr}"))
            .build()
            .expect("the OTLP span exporter")
    };
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .build();
    let filter = Targets::new()
        .with_target(tower_resources_operation::names::TARGET, Level::DEBUG)
        .with_target("tower_http", Level::DEBUG)
        .with_default(Level::INFO);
    let subscriber = tracing_subscriber::registry()
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("trace-tests")))
        .with(filter);
    tracing::subscriber::set_global_default(subscriber).expect("the process's only subscriber");
    Traces {
        provider,
        received,
        _runtime: runtime,
    }
}

impl Traces {
    /// Exports what has ended, and returns every span received so far.
    pub async fn flush(&'static self) -> Vec<Span> {
        let flushed = tokio::task::spawn_blocking(|| self.provider.force_flush());
        super::within("the span export", flushed)
            .await
            .unwrap()
            .expect("flush to the OTLP receiver");
        self.received.lock().unwrap().clone()
    }

    /// The trace of the request span (tower-http's `request`) whose `uri` is `uri`, once it and
    /// `expected` spans under it have been received.
    pub async fn trace_of(&'static self, uri: &str, expected: usize) -> Trace {
        let mut last = Vec::new();
        for _ in 0..100 {
            let spans = self.flush().await;
            let request = spans
                .iter()
                .find(|span| span.name == "request" && string(span, "uri").as_deref() == Some(uri));
            if let Some(request) = request {
                let trace: Vec<Span> = spans
                    .iter()
                    .filter(|span| span.trace_id == request.trace_id)
                    .cloned()
                    .collect();
                if trace.len() > expected {
                    return Trace {
                        request: request.clone(),
                        spans: trace,
                    };
                }
                last = trace;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("no trace of {uri} with {expected} spans under its request: {last:#?}")
    }
}

/// One request's trace.
#[derive(Debug)]
pub struct Trace {
    pub request: Span,
    pub spans: Vec<Span>,
}

impl Trace {
    /// The spans named `name`.
    pub fn named(&self, name: &str) -> Vec<&Span> {
        self.spans.iter().filter(|span| span.name == name).collect()
    }

    /// The one span named `name`.
    pub fn one(&self, name: &str) -> &Span {
        match self.named(name).as_slice() {
            [span] => span,
            spans => panic!("one {name} span expected, got {spans:#?}"),
        }
    }
}

/// How long `span` lasted.
pub fn length(span: &Span) -> Duration {
    Duration::from_nanos(span.end_time_unix_nano - span.start_time_unix_nano)
}

/// The attributes of `span`, as strings (numbers as they print).
pub fn attributes(span: &Span) -> BTreeMap<String, String> {
    span.attributes
        .iter()
        .map(|kv| {
            let value = match kv.value.as_ref().and_then(|v| v.value.as_ref()) {
                Some(Value::StringValue(s)) => s.clone(),
                Some(Value::IntValue(i)) => i.to_string(),
                Some(Value::DoubleValue(d)) => d.to_string(),
                Some(Value::BoolValue(b)) => b.to_string(),
                other => format!("{other:?}"),
            };
            (kv.key.clone(), value)
        })
        .collect()
}

/// The string attribute `key` of `span`.
pub fn string(span: &Span, key: &str) -> Option<String> {
    span.attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(
            |kv| match kv.value.as_ref().and_then(|v| v.value.as_ref()) {
                Some(Value::StringValue(s)) => Some(s.clone()),
                _ => None,
            },
        )
}

/// The number attribute `key` of `span`.
pub fn number(span: &Span, key: &str) -> Option<f64> {
    span.attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(
            |kv| match kv.value.as_ref().and_then(|v| v.value.as_ref()) {
                Some(Value::DoubleValue(d)) => Some(*d),
                Some(Value::IntValue(i)) => Some(*i as f64),
                _ => None,
            },
        )
}
