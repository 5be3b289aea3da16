//! A [`Limit`] that finds its own capacity: a controller that raises or lowers it from the run
//! times and outcomes of the operations it admits.
//!
//! A verifier pool that is CPU-bound should run about as many operations as there are cores; a
//! judge endpoint as many as it can serve before its latency climbs. Both figures change while
//! the server runs. Give a limit an [`Adaptive`] controller and it looks for them:
//!
//! ```
//! use tower_resources_operation::adaptive::{Adaptive, Vegas};
//! use tower_resources_operation::Limit;
//!
//! // Starts at 1 and goes where the run times and the failures say, between 1 and 64.
//! let verifiers = Limit::builder(1)
//!     .name("verifiers")
//!     .adaptive(Adaptive::new(Vegas::default(), 1..=64))
//!     .build();
//! assert_eq!(verifiers.capacity(), 1);
//! ```
//!
//! The crate ships one algorithm, [`Vegas`]: it finds a server that slows down above some
//! load, one that fails or times out above it, and one that stops answering above it, with
//! nothing to set, fills a server that does none of these quickly, and keeps the callers of a
//! kind of work that runs near their patience out of its probes. An algorithm of your own is an
//! [`Algorithm`]: its docs show how to write the two that 0.5 shipped beside it (AIMD, and a
//! latency gradient).
//!
//! # How it decides
//!
//! Each operation that ends feeds the controller its run time, when it ended (so when it was
//! admitted), its series (its [`Operation`](crate::Operation) and
//! [`Executor`](crate::Executor)), and whether its outcome is a sign of congestion
//! (`timeout`, `error`, `crashed`; not `ok`, nor `cancelled`, whose caller went
//! away), or a sign that its caller gave up on it (`timeout`, `cancelled`: see
//! [Callers' patience](#callers-patience)). The controller adds them to the current *window*,
//! which lasts about one round trip:
//!
//! - it measures the operations admitted after it opened, which ran at the capacity it set;
//! - it closes once as many of them as the capacity have ended (about two run times after it
//!   opened: one for the first of them to come back, one for the rest), or once it is more than
//!   twice the last round trip old with half of them, or `interval` (1 s) old with one;
//! - or at once at the first sign of congestion that is news (see [`Adaptive::tolerance`]), so
//!   that a probe above what the server takes costs one failure rather than a window of them.
//!
//! A window that closes on its count of ends lasts at least 2 ms: a limit doing a few thousand
//! operations a second or fewer is not affected; a busier one decides at most 500 times a
//! second, on a sample (see [Cost](#cost)).
//!
//! A failure of an operation admitted before the capacity was last lowered is not news: the
//! decrease answered it, however late the failure comes (a judge given up after
//! three seconds, seconds after a decrease decided on verifies of 100 ms). So a server that fails
//! everything above its capacity gets one decrease per round trip, however many operations it
//! fails, and cuts never compound.
//!
//! The [`Algorithm`] then reads what the window saw (a [`Sample`]) and names the next capacity,
//! which the controller clamps to `[min, max]` and sets with [`Limit::set_capacity`]. Lowering
//! revokes nobody: running operations finish, and the places above the new capacity are taken
//! out as they do.
//!
//! - [`Vegas`]: estimates how many operations wait at the server rather than run (from the run
//!   time against the run time at low load, and the places held by operations that do not
//!   answer) and keeps that between 1 and 2; a slow start that ends at the first sign of a
//!   rise; probes where it last had to shrink one place at a time.
//! - [`Algorithm`]: your own.
//!
//! On congestion `Vegas` takes `backoff` times the capacity at once, and goes on toward what the
//! backend served over the last round trip (the run times of the operations that ended `ok`,
//! over the time they ended in), by half at most, taking the rest out as the operations
//! admitted before the decrease fail. A capacity that falls from 24 to 8 is followed to 10 or
//! less within 3 round trips, not six decreases of ×0.9.
//!
//! # Mixed work
//!
//! Routes that share a limit often do work of several kinds: a verify of 100 ms and a judge of
//! 1 s. The limit hears each operation's series, and the controller keeps each series' run
//! times apart ([`Sample::series`]): each algorithm compares every kind of work with what is
//! normal for it (a baseline per series, a queue estimate that adds up each series' share of the
//! wait), so a judge's first second is no queue measured against the verifies' 100 ms. A series
//! measured for the first time, or not for a while, counts as no queue. A kind that runs longer
//! than a window lasts is not taken for places that do not answer.
//!
//! # Callers' patience
//!
//! A probe above the knee (one place more than the backend serves at its pace) costs each
//! operation admitted into it up to a whole run time more: it waits for a place at the server,
//! or runs at half its speed. A verify of 100 ms whose caller waits a second does not mind; a
//! judge of 1 s whose caller waits a second is given up on. The controller hears how long the
//! callers of each series waited when they gave up (an operation that ended `timeout`, or
//! `cancelled`: a caller's own timeout around the limit, such as tower's `Timeout` over the
//! layer, drops the operation). A series whose callers give up after about its run time at low
//! load, and before twice that, runs near its callers' patience. While such a series is heard
//! (within the last 64 windows), [`Vegas`] does not probe where it last had to shrink, let
//! alone past it, and takes any queue that is more than chance as the knee: it holds one place
//! under it. What it gives up for that: a backend that gained room is not looked for until that
//! series has been away for 64 windows. It learns the patience from the first operations given
//! up on, which its first slow start past the knee costs. (Callers who leave sooner than the
//! usual run time were not waiting on a slow answer: a series whose operations are given up on
//! that soon, on average, is not taken as near its callers' patience.)
//!
//! Against the scenarios Vector publishes for its adaptive request concurrency (ARC), and ARC's
//! controller run beside them on the same simulated links, `Vegas` holds a knee where ARC does
//! at ARC's rate or better, fills a constant link sooner, and fails fewer requests on a server
//! that defers or drops what is above its capacity; it meets the same targets on mixed work,
//! on callers whose patience is the slow kind's run time, a falling capacity and a slow rise
//! (`tests/arc_scenarios.rs`).
//!
//! The limit's own rejections (a full queue, a queue timeout) are counted in the sample, but
//! `Vegas` does not shrink for them: they say the limit is too small for the demand,
//! not that what it guards is overloaded, and shrinking would turn more away. A rejection from
//! *downstream* (a `503`, RESOURCE_EXHAUSTED) reaches the controller as the `error` the
//! classifier makes of it.
//!
//! # Every form
//!
//! A controller belongs to its limit, and hears each operation's end from the limit itself
//! ([`Acquire::ended`](crate::Acquire::ended)), not through the metrics: the layer,
//! [`resources_operation`](crate::resources_operation), several routes' layers on clones of one
//! limit, and a per-request layer's named limits all feed the same one, with metrics on or
//! [off](crate::OperationMetrics::disabled).
//!
//! # A limit whose windows are kept elsewhere
//!
//! A limit shared by many processes (the companion crate `tower-resources-operation-redis`
//! keeps a fleet's in Redis) decides as a `Limit`'s controller does, from the same
//! [`Adaptive`]: each process counts its ends in a [`Window`], the store adds the windows up,
//! and the process that decides turns the sum into the [`Sample`] its
//! [`new_algorithm`](Adaptive::new_algorithm) reads. A new decider takes the limit over from
//! what the last one [handed over](Algorithm::handover).
//!
//! # What it decided, in the metrics
//!
//! `gym.resources.operation.limit` and, for a named limit, `gym.resources.limit.capacity`
//! follow the capacity it sets. A named adaptive limit also reports what its algorithm measured:
//! [`LIMIT_BASELINE_INSTRUMENT`](crate::names::LIMIT_BASELINE_INSTRUMENT) (the run time it
//! takes as normal) and [`LIMIT_ESTIMATE_INSTRUMENT`](crate::names::LIMIT_ESTIMATE_INSTRUMENT)
//! (the recent run time it compares with it), in milliseconds, with the limit's name as their
//! only attribute.
//!
//! # Cost
//!
//! No lock on an operation's path: an end adds to a handful of relaxed atomics of the window (its
//! counts, and its series' counts, run time sum, sum of squares and what it served, the operations
//! in flight it saw), and the operation reads the clock twice for its run time (which it reads
//! anyway with metrics on). The thread whose operation closes a window wins an atomic flag and runs
//! the algorithm, once per window, before that operation's place goes back. A limit without a
//! controller pays one `Option` check per end.
//!
//! A busy limit's controller hears a sample: as each window opens, it asks its limit to let it hear
//! one in `2^k` operations, picked at random as each is admitted, so that a window of 2 ms hears
//! about 32 of them; its counts are scaled back up for the algorithm. The others are neither timed
//! nor counted for it: with metrics off they take a plain limit's path (a number from the thread's
//! own generator, a few instructions, aside). A failure is then heard with the same odds, which at
//! that rate is still within a window. The scale falls by half at most per window, so that a window
//! open through an idle spell costs one window that hears twice as many, not a burst that hears
//! all; a rate that falls for good is heard in full again within a few windows. `cargo bench
//! --bench adaptive` measures what an adaptive limit costs beside a plain one (`BENCHMARKS.md`).

