//! [`Vegas`]: keeps a small queue at the server, estimated from the run time and the places that
//! deliver nothing, as TCP Vegas does.

use std::time::Duration;

use super::baseline::Baselines;
use super::served::{decrease, Occupancy, Served};
use super::{in_range, working, Algorithm, Average, Handover, Sample};

#[cfg(doc)]
use super::Adaptive;

/// A queue estimate, in the manner of TCP Vegas: the capacity follows how many operations wait
/// at the server rather than run, kept between `alpha` and `beta` (1 and 2). The crate's
/// algorithm: it finds a server that slows down above some load, one that fails or times out
/// above it, and one that never answers above it, without a threshold to set.
///
/// After each round trip (see [`Adaptive::window`]) in which the limit was used, with `L`
/// operations in flight, a mean run time `r` and a baseline `b` (the run time at low load):
///
/// - `L × (1 − b / r)` of them wait rather than run (Vegas's *diff*); with several kinds of work
///   on the limit, `r` and `b` are their means over the window's operations, each kind against
///   its own baseline, so the wait is each kind's share of it;
/// - the operations admitted before the round trip and still running after it
///   ([`Sample::overdue`]), beyond those a kind of work slower than a round trip explains, hold
///   a place without delivering: a server that drops requests never answers them;
/// - below `alpha` in all, the capacity grows; with more than `beta` waiting it shrinks to bring
///   them back between the two; otherwise it holds. A run time that rises with the load without
///   a queue (1% per operation in flight) is no reason to stop: the estimate decides.
///
/// **Slow start.** The capacity grows by half each round trip until the first sign of a queue
/// or of congestion, so a link that takes 200 at once gets there in a dozen round trips, and a
/// knee is overshot by half at most before it is seen. A slow start that ends on a queue steps
/// an eighth back, as TCP Vegas does. A run time risen by more than chance (on a link without
/// jitter, any rise) but no queue yet holds the capacity for a round trip, and that round trip
/// judges the slow start's last step as its end would (the round trip after a step still mixes
/// operations admitted at the capacity before): a queue then steps an eighth back too.
///
/// **Probing.** After that it grows by one place a round trip up to where it last had to shrink
/// (its *ceiling*), judges a probe up to the ceiling a round trip later (the round trip after a
/// step still mixes the operations admitted before it), and slow-starts again once past it,
/// from two places a round trip, doubling: a server whose capacity came back is found within
/// a few round trips, and one whose knee is just past the ceiling is not overshot by half. A
/// probe that fails costs one failure; when probes cost more (a server whose refusals hold a
/// place, so that the requests behind them are refused too), it waits up to 8 round trips
/// below the ceiling before the next one, as CUBIC plateaus.
///
/// **Callers' patience.** While a kind of work whose callers give up on it after about its run
/// time at low load is in the mix (see the [module docs](super#callers-patience)), it does not
/// probe up to its ceiling, let alone past it, and a queue that is more than chance sends it
/// one place or more back below it: each operation of that kind admitted above the knee would
/// be given up on.
///
/// **Congestion.** A window with congestion (`timeout`, `error`, `crashed`, news to the
/// controller) multiplies the capacity by `backoff` at once, at least one place less, and goes
/// on toward what the backend served over the last round trip (the operations that ended
/// `ok`), by half at most, as the operations admitted before the decrease fail. The controller
/// does not count as news the failures of operations admitted before the last decrease, so cuts
/// never compound. The places of overdue operations are not cut (that would take them from the
/// operations still delivering): they are taken out one by one as those operations fail.
///
/// **Baseline.** It follows what it measures: a round trip at less load than the one the
/// baseline was taken at measures it again, up or down; a faster one at more load, by more than
/// chance, lowers it. A server that became slower makes the queue look longer, so the capacity
/// falls below the load the baseline was taken at, where it is measured again: the probe of
/// the minimum that Envoy and BBR schedule happens when it is needed. It is reported as the
/// limit's baseline gauge; the estimate gauge is a moving average of the round trips' run
/// times.
///
/// ```
/// use tower_resources_operation::adaptive::{Adaptive, Vegas};
/// use tower_resources_operation::Limit;
///
/// let judges = Limit::builder(1)
///     .name("judges")
///     .adaptive(Adaptive::new(Vegas::default(), 1..=200))
///     .build();
/// # drop(judges);
/// ```
#[derive(Clone, Debug)]
pub struct Vegas {
    alpha: f64,
    beta: f64,
    backoff: f64,
    /// Still in the first slow start, or in one above the last decrease.
    slow_start: bool,
    /// The capacity at the last decrease: probed one place at a time.
    ceiling: Option<f64>,
    /// The last step probed up to the ceiling: the next round trip, which still mixes the
    /// operations admitted before it, holds.
    probed: bool,
    /// The slow start's last round trip rose without a queue: the next one judges its step.
    judging: bool,
    /// A slow start past the ceiling: its next step, which doubles each round trip.
    restarted: Option<f64>,
    /// Round trips to wait below the ceiling before probing it again (a plateau, as CUBIC's):
    /// one more after each failed probe that cost more than its own failure (a server whose
    /// refusals hold a place, so that others queued behind them are refused too), one less
    /// after one that cost only its own, none once one passes. And how many it has waited.
    plateau: u32,
    waited: u32,
    /// Failures since the last failed probe, beyond its own; `None` when none failed since the
    /// last probe was judged.
    echo: Option<u64>,
    /// The last window was congested: a decrease that follows it belongs to the same episode,
    /// whose ceiling is where it began.
    cutting: bool,
    /// Places held by operations that did not answer within a round trip (a server that drops
    /// them): taken out one by one as those fail, rather than at once (which would take them
    /// from the operations that still deliver).
    retiring: f64,
    baseline: Baselines,
    served: Served,
    occupancy: Occupancy,
    estimate: Average,
    /// The capacity, kept between windows.
    limit: Option<f64>,
}

