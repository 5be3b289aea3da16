//! The subscribers the span cases run under: none (the default), one that filters the
//! operation's `DEBUG` spans out by level (an `info` filter, as most services run), and one
//! that records them through `tracing-opentelemetry` into an SDK tracer whose exporter drops
//! each span (what a real pipeline pays, less the export).

use std::future::{ready, Future};

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{SdkTracerProvider, SpanData, SpanExporter};
use tracing::{Dispatch, Level};
use tracing_subscriber::filter::Targets;
use tracing_subscriber::layer::SubscriberExt as _;

/// Which subscriber a case runs under.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Spans {
    /// No subscriber: `tracing`'s default.
    None,
    /// A subscriber at `INFO`: the operation's spans are filtered out.
    Filtered,
    /// A subscriber that records the operation's spans.
    On,
}

impl Spans {
    pub const ALL: [Spans; 3] = [Spans::None, Spans::Filtered, Spans::On];

    pub fn name(self) -> &'static str {
        match self {
            Spans::None => "no_subscriber",
            Spans::Filtered => "spans_filtered",
            Spans::On => "spans_on",
        }
    }

    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|spans| spans.name() == name)
    }

    /// Runs `f` under this subscriber (as the thread's default).
    pub fn run<R>(self, f: impl FnOnce() -> R) -> R {
        match self.dispatch() {
            Some(dispatch) => tracing::dispatcher::with_default(&dispatch, f),
            None => f(),
        }
    }

    fn dispatch(self) -> Option<Dispatch> {
        let level = match self {
            Spans::None => return None,
            Spans::Filtered => Level::INFO,
            Spans::On => Level::DEBUG,
        };
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(Discard)
            .build();
        let filter = Targets::new()
            .with_target(tower_resources_operation::names::TARGET, level)
            .with_default(Level::INFO);
        let subscriber = tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("bench")))
            .with(filter);
        Some(Dispatch::new(subscriber))
    }
}

/// An exporter that drops every span.
#[derive(Debug)]
struct Discard;

impl SpanExporter for Discard {
    fn export(&self, batch: Vec<SpanData>) -> impl Future<Output = OTelSdkResult> + Send {
        drop(batch);
        ready(Ok(()))
    }
}
