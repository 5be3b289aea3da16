//! [`Window`]: what the operations of an adaptive limit's current window add up to, lock-free.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::time::Duration;

/// Operations a window counts at most, so that its three counts fit one word.
pub(super) const WINDOW_CAP: u64 = 1 << 20;
const COUNT_BITS: u32 = 21;
const COUNT_MASK: u64 = (1 << COUNT_BITS) - 1;
/// One more ended operation of the window, in its tally.
const ENDED: u64 = 1;
/// One more sign of congestion.
const CONGESTED: u64 = 1 << COUNT_BITS;
/// One more `ok` operation of the window, whose run time is summed.
const TIMED: u64 = 1 << (2 * COUNT_BITS);
// A window's three counts fit one word, with as much again for the ends that race its close.
const _: () = assert!(3 * COUNT_BITS <= 64 && WINDOW_CAP < COUNT_MASK);
/// An atomic duration's "none".
pub(super) const NONE: u64 = u64::MAX;

/// The running sums of the current window: what every operation's end writes (a handful of
/// relaxed atomics), on cache lines of their own.
#[derive(Debug)]
#[repr(align(64))]
pub(super) struct Window {
    /// Ended, congested and timed counts, `COUNT_BITS` each.
    tally: AtomicU64,
    /// Sum of the run times of the timed (`ok`) operations, in microseconds.
    sum_us: AtomicU64,
    /// Sum of their squares, in µs² / 1024.
    squares: AtomicU64,
    /// Shortest of them (`NONE` for none yet).
    min_us: AtomicU64,
    /// Sum of the operations in flight that the window's own ends saw.
    in_flight: AtomicU64,
    /// Ends since the window opened, of its own operations or of earlier ones.
    after: AtomicU64,
    /// Signs of congestion from operations admitted before the last decrease.
    stale: AtomicU64,
    peak: AtomicUsize,
    rejected: AtomicU64,
}

/// How the controller counts one end.
#[derive(Clone, Copy, Debug)]
pub(super) struct Counted {
    /// It ended after the window opened.
    pub(super) after: bool,
    /// Its operation was admitted after the window opened: it ran at the window's capacity.
    pub(super) own: bool,
    /// It ended `ok`.
    pub(super) ok: bool,
    /// A sign of congestion that is news (admitted since the last decrease).
    pub(super) news: bool,
    /// A sign of congestion that is not (admitted before it).
    pub(super) stale: bool,
}

/// What the window adds up to after an end: what says whether it is due to close.
#[derive(Clone, Copy, Debug)]
pub(super) struct Running {
    /// Its own operations that ended.
    pub(super) ended: u64,
    /// Its signs of congestion that are news.
    pub(super) congested: u64,
    /// Its signs of congestion that are not.
    pub(super) stale: u64,
}

/// What a window added up to, taken when it closes.
#[derive(Clone, Copy, Debug)]
pub(super) struct Totals {
    pub(super) ended: u64,
    pub(super) congested: u64,
    pub(super) stale: u64,
    pub(super) timed: u64,
    pub(super) after: u64,
    pub(super) peak: usize,
    pub(super) rejected: u64,
    sum_us: u64,
    squares: u64,
    min_us: u64,
    in_flight: u64,
}

impl Window {
    pub(super) fn new() -> Self {
        Self {
            tally: AtomicU64::new(0),
            sum_us: AtomicU64::new(0),
            squares: AtomicU64::new(0),
            min_us: AtomicU64::new(NONE),
            in_flight: AtomicU64::new(0),
            after: AtomicU64::new(0),
            stale: AtomicU64::new(0),
            peak: AtomicUsize::new(0),
            rejected: AtomicU64::new(0),
        }
    }

    /// Adds an end, `counted` so, of an operation that ran for `ran`, with `in_flight`
    /// operations of the limit holding a place as it ended (itself included).
    #[inline]
    pub(super) fn add(&self, counted: Counted, ran: Duration, in_flight: usize) -> Running {
        if in_flight > self.peak.load(Relaxed) {
            self.peak.fetch_max(in_flight, Relaxed);
        }
        if counted.after {
            self.after.fetch_add(1, Relaxed);
        }
        let stale = match counted.stale {
            true => self.stale.fetch_add(1, Relaxed) + 1,
            false => self.stale.load(Relaxed),
        };
        let mut add = if counted.news { CONGESTED } else { 0 };
        if counted.own {
            add += ENDED;
            if counted.ok {
                add += TIMED;
                let us = u64::try_from(ran.as_micros()).unwrap_or(NONE - 1);
                self.sum_us.fetch_add(us, Relaxed);
                self.squares.fetch_add(us.saturating_mul(us) >> 10, Relaxed);
                if us < self.min_us.load(Relaxed) {
                    self.min_us.fetch_min(us, Relaxed);
                }
            }
            let in_flight = u64::try_from(in_flight).unwrap_or(u64::MAX);
            self.in_flight.fetch_add(in_flight, Relaxed);
        }
        let tally = match add {
            0 => self.tally.load(Relaxed),
            add => self.tally.fetch_add(add, Relaxed) + add,
        };
        Running {
            ended: tally & COUNT_MASK,
            congested: (tally >> COUNT_BITS) & COUNT_MASK,
            stale,
        }
    }