impl Default for Vegas {
    /// A queue of 1 to 2 operations, 0.9 times the capacity on congestion (ARC's decrease
    /// ratio).
    fn default() -> Self {
        Self {
            alpha: 1.0,
            beta: 2.0,
            backoff: 0.9,
            slow_start: true,
            ceiling: None,
            probed: false,
            judging: false,
            restarted: None,
            plateau: 0,
            waited: 0,
            echo: None,
            cutting: false,
            retiring: 0.0,
            baseline: Baselines::default(),
            served: Served::default(),
            occupancy: Occupancy::default(),
            estimate: Average::default(),
            limit: None,
        }
    }
}

impl Vegas {
    /// The most round trips it waits below a ceiling before probing it again.
    const PLATEAU: u32 = 8;

    /// How many operations may wait at the server: the capacity grows while fewer than `alpha`
    /// do, and shrinks once more than `beta` do. Defaults to 1 and 2.
    ///
    /// More rides out more jitter and keeps a server with a queue of its own busier, at the
    /// cost of run time.
    ///
    /// # Panics
    ///
    /// If `alpha` is negative or not a number, or `beta` is below `alpha`.
    #[track_caller]
    pub fn queue(mut self, alpha: f64, beta: f64) -> Self {
        self.alpha = in_range("Vegas::queue alpha", alpha, 0.0..=f64::MAX);
        self.beta = in_range("Vegas::queue beta", beta, alpha..=f64::MAX);
        self
    }

    /// What the capacity is multiplied by after a window with congestion, in `(0, 1)`; it
    /// drops by at least one place. Defaults to 0.9.
    ///
    /// # Panics
    ///
    /// If `backoff` is outside `(0, 1)` or not a number, with a message that names it.
    #[track_caller]
    pub fn backoff(mut self, backoff: f64) -> Self {
        let below_one = 1.0 - f64::EPSILON;
        self.backoff = in_range("Vegas::backoff", backoff, f64::MIN_POSITIVE..=below_one);
        self
    }

