//! An adaptive fleet limit's controller in one process ([`FleetControl`]), on the core's seam for
//! windows kept outside the process: each end goes to this process's [`Window`] (nothing that
//! reaches the store), judged own or news on marks that are the fleet's window numbers. The
//! background task flushes the window to the store every tick and, in the one process that
//! holds the leader's lease, turns the fleet's window into the [`Sample`] the core's algorithm
//! reads ([`Window::sample`]), as a `Limit`'s controller does in one process: the loop that does
//! it is [`decide`](super::leader::decide).

use std::fmt;
use std::ops::RangeInclusive;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::Notify;
use tower_resources_operation::adaptive::{Adaptive, Window};
use tower_resources_operation::limit::Ended;

use super::books::lock;
use super::store::Known;

/// How an adaptive fleet limit decides, as the builder was told: the core's [`Adaptive`]
/// (algorithm, bounds, tolerance, longest window), and how often each process ticks.
#[derive(Clone, Debug)]
pub(crate) struct AdaptiveSettings {
    pub(crate) adaptive: Adaptive,
    pub(crate) tick: Duration,
}

/// An adaptive fleet limit's controller in this process.
pub(crate) struct FleetControl {
    pub(crate) settings: AdaptiveSettings,
    /// This process's id as a candidate for the leader's lease.
    pub(crate) id: String,
    /// How long the leader's lease lasts without a tick that extends it.
    pub(crate) leader_ttl: Duration,
    /// This process's ends since its last tick.
    pub(crate) tally: Mutex<Window>,
    /// The fleet's window in which the capacity was last lowered (0 for none): an operation
    /// admitted in it or before it was admitted before the decrease, so its failure is not
    /// news (marks are the fleet's window numbers: an operation's, the window this process knew
    /// as it was admitted).
    decreased: AtomicU64,
    /// What the tally had counted when this process heard of a decrease, for its next tick:
    /// each end in it was judged against an older mark, and was admitted before the decrease
    /// (this process had not yet heard of the window after it), so its failures are stale.
    carried: Mutex<Window>,
    /// The fleet's window, as this process last heard (0 before it heard any).
    epoch: AtomicU64,
    /// The fleet's baseline and estimate, in µs, as last heard (read by the metrics'
    /// callbacks, written once a tick).
    measured_us: Mutex<(Option<u64>, Option<u64>)>,
    /// Whether this process held the leader's lease at its last tick.
    pub(crate) leads: AtomicBool,
    /// Windows this process decided.
    pub(crate) decisions: AtomicU64,
    /// Tick now: a first sign of congestion, or the leader hears that the window is due.
    pub(crate) doorbell: Notify,
}

impl FleetControl {
    /// The controller of the member whose ids start with `token`.
    pub(crate) fn new(
        settings: AdaptiveSettings,
        token: &str,
        call_timeout: Duration,
        lease_ttl: Duration,
    ) -> Self {
        let leader_ttl = (call_timeout * 3).max(settings.tick * 10).min(lease_ttl);
        Self {
            settings,
            id: format!("{token}:leader"),
            leader_ttl,
            tally: Mutex::default(),
            decreased: AtomicU64::new(0),
            carried: Mutex::default(),
            epoch: AtomicU64::new(0),
            measured_us: Mutex::default(),
            leads: AtomicBool::new(false),
            decisions: AtomicU64::new(0),
            doorbell: Notify::new(),
        }
    }

    /// The window an operation admitted now belongs to.
    #[inline]
    pub(crate) fn epoch(&self) -> u64 {
        self.epoch.load(Relaxed)
    }

    /// Whether this process decides the fleet's capacity, as of its last tick.
    pub(crate) fn leads(&self) -> bool {
        self.leads.load(Relaxed)
    }

    pub(crate) fn decisions(&self) -> u64 {
        self.decisions.load(Relaxed)
    }

    pub(crate) fn bounds(&self) -> RangeInclusive<usize> {
        self.settings.adaptive.bounds()
    }

    /// The fleet's baseline and estimate, as last heard.
    pub(crate) fn measured(&self) -> (Option<Duration>, Option<Duration>) {
        let (baseline, estimate) = *lock(&self.measured_us);
        (
            baseline.map(Duration::from_micros),
            estimate.map(Duration::from_micros),
        )
    }

    /// An operation admitted in window `admitted` ended: into the tally, and the doorbell at
    /// the first sign of congestion that is news since the last tick.
    #[inline]
    pub(crate) fn ended(&self, admitted: u64, ended: &Ended) {
        let news = admitted > self.decreased.load(Relaxed);
        let own = admitted == self.epoch();
        let first = {
            let mut tally = lock(&self.tally);
            tally.record(ended, own, news) && tally.congested() == 1
        };
        if first {
            self.doorbell.notify_one();
        }
    }

