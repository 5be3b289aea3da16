//! [`Baseline`]: the run time at low load, the load it holds up to, and how much it varies; and
//! [`Baselines`]: one per series, and what a round trip of mixed work measured against them.

use std::time::Duration;

use super::{Sample, SeriesBaseline, SeriesSample};
use crate::attributes::{Executor, Operation, SeriesKey};

/// The run time an algorithm takes as normal: the mean run time of a round trip at low load,
/// with the load (operations in flight) it holds up to.
///
/// It follows what it measures. A round trip at less load than the baseline holds up to (or at
/// one operation in flight) measures it again, up or down: when the load falls (the limit was
/// lowered, or the demand fell), the run time the algorithm sees is the low-load run time,
/// whatever it was before. A round trip at more load lowers it if it is faster by more than
/// chance (what the spread of the run times explains), and extends the load it holds up to if
/// it is no slower than chance, has less than half an operation waiting, and measured as many
/// operations as its load (a round trip closed early measured only those that did not wait).
/// A round trip at the load it holds up to does not measure it again: that load may have been
/// taken in with a queue that chance hid, and a baseline measured again and again there climbs
/// with the queue (verifiers that share a CPU by turns, whose run time grows a little with each
/// one more). So a server that became slower is found out once the load falls below where the
/// baseline was measured, and a baseline is never an average that lags behind the load (which
/// is how a baseline taken at the bottom of the bounds from a moving average drifts up).
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Baseline {
    /// In seconds.
    run_time: Option<f64>,
    /// The most operations in flight at which it still holds.
    level: f64,
    /// The variance of one operation's run time in the round trips that set the baseline,
    /// pooled: the sum of `n × variance`, and of `n`, over the last
    /// [`POOLED`](Self::POOLED) operations or so.
    squares: f64,
    pooled: f64,
    /// About how many operations the baseline's value rests on: the error of the baseline
    /// itself is part of what chance explains.
    support: f64,
}

/// What a round trip of one series measured, against its baseline.
#[derive(Clone, Copy, Debug, Default)]
struct SeriesMeasured {
    /// Its mean run time, in seconds.
    run_time: f64,
    /// The baseline, in seconds.
    baseline: f64,
    /// The standard error of their difference, if the spread of the run times is known.
    error: Option<f64>,
}

/// What a round trip measured, against the baseline: of one series, or of a window's mix of
/// series (each against its own).
#[derive(Clone, Copy, Debug)]
pub(super) struct Measured {
    /// Its mean run time, in seconds.
    pub(super) run_time: f64,
    /// The baseline, in seconds.
    pub(super) baseline: f64,
    /// Whether its mean run time is above the baseline by more than chance: twice the
    /// standard error of their difference, and at least half a percent. So on a link without jitter any rise
    /// counts, as ARC's "no slower than the average" does, and on a jittery one the noise
    /// of a round trip's mean does not.
    pub(super) rose: bool,
}

impl Baseline {
    /// How far a measurement at the baseline's load moves it: half-way, so that one noisy
    /// round trip does not set it.
    const WEIGHT: f64 = 0.5;
    /// Operations the spread is pooled over; it is trusted alone from a quarter of them on.
    const POOLED: f64 = 64.0;

    /// Takes in a whole round trip's mean run time `run_time` (seconds), measured with `level`
    /// operations in flight (and as many ended); returns the baseline.
    #[cfg(test)]
    fn add(&mut self, run_time: f64, level: f64) -> f64 {
        self.add_round_trip(run_time, None, level, level.ceil() as u64, true)
            .baseline
    }

    /// [`add_round_trip`](Self::add_round_trip), with whether the rise is more than chance.
    #[cfg(test)]
    fn measured(&mut self, run_time: f64, deviation: Option<f64>, level: f64, n: u64) -> Measured {
        let whole = n as f64 + 0.5 >= level;
        let measured = self.add_round_trip(run_time, deviation, level, n, whole);
        Measured::of(&[(n as f64, measured)])
    }

    /// The standard deviation of one run time to judge a round trip of `deviation` by: the
    /// pooled one once it rests on enough operations, else the larger of it and the round
    /// trip's own; `None` if neither is known.
    fn spread(&self, deviation: Option<f64>) -> Option<f64> {
        let pooled = (self.pooled > 0.0).then(|| (self.squares / self.pooled).sqrt());
        if self.pooled >= Self::POOLED / 4.0 {
            return pooled;
        }
        match (pooled, deviation) {
            (Some(pooled), Some(own)) => Some(pooled.max(own)),
            (pooled, own) => pooled.or(own),
        }
    }