mod algorithm;
mod baseline;
mod config;
mod controller;
mod news;
mod own_limit;
mod served;
mod tally;
mod vegas;
mod window;

pub use algorithm::{Algorithm, Sample, SeriesSample};
use algorithm::{Handover, SeriesBaseline};
pub use config::Adaptive;
pub use own_limit::Controller;
pub use vegas::Vegas;
pub use window::Window;

#[cfg(doc)]
use crate::limit::Limit;
use std::time::Duration;

/// `value`, if it is within `range`; otherwise a panic that names the setting and the value
/// (every configuration value of the crate is checked when it is given, as tower does).
#[track_caller]
fn in_range(setting: &str, value: f64, range: std::ops::RangeInclusive<f64>) -> f64 {
    if range.contains(&value) {
        return value;
    }
    panic!(
        "tower-resources-operation: {setting} must be {}; got {value:?}",
        Within(&range)
    )
}

/// A range of settings as a person writes it: "above 0 and below 1", "at least 1".
struct Within<'a>(&'a std::ops::RangeInclusive<f64>);

impl std::fmt::Display for Within<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (start, end) = (*self.0.start(), *self.0.end());
        // The smallest positive value stands for "above 0", the largest below 1 for "below 1".
        match start {
            f64::MIN_POSITIVE => f.write_str("above 0")?,
            start => write!(f, "at least {start}")?,
        }
        match end {
            f64::MAX | f64::INFINITY => Ok(()),
            end if end == 1.0 - f64::EPSILON => f.write_str(" and below 1"),
            end => write!(f, " and at most {end}"),
        }
    }
}

