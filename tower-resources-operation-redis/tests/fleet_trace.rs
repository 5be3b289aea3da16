//! A fleet limit's operations in the trace, on a real `redis-server`: the scoped form on a
//! `RedisLimit` makes the core's wait and run spans, named after the fleet limit, children of
//! the span that calls it; a wait the fleet turns away closes its span with the reason.
//!
//! The spans are caught by a small `tracing` subscriber of the test's own (the core crate's
//! `tests/trace.rs` follows them through `tracing-opentelemetry` to an OTLP receiver).
#![cfg(feature = "tracing")]

mod support;

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Metadata, Subscriber};
use tracing_core::span::Current;

use support::redis_server::RedisServer;
use support::{within, Telemetry};
use tower_resources_operation::names::{
    LIMIT_ATTRIBUTE, OPERATION_ATTRIBUTE, OUTCOME_ATTRIBUTE, QUEUE_DURATION_ATTRIBUTE,
    REJECTION_ATTRIBUTE, RUN_SPAN, WAIT_ATTRIBUTE, WAIT_SPAN,
};
use tower_resources_operation::{Acquire, Executor, Operation, Rejection};
use tower_resources_operation_redis::RedisLimit;

/// A span as the subscriber saw it.
#[derive(Clone, Debug, Default)]
struct Seen {
    name: String,
    metadata: Option<&'static Metadata<'static>>,
    parent: Option<u64>,
    fields: BTreeMap<String, String>,
    closed: bool,
}

/// Keeps every span, its fields as recorded, its parent (explicit, or the span entered when
/// it was made) and whether it was closed. For one thread: the test's current-thread runtime.
#[derive(Clone, Default)]
struct Spans {
    seen: Arc<Mutex<Vec<Seen>>>,
    entered: Arc<Mutex<Vec<u64>>>,
}

impl Spans {
    fn named(&self, name: &str) -> Vec<Seen> {
        let seen = self.seen.lock().unwrap();
        seen.iter()
            .filter(|span| span.name == name)
            .cloned()
            .collect()
    }

    fn id_of(&self, name: &str) -> u64 {
        let seen = self.seen.lock().unwrap();
        1 + seen.iter().position(|span| span.name == name).unwrap() as u64
    }
}

struct Fields<'a>(&'a mut BTreeMap<String, String>);

impl Visit for Fields<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.0.insert(field.name().to_owned(), format!("{value:?}"));
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_owned(), value.to_owned());
    }
}

impl Subscriber for Spans {
    fn enabled(&self, _: &Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, span: &Attributes<'_>) -> Id {
        let parent = match span.parent() {
            Some(parent) => Some(parent.into_u64()),
            None if span.is_contextual() => self.entered.lock().unwrap().last().copied(),
            None => None,
        };
        let mut seen = Seen {
            name: span.metadata().name().to_owned(),
            metadata: Some(span.metadata()),
            parent,
            ..Seen::default()
        };
        span.record(&mut Fields(&mut seen.fields));
        let mut all = self.seen.lock().unwrap();
        all.push(seen);
        Id::from_u64(all.len() as u64)
    }
    fn record(&self, id: &Id, values: &Record<'_>) {
        let mut all = self.seen.lock().unwrap();
        values.record(&mut Fields(&mut all[id.into_u64() as usize - 1].fields));
    }
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, _: &Event<'_>) {}
    fn enter(&self, id: &Id) {
        self.entered.lock().unwrap().push(id.into_u64());
    }
    fn exit(&self, id: &Id) {
        let mut entered = self.entered.lock().unwrap();
        if let Some(at) = entered
            .iter()
            .rposition(|entered| *entered == id.into_u64())
        {
            entered.remove(at);
        }
    }
    fn current_span(&self) -> Current {
        let Some(&id) = self.entered.lock().unwrap().last() else {
            return Current::none();
        };
        match self.seen.lock().unwrap()[id as usize - 1].metadata {
            Some(metadata) => Current::new(Id::from_u64(id), metadata),
            None => Current::none(),
        }
    }
    fn try_close(&self, id: Id) -> bool {
        self.seen.lock().unwrap()[id.into_u64() as usize - 1].closed = true;
        true
    }
}

#[tokio::test]
async fn a_fleet_limits_wait_and_run_are_spans_of_the_caller_named_after_the_fleet_limit() {
    let redis = RedisServer::start_required();
    let spans = Spans::default();
    let _default = tracing::subscriber::set_default(spans.clone());
    let telemetry = Telemetry::new();
    let limit = RedisLimit::builder("traced-fleet", 1)
        .max_queued(1)
        .lease_ttl(Duration::from_secs(5))
        .call_timeout(Duration::from_secs(1))
        .fallback_poll(Duration::from_millis(200))
        .build(redis.url())
        .unwrap();
    let held = within("the only place", limit.acquire())
        .await
        .expect("a place");

    // One waits in the fleet's queue, inside a request's span; another finds the queue full.
    let request = tracing::info_span!("request");
    let waiting = {
        let (limit, metrics) = (limit.clone(), telemetry.metrics.clone());
        let request = request.clone();
        tokio::spawn(async move {
            let _entered = request.enter();
            metrics
                .resources_operation(&limit, Operation::Verify, Executor::Subprocess, async {
                    Ok::<_, &str>("verified")
                })
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let turned_away = {
        let _entered = request.enter();
        let work = async { Ok::<_, &str>("never") };
        telemetry
            .metrics
            .resources_operation(&limit, Operation::Judge, Executor::Inline, work)
            .await
    };
    assert_eq!(
        turned_away
            .expect_err("the fleet's queue is full")
            .rejection(),
        Rejection::QueueFull
    );
    drop(held);
    let answer = within("the wait ends", waiting).await.unwrap();
    assert_eq!(answer.expect("admitted"), Ok("verified"));
    drop(request);

    let request = spans.id_of("request");
    let waits = spans.named(WAIT_SPAN);
    assert_eq!(waits.len(), 2, "{waits:#?}");
    for wait in &waits {
        assert_eq!(wait.parent, Some(request), "{wait:?}");
        assert!(wait.closed, "{wait:?}");
        assert_eq!(wait.fields[LIMIT_ATTRIBUTE], "traced-fleet", "{wait:?}");
    }
    let admitted = waits
        .iter()
        .find(|wait| wait.fields[OPERATION_ATTRIBUTE] == "verify")
        .unwrap();
    assert_eq!(admitted.fields[WAIT_ATTRIBUTE], "admitted", "{admitted:?}");
    let waited_ms: f64 = admitted.fields[QUEUE_DURATION_ATTRIBUTE].parse().unwrap();
    assert!(waited_ms >= 250.0, "it waited about 300 ms: {admitted:?}");
    let rejected = waits
        .iter()
        .find(|wait| wait.fields[OPERATION_ATTRIBUTE] == "judge")
        .unwrap();
    assert_eq!(rejected.fields[WAIT_ATTRIBUTE], "rejected", "{rejected:?}");
    assert_eq!(
        rejected.fields[REJECTION_ATTRIBUTE], "queue_full",
        "{rejected:?}"
    );

    let runs = spans.named(RUN_SPAN);
    let [run] = &runs[..] else {
        panic!("one run, the admitted one's: {runs:#?}")
    };
    assert_eq!(run.parent, Some(request), "{run:?}");
    assert!(run.closed, "{run:?}");
    assert_eq!(run.fields[LIMIT_ATTRIBUTE], "traced-fleet", "{run:?}");
    assert_eq!(run.fields[OUTCOME_ATTRIBUTE], "ok", "{run:?}");
}