    /// The capacity after a round trip at `limit` that measured `waiting` operations waiting
    /// at the server rather than running and `overdue` holding a place without answering,
    /// whether the run time `rose` above the baseline by more than chance, and whether a kind of
    /// work `near` its callers' patience is in the mix.
    fn step(&mut self, limit: f64, waiting: f64, overdue: f64, rose: bool, near: bool) -> f64 {
        let room = waiting + overdue < self.alpha;
        let probed = std::mem::take(&mut self.probed);
        if self.slow_start {
            if room && !rose {
                let half = (limit / 2.0).round().max(1.0);
                return match &mut self.restarted {
                    Some(step) => limit + std::mem::replace(step, *step * 2.0).min(half),
                    None => limit + half,
                };
            }
            if room && !std::mem::replace(&mut self.judging, true) {
                // The run time rose by more than chance, but no queue shows yet: the round
                // trip after a step still mixes operations admitted at the lower capacity, so
                // the slow start's last step is judged at this capacity, on the next round trip.
                self.ceiling = Some(limit);
                return limit;
            }
            (self.slow_start, self.judging, self.restarted) = (false, false, None);
            if waiting >= self.alpha && waiting <= self.beta {
                // The run time says the last step went past the knee: an eighth back, as
                // TCP Vegas leaves its slow start.
                self.ceiling = Some(limit);
                return (limit * 7.0 / 8.0).round().min(limit - 1.0).max(1.0);
            }
        }
        // With a kind of work near its callers' patience in the mix, a queue that is more than
        // chance is no band to hold in: the operations of that kind admitted into it are given
        // up on. Back to `alpha` waiting, at least one place.
        let (queued, middle) = match near && rose {
            true => (waiting >= self.alpha, self.alpha),
            false => (waiting > self.beta, (self.alpha + self.beta) / 2.0),
        };
        if queued {
            self.ceiling = Some(limit);
            (limit - (waiting - middle))
                .round()
                .min(limit - 1.0)
                .max((limit / 2.0).ceil())
        } else if room && !probed {
            if let Some(echo) = self.echo.take() {
                self.plateau = match echo {
                    0 => self.plateau / 2,
                    _ => (self.plateau * 2 + 1).min(Self::PLATEAU),
                };
            }
            match self.ceiling {
                // Near a ceiling, a kind of work near its callers' patience is in the mix: a
                // probe would cost the operations of that kind admitted into it. It holds
                // while that kind flows.
                Some(ceiling) if limit + 1.0 >= ceiling && (near || self.waited < self.plateau) => {
                    self.waited += 1;
                    limit
                }
                Some(ceiling) if limit < ceiling => {
                    self.probed = limit + 1.0 >= ceiling;
                    self.waited = 0;
                    limit + 1.0
                }
                // At or past where it last had to shrink, and still no queue: the server has
                // room again; look for it fast.
                _ => {
                    // From two places, doubling each round trip: the knee it passed may be just
                    // above, and a step of half the capacity would go that far past it.
                    self.slow_start = true;
                    self.ceiling = None;
                    self.plateau = 0;
                    self.restarted = Some(4.0);
                    limit + 2.0
                }
            }
        } else {
            limit
        }
    }
}

