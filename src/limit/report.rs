//! How a limit shows itself: its identity, its name, and what it reports at each metrics
//! collection ([`Capacity`], [`Reading`]). The crate's own limits report through these, and a
//! limit of your own (a pool, a fleet limit on another store) reports exactly as they do.
//!
//! A limit does not know how it is reported: it hands out a [`Capacity`] whose closure reads it,
//! and the metrics call that closure when they collect.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::error::ConfigError;

/// A limit as the metrics see it: how many operations it admits at once, read at each
/// collection, and, for a named limit, what it holds and keeps waiting now.
///
/// It is also the limit's identity in the metrics: a series served by several limits reports
/// the sum of their capacities, and a limit reached through several layers counts once. So make
/// one `Capacity` per limit and hand out clones of it; each `Capacity` made anew is another
/// limit. A limit counts as long as something other than the metrics holds one of its
/// `Capacity` values: the limit itself, or a layer or service given it.
///
/// ```
/// use tower_resources_operation::limit::Capacity;
///
/// let four = Capacity::fixed(4);
/// assert_eq!(four.get(), Some(4));
/// assert!(four.same_limit(&four.clone()));
/// assert!(!four.same_limit(&Capacity::fixed(4)));
/// ```
#[derive(Clone)]
pub struct Capacity {
    /// Unique to the limit, never reused.
    id: u64,
    /// The limit's name, for a limit that reports instruments of its own.
    name: Option<Arc<str>>,
    read: Arc<dyn Fn() -> Option<Reading> + Send + Sync>,
}

/// What a limit reports at a collection: `gym.resources.operation.limit` for every series it
/// serves and, for a named limit, `gym.resources.limit.*` under its name.
///
/// ```
/// use std::time::Duration;
/// use tower_resources_operation::limit::Reading;
///
/// let reading = Reading::new(8, 3, 2).with_run_times(Some(Duration::from_millis(100)), None);
/// assert_eq!((reading.capacity, reading.active, reading.queued), (8, 3, 2));
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Reading {
    /// Operations it admits at once.
    pub capacity: usize,
    /// Operations holding one of its places now (above `capacity` for a while after it was
    /// lowered).
    pub active: usize,
    /// Operations waiting for it now.
    pub queued: usize,
    /// An adaptive limit's baseline run time, if its algorithm keeps one.
    pub baseline: Option<Duration>,
    /// An adaptive limit's estimate of its recent run time, if its algorithm keeps one.
    pub estimate: Option<Duration>,
    /// Whose capacity it is: this process's (the default), or a whole fleet's.
    pub scope: Scope,
}

/// Whose capacity a [`Reading`] is, so that a dashboard adds up what adds up: reported as
/// [`LIMIT_SCOPE_ATTRIBUTE`](crate::names::LIMIT_SCOPE_ATTRIBUTE) with every named limit's
/// instruments and with `gym.resources.operation.limit`.
///
/// A process-local limit of 4 on each of 3 replicas is 12 places: its capacity is added up over
/// the replicas. A fleet limit of 4 is 4 places, reported alike by each of the 3: its capacity
/// is read once (the largest), never added up. Its `active` and `queued` are each replica's
/// own, and are added up either way.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Scope {
    /// This process's own limit: added up over the processes that report it.
    #[default]
    Process,
    /// One limit for the whole fleet, the same capacity reported by every process: read once.
    Fleet,
    /// A fleet limit that cannot reach its store, running on this process's share of the
    /// fleet's last capacity: the shares add up (to at most that capacity), as `Process` does.
    Share,
}

impl Scope {
    /// Every scope.
    pub const ALL: [Scope; 3] = [Scope::Process, Scope::Fleet, Scope::Share];

    /// Its value as an attribute: `process`, `fleet` or `share`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Scope::Process => "process",
            Scope::Fleet => "fleet",
            Scope::Share => "share",
        }
    }

    /// Its position in [`ALL`](Self::ALL).
    pub(crate) const fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Reading {
    /// A limit of `capacity`, with `active` operations holding a place and `queued` waiting.
    pub fn new(capacity: usize, active: usize, queued: usize) -> Self {
        Self {
            capacity,
            active,
            queued,
            baseline: None,
            estimate: None,
            scope: Scope::Process,
        }
    }

    /// The same reading, of a limit whose capacity is `scope`'s: a fleet limit says
    /// [`Scope::Fleet`] (or [`Scope::Share`] while it runs on its share).
    ///
    /// ```
    /// use tower_resources_operation::limit::{Reading, Scope};
    ///
    /// let fleet = Reading::new(4, 1, 0).with_scope(Scope::Fleet);
    /// assert_eq!(fleet.scope.as_str(), "fleet");
    /// ```
    pub fn with_scope(self, scope: Scope) -> Self {
        Self { scope, ..self }
    }

    /// The same reading, with what an adaptive limit's controller measured.
    pub fn with_run_times(self, baseline: Option<Duration>, estimate: Option<Duration>) -> Self {
        Self {
            baseline,
            estimate,
            ..self
        }
    }

    /// `self` and `other` as one limit: limits that share a name (and a scope) add up (their
    /// run times: the slowest).
    pub(crate) fn add(&mut self, other: &Reading) {
        self.capacity = self.capacity.saturating_add(other.capacity);
        self.active = self.active.saturating_add(other.active);
        self.queued = self.queued.saturating_add(other.queued);
        self.baseline = self.baseline.max(other.baseline);
        self.estimate = self.estimate.max(other.estimate);
    }
}