    /// The limit turned an operation away by a rule of its own.
    pub(super) fn rejected(&self) {
        self.rejected.fetch_add(1, Relaxed);
    }

    /// What it adds up to now.
    pub(super) fn running(&self) -> Running {
        let tally = self.tally.load(Relaxed);
        Running {
            ended: tally & COUNT_MASK,
            congested: (tally >> COUNT_BITS) & COUNT_MASK,
            stale: self.stale.load(Relaxed),
        }
    }

    /// Takes what it added up to, and starts again from nothing. An end racing this may land
    /// its count in one window and its run time in the next: a small error, once in a while,
    /// for no lock on the operations' path.
    pub(super) fn take(&self) -> Totals {
        let sum_us = self.sum_us.swap(0, Relaxed);
        let squares = self.squares.swap(0, Relaxed);
        let min_us = self.min_us.swap(NONE, Relaxed);
        let in_flight = self.in_flight.swap(0, Relaxed);
        let after = self.after.swap(0, Relaxed);
        let tally = self.tally.swap(0, Relaxed);
        Totals {
            ended: tally & COUNT_MASK,
            congested: (tally >> COUNT_BITS) & COUNT_MASK,
            timed: (tally >> (2 * COUNT_BITS)) & COUNT_MASK,
            stale: self.stale.swap(0, Relaxed),
            after,
            peak: self.peak.swap(0, Relaxed),
            rejected: self.rejected.swap(0, Relaxed),
            sum_us,
            squares,
            min_us,
            in_flight,
        }
    }
}

impl Totals {
    /// The mean run time of the window's `ok` operations.
    pub(super) fn mean_run_time(&self) -> Option<Duration> {
        (self.timed > 0).then(|| Duration::from_micros(self.sum_us / self.timed))
    }

    /// The shortest of them.
    pub(super) fn min_run_time(&self) -> Option<Duration> {
        (self.min_us != NONE).then(|| Duration::from_micros(self.min_us))
    }

    /// The standard deviation of their run times, with two of them or more.
    pub(super) fn run_time_deviation(&self) -> Option<Duration> {
        (self.timed > 1).then(|| {
            let mean = self.sum_us as f64 / self.timed as f64;
            let squares = self.squares as f64 * 1024.0 / self.timed as f64;
            Duration::from_micros((squares - mean * mean).max(0.0).sqrt() as u64)
        })
    }

    /// The mean of the operations in flight that its own ends saw (the peak, without any).
    pub(super) fn mean_in_flight(&self) -> f64 {
        match self.ended {
            0 => self.peak as f64,
            ended => self.in_flight as f64 / ended as f64,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counted(own: bool, ok: bool) -> Counted {
        Counted {
            after: true,
            own,
            ok,
            news: false,
            stale: false,
        }
    }

    #[test]
    fn sums_its_own_operations_and_counts_the_others() {
        let window = Window::new();
        let ms = Duration::from_millis;
        window.add(counted(true, true), ms(100), 4);
        window.add(counted(true, true), ms(120), 3);
        window.add(counted(false, true), ms(900), 2);
        let running = window.add(
            Counted {
                stale: true,
                ..counted(false, false)
            },
            ms(5),
            2,
        );
        assert_eq!((running.ended, running.stale), (2, 1));
        let totals = window.take();
        assert_eq!((totals.ended, totals.timed, totals.after), (2, 2, 4));
        assert_eq!(totals.mean_run_time(), Some(ms(110)));
        assert_eq!(totals.min_run_time(), Some(ms(100)));
        let deviation = totals.run_time_deviation().unwrap().as_secs_f64();
        assert!((deviation - 0.010).abs() < 1e-3, "{deviation}");
        assert_eq!((totals.mean_in_flight(), totals.peak), (3.5, 4));
        assert_eq!(window.take().after, 0, "taken");
    }
}
