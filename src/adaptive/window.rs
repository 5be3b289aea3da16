//! [`Window`]: one adaptive window kept outside the process, as plain numbers.

use std::ops::AddAssign;

use super::config::Adaptive;
use super::news::{is_congestion, is_given_up};
use super::tally::{Counts, SeriesCounts};
use super::Sample;
use crate::attributes::{Executor, Operation, Outcome, SeriesKey};
use crate::limit::Ended;

/// What the ends of one window of an adaptive limit add up to, as plain numbers that add up
/// across processes: the seam for a limit whose windows are kept outside the process, as the
/// companion crate `tower-resources-operation-redis` keeps a fleet's in Redis.
///
/// A [`Limit`](crate::Limit)'s controller counts its window in the process and closes it there.
/// A limit shared by many processes counts each process's ends in a `Window` of its own
/// ([`record`](Self::record)), adds them up in its store every tick (`+=`, or field by field:
/// [`fields`](Self::fields)), and, in the one process that decides, turns the sum into the
/// [`Sample`] the algorithm reads ([`sample`](Self::sample)): the same decision from the same
/// [`Adaptive`], whoever keeps the window.
///
/// Two marks keep a fleet's windows exact although its processes hear late:
///
/// - an operation is *own* if it was admitted in the window it ends in: only then does its run
///   time measure the window's capacity ([`into_next`](Self::into_next) keeps only what any
///   window counts);
/// - its failure is *news* if it was admitted after the capacity was last lowered: an older
///   failure was answered by that decrease ([`into_stale`](Self::into_stale)).
///
/// ```
/// use std::time::Duration;
/// use tower_resources_operation::adaptive::{Adaptive, Algorithm, Vegas, Window};
/// use tower_resources_operation::limit::Ended;
/// use tower_resources_operation::{Executor, Operation, Outcome};
///
/// let adaptive = Adaptive::new(Vegas::default(), 1..=64);
/// let verify = |ms| {
///     Ended::new(Outcome::Ok, Duration::from_millis(ms), None)
///         .with_series(Operation::Verify, Executor::Subprocess)
/// };
/// // Two processes, each with its own window.
/// let (mut one, mut two) = (Window::new(), Window::new());
/// for ms in [100, 104] {
///     one.record(&verify(ms), true, true);
/// }
/// for ms in [98, 102] {
///     two.record(&verify(ms), true, true);
/// }
/// // Added up where the fleet keeps its window, as the store keeps it: named numbers.
/// let mut fleet = Window::from_fields(one.fields().iter().map(|(k, v)| (k.as_str(), *v)));
/// fleet += two;
/// let mut sample = fleet.sample(4, &adaptive);
/// (sample.in_flight, sample.peak_in_flight) = (4.0, 4);
/// sample.elapsed = Duration::from_millis(210);
/// assert_eq!(sample.mean_run_time, Some(Duration::from_millis(101)));
/// assert!(adaptive.new_algorithm().update(&sample) > 4, "no queue yet: a slow start");
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Window {
    counts: Counts,
}

impl Window {
    /// A window with nothing in it.
    pub fn new() -> Self {
        Self::default()
    }

    /// Counts the end of an operation: `own` if it was admitted in this window, `news` if it
    /// was admitted after the capacity was last lowered. Returns whether it was a sign of
    /// congestion (`timeout`, `error`, `crashed`) that is news: the first one makes a window
    /// due at once.
    pub fn record(&mut self, ended: &Ended, own: bool, news: bool) -> bool {
        let outcome = ended.outcome();
        let ok = outcome == Outcome::Ok;
        let us = u64::try_from(ended.run_time().as_micros()).unwrap_or(u64::MAX - 1);
        let series = &mut self.counts.series[ended.series().index()];
        series.ended += 1;
        if ok {
            series.ok += 1;
            series.served_us = series.served_us.saturating_add(us);
        }
        if is_given_up(outcome) {
            series.given_up += 1;
            series.given_up_us = series.given_up_us.saturating_add(us);
        }
        if own && ok {
            series.timed += 1;
            series.sum_us = series.sum_us.saturating_add(us);
            series.squares = series.squares.saturating_add(us.saturating_mul(us) >> 10);
            series.min_us = Some(series.min_us.map_or(us, |min| min.min(us)));
        }
        if own {
            self.counts.ended += 1;
        }
        let congestion = is_congestion(outcome);
        match (congestion, news) {
            (true, true) => self.counts.congested += 1,
            (true, false) => self.counts.stale += 1,
            (false, _) => {}
        }
        congestion && news
    }

