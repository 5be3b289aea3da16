//! A `tracing` subscriber for the whole test binary that keeps each event's level, target,
//! `limit` field and message, so that a test can count what was said about its own limit (each
//! test names its limits apart).

use std::fmt::Debug;
use std::sync::{Arc, Mutex, OnceLock};

use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Level, Metadata, Subscriber};

/// One event.
#[derive(Clone, Debug)]
pub struct Said {
    pub level: Level,
    pub target: String,
    pub limit: String,
    pub message: String,
}

#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<Said>>>);

/// Installs the subscriber for the process, once.
fn captured() -> &'static Captured {
    static CAPTURED: OnceLock<Captured> = OnceLock::new();
    CAPTURED.get_or_init(|| {
        let captured = Captured::default();
        tracing::subscriber::set_global_default(captured.clone())
            .expect("the test binary's only subscriber");
        captured
    })
}

/// Starts capturing (call it before the code under test runs).
pub fn start() {
    captured();
}

/// What was said so far about the limit `limit`, at `level`, by this crate.
pub fn said(limit: &str, level: Level) -> Vec<Said> {
    captured()
        .0
        .lock()
        .unwrap()
        .iter()
        .filter(|said| {
            said.level == level
                && said.target == "tower_resources_operation_redis"
                && said.limit == limit
        })
        .cloned()
        .collect()
}

#[derive(Default)]
struct Fields {
    limit: String,
    message: String,
}

impl Visit for Fields {
    fn record_str(&mut self, field: &Field, value: &str) {
        match field.name() {
            "limit" => self.limit = value.to_owned(),
            "message" => self.message = value.to_owned(),
            _ => {}
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn Debug) {
        match field.name() {
            "limit" => self.limit = format!("{value:?}").trim_matches('"').to_owned(),
            "message" => self.message = format!("{value:?}"),
            _ => {}
        }
    }
}

impl Subscriber for Captured {
    fn enabled(&self, _: &Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &Attributes<'_>) -> Id {
        Id::from_u64(1)
    }
    fn record(&self, _: &Id, _: &Record<'_>) {}
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, event: &Event<'_>) {
        let mut fields = Fields::default();
        event.record(&mut fields);
        let metadata = event.metadata();
        self.0.lock().unwrap().push(Said {
            level: *metadata.level(),
            target: metadata.target().to_owned(),
            limit: fields.limit,
            message: fields.message,
        });
    }
    fn enter(&self, _: &Id) {}
    fn exit(&self, _: &Id) {}
}
