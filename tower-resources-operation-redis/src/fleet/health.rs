//! Whether a limit reaches its store.
//!
//! After the first failure the limit is *down*: callers are answered at once (on this process's
//! share, turned away, or admitted without the fleet limit) with the failure that started it,
//! instead of each waiting a whole call timeout, and the background task asks the store again
//! every fallback poll. The first call that succeeds, whoever makes it, brings the limit back
//! up. The member says each outage once, and its end once.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

use super::books::lock;
use crate::error::Error;

/// Up or down, and the answer while down.
pub(crate) struct Health {
    down: AtomicBool,
    outage: Mutex<Option<Outage>>,
    /// The answer of the last outage, kept after it ended.
    last: Mutex<Option<Error>>,
}

/// An outage under way.
struct Outage {
    /// The answer given meanwhile: the failure that started it, short-circuited.
    answer: Error,
    since: Instant,
}

/// What a call's result changed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Change {
    /// Nothing: up and still up, or down and still down.
    None,
    /// An outage starts with this call.
    Down,
    /// The outage ends with this call, after it lasted this long.
    Up(Duration),
}

impl Health {
    pub(crate) fn new() -> Self {
        Self {
            down: AtomicBool::new(false),
            outage: Mutex::new(None),
            last: Mutex::new(None),
        }
    }

    /// Whether the last call failed: callers are answered without asking.
    pub(crate) fn is_down(&self) -> bool {
        self.down.load(Ordering::Acquire)
    }

    /// The answer to give without asking while down, if it is down.
    pub(crate) fn answer(&self) -> Option<Error> {
        if !self.is_down() {
            return None;
        }
        lock(&self.outage)
            .as_ref()
            .map(|outage| outage.answer.clone())
    }

    /// The answer the last outage was given, short-circuited: what a waiter that settles after
    /// it is told.
    pub(crate) fn last_answer(&self) -> Option<Error> {
        lock(&self.last).clone()
    }

    /// A call ended with `result`'s error, or none: what that changed.
    pub(crate) fn note(&self, error: Option<&Error>) -> Change {
        match error {
            // The store answered, if wrongly (a script error, authentication): reached.
            Some(error) if error.is_unavailable() => self.failed(error),
            _ => self.reached(),
        }
    }

    fn failed(&self, error: &Error) -> Change {
        let mut outage = lock(&self.outage);
        let started = outage.is_none();
        match outage.as_mut() {
            Some(outage) => outage.answer = error.short_circuited(),
            None => {
                *outage = Some(Outage {
                    answer: error.short_circuited(),
                    since: Instant::now(),
                })
            }
        }
        self.down.store(true, Ordering::Release);
        match started {
            true => Change::Down,
            false => Change::None,
        }
    }

    fn reached(&self) -> Change {
        if !self.is_down() {
            return Change::None;
        }
        let mut outage = lock(&self.outage);
        let Some(ended) = outage.take() else {
            return Change::None;
        };
        self.down.store(false, Ordering::Release);
        *lock(&self.last) = Some(ended.answer);
        Change::Up(ended.since.elapsed())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;

    fn error(kind: ErrorKind) -> Error {
        Error::new(
            kind,
            &"judges".into(),
            "redis://127.0.0.1:1/0",
            "test".into(),
            None,
        )
    }

    #[test]
    fn an_outage_starts_once_is_answered_short_circuited_and_ends_once() {
        let health = Health::new();
        assert_eq!(health.note(None), Change::None);
        assert_eq!(health.note(Some(&error(ErrorKind::Timeout))), Change::Down);
        assert_eq!(
            health.note(Some(&error(ErrorKind::Unreachable))),
            Change::None
        );
        let answer = health.answer().expect("down");
        assert!(answer.is_short_circuited());
        assert_eq!(answer.kind(), ErrorKind::Unreachable, "the latest cause");
        assert!(matches!(health.note(None), Change::Up(_)));
        assert!(!health.is_down() && health.answer().is_none());
    }

    #[test]
    fn an_error_the_store_answered_with_is_reaching_it() {
        let health = Health::new();
        assert_eq!(health.note(Some(&error(ErrorKind::Timeout))), Change::Down);
        assert!(matches!(
            health.note(Some(&error(ErrorKind::Redis))),
            Change::Up(_)
        ));
    }
}