/// An exponentially weighted moving average of run times, in seconds.
#[derive(Clone, Copy, Debug, Default)]
struct Average {
    value: Option<f64>,
}

impl Average {
    /// Moves `weight` of the way toward `sample` (all the way for the first one).
    fn add(&mut self, sample: f64, weight: f64) -> f64 {
        let next = match self.value {
            None => sample,
            Some(value) => value + weight * (sample - value),
        };
        self.value = Some(next);
        next
    }

    fn duration(self) -> Option<Duration> {
        self.value.map(Duration::from_secs_f64)
    }
}

/// The capacity an algorithm works from: its own fractional estimate while the limit still has
/// it, or the limit's capacity once something else changed it (a clamp, `set_capacity`).
fn working(estimate: &mut Option<f64>, capacity: usize) -> f64 {
    let capacity_f = capacity as f64;
    match *estimate {
        Some(value) if (value.round() - capacity_f).abs() < 1.0 => value,
        _ => {
            *estimate = Some(capacity_f);
            capacity_f
        }
    }
}

#[cfg(test)]
mod tests {
    use super::algorithm::BySeries;
    use super::*;
    use std::time::Duration;

    pub(super) fn sample(capacity: usize) -> Sample {
        Sample {
            capacity,
            min_capacity: 1,
            max_capacity: 100,
            ended: 20,
            congested: 0,
            stale_congested: 0,
            tolerance: 0.0,
            rejected: 0,
            mean_run_time: Some(Duration::from_millis(100)),
            min_run_time: Some(Duration::from_millis(90)),
            run_time_deviation: Some(Duration::ZERO),
            series: BySeries::default(),
            // The backend served the whole capacity.
            served: Duration::from_secs(capacity as u64),
            peak_in_flight: capacity,
            in_flight: capacity as f64,
            overdue: 0,
            round_trip: true,
            elapsed: Duration::from_secs(1),
        }
    }