impl Capacity {
    /// A limit of `capacity` operations at once, for good.
    pub fn fixed(capacity: usize) -> Self {
        Self::from_fn(move || capacity)
    }

    /// A limit whose capacity `read` returns at each collection (for a pool that grows, say).
    pub fn from_fn(read: impl Fn() -> usize + Send + Sync + 'static) -> Self {
        Self::of_checked(None, move || Some(Reading::new(read(), 0, 0)))
    }

    /// A limit of your own, named `name` (if it is), whose state `read` returns while the limit
    /// exists, and `None` once it is gone: a gone limit stops counting in the metrics. What the
    /// crate's own [`Limit`](super::Limit) reports through.
    ///
    /// A named limit reports `gym.resources.limit.{capacity,active,queued}` (and, when its
    /// reading has them, `gym.resources.limit.adaptive.{baseline,estimate}_ms`) under its name.
    /// `read` runs in the metrics collection: keep it to a few atomic loads. A `read` that
    /// panics costs its limit that collection, nothing else.
    ///
    /// ```
    /// use std::sync::atomic::{AtomicUsize, Ordering};
    /// use std::sync::Arc;
    /// use tower_resources_operation::limit::{Capacity, Reading};
    ///
    /// // A pool of 4 connections, of which `busy` are checked out.
    /// let busy = Arc::new(AtomicUsize::new(0));
    /// let seen = Arc::downgrade(&busy);
    /// let capacity = Capacity::of_limit(Some("pool"), move || {
    ///     let busy = seen.upgrade()?.load(Ordering::Relaxed);
    ///     Some(Reading::new(4, busy, 0))
    /// })
    /// .unwrap();
    /// assert_eq!((capacity.get(), capacity.name()), (Some(4), Some("pool")));
    /// drop(busy);
    /// assert_eq!(capacity.get(), None);
    /// ```
    ///
    /// # Errors
    ///
    /// If `name` cannot be a metric attribute: it must be 1 to 64 characters among
    /// `A-Z a-z 0-9 _ . : / -`, starting with a letter, so that the attribute stays bounded and
    /// safe in any backend.
    pub fn of_limit(
        name: Option<&str>,
        read: impl Fn() -> Option<Reading> + Send + Sync + 'static,
    ) -> Result<Self, ConfigError> {
        if let Some(name) = name {
            check_name(name)?;
        }
        Ok(Self::of_checked(name, read))
    }

    /// [`of_limit`](Self::of_limit), for a `name` already checked.
    pub(crate) fn of_checked(
        name: Option<&str>,
        read: impl Fn() -> Option<Reading> + Send + Sync + 'static,
    ) -> Self {
        let name = name.map(Arc::from);
        static NEXT_ID: AtomicU64 = AtomicU64::new(1);
        Self {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            name,
            read: Arc::new(read),
        }
    }

    /// The capacity now, or `None` if the limit it describes is gone.
    pub fn get(&self) -> Option<usize> {
        self.read().map(|reading| reading.capacity)
    }

    /// The limit's whole reading now, or `None` if it is gone.
    pub fn read(&self) -> Option<Reading> {
        (self.read)()
    }

    /// The name of the limit, if it has one: a named limit reports `gym.resources.limit.*`
    /// under it.
    pub fn name(&self) -> Option<&str> {
        self.name.as_deref()
    }

    /// The name, shared (for the metrics, which keep it across collections).
    pub(crate) fn shared_name(&self) -> Option<&Arc<str>> {
        self.name.as_ref()
    }

    /// Whether `self` and `other` describe the same limit (one is a clone of the other).
    pub fn same_limit(&self, other: &Capacity) -> bool {
        self.id == other.id
    }

    /// The limit's identity, never reused.
    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    /// Whether this is the last `Capacity` of its limit: nothing else describes that limit.
    ///
    /// The metrics keep one `Capacity` per limit a series draws from, and forget it once it is
    /// the last: the limit, and every layer and service given it, are gone. A limit of the
    /// user's own may keep its `Capacity` only through its `read` closure's captures, so the
    /// count of the shared `read` is the one fact that says "nothing else holds it".
    pub(crate) fn is_last(&self) -> bool {
        Arc::strong_count(&self.read) == 1
    }
}

impl fmt::Debug for Capacity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Capacity")
            .field("name", &self.name)
            .field("capacity", &self.get())
            .finish()
    }
}

/// Whether `name` can name a limit in the metrics: 1 to 64 characters among
/// `A-Z a-z 0-9 _ . : / -`, starting with a letter, so that the attribute stays bounded and safe
/// in any backend.
pub(crate) fn check_name(name: &str) -> Result<(), ConfigError> {
    let allowed = |c: char| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | ':' | '/' | '-');
    let starts_with_letter = name.chars().next().is_some_and(|c| c.is_ascii_alphabetic());
    if (1..=64).contains(&name.len()) && starts_with_letter && name.chars().all(allowed) {
        Ok(())
    } else {
        Err(ConfigError::name(name))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_is_checked_as_an_attribute_value() {
        assert!(check_name("judges").is_ok());
        assert!(check_name("fleet/judges:v2.1-a_b").is_ok());
        for name in ["", "9 judges", "my judges", "juges\n", &"j".repeat(65)] {
            let error = check_name(name).unwrap_err();
            assert_eq!(error.setting(), "name", "{name:?}");
        }
    }
}