impl Algorithm for Vegas {
    fn update(&mut self, sample: &Sample) -> usize {
        let mut limit = working(&mut self.limit, sample.capacity);
        self.served.add(sample);
        self.baseline.hear(sample);
        let unanswered = self.occupancy.unanswered(sample);
        let (min, max) = (sample.min_capacity as f64, sample.max_capacity as f64);
        // Operations it knew would fail did: their places go.
        let retired = self.retiring.min(sample.stale_congested as f64);
        self.retiring -= retired;
        limit -= retired;
        if let Some(echo) = &mut self.echo {
            *echo += sample.stale_congested;
        }
        let next = if sample.is_congested() {
            (self.slow_start, self.judging, self.restarted) = (false, false, None);
            if self.ceiling.is_some_and(|ceiling| limit >= ceiling) {
                // A probe up to where it failed before failed again: what did it cost?
                self.echo = Some(sample.congested.saturating_sub(1));
            }
            self.probed = false;
            self.ceiling = match (self.cutting, self.ceiling) {
                (true, Some(ceiling)) => Some(ceiling.max(limit)),
                _ => Some(limit),
            };
            self.cutting = true;
            let failed = sample.congested as f64;
            if self.retiring >= failed {
                // The operations it knew would fail: their places go, no more.
                self.retiring -= failed;
                limit - failed
            } else {
                // Toward what the backend served: the rest as the operations admitted before
                // the decrease fail.
                let (now, rest) = decrease(limit, self.backoff, self.served.in_flight());
                self.retiring = rest;
                now
            }
        } else if let Some(measured) = self.baseline.measure(sample) {
            self.cutting = false;
            let (run_time, baseline) = (measured.run_time, measured.baseline);
            self.estimate.add(run_time, 0.5);
            let level = sample.in_flight.max(1.0);
            let waiting = level * (1.0 - baseline / run_time).max(0.0);
            // Places held by operations from before the window that do not answer.
            let overdue = unanswered;
            self.retiring = match sample.stale_congested {
                // No operation from before the last decrease fails any more: what is left of
                // it is not owed.
                0 => overdue,
                _ => self.retiring.max(overdue),
            };
            if !sample.is_used() {
                // The load stayed below the limit: nothing to learn about what it can take.
                limit
            } else if sample.stale_congested > 0 && waiting + overdue < self.alpha {
                // Operations admitted before the last decrease still failed: no news, but no
                // room either.
                limit
            } else {
                let near = self.baseline.near_patience();
                self.step(limit, waiting, overdue, measured.rose, near)
            }
        } else {
            // Cut short, or nothing ended `ok`.
            limit
        };
        let next = next.clamp(min, max);
        self.limit = Some(next);
        next as usize
    }

    /// The run time at low load.
    fn baseline(&self) -> Option<Duration> {
        self.baseline.get().map(Duration::from_secs_f64)
    }

    /// A moving average of the round trips' mean run times.
    fn estimate(&self) -> Option<Duration> {
        self.estimate.duration()
    }

    fn handover(&self) -> String {
        Handover {
            capacity: 0,
            baselines: self.baseline.handover(),
            estimate: self.estimate(),
        }
        .encode()
    }