    /// Vegas, resumed at a capacity another instance set (a fleet's new leader), grows by at
    /// most one place per window while nothing shows a queue, where a fresh one slow-starts by
    /// half.
    #[test]
    fn a_resumed_algorithm_grows_one_step_at_a_time_where_a_fresh_one_slow_starts() {
        let mut fresh = Vegas::default();
        let mut resumed = Vegas::default();
        resumed.resume(20, "");
        let mut capacity = 20;
        for window in 0..3 {
            let next = resumed.update(&sample(capacity));
            assert!(
                next <= capacity + 1,
                "window {window}: {capacity} -> {next}, more than one step"
            );
            capacity = next;
        }
        assert!(fresh.update(&sample(20)) >= 30, "a fresh one slow-starts");
    }

    /// Vegas, resumed with the baselines its predecessor measured, reads a first window with a
    /// queue at the backend as a queue (and lowers the capacity); resumed without them, it takes
    /// that window's run time for the one at low load, sees no queue, and does not lower it.
    #[test]
    fn a_resumed_algorithm_reads_its_first_window_against_the_handed_baselines() {
        let mut leader = Vegas::default();
        // 100 ms at low load: a slow start from 2 without a queue.
        let mut capacity = 2;
        for _ in 0..3 {
            let mut low = sample(capacity);
            low.ended = capacity as u64 * 2;
            capacity = leader.update(&low);
        }
        let handed = Handover::parse(0, &leader.handover());
        let baselines = &handed.baselines;
        assert_eq!(baselines.len(), 1, "{baselines:?}");
        assert_eq!(baselines[0].run_time, Duration::from_millis(100));
        // The leader dies at 10; the first window after it ran with 6 waiting at the backend
        // (250 ms where 100 is normal).
        let mut queued = sample(10);
        queued.mean_run_time = Some(Duration::from_millis(250));
        queued.min_run_time = queued.mean_run_time;
        let mut informed = Vegas::default();
        informed.resume(10, &leader.handover());
        assert_eq!(informed.baseline(), Some(Duration::from_millis(100)));
        let mut blind = Vegas::default();
        blind.resume(10, "");
        let (informed, blind) = (informed.update(&queued), blind.update(&queued));
        assert!(
            blind >= 10,
            "without the baselines, no queue: 10 -> {blind}"
        );
        assert!(informed < 10, "a queue of 6 read as one: 10 -> {informed}");
    }