    /// Pools the round trip's `deviation` of `n` run times into the spread.
    fn pool(&mut self, deviation: Option<f64>, n: u64) {
        let Some(deviation) = deviation else {
            return;
        };
        let n = n as f64;
        self.squares += n * deviation * deviation;
        self.pooled += n;
        if self.pooled > Self::POOLED {
            let keep = Self::POOLED / self.pooled;
            self.squares *= keep;
            self.pooled *= keep;
        }
    }

    /// Takes in a round trip of `n` operations whose run times have a mean of `run_time` and a
    /// standard deviation of `deviation` (if known), with `level` operations in flight; `whole`
    /// if the round trip measured as many operations as its load (one closed on the first of
    /// them to come back measured those that did not wait).
    fn add_round_trip(
        &mut self,
        run_time: f64,
        deviation: Option<f64>,
        level: f64,
        n: u64,
        whole: bool,
    ) -> SeriesMeasured {
        let n_f = n.max(1) as f64;
        // The standard error of the difference between a mean of these `n` and the baseline
        // (`None` without a spread yet).
        let error = |support: f64| {
            self.spread(deviation)
                .map(|spread| spread * (1.0 / n_f + 1.0 / support.max(1.0)).sqrt())
        };
        // How far it may be from the baseline by chance: twice that, and at least half a
        // percent.
        let chance = |baseline: f64, support: f64| {
            error(support).map(|error| (2.0 * error).max(0.005 * baseline))
        };
        let rose = |baseline: f64, support: f64| {
            chance(baseline, support).is_some_and(|c| run_time - baseline > c)
        };
        let support = self.support;
        let (baseline, level, pool, support) = match self.run_time {
            None => (run_time, level, true, n_f),
            // At less load than it holds up to (or at one operation, the least there is):
            // measured again, up or down. Not at the load it holds up to: that load may have
            // been taken in with a queue within chance, and measured there again and again the
            // baseline would climb with the queue.
            Some(baseline) if level <= (self.level - 0.5).max(1.0) => (
                baseline + Self::WEIGHT * (run_time - baseline),
                level,
                true,
                (Self::WEIGHT * support + n_f).min(Self::POOLED),
            ),
            // Faster at more load, by more than chance: it was too high. (The load it holds up
            // to is not this one: a fast round trip at a load with a queue, by chance, says
            // nothing of the queue.)
            Some(baseline) if baseline - run_time > chance(baseline, support).unwrap_or(0.0) => {
                (run_time, self.level, true, n_f)
            }
            // No slower than chance, and less than half an operation waiting: it holds up to
            // here, if the round trip measured as many operations as its load; and the round
            // trip measured the run time at low load too, so it is taken in, by the operations
            // each rests on (a first round trip of one operation, on a jittery link, is no
            // baseline to hold to). Not with a queue, however slight: a baseline taken in with
            // a queue drifts up with the load.
            Some(baseline)
                if !rose(baseline, support) && level * (1.0 - baseline / run_time) < 0.5 =>
            {
                let merged = baseline + n_f / (support + n_f) * (run_time - baseline);
                (
                    merged,
                    if whole { level } else { self.level },
                    true,
                    (support + n_f).min(Self::POOLED),
                )
            }
            Some(baseline) => (baseline, self.level, false, support),
        };
        let error = error(support);
        self.support = support;
        if pool {
            self.pool(deviation, n);
        }
        self.run_time = Some(baseline);
        self.level = level;
        SeriesMeasured {
            run_time,
            baseline,
            error,
        }
    }
}

impl Measured {
    /// What a round trip of several series measured, each of `(n, measured)`: `n` operations
    /// measured so against its own baseline. Its run time is their mean, its baseline the
    /// mean of theirs (what the same operations would take at low load), and it rose if their
    /// difference is more than chance: twice its standard error, and at least half a percent.
    ///
    /// So the queue a window shows is each series' share of it (Little's law: the operations
    /// waiting are the sum of the time each spent above its own baseline, over the window),
    /// and a verify of 100 ms and a judge of 1 s are each compared with their own.
    fn of(series: &[(f64, SeriesMeasured)]) -> Self {
        let n: f64 = series.iter().map(|(n, _)| n).sum::<f64>().max(1.0);
        let mean = |value: fn(&SeriesMeasured) -> f64| {
            series.iter().map(|(n, m)| n * value(m)).sum::<f64>() / n
        };
        let (run_time, baseline) = (mean(|m| m.run_time), mean(|m| m.baseline));
        let variance = series
            .iter()
            .filter_map(|(n, m)| m.error.map(|error| (n * error).powi(2)))
            .reduce(|a, b| a + b);
        let chance = variance.map(|variance| (2.0 * variance.sqrt() / n).max(0.005 * baseline));
        Self {
            run_time,
            baseline,
            rose: chance.is_some_and(|chance| run_time - baseline > chance),
        }
    }
}

