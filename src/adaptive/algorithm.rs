//! [`Algorithm`]: how a controller decides, and the [`Sample`] of a window it decides from.

use std::fmt;
use std::time::Duration;

#[cfg(doc)]
use super::Adaptive;
use crate::attributes::{Executor, Operation, SeriesKey};

/// What one window of operations showed: what an [`Algorithm`] decides from.
///
/// A window lasts about one round trip (see [`Adaptive::window`]): its figures are those of the
/// operations admitted after it opened, which ran at the capacity it opened with. Operations
/// admitted earlier count only in [`peak_in_flight`](Self::peak_in_flight) and, if they failed,
/// in [`congested`](Self::congested) or [`stale_congested`](Self::stale_congested).
///
/// A busy limit's controller hears a sample of its operations (see the
/// [module docs](super#cost)): its counts are then estimates, the sample's counts scaled up, and
/// the run times and loads are the sample's.
///
/// Its run times are given for all the window's `ok` operations together
/// ([`mean_run_time`](Self::mean_run_time)) and for each series apart
/// ([`series`](Self::series)): a limit shared by work of several kinds (a verify of 100 ms, a
/// judge of 1 s) is read series by series, each against what is normal for it.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct Sample {
    /// The limit's capacity when the window closed.
    pub capacity: usize,
    /// The lowest capacity the controller may set.
    pub min_capacity: usize,
    /// The highest capacity the controller may set.
    pub max_capacity: usize,
    /// Operations of the window that ended, whatever their outcome.
    pub ended: u64,
    /// Operations that ended `timeout`, `error` or `crashed` in the window, admitted since the
    /// capacity was last lowered: signs of congestion, news to the algorithm.
    pub congested: u64,
    /// Operations that ended `timeout`, `error` or `crashed` in the window but were admitted
    /// before the capacity was last lowered: that decrease already answered them.
    pub stale_congested: u64,
    /// The share of `ended` that may be signs of congestion before the window counts as
    /// congested ([`Adaptive::tolerance`]).
    pub tolerance: f64,
    /// Operations the limit turned away during the window (a full queue, a queue timeout).
    pub rejected: u64,
    /// The mean run time of the operations that ended `ok`; `None` if none did.
    pub mean_run_time: Option<Duration>,
    /// The shortest run time of an operation that ended `ok`.
    pub min_run_time: Option<Duration>,
    /// The standard deviation of the run times of the operations that ended `ok`; `None` with
    /// fewer than 2 of them. How much of a change in the mean run time is noise.
    pub run_time_deviation: Option<Duration>,
    /// The same, series by series: see [`series`](Self::series).
    pub(crate) series: BySeries,
    /// The run times of every operation that ended `ok` in the window, whenever it was
    /// admitted, summed: over [`elapsed`](Self::elapsed), how many operations the backend
    /// served at once (Little's law; see [`served_in_flight`](Self::served_in_flight)).
    pub served: Duration,
    /// The most operations of the limit that ran at once during the window, as their ends saw
    /// it: whether the limit was used, or the load stayed below it.
    pub peak_in_flight: usize,
    /// The mean of the operations in flight (each one's own included) that the window's ends
    /// saw: the load the window's run times were measured at.
    pub in_flight: f64,
    /// Operations admitted before the window opened and still running when it closed, a
    /// round trip or more later: places held by operations that are slow or never answer (a
    /// server that drops what is above its capacity), which deliver nothing until they time
    /// out, or by a kind of work that runs longer than a window lasts (a judge of 1 s among
    /// verifies of 100 ms: [`series`](Self::series) says how many of each kind ended, and what
    /// they served). 0 for a window cut short, of a fixed count, or heard in a sample.
    pub overdue: u64,
    /// Whether the window ran its course (a round trip, or its count of operations), rather
    /// than being closed early by congestion: only then are its run times and rate those of a
    /// whole round trip.
    pub round_trip: bool,
    /// How long the window lasted (0 if the clock could not be read).
    pub elapsed: Duration,
}

