//! A `tracing` subscriber that keeps each event's level, target and message, for the tests that
//! count what the crate warned about. Warnings are once per process, so such a test is alone in
//! its binary and installs this as the process's subscriber.

use std::fmt::Debug;
use std::sync::{Arc, Mutex};

use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Level, Metadata, Subscriber};

/// The events so far: level, target and message of each.
#[derive(Clone, Default)]
pub struct Captured(Arc<Mutex<Vec<(Level, String, String)>>>);

impl Captured {
    /// A subscriber installed for the whole process.
    pub fn install() -> Self {
        let captured = Self::default();
        tracing::subscriber::set_global_default(captured.clone())
            .expect("the test binary's only subscriber");
        captured
    }

    /// The crate's warnings so far that contain `text`.
    pub fn warnings(&self, text: &str) -> Vec<String> {
        let events = self.0.lock().unwrap();
        events
            .iter()
            .filter(|(level, target, message)| {
                *level == Level::WARN
                    && target == "tower_resources_operation"
                    && message.contains(text)
            })
            .map(|(_, _, message)| message.clone())
            .collect()
    }
}

struct Message(String);

impl Visit for Message {
    fn record_debug(&mut self, field: &Field, value: &dyn Debug) {
        if field.name() == "message" {
            self.0 = format!("{value:?}");
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
        let mut message = Message(String::new());
        event.record(&mut message);
        let metadata = event.metadata();
        self.0
            .lock()
            .unwrap()
            .push((*metadata.level(), metadata.target().to_owned(), message.0));
    }
    fn enter(&self, _: &Id) {}
    fn exit(&self, _: &Id) {}
}
