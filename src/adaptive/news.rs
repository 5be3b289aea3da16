//! [`News`]: whether a sign of congestion is news to the controller, or was answered by its
//! last decrease; and which outcomes are signs of congestion ([`is_congestion`]).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use crate::attributes::Outcome;

/// Whether an operation's outcome is a sign of congestion for an adaptive limit: `timeout`,
/// `error` and `crashed`. Not `ok`, and not `cancelled`: its caller went away.
///
/// A rejection from *downstream* (a `503`, RESOURCE_EXHAUSTED) is the `error` the classifier
/// makes of it.
pub(crate) fn is_congestion(outcome: Outcome) -> bool {
    matches!(
        outcome,
        Outcome::Error | Outcome::Timeout | Outcome::Crashed
    )
}

/// Whether an operation's outcome says its caller gave up on it: `timeout` (its deadline
/// passed), or `cancelled` (its caller dropped it: a timeout of the caller's own, around the
/// limit, reads as this). How long it ran then says how long its callers wait.
pub(crate) fn is_given_up(outcome: Outcome) -> bool {
    matches!(outcome, Outcome::Timeout | Outcome::Cancelled)
}

/// The rule that keeps decreases from compounding: a failure of an operation admitted before
/// the capacity was last lowered is not news, since that decrease answered it. So a server that
/// fails everything above its capacity costs one decrease per round trip, however many
/// operations it fails: those admitted after the decrease ran at the new capacity, and their
/// failures say it was not enough.
///
/// It reads *marks* that only go up, which a controller chooses: a
/// [`Limit`](crate::Limit)'s controller marks an operation with when it was admitted, and a
/// decrease with when it was decided, on its own clock; a fleet whose processes do not share a
/// clock marks both with the number of the fleet's window (an operation with the window its
/// process knew when it was admitted, a decrease with the window it was decided in), which
/// every process hears. Lock-free: one relaxed atomic.
///
#[derive(Debug, Default)]
pub(crate) struct News {
    /// The mark of the last decrease; 0 for none.
    decreased: AtomicU64,
}

impl News {
    /// A rule for a limit whose capacity was never lowered: every sign of congestion is news.
    pub(crate) const fn new() -> Self {
        Self {
            decreased: AtomicU64::new(0),
        }
    }

    /// The capacity was lowered at `mark`: operations admitted at or before it were admitted
    /// before the decrease. A mark lower than the last one is ignored. Returns whether the mark
    /// moved: if it did, what was judged before against an older mark was judged too kindly
    /// (a fleet's process that hears of a decrease late moves what it counted since as news to
    /// the decrease's, as stale).
    pub(crate) fn decreased(&self, mark: u64) -> bool {
        self.decreased.fetch_max(mark, Relaxed) < mark
    }

    /// Whether the failure of an operation admitted at `admitted` is news: whether it was
    /// admitted after the last decrease.
    #[inline]
    pub(crate) fn is_news(&self, admitted: u64) -> bool {
        admitted > self.decreased.load(Relaxed)
    }
}