    /// The limit turned an operation away by a rule of its own (a full queue).
    pub fn reject(&mut self) {
        self.counts.rejected += 1;
    }

    /// Its own operations that ended: what closes a window once it reaches the capacity.
    pub fn ended(&self) -> u64 {
        self.counts.ended
    }

    /// Every operation that ended in it, whenever admitted.
    pub fn ends(&self) -> u64 {
        self.counts
            .series()
            .map(|(_, _, series)| series.ended)
            .sum()
    }

    /// Its signs of congestion that are news: what closes a window at once past the
    /// tolerance.
    pub fn congested(&self) -> u64 {
        self.counts.congested
    }

    /// These counts, as a later window counts them: what any window counts of an end, whenever
    /// its operation was admitted (each series' ends, `ok` ends and what was served, the signs
    /// of congestion, the limit's rejections), without what only the window the operations were
    /// admitted in counts (its own ends, and their run times). For counts taken just as the
    /// window changed.
    pub fn into_next(self) -> Self {
        Self {
            counts: self.counts.into_next_window(),
        }
    }

    /// These counts, their signs of congestion all stale: judged news against a decrease
    /// before the last.
    pub fn into_stale(mut self) -> Self {
        self.counts.stale += std::mem::take(&mut self.counts.congested);
        self
    }

    /// The [`Sample`] of a window that added up to these counts, closed at `capacity`, under
    /// `adaptive`'s bounds and tolerance: its counts, its run times (each series' and all of
    /// them together), what the backend served, and whether it ran its course
    /// ([`Sample::round_trip`]). Left for the caller, who knows them:
    /// [`elapsed`](Sample::elapsed), [`in_flight`](Sample::in_flight) and
    /// [`peak_in_flight`](Sample::peak_in_flight), from the load it sampled.
    pub fn sample(&self, capacity: usize, adaptive: &Adaptive) -> Sample {
        self.counts.sample(capacity, adaptive)
    }

    /// Its numbers by name, as a store keeps them: `ended`, `congested`, `stale`, `rejected`,
    /// and for each series with an end, `<operation>/<executor>/<field>`, where the field is
    /// `e` (ends), `o` (`ok` ends), `v` (their run times summed, µs), `g` (ends given up on:
    /// `timeout`, `cancelled`), `p` (their run times summed, µs), and, of its own `ok` ends, `t`
    /// (how many), `s` (their run times summed, µs), `q` (their squares, µs² / 1024) and `m` (the
    /// shortest, µs). Every field adds up across processes but `m`, which keeps the least;
    /// `ended`, `t`, `s`, `q` and `m` are what [`into_next`](Self::into_next) drops. Fields at
    /// 0 are left out.
    pub fn fields(&self) -> Vec<(String, u64)> {
        let counts = &self.counts;
        let mut fields: Vec<(String, u64)> = [
            ("ended", counts.ended),
            ("congested", counts.congested),
            ("stale", counts.stale),
            ("rejected", counts.rejected),
        ]
        .into_iter()
        .filter(|&(_, value)| value > 0)
        .map(|(name, value)| (name.to_owned(), value))
        .collect();
        for (operation, executor, series) in counts.series() {
            let named = [
                ('e', Some(series.ended)),
                ('o', Some(series.ok)),
                ('v', Some(series.served_us)),
                ('g', Some(series.given_up)),
                ('p', Some(series.given_up_us)),
                ('t', Some(series.timed)),
                ('s', Some(series.sum_us)),
                ('q', Some(series.squares)),
                ('m', series.min_us),
            ];
            for (field, value) in named {
                if let Some(value) = value.filter(|&value| value > 0 || field == 'm') {
                    fields.push((format!("{operation}/{executor}/{field}"), value));
                }
            }
        }
        fields
    }