/// A [`Baseline`] per series: the run time at low load of each kind of work a limit admits,
/// and what a window measured against them all.
///
/// A series measured for the first time has no baseline to compare with: its first round trip
/// sets it, and counts as no queue. So does a series not measured for
/// [`STALE`](Self::STALE) windows (one seen rarely): its old baseline may be of a server that
/// has changed since, and its few operations say little. Neither reads as congestion.
#[derive(Clone, Debug)]
pub(super) struct Baselines {
    table: [Baseline; SeriesKey::COUNT],
    /// How long each series' callers wait before they give up on one of its operations, in
    /// seconds, as its operations given up on showed (see [`near_patience`](Self::near_patience)).
    patience: [Option<f64>; SeriesKey::COUNT],
    /// The window in which each last had an end, counted in `heard_windows`.
    heard: [u64; SeriesKey::COUNT],
    /// Windows heard, whatever they were.
    heard_windows: u64,
    /// The window in which each was last measured.
    measured: [u64; SeriesKey::COUNT],
    /// Windows taken in.
    windows: u64,
    /// The last round trip's baseline, in seconds.
    last: Option<f64>,
}

impl Default for Baselines {
    fn default() -> Self {
        Self {
            table: [Baseline::default(); SeriesKey::COUNT],
            patience: [None; SeriesKey::COUNT],
            heard: [0; SeriesKey::COUNT],
            heard_windows: 0,
            measured: [0; SeriesKey::COUNT],
            windows: 0,
            last: None,
        }
    }
}

impl Baselines {
    /// Windows after which a series' baseline is measured anew.
    const STALE: u64 = 64;

    /// Takes in a round trip, if `sample` is one with a run time: each series' run times
    /// against its own baseline. Its load is the most operations its ends saw in flight: an
    /// operation's run time reflects the load when it was admitted, which the load at its end
    /// may be below (the demand falling off).
    pub(super) fn measure(&mut self, sample: &Sample) -> Option<Measured> {
        if !sample.round_trip {
            return None;
        }
        self.windows += 1;
        let level = (sample.peak_in_flight as f64)
            .max(sample.in_flight)
            .max(1.0);
        let whole = sample.ended as f64 + 0.5 >= level;
        // A table of fixed size: a window's close allocates nothing.
        let mut measured = [(0.0, SeriesMeasured::default()); SeriesKey::COUNT];
        let mut len = 0;
        // A sample made by hand without series (a controller of its own) is one series.
        let alone = match sample.series.is_empty() {
            true => sample.mean_run_time.map(|mean| {
                let mut alone = SeriesSample::new(Operation::Other, Executor::Other);
                (alone.timed, alone.mean_run_time) = (sample.ended.max(1), Some(mean));
                alone.run_time_deviation = sample.run_time_deviation;
                alone
            }),
            false => None,
        };
        for series in sample.series.iter().chain(&alone) {
            let Some(run_time) = series.mean_run_time.filter(|_| series.timed > 0) else {
                continue;
            };
            let index = series.key().index();
            let baseline = &mut self.table[index];
            let stale = self.windows - self.measured[index] > Self::STALE;
            if stale {
                *baseline = Baseline::default();
                self.patience[index] = None;
            }
            let new = baseline.run_time.is_none();
            self.measured[index] = self.windows;
            let run_time = run_time.as_secs_f64().max(1e-9);
            let deviation = series.run_time_deviation.map(|d| d.as_secs_f64());
            let mut one = baseline.add_round_trip(run_time, deviation, level, series.timed, whole);
            if new {
                // No baseline to compare with yet: no queue, whatever the run time.
                one = SeriesMeasured {
                    baseline: run_time,
                    error: None,
                    ..one
                };
            }
            measured[len] = (series.timed as f64, one);
            len += 1;
        }
        if len == 0 {
            return None;
        }
        let mix = Measured::of(&measured[..len]);
        self.last = Some(mix.baseline);
        Some(mix)
    }

    /// Takes in which series `sample` heard from, and how long their callers waited before they
    /// gave up on some of their operations, if they did: half-way from what it knew.
    pub(super) fn hear(&mut self, sample: &Sample) {
        self.heard_windows += 1;
        for series in sample.series.iter() {
            self.heard[series.key().index()] = self.heard_windows;
            let Some(waited) = series.given_up_run_time() else {
                continue;
            };
            let patience = &mut self.patience[series.key().index()];
            let waited = waited.as_secs_f64();
            *patience = Some(patience.map_or(waited, |known| known + 0.5 * (waited - known)));
        }
    }