impl Sample {
    /// A sample of a window at `capacity`, within `[min_capacity, max_capacity]`, with nothing
    /// in it yet: zero counts and in flight, no run times, a tolerance of 0, a window that ran
    /// its course ([`round_trip`](Self::round_trip) `true`) for no time. For a controller
    /// outside this crate (a fleet limit that adds up its replicas' windows, a replay in a
    /// test): the fields are public, so it sets what it measured.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_resources_operation::adaptive::{Algorithm, Sample, Vegas};
    ///
    /// let mut sample = Sample::new(4, 1, 64);
    /// sample.ended = 4;
    /// sample.mean_run_time = Some(Duration::from_millis(100));
    /// sample.min_run_time = sample.mean_run_time;
    /// sample.peak_in_flight = 4;
    /// sample.in_flight = 4.0;
    /// assert!(Vegas::default().update(&sample) > 4, "no queue yet: a slow start");
    /// ```
    pub fn new(capacity: usize, min_capacity: usize, max_capacity: usize) -> Self {
        Self {
            capacity,
            min_capacity,
            max_capacity,
            ended: 0,
            congested: 0,
            stale_congested: 0,
            tolerance: 0.0,
            rejected: 0,
            mean_run_time: None,
            min_run_time: None,
            run_time_deviation: None,
            series: BySeries::default(),
            served: Duration::ZERO,
            peak_in_flight: 0,
            in_flight: 0.0,
            overdue: 0,
            round_trip: true,
            elapsed: Duration::ZERO,
        }
    }

    /// Whether the load reached at least half the capacity: an algorithm that grows the limit
    /// only then does not grow a limit that nothing uses.
    pub fn is_used(&self) -> bool {
        self.peak_in_flight.saturating_mul(2) >= self.capacity
    }

    /// Whether the window's signs of congestion passed the tolerance: what the built-in
    /// algorithms back off for.
    pub fn is_congested(&self) -> bool {
        self.congested as f64 > self.tolerance * self.ended as f64
    }

    /// How many operations the backend served at once during the window, on average: the run
    /// times of the operations that ended `ok` ([`served`](Self::served)) over the window's
    /// length. `None` for a window of no length.
    ///
    /// A backend that serves 8 at once answers 8 operations `ok` per round trip, however many
    /// more the limit lets through and whatever it does with them (fails them at once, or
    /// keeps them until their callers give up): what a decrease goes toward.
    pub fn served_in_flight(&self) -> Option<f64> {
        (!self.elapsed.is_zero()).then(|| self.served.as_secs_f64() / self.elapsed.as_secs_f64())
    }

    /// The window series by series (an [`Operation`] on an [`Executor`]): every series with an
    /// end in it, each with its own operations' run times, in a fixed order.
    pub fn series(&self) -> impl Iterator<Item = &SeriesSample> + '_ {
        self.series.iter()
    }

    /// The series of `operation` on `executor`, if it had an end in the window.
    pub fn series_of(&self, operation: Operation, executor: Executor) -> Option<&SeriesSample> {
        self.series.get(operation, executor)
    }
}

/// What one series' operations showed in a window: a [`Sample`] of one kind of work.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct SeriesSample {
    /// What kind of work.
    pub(crate) operation: Operation,
    /// Where it ran.
    pub(crate) executor: Executor,
    /// Its operations that ended in the window, whenever admitted, whatever their outcome.
    pub ended: u64,
    /// Those of them that ended `ok`.
    pub ok: u64,
    /// Their run times, summed: what the backend served of this series.
    pub served: Duration,
    /// Those of them admitted in the window that ended `ok`: the ones its run times are of.
    pub timed: u64,
    /// Their mean run time; `None` if there are none.
    pub mean_run_time: Option<Duration>,
    /// The shortest.
    pub min_run_time: Option<Duration>,
    /// The standard deviation of their run times; `None` with fewer than 2.
    pub run_time_deviation: Option<Duration>,
    /// Its operations that ended in the window, whenever admitted, that their callers gave up
    /// on: `timeout`, or `cancelled` (a caller's own timeout around the limit reads as this).
    pub given_up: u64,
    /// Their run times, summed: how long those callers waited.
    pub given_up_after: Duration,
}

impl SeriesSample {
    /// A series with nothing in it yet, to fill in: for a controller outside this crate, or a
    /// test.
    pub fn new(operation: Operation, executor: Executor) -> Self {
        Self {
            operation,
            executor,
            ended: 0,
            ok: 0,
            served: Duration::ZERO,
            timed: 0,
            mean_run_time: None,
            min_run_time: None,
            run_time_deviation: None,
            given_up: 0,
            given_up_after: Duration::ZERO,
        }
    }

