//! A `tracing` subscriber for the whole test binary that keeps each event's level, target and
//! message, so that a test can count what was said about its own limit (each test names its
//! limits apart, and every message names its limit).

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

/// What was said so far about the limit `limit`, at `level`, by this crate, under its own
/// target: a filter on `tower_resources_operation_redis` keeps every one of them.
pub fn said(limit: &str, level: Level) -> Vec<Said> {
    let named = format!("the fleet limit {limit:?}");
    captured()
        .0
        .lock()
        .unwrap()
        .iter()
        .filter(|said| {
            said.level == level
                && said.target == "tower_resources_operation_redis"
                && said.message.contains(&named)
        })
        .cloned()
        .collect()
}

#[derive(Default)]
struct Fields {
    message: String,
}

impl Visit for Fields {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.message = value.to_owned();
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn Debug) {
        if field.name() == "message" {
            self.message = format!("{value:?}");
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
            message: fields.message,
        });
    }
    fn enter(&self, _: &Id) {}
    fn exit(&self, _: &Id) {}
}