    /// Whether a series heard from lately (within [`STALE`](Self::STALE) windows) runs near its
    /// callers' patience: they give up on its operations after about its run time at low load
    /// (a tenth less, for its spread) and before twice that. One operation in flight above a
    /// knee can cost each operation admitted there a whole run time more (it waits for a place
    /// at the server, or runs at half its speed): for such a kind of work, that is its callers'
    /// patience gone. (Callers who leave sooner than the run time were not waiting on a slow
    /// answer: they left for reasons of their own.)
    pub(super) fn near_patience(&self) -> bool {
        (0..SeriesKey::COUNT).any(|index| {
            let lately = self.heard_windows - self.heard[index] <= Self::STALE;
            lately
                && match (self.patience[index], self.table[index].run_time) {
                    (Some(patience), Some(run_time)) => {
                        (0.9 * run_time..2.0 * run_time).contains(&patience)
                    }
                    _ => false,
                }
        })
    }

    /// The last round trip's baseline (what its operations would take at low load), in
    /// seconds.
    pub(super) fn get(&self) -> Option<f64> {
        self.last
    }

    /// Every series' baseline that is not stale: what a successor starts from.
    pub(super) fn handover(&self) -> Vec<SeriesBaseline> {
        (0..SeriesKey::COUNT)
            .filter(|&index| self.windows - self.measured[index] <= Self::STALE)
            .filter_map(|index| {
                let (key, baseline) = (SeriesKey::from_index(index)?, &self.table[index]);
                let run_time = Duration::try_from_secs_f64(baseline.run_time?).ok()?;
                let deviation = baseline.spread(None);
                Some(SeriesBaseline {
                    operation: key.operation(),
                    executor: key.executor(),
                    run_time,
                    level: baseline.level,
                    deviation: deviation.and_then(|d| Duration::try_from_secs_f64(d).ok()),
                    support: baseline.support,
                    patience: self.patience[index]
                        .and_then(|patience| Duration::try_from_secs_f64(patience).ok()),
                })
            })
            .collect()
    }