    /// A successor's baselines are the predecessor's: the same figures back, whatever the
    /// series; a stale series is not handed over, and figures that are not numbers are held to
    /// what one could measure.
    #[test]
    fn baselines_are_handed_over_series_by_series() {
        use crate::attributes::{Executor, Operation};
        let mut verify = SeriesBaseline::new(
            Operation::Verify,
            Executor::Subprocess,
            Duration::from_millis(50),
        );
        (verify.level, verify.support) = (6.0, 40.0);
        verify.deviation = Some(Duration::from_millis(5));
        verify.patience = Some(Duration::from_millis(120));
        let mut judge =
            SeriesBaseline::new(Operation::Judge, Executor::Inline, Duration::from_secs(1));
        (judge.level, judge.support) = (f64::NAN, f64::INFINITY);
        let mut vegas = Vegas::default();
        let mut handover = Handover::new(8);
        handover.baselines = vec![judge, verify];
        vegas.resume(8, &handover.encode());
        let back = Handover::parse(8, &vegas.handover()).baselines;
        assert_eq!(back.len(), 2, "{back:?}");
        let verify_back = back
            .iter()
            .find(|b| b.operation == Operation::Verify)
            .unwrap();
        assert_eq!(verify_back, &verify);
        let judge_back = back
            .iter()
            .find(|b| b.operation == Operation::Judge)
            .unwrap();
        assert_eq!((judge_back.level, judge_back.support), (1.0, 1.0));
        assert_eq!(judge_back.run_time, Duration::from_secs(1));
    }

    #[test]
    fn a_sample_is_used_from_half_its_capacity() {
        let mut s = sample(10);
        s.peak_in_flight = 5;
        assert!(s.is_used());
        s.peak_in_flight = 4;
        assert!(!s.is_used());
    }

    /// `give` panics with a message that names `setting` and `value`.
    fn assert_refused<T>(setting: &str, value: &str, give: impl FnOnce() -> T) {
        let payload = std::panic::catch_unwind(std::panic::AssertUnwindSafe(give))
            .err()
            .unwrap_or_else(|| panic!("{setting} = {value} was taken"));
        let message = match payload.downcast_ref::<&str>() {
            Some(message) => (*message).to_owned(),
            None => payload
                .downcast_ref::<String>()
                .cloned()
                .unwrap_or_default(),
        };
        assert!(
            message.contains(setting) && message.contains(value),
            "{setting} = {value}: {message}"
        );
    }

    /// Every setting out of its range is refused where it is given, with a message that names
    /// the setting and the value (0.3 clamped some of them without a word).
    #[test]
    fn each_setting_out_of_range_is_refused_naming_the_setting_and_the_value() {
        // As a person writes the range: no float's bit pattern for "0" and "1".
        assert_refused("must be above 0 and below 1; got 1.5", "", || {
            Vegas::default().backoff(1.5)
        });
        assert_refused("must be at least 1; got 0.5", "", || {
            Vegas::default().queue(1.0, 0.5)
        });
        assert_refused("must be at least 0 and at most 1; got 2.0", "", || {
            Adaptive::new(Vegas::default(), 1..=8).tolerance(2.0)
        });
        assert_refused("Vegas::backoff", "NaN", || {
            Vegas::default().backoff(f64::NAN)
        });
        assert_refused("Vegas::backoff", "1.0", || Vegas::default().backoff(1.0));
        assert_refused("Vegas::queue alpha", "-1.0", || {
            Vegas::default().queue(-1.0, 3.0)
        });
        assert_refused("Vegas::queue beta", "0.5", || {
            Vegas::default().queue(1.0, 0.5)
        });
        let adaptive = || Adaptive::new(Vegas::default(), 1..=8);
        assert_refused("Adaptive::tolerance", "2.0", || adaptive().tolerance(2.0));
        assert_refused("Adaptive::window", "0", || {
            adaptive().window(0, Duration::from_secs(1))
        });
        assert_refused("bounds", "0..=4", || Adaptive::new(Vegas::default(), 0..=4));

        // The values at the edges of each range are taken.
        let _ = Vegas::default().backoff(0.5).queue(0.0, 0.0);
        let _ = Adaptive::new(Vegas::default(), 1..=1)
            .tolerance(1.0)
            .window(1, Duration::ZERO);
    }

    #[test]
    #[should_panic(expected = "non-empty range")]
    fn bounds_starting_at_zero_are_refused() {
        let _ = Adaptive::new(Vegas::default(), 0..=4);
    }
}