    /// How long the callers of its operations given up on in the window waited, on average:
    /// how much patience they have. `None` if none was given up on.
    pub fn given_up_run_time(&self) -> Option<Duration> {
        let given_up = u32::try_from(self.given_up).unwrap_or(u32::MAX);
        (given_up > 0).then(|| self.given_up_after / given_up)
    }

    /// The mean run time of its operations that ended `ok` in the window, whenever admitted:
    /// what one of them takes, even when none was admitted in the window (a kind of work
    /// slower than a window lasts).
    pub fn served_run_time(&self) -> Option<Duration> {
        let ok = u32::try_from(self.ok).unwrap_or(u32::MAX);
        (ok > 0).then(|| self.served / ok)
    }

    /// Its place in a [`BySeries`].
    pub(super) fn key(&self) -> SeriesKey {
        SeriesKey::new(self.operation, self.executor)
    }
}

/// A window's [`SeriesSample`]s, one per series with an end in it: a table of fixed size (an
/// [`Operation`] on an [`Executor`], 20 at most), so that making a sample allocates nothing.
#[derive(Clone, Default, PartialEq, Eq)]
pub(crate) struct BySeries {
    entries: [Option<SeriesSample>; SeriesKey::COUNT],
}

impl BySeries {
    /// Every series in it, in a fixed order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &SeriesSample> + '_ {
        self.entries.iter().flatten()
    }

    /// The series of `operation` on `executor`, if it is in it.
    pub(crate) fn get(&self, operation: Operation, executor: Executor) -> Option<&SeriesSample> {
        self.entries[SeriesKey::new(operation, executor).index()].as_ref()
    }

    /// Puts `series` in, in place of what it had of the same series.
    pub(crate) fn insert(&mut self, series: SeriesSample) {
        self.entries[series.key().index()] = Some(series);
    }

    /// How many series are in it.
    pub(crate) fn len(&self) -> usize {
        self.iter().count()
    }

    /// Whether none is.
    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl fmt::Debug for BySeries {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

/// How a controller decides the next capacity of its limit, once per window.
///
/// The crate ships [`Vegas`](super::Vegas); another is a few lines of your own, given to
/// [`Adaptive::new`]. Additive increase, multiplicative decrease (AIMD, as TCP's congestion
/// window; 0.5 shipped it as `Aimd`): one place more after a round trip that filled the limit
/// without a failure, 0.9 times as many (at least one place less) after one with a failure.
/// It reacts to failures only, so a backend that slows down without failing lets it grow to
/// its `max`:
///
/// ```
/// use tower_resources_operation::adaptive::{Adaptive, Algorithm, Sample};
/// use tower_resources_operation::Limit;
///
/// #[derive(Clone)]
/// struct Aimd;
///
/// impl Algorithm for Aimd {
///     fn update(&mut self, sample: &Sample) -> usize {
///         let capacity = sample.capacity;
///         if sample.is_congested() {
///             (capacity * 9 / 10).min(capacity.saturating_sub(1))
///         } else if sample.round_trip && sample.is_used() {
///             capacity + 1
///         } else {
///             capacity
///         }
///     }
/// }
///
/// let mut failed = Sample::new(20, 1, 64);
/// failed.congested = 1;
/// assert_eq!(Aimd.update(&failed), 18);
/// let judges = Limit::builder(1).adaptive(Adaptive::new(Aimd, 1..=64)).build();
/// # drop(judges);
/// ```
///
/// A latency gradient (as Netflix's Gradient2 and Envoy's adaptive concurrency; 0.5 shipped
/// one as `Gradient`): the capacity times the ratio of the run time at low load (here the
/// lowest mean seen) to the recent one, within a tolerance of 10%, plus a headroom of
/// `√capacity`. A limit shared by several kinds of work reads each against its own
/// ([`Sample::series`]), as `Vegas` does:
///
/// ```
/// use std::time::Duration;
/// use tower_resources_operation::adaptive::{Algorithm, Sample};
///
/// #[derive(Clone, Default)]
/// struct Gradient {
///     baseline: Option<Duration>,
/// }
///
/// impl Algorithm for Gradient {
///     fn update(&mut self, sample: &Sample) -> usize {
///         let Some(run_time) = sample.mean_run_time.filter(|_| sample.round_trip) else {
///             return sample.capacity;
///         };
///         let baseline = *self.baseline.insert(self.baseline.unwrap_or(run_time).min(run_time));
///         let gradient = (1.1 * baseline.as_secs_f64() / run_time.as_secs_f64()).clamp(0.5, 1.0);
///         let capacity = sample.capacity as f64;
///         (capacity * gradient + capacity.sqrt()).round() as usize
///     }
///
///     fn baseline(&self) -> Option<Duration> {
///         self.baseline
///     }
/// }
///
/// let mut gradient = Gradient::default();
/// let mut sample = Sample::new(16, 1, 64);
/// sample.mean_run_time = Some(Duration::from_millis(100));
/// assert_eq!(gradient.update(&sample), 20, "no climb: the headroom");
/// sample.mean_run_time = Some(Duration::from_millis(220));
/// assert_eq!(gradient.update(&sample), 12, "twice the run time: half, and the headroom");
/// ```
pub trait Algorithm: Send + 'static {
    /// The capacity for the next window, from what the last one showed. The controller clamps
    /// it to `[min, max]`. A panic keeps the capacity as it is.
    fn update(&mut self, sample: &Sample) -> usize;

    /// The run time this algorithm takes as normal (at low load), if it keeps one: reported as
    /// `gym.resources.limit.adaptive.baseline_ms`. Defaults to `None`.
    fn baseline(&self) -> Option<Duration> {
        None
    }

    /// The recent run time it compares with its baseline, if it keeps one: reported as
    /// `gym.resources.limit.adaptive.estimate_ms`. Defaults to `None`.
    fn estimate(&self) -> Option<Duration> {
        None
    }

    /// What another instance taking its limit over should start from (a fleet's new leader,
    /// whose predecessor died), as text the fleet's store keeps with each decision: what it
    /// measured, such as the run time at low load of each kind of work. Defaults to nothing.
    fn handover(&self) -> String {
        String::new()
    }

    /// Takes over a limit at `capacity` that another instance of the algorithm decided until
    /// now, from what its [`handover`](Self::handover) said (empty if nothing reached it).
    /// Called once, before the first [`update`](Self::update). Defaults to doing nothing.
    ///
    /// The limit is not new, so the built-in algorithms start past their slow start, at
    /// `capacity`: the next windows raise it by at most one of their additive steps each, until
    /// their own measurements say more (a new leader that slow-started from the fleet's
    /// capacity overshot it by half, then by half again). And they read their first window
    /// against the baselines their predecessor measured: a first window run with a queue at the
    /// backend is then a queue, not the run time at low load.
    fn resume(&mut self, capacity: usize, handover: &str) {
        let _ = (capacity, handover);
    }
}