    /// Starts from a predecessor's baselines, as if it had measured them itself just now. A
    /// baseline of no run time, or of figures that are not numbers, is skipped; the others
    /// are held to what one measured here could be.
    pub(super) fn resume(&mut self, baselines: &[SeriesBaseline]) {
        let (mut sum, mut weight) = (0.0, 0.0);
        for handed in baselines {
            let run_time = handed.run_time.as_secs_f64();
            if run_time <= 0.0 {
                continue;
            }
            let finite_or = |value: f64, or: f64| if value.is_finite() { value } else { or };
            let support = finite_or(handed.support, 1.0).clamp(1.0, Baseline::POOLED);
            let (squares, pooled) = match handed.deviation {
                Some(deviation) => (support * deviation.as_secs_f64().powi(2), support),
                None => (0.0, 0.0),
            };
            let index = SeriesKey::new(handed.operation, handed.executor).index();
            self.table[index] = Baseline {
                run_time: Some(run_time),
                level: finite_or(handed.level, 1.0).max(1.0),
                squares,
                pooled,
                support,
            };
            self.measured[index] = self.windows;
            self.patience[index] = handed.patience.map(|patience| patience.as_secs_f64());
            self.heard[index] = self.heard_windows;
            (sum, weight) = (sum + support * run_time, weight + support);
        }
        if weight > 0.0 {
            self.last = Some(sum / weight);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn follows_the_run_time_when_the_load_falls_back() {
        let mut baseline = Baseline::default();
        assert_eq!(baseline.add(0.1, 1.0), 0.1);
        // At 8 in flight the run time doubled: a queue, not a new normal.
        assert_eq!(baseline.add(0.2, 8.0), 0.1);
        // Back at 1 in flight it is still 0.2: the server is slower now.
        assert!((baseline.add(0.2, 1.0) - 0.15).abs() < 1e-9);
        assert!((baseline.add(0.2, 1.0) - 0.175).abs() < 1e-9);
    }

    #[test]
    fn holds_up_to_the_load_at_which_the_run_time_does_not_climb() {
        let mut baseline = Baseline::default();
        baseline.add(0.1, 1.0);
        // The same at 16 in flight: the baseline holds up to 16, and is measured again below.
        baseline.add(0.1, 16.0);
        assert!((baseline.add(0.12, 12.0) - 0.11).abs() < 1e-9);
        // Not at 16 itself: a rise there is a queue, however slight.
        let mut held = Baseline::default();
        held.add(0.1, 1.0);
        held.add(0.1, 16.0);
        assert_eq!(held.add(0.12, 16.0), 0.1);
    }

    #[test]
    fn a_round_trip_closed_on_its_first_ends_does_not_extend_it() {
        let mut baseline = Baseline::default();
        baseline.add(0.04, 1.0);
        // 6 of 8 came back at 40 ms (6 servers; the other 2 waited): not a load of 8 without a
        // queue.
        baseline.add_round_trip(0.04, Some(0.0), 8.0, 6, false);
        // So a whole round trip at 8, with its queue, does not measure it again.
        assert_eq!(baseline.add(0.053, 8.0), 0.04);
    }

    #[test]
    fn a_faster_round_trip_at_more_load_lowers_it() {
        let mut baseline = Baseline::default();
        baseline.add(0.2, 1.0);
        assert_eq!(baseline.add(0.1, 4.0), 0.1);
    }

    #[test]
    fn a_rise_counts_once_it_is_more_than_the_spread_explains() {
        let mut still = Baseline::default();
        still.measured(0.1, Some(0.0), 1.0, 20);
        // No jitter: 1% slower is a rise.
        assert!(still.measured(0.101, Some(0.0), 8.0, 20).rose);
        let mut jittery = Baseline::default();
        jittery.measured(0.1, Some(0.01), 1.0, 20);
        // 10 ms of spread: two means of 20 may be 6.3 ms apart by chance, not 7.
        assert!(!jittery.clone().measured(0.106, Some(0.01), 8.0, 20).rose);
        assert!(jittery.measured(0.107, Some(0.01), 12.0, 20).rose);
    }

    #[test]
    fn a_round_trip_at_more_load_without_a_queue_refines_it() {
        // A first round trip of one operation that happened to be fast (a jitter of ±10%).
        let mut baseline = Baseline::default();
        baseline.measured(0.091, Some(0.0058), 1.0, 1);
        // The slow start's next round trips, at 100 ms on average: within what chance explains
        // of a baseline resting on one operation, and less than half an operation waiting.
        for level in [2.0, 3.0, 5.0, 8.0, 12.0] {
            baseline.measured(0.100, Some(0.0058), level, level as u64);
        }
        let value = baseline.run_time.unwrap();
        assert!((value - 0.1).abs() < 0.002, "{value}");
        // On a link without jitter, a rise of 1% is more than chance: not taken in.
        let mut still = Baseline::default();
        still.measured(0.05, Some(0.0), 1.0, 1);
        assert!(still.measured(0.0505, Some(0.0), 2.0, 2).rose);
        assert_eq!(still.run_time, Some(0.05));
    }

    /// A window of one judge series: `timed` of 1 s measured, `given_up` given up on after
    /// `after_ms`.
    fn judges(timed: u64, given_up: u64, after_ms: u64) -> Sample {
        let mut window = crate::adaptive::tests::sample(4);
        let second = Duration::from_secs(1);
        let mut judge = SeriesSample::new(Operation::Judge, Executor::Inline);
        (judge.ended, judge.ok, judge.timed) = (timed + given_up, timed, timed);
        judge.mean_run_time = (timed > 0).then_some(second);
        judge.run_time_deviation = Some(Duration::ZERO);
        judge.given_up = given_up;
        judge.given_up_after = Duration::from_millis(after_ms * given_up);
        window.series.insert(judge);
        window
    }

    #[test]
    fn a_kind_whose_callers_give_up_within_twice_its_run_time_is_near_their_patience() {
        for (after_ms, near) in [(1_000, true), (1_900, true), (2_100, false), (300, false)] {
            let mut baselines = Baselines::default();
            baselines.hear(&judges(4, 0, 0));
            baselines.measure(&judges(4, 0, 0));
            assert!(!baselines.near_patience(), "none given up yet");
            baselines.hear(&judges(0, 2, after_ms));
            assert_eq!(
                baselines.near_patience(),
                near,
                "given up after {after_ms} ms"
            );
        }
    }

    #[test]
    fn a_kind_not_heard_for_a_while_is_no_longer_near_its_callers_patience() {
        let mut baselines = Baselines::default();
        baselines.measure(&judges(4, 0, 0));
        baselines.hear(&judges(0, 2, 1_000));
        let others = crate::adaptive::tests::sample(4);
        for _ in 0..Baselines::STALE {
            baselines.hear(&others);
        }
        assert!(
            baselines.near_patience(),
            "heard within the last 64 windows"
        );
        baselines.hear(&others);
        assert!(!baselines.near_patience());
    }
}