    /// A window from its numbers by name, as [`fields`](Self::fields) names them. A name it
    /// does not know is skipped.
    pub fn from_fields<'a>(fields: impl IntoIterator<Item = (&'a str, u64)>) -> Self {
        let mut counts = Counts::default();
        for (name, value) in fields {
            match name {
                "ended" => counts.ended = value,
                "congested" => counts.congested = value,
                "stale" => counts.stale = value,
                "rejected" => counts.rejected = value,
                name => {
                    let mut parts = name.splitn(3, '/');
                    let (Some(Ok(operation)), Some(Ok(executor)), Some(field)) = (
                        parts.next().map(str::parse::<Operation>),
                        parts.next().map(str::parse::<Executor>),
                        parts.next(),
                    ) else {
                        continue;
                    };
                    let series: &mut SeriesCounts =
                        &mut counts.series[SeriesKey::new(operation, executor).index()];
                    match field {
                        "e" => series.ended = value,
                        "o" => series.ok = value,
                        "v" => series.served_us = value,
                        "g" => series.given_up = value,
                        "p" => series.given_up_us = value,
                        "t" => series.timed = value,
                        "s" => series.sum_us = value,
                        "q" => series.squares = value,
                        "m" => series.min_us = Some(value),
                        _ => {}
                    }
                }
            }
        }
        Self { counts }
    }
}

impl AddAssign for Window {
    /// Another process's counts of the same window: counts and sums add, the shortest run
    /// times keep the least.
    fn add_assign(&mut self, other: Self) {
        self.counts += other.counts;
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn ended(outcome: Outcome, ms: u64) -> Ended {
        Ended::new(outcome, Duration::from_millis(ms), None)
            .with_series(Operation::Judge, Executor::Inline)
    }

    #[test]
    fn a_window_reads_back_from_its_fields() {
        let mut window = Window::new();
        assert!(!window.record(&ended(Outcome::Ok, 100), true, true));
        assert!(!window.record(&ended(Outcome::Ok, 300), false, true));
        assert!(window.record(&ended(Outcome::Timeout, 1000), true, true));
        assert!(!window.record(&ended(Outcome::Error, 5), true, false));
        window.record(&ended(Outcome::Cancelled, 3000), false, true);
        window.reject();
        let fields = window.fields();
        let field = |name: &str| fields.iter().find(|(n, _)| n == name).map(|(_, v)| *v);
        // Given up on: the timeout after 1 s and the cancellation after 3 s.
        assert_eq!(field("judge/inline/g"), Some(2));
        assert_eq!(field("judge/inline/p"), Some(4_000_000));
        let back = Window::from_fields(fields.iter().map(|(k, v)| (k.as_str(), *v)));
        assert_eq!(back, window);
        assert_eq!(
            (window.ended(), window.ends(), window.congested()),
            (3, 5, 1)
        );
        let noise = [("judge/inline/z", 7), ("bogus/inline/e", 7), ("x", 1)];
        let with_noise = fields.iter().map(|(k, v)| (k.as_str(), *v)).chain(noise);
        assert_eq!(Window::from_fields(with_noise), window);
    }

    #[test]
    fn a_later_window_keeps_only_what_any_window_counts_and_stale_ones_no_news() {
        let mut window = Window::new();
        window.record(&ended(Outcome::Ok, 100), true, true);
        window.record(&ended(Outcome::Error, 50), true, true);
        let next = window.into_next();
        assert_eq!((next.ended(), next.ends(), next.congested()), (0, 2, 1));
        let sample = next.sample(4, &Adaptive::new(super::super::Vegas::default(), 1..=8));
        assert_eq!(sample.mean_run_time, None, "no run time of its own");
        let stale = window.into_stale();
        assert_eq!((stale.congested(), stale.counts.stale), (0, 1));
    }
}