/// What one instance of a built-in [`Algorithm`] hands to another that takes its limit over
/// ([`Algorithm::resume`]): the capacity it decided last, and what it measured.
///
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Handover {
    /// The limit's capacity now.
    pub(crate) capacity: usize,
    /// The run time at low load of each kind of work, as the predecessor measured them.
    pub(crate) baselines: Vec<SeriesBaseline>,
    /// The predecessor's last [estimate](Algorithm::estimate), if it kept one.
    pub(crate) estimate: Option<Duration>,
}

impl Handover {
    /// A handover at `capacity`, with nothing measured.
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            capacity,
            baselines: Vec::new(),
            estimate: None,
        }
    }
}

/// The run time at low load of one series (an [`Operation`] on an [`Executor`]), as an
/// algorithm measured it: what a [`Handover`] carries.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct SeriesBaseline {
    /// What kind of work.
    pub(crate) operation: Operation,
    /// Where it ran.
    pub(crate) executor: Executor,
    /// Its run time at low load.
    pub(crate) run_time: Duration,
    /// The most operations in flight at which that run time still held.
    pub(crate) level: f64,
    /// The standard deviation of one operation's run time, if known: how much of a rise is
    /// chance.
    pub(crate) deviation: Option<Duration>,
    /// About how many operations it rests on.
    pub(crate) support: f64,
    /// How long its callers wait before they give up on one of its operations, if known.
    pub(crate) patience: Option<Duration>,
}

impl SeriesBaseline {
    /// `operation` on `executor` takes `run_time` at low load (one operation in flight,
    /// measured once, its spread unknown).
    pub(crate) fn new(operation: Operation, executor: Executor, run_time: Duration) -> Self {
        Self {
            operation,
            executor,
            run_time,
            level: 1.0,
            deviation: None,
            support: 1.0,
            patience: None,
        }
    }
}

/// `duration` in whole microseconds.
fn micros(duration: Duration) -> u64 {
    u64::try_from(duration.as_micros()).unwrap_or(u64::MAX)
}