    /// This process's counts since its last tick, for the next, and the decrease they were
    /// judged against (the window it was decided in, 0 for none): a store that has heard of a
    /// later one counts their failures as stale (see [`Tick::judged`]).
    ///
    /// [`Tick::judged`]: super::store::Tick::judged
    pub(crate) fn take_counts(&self) -> (Window, u64) {
        // The mark first: a decrease heard between the two takes the tally into `carried`, and
        // what is counted after it was judged against a newer mark than this one (the store
        // then counts its failures as stale too, which errs toward no decrease).
        let judged = self.decreased.load(Relaxed);
        let mut counts = std::mem::take(&mut *lock(&self.tally));
        counts += std::mem::take(&mut *lock(&self.carried));
        (counts, judged)
    }

    /// Drops this process's counts: the fleet cannot be measured while the store is out of
    /// reach.
    pub(crate) fn drop_counts(&self) {
        let _ = self.take_counts();
    }

    /// The limit turned an operation away (a full queue).
    pub(crate) fn rejected(&self) {
        lock(&self.tally).reject();
    }

    /// What the store said of the fleet's window and its last decision.
    pub(crate) fn learn(&self, known: &Known) {
        self.epoch.store(known.epoch, Relaxed);
        // `decreased` is the first window after the decrease: it was decided in the one
        // before, and what was admitted in that one ran at the capacity it lowered.
        let decrease = known.decreased.saturating_sub(1);
        if known.decreased > 0 && self.decreased.fetch_max(decrease, Relaxed) < decrease {
            // Heard late (a decision is pushed, and a tick answers it): what was counted since
            // the last tick was judged against the decrease before, and each of its operations
            // was admitted in a window up to the one this decrease was decided in. Their
            // failures go as the decrease's stale ones; their own ends, to a window that has
            // closed. (An end judged just as this runs may still land in the next tally as
            // news: one end, in the time between two atomic operations.)
            let judged = std::mem::take(&mut *lock(&self.tally));
            *lock(&self.carried) += judged.into_stale().into_next();
        }
        *lock(&self.measured_us) = (known.baseline_us, known.estimate_us);
    }
}

impl fmt::Debug for FleetControl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (baseline, estimate) = self.measured();
        f.debug_struct("FleetControl")
            .field("settings", &self.settings)
            .field("leads", &self.leads())
            .field("epoch", &self.epoch())
            .field("baseline", &baseline)
            .field("estimate", &estimate)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use tower_resources_operation::adaptive::Vegas;
    use tower_resources_operation::Outcome;

    use super::*;

    fn control() -> FleetControl {
        let settings = AdaptiveSettings {
            adaptive: Adaptive::new(Vegas::default(), 1..=64),
            tick: Duration::from_millis(50),
        };
        FleetControl::new(
            settings,
            "0123456789abcdef",
            Duration::from_millis(500),
            Duration::from_secs(10),
        )
    }

    fn known(epoch: u64, decreased: u64) -> Known {
        Known {
            epoch,
            decreased,
            ..Known::default()
        }
    }

    #[test]
    fn what_was_counted_before_a_decrease_was_heard_goes_to_the_next_tick_as_stale() {
        let control = control();
        control.learn(&known(5, 0));
        let failed = Ended::new(Outcome::Error, Duration::from_millis(50), None);
        let ok = Ended::new(Outcome::Ok, Duration::from_millis(50), None);
        // Admitted in window 5, and ended before this process heard of the decrease decided
        // as window 6 opened: judged news then.
        control.ended(5, &failed);
        control.ended(5, &ok);
        control.learn(&known(6, 6));
        // Admitted after it: news.
        control.ended(6, &failed);
        // The same decision heard again (a tick answers what was pushed): nothing moves.
        control.learn(&known(6, 6));
        let (counts, judged) = control.take_counts();
        assert_eq!(judged, 5, "judged against the decrease of window 5");
        let fields = counts.fields();
        let field = |name: &str| {
            fields
                .iter()
                .find(|(n, _)| n == name)
                .map_or(0, |(_, v)| *v)
        };
        assert_eq!((field("congested"), field("stale")), (1, 1));
        assert_eq!(counts.ended(), 1, "window 5's own ends are not window 6's");
        assert_eq!(counts.ends(), 3, "every end still counts as an end");
        let (empty, _) = control.take_counts();
        assert_eq!(empty, Window::default(), "taken once");
    }
}
