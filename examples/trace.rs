//! The wait in the request's trace: an axum server with tower-http's `TraceLayer` and a limit of
//! 2, a burst of 8 requests, and the trace of the slowest one printed as a tree.
//!
//! ```text
//! cargo run --example trace
//! ```
//!
//! The spans go through `tracing-opentelemetry` to an OpenTelemetry SDK tracer with an
//! in-memory exporter (in production, opentelemetry-otlp's exporter to your collector); the
//! subscriber shows the layer's spans (target `tower_resources_operation`) and tower-http's at
//! `DEBUG`. Each request's trace holds its request span, its operation's wait for the limit (if
//! it waited) and its run inside it, with NeMo Gym's attribute keys.

use std::net::SocketAddr;
use std::time::Duration;

use axum::routing::get;
use axum::Router;
use opentelemetry::trace::{SpanId, TracerProvider as _};
use opentelemetry::Value;
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tower_http::trace::TraceLayer;
use tower_resources_operation::names::{
    DURATION_ATTRIBUTE, LIMIT_ATTRIBUTE, OPERATION_ATTRIBUTE, OUTCOME_ATTRIBUTE,
    QUEUED_AHEAD_ATTRIBUTE, QUEUE_DURATION_ATTRIBUTE, RUN_SPAN, TARGET, WAIT_ATTRIBUTE, WAIT_SPAN,
};
use tower_resources_operation::{Executor, Limit, Operation, ResourcesOperationLayer};
use tracing::Level;
use tracing_subscriber::filter::Targets;
use tracing_subscriber::layer::SubscriberExt as _;

const REQUESTS: u32 = 8;
const RUN: Duration = Duration::from_millis(100);

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    // The tracing pipeline: tracing-subscriber, tracing-opentelemetry, the SDK.
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    let filter = Targets::new()
        .with_target(TARGET, Level::DEBUG)
        .with_target("tower_http", Level::DEBUG)
        .with_default(Level::INFO);
    let subscriber = tracing_subscriber::registry()
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("trace-example")))
        .with(filter);
    tracing::subscriber::set_global_default(subscriber).expect("the only subscriber");

    // A limit of 2 for /verify, inside the request spans of TraceLayer.
    let verifiers = Limit::builder(2).name("verifiers").build();
    let verify = get(|| async {
        tokio::time::sleep(RUN).await;
        "verified"
    })
    .layer(
        ResourcesOperationLayer::new_for_http(verifiers)
            .operation(Operation::Verify)
            .executor(Executor::Subprocess),
    );
    let app = Router::new()
        .route("/verify", verify)
        .layer(TraceLayer::new_for_http());
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });

    println!(
        "{REQUESTS} requests at once to /verify (runs {} ms) through a limit of 2:\n",
        RUN.as_millis()
    );
    let requests: Vec<_> = (0..REQUESTS)
        .map(|id| tokio::spawn(get_status(addr, id)))
        .collect();
    for request in requests {
        assert_eq!(request.await.unwrap(), "200");
    }
    // The request spans close once their responses are written: give the server a moment.
    let spans = loop {
        let spans = exporter.get_finished_spans().expect("the finished spans");
        let requests = spans.iter().filter(|span| span.name == "request").count();
        if requests == REQUESTS as usize {
            break spans;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };

    let slowest = spans
        .iter()
        .filter(|span| span.name == "request")
        .max_by_key(|span| length(span))
        .expect("a request span");
    println!("the slowest request's trace:\n");
    print_tree(&spans, slowest, "", "");
    let children = children(&spans, slowest.span_context.span_id());
    let names: Vec<_> = children.iter().map(|span| span.name.as_ref()).collect();
    assert_eq!(names, [WAIT_SPAN, RUN_SPAN], "request, wait, run");
}

async fn get_status(addr: SocketAddr, id: u32) -> String {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    let head = format!("GET /verify?id={id} HTTP/1.1\r\nHost: trace\r\nConnection: close\r\n\r\n");
    stream.write_all(head.as_bytes()).await.unwrap();
    let mut response = Vec::new();
    stream.read_to_end(&mut response).await.unwrap();
    let response = String::from_utf8_lossy(&response);
    response.split_whitespace().nth(1).unwrap_or("?").to_owned()
}

/// The spans under `parent`, in the order they started.
fn children(spans: &[SpanData], parent: SpanId) -> Vec<&SpanData> {
    let mut children: Vec<_> = spans
        .iter()
        .filter(|span| span.parent_span_id == parent)
        .collect();
    children.sort_by_key(|span| span.start_time);
    children
}

fn length(span: &SpanData) -> Duration {
    span.end_time
        .duration_since(span.start_time)
        .unwrap_or_default()
}

fn attribute(span: &SpanData, key: &str) -> Option<Value> {
    span.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .map(|kv| kv.value.clone())
}

/// What a line says of `span`, besides its name and length.
fn described(span: &SpanData) -> String {
    let shown: &[&str] = match span.name.as_ref() {
        "request" => &["uri"],
        WAIT_SPAN => &[
            OPERATION_ATTRIBUTE,
            LIMIT_ATTRIBUTE,
            QUEUED_AHEAD_ATTRIBUTE,
            QUEUE_DURATION_ATTRIBUTE,
            WAIT_ATTRIBUTE,
        ],
        RUN_SPAN => &[DURATION_ATTRIBUTE, OUTCOME_ATTRIBUTE],
        _ => &[],
    };
    shown
        .iter()
        .filter_map(|key| attribute(span, key).map(|value| format!("{key}={value}")))
        .collect::<Vec<_>>()
        .join(" ")
}

fn print_tree(spans: &[SpanData], span: &SpanData, prefix: &str, branch: &str) {
    let label = format!("{prefix}{branch}{}", span.name);
    println!(
        "{label:<34} {:>7.1} ms  {}",
        length(span).as_secs_f64() * 1e3,
        described(span)
    );
    let children = children(spans, span.span_context.span_id());
    let last = children.len().saturating_sub(1);
    let prefix = match branch {
        "" => prefix.to_owned(),
        "└─ " => format!("{prefix}   "),
        _ => format!("{prefix}│  "),
    };
    for (i, child) in children.iter().enumerate() {
        let branch = if i == last { "└─ " } else { "├─ " };
        print_tree(spans, child, &prefix, branch);
    }
}