impl Handover {
    /// What [`Algorithm::handover`] says: one word for the estimate (`e:<µs>`), then one per
    /// series, `<operation>/<executor>/<run time µs>/<level>/<deviation µs, -1 for
    /// none>/<support>`, then one per series whose callers' patience is known,
    /// `p:<operation>/<executor>/<µs>` (a word of its own, which a reader that does not know it
    /// skips), separated by spaces (NeMo Gym's values have neither `/` nor spaces).
    pub(crate) fn encode(&self) -> String {
        let estimate = self.estimate.map(|e| format!("e:{}", micros(e)));
        let baselines = self.baselines.iter().map(|b| {
            let deviation = b
                .deviation
                .map_or(-1, |d| i64::try_from(micros(d)).unwrap_or(i64::MAX));
            format!(
                "{}/{}/{}/{:.3}/{deviation}/{:.3}",
                b.operation,
                b.executor,
                micros(b.run_time),
                b.level,
                b.support
            )
        });
        let patience = self.baselines.iter().filter_map(|b| {
            let patience = micros(b.patience?);
            Some(format!("p:{}/{}/{patience}", b.operation, b.executor))
        });
        estimate
            .into_iter()
            .chain(baselines)
            .chain(patience)
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// [`encode`](Self::encode) read back, at `capacity`. A word it did not write is skipped.
    pub(crate) fn parse(capacity: usize, text: &str) -> Self {
        let mut handover = Self::new(capacity);
        for word in text.split(' ') {
            if let Some(us) = word.strip_prefix("e:") {
                handover.estimate = us.parse().ok().map(Duration::from_micros);
            } else if let Some(patience) = word.strip_prefix("p:") {
                handover.patience(patience);
            } else if let Some(baseline) = SeriesBaseline::parse(word) {
                handover.baselines.push(baseline);
            }
        }
        handover
    }
}

impl Handover {
    /// Reads a patience word's `<operation>/<executor>/<µs>` into its series' baseline, handed
    /// before it; a word for no such series is skipped.
    fn patience(&mut self, word: &str) -> Option<()> {
        let mut parts = word.split('/');
        let operation = parts.next()?.parse::<Operation>().ok()?;
        let executor = parts.next()?.parse::<Executor>().ok()?;
        let us: u64 = parts.next()?.parse().ok()?;
        let baseline = self
            .baselines
            .iter_mut()
            .find(|b| b.operation == operation && b.executor == executor)?;
        baseline.patience = Some(Duration::from_micros(us));
        Some(())
    }
}

impl SeriesBaseline {
    fn parse(word: &str) -> Option<Self> {
        let mut parts = word.split('/');
        let operation = parts.next()?.parse::<Operation>().ok()?;
        let executor = parts.next()?.parse::<Executor>().ok()?;
        let run_time = Duration::from_micros(parts.next()?.parse().ok()?);
        let mut baseline = SeriesBaseline::new(operation, executor, run_time);
        baseline.level = parts.next()?.parse().ok()?;
        let deviation: i64 = parts.next()?.parse().ok()?;
        baseline.deviation = u64::try_from(deviation).ok().map(Duration::from_micros);
        baseline.support = parts.next()?.parse().ok()?;
        parts.next().is_none().then_some(baseline)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_handover_reads_back_what_it_wrote_and_skips_what_it_did_not() {
        let mut verify = SeriesBaseline::new(
            Operation::Verify,
            Executor::Subprocess,
            Duration::from_micros(100_250),
        );
        (verify.level, verify.deviation, verify.support) =
            (6.5, Some(Duration::from_micros(4_000)), 32.0);
        let mut judge =
            SeriesBaseline::new(Operation::Judge, Executor::Inline, Duration::from_secs(1));
        judge.patience = Some(Duration::from_millis(1_050));
        let handover = Handover {
            capacity: 9,
            baselines: vec![verify, judge],
            estimate: Some(Duration::from_millis(120)),
        };
        let text = handover.encode();
        assert_eq!(Handover::parse(9, &text), handover);
        let noisy = format!("x/y/1 {text} verify/inline/oops p:tool/inline/5 p:judge e:nope");
        let read = Handover::parse(4, &noisy);
        assert_eq!((read.capacity, read.baselines.len()), (4, 2));
        assert_eq!(
            read.estimate, None,
            "the last estimate word wins, unreadable: none"
        );
        assert_eq!(Handover::parse(3, ""), Handover::new(3));
    }
}