    /// Past the slow start, below a ceiling one place above the capacity, on its longest
    /// plateau: as a limit that settled there, it holds, probes one place up, and holds again
    /// before it looks for more room. Its first window is read against the handed baselines
    /// (and what its predecessor knew of each kind's callers' patience).
    fn resume(&mut self, capacity: usize, handover: &str) {
        let handover = &Handover::parse(capacity, handover);
        let capacity = handover.capacity as f64;
        self.limit = Some(capacity);
        self.slow_start = false;
        self.ceiling = Some(capacity + 1.0);
        (self.plateau, self.waited) = (Self::PLATEAU, 0);
        self.baseline.resume(&handover.baselines);
        self.estimate = Average {
            value: handover.estimate.map(|estimate| estimate.as_secs_f64()),
        };
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::sample;
    use super::*;

    fn ms(ms: u64) -> Option<Duration> {
        Some(Duration::from_millis(ms))
    }

    #[test]
    fn slow_starts_by_half_until_a_queue_shows() {
        let mut vegas = Vegas::default();
        let mut capacities = Vec::new();
        let mut capacity = 1;
        for _ in 0..6 {
            capacity = vegas.update(&sample(capacity));
            capacities.push(capacity);
        }
        assert_eq!(capacities, [2, 3, 5, 8, 12, 18]);
        // At 18 the run time is 10% up: 1.6 of 18 wait. Slow start ends, an eighth back.
        let mut slow = sample(18);
        slow.mean_run_time = ms(110);
        slow.in_flight = 18.0;
        assert_eq!(vegas.update(&slow), 16);
        // Then one place at a time, while the run time holds.
        assert_eq!(vegas.update(&sample(16)), 17);
    }

    #[test]
    fn a_rise_more_than_chance_ends_the_slow_start_and_a_queue_stops_growth() {
        let mut vegas = Vegas::default();
        assert_eq!(vegas.update(&sample(1)), 2);
        // 2% slower with 8 in flight: a link without jitter does not slow down by chance, but
        // 8 × (1 − 100/102) = 0.16 wait, no queue of 1: the slow start holds where it is, and
        // 8 is judged on its next round trip (which no longer mixes operations admitted at 5).
        let mut slower = sample(8);
        slower.mean_run_time = ms(102);
        assert_eq!(vegas.update(&slower), 8);
        // Still no queue: the server has room (a backend whose run time rises 1% for each
        // operation is not queueing): a slow start again, from two places, doubling.
        assert_eq!(vegas.update(&slower), 10);
        assert_eq!(vegas.update(&sample(10)), 14);
        // 14 × (1 − 100/112) = 1.5 wait: a queue between alpha and beta.
        let mut queue = sample(14);
        queue.mean_run_time = ms(112);
        assert_eq!(
            vegas.update(&queue),
            12,
            "the slow start ends an eighth back"
        );
        // 12 × (1 − 100/112) = 1.3 wait: held.
        queue.capacity = 12;
        assert_eq!(vegas.update(&queue), 12);
        // With a spread of 10 ms per operation, 20 operations' mean may be 4 ms off by chance:
        // 2% is not a rise.
        let mut vegas = Vegas::default();
        let mut jittery = sample(1);
        jittery.run_time_deviation = ms(10);
        assert_eq!(vegas.update(&jittery), 2);
        assert_eq!(vegas.update(&slower), 12);
    }

    #[test]
    fn shrinks_a_queue_past_beta_back_to_the_middle() {
        let mut vegas = Vegas::default();
        vegas.update(&sample(1));
        let mut slow = sample(20);
        slow.in_flight = 20.0;
        slow.mean_run_time = ms(125);
        // 20 × (1 − 100/125) = 4 wait: 2 more than the middle of 1..=3.
        assert_eq!(vegas.update(&slow), 18);
    }

    #[test]
    fn places_that_deliver_nothing_stop_growth_and_go_as_their_operations_fail() {
        let mut vegas = Vegas::default();
        vegas.update(&sample(1));
        // 8 in flight at 100 ms, but 3 of them have run for a round trip and more: 3 places
        // deliver nothing (a server that drops what is above 5).
        let mut dropping = sample(8);
        dropping.overdue = 3;
        assert_eq!(
            vegas.update(&dropping),
            8,
            "the slow start ends; nothing is cut yet"
        );
        assert_eq!(vegas.update(&dropping), 8);
        // Two of them fail, admitted before the last decrease (stale, not news): a window cut
        // short by them takes their places out.
        let mut failed = sample(8);
        (failed.stale_congested, failed.round_trip) = (2, false);
        assert_eq!(vegas.update(&failed), 6);
        // The last one: news (the congestion of this round trip), a decrease; nothing more
        // to take out after it.
        let mut last = sample(6);
        last.congested = 1;
        assert_eq!(vegas.update(&last), 5);
        failed.capacity = 5;
        assert_eq!(vegas.update(&failed), 5);
    }

    #[test]
    fn congestion_cuts_by_its_backoff_and_then_probes_one_place_at_a_time() {
        let mut vegas = Vegas::default();
        let mut failed = sample(20);
        failed.congested = 1;
        assert_eq!(vegas.update(&failed), 18);
        assert_eq!(vegas.update(&sample(18)), 19);
        assert_eq!(vegas.update(&sample(19)), 20);
        // The probe up to where it had to shrink is judged a round trip later.
        assert_eq!(vegas.update(&sample(20)), 20);
        // Without a queue there: slow start again, from two places, doubling.
        assert_eq!(vegas.update(&sample(20)), 22);
        assert_eq!(vegas.update(&sample(22)), 26);
        assert_eq!(vegas.update(&sample(26)), 34);
    }

    #[test]
    fn a_window_cut_short_or_unused_leaves_the_capacity() {
        let mut vegas = Vegas::default();
        let mut short = sample(10);
        short.round_trip = false;
        assert_eq!(vegas.update(&short), 10);
        let mut idle = sample(10);
        idle.peak_in_flight = 3;
        assert_eq!(vegas.update(&idle), 10);
    }

    #[test]
    fn a_run_of_decreases_keeps_the_ceiling_where_it_began() {
        let mut vegas = Vegas::default();
        // A server that goes on refusing for a while after an overshoot: three decreases in a
        // row, 20, 18, 16.
        for capacity in [20, 18, 16] {
            let mut failed = sample(capacity);
            failed.congested = 1;
            vegas.update(&failed);
        }
        assert_eq!(vegas.ceiling, Some(20.0));
        // Then one place at a time toward 20, not a slow start from 16.
        assert_eq!(vegas.update(&sample(14)), 15);
    }

    #[test]
    fn a_probe_that_costs_more_than_its_own_failure_waits_longer_next_time() {
        let mut vegas = Vegas::default();
        let mut failed = sample(10);
        failed.congested = 1;
        assert_eq!(vegas.update(&failed), 9);
        // Probe up to 10, judged a round trip later.
        assert_eq!(vegas.update(&sample(9)), 10);
        assert_eq!(vegas.update(&sample(10)), 10);
        // It fails, and three more fail behind it.
        assert_eq!(vegas.update(&failed), 9);
        let mut echo = sample(9);
        (echo.stale_congested, echo.round_trip) = (3, false);
        assert_eq!(vegas.update(&echo), 9);
        // So it waits a round trip below the ceiling before the next probe.
        assert_eq!(vegas.update(&sample(9)), 9);
        assert_eq!(vegas.update(&sample(9)), 10);
    }

    /// A window of judges of 1 s at `capacity`, none queued; `given_up` of them given up on by
    /// their callers after 1 s.
    fn judges(capacity: usize, given_up: u64) -> Sample {
        use crate::adaptive::SeriesSample;
        use crate::attributes::{Executor, Operation};
        let second = Duration::from_secs(1);
        let mut window = sample(capacity);
        (window.mean_run_time, window.min_run_time) = (Some(second), Some(second));
        let mut judge = SeriesSample::new(Operation::Judge, Executor::Inline);
        let n = capacity as u64;
        (judge.ended, judge.ok, judge.timed) = (n + given_up, n, n);
        (judge.mean_run_time, judge.min_run_time) = (Some(second), Some(second));
        judge.run_time_deviation = Some(Duration::ZERO);
        judge.served = second * capacity as u32;
        (judge.given_up, judge.given_up_after) = (given_up, second * given_up as u32);
        window.series.insert(judge);
        window
    }

    #[test]
    fn with_a_kind_near_its_callers_patience_it_does_not_probe_its_ceiling() {
        for (given_up, probes) in [(0, true), (2, false)] {
            let mut vegas = Vegas::default();
            assert_eq!(vegas.update(&judges(8, 0)), 12, "a slow start");
            // A failure at 13: the ceiling; and the callers of `given_up` judges gave up after
            // their run time.
            let mut failed = judges(13, given_up);
            failed.congested = 1;
            assert_eq!(vegas.update(&failed), 11);
            assert_eq!(vegas.update(&judges(11, 0)), 12);
            let next = vegas.update(&judges(12, 0));
            assert_eq!(next == 13, probes, "given up {given_up}: 12 -> {next}");
            if !probes {
                for _ in 0..20 {
                    assert_eq!(vegas.update(&judges(12, 0)), 12, "holds under the ceiling");
                }
            }
        }
    }

    #[test]
    fn with_a_kind_near_its_callers_patience_a_queue_is_the_knee() {
        let mut vegas = Vegas::default();
        assert_eq!(vegas.update(&judges(8, 0)), 12);
        let mut failed = judges(13, 1);
        failed.congested = 1;
        assert_eq!(vegas.update(&failed), 11);
        // At 12, 1.2 s on average: 12 × (1 − 1 / 1.2) = 2 wait, within 1 to 2 and held
        // without such a kind; with it, one place back.
        let mut queued = judges(12, 0);
        queued.mean_run_time = Some(Duration::from_millis(1_200));
        queued.series = {
            let mut series = queued.series.clone();
            let mut judge = *queued.series.iter().next().unwrap();
            judge.mean_run_time = queued.mean_run_time;
            series.insert(judge);
            series
        };
        assert_eq!(vegas.update(&queued), 11);
    }
}
