//! How long an operation may take before a drop is past its caller's deadline ([`Budget`]).
//!
//! A caller that gives up at its deadline drops the operation: the drop is then `timeout`, not
//! `cancelled`. The deadline counts from when the operation asked for its permit, so the time
//! it waited is spent from it before it runs.

use std::time::Duration;

/// A drop of an operation that had a deadline counts as `timeout` when it comes this close to
/// the deadline (or a tenth of it, for short ones): the operation started to wait a little after
/// its caller started the clock.
const SLACK: Duration = Duration::from_millis(10);

/// `duration` in whole milliseconds, rounded up; in 64 bits (`as_nanos` is a 128-bit division).
pub(super) fn ceil_ms(duration: Duration) -> u64 {
    let part = duration.subsec_nanos().div_ceil(1_000_000);
    duration
        .as_secs()
        .saturating_mul(1_000)
        .saturating_add(u64::from(part))
}

/// How long an operation may take before a drop is past a deadline, in whole milliseconds; or
/// no deadline. In 32 bits, so that it fits in the spare bytes of a record's stage beside the
/// stage's clock.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Budget(u32);

impl Budget {
    pub(super) const NONE: Self = Self(u32::MAX);

    /// `deadline` less a slack (the caller started its clock a little before the operation
    /// asked), rounded up to a millisecond: at most the longest a budget holds.
    pub(super) fn new(deadline: Option<Duration>) -> Self {
        let Some(deadline) = deadline else {
            return Self::NONE;
        };
        let slack = SLACK.min(deadline / 10);
        let ms = ceil_ms(deadline.saturating_sub(slack));
        Self(u32::try_from(ms).unwrap_or(u32::MAX - 1).min(u32::MAX - 1))
    }

    /// The budget left after `spent`.
    pub(super) fn less(self, spent: Duration) -> Self {
        match self {
            Self::NONE => Self::NONE,
            Self(ms) => {
                let spent = u32::try_from(ceil_ms(spent)).unwrap_or(u32::MAX);
                Self(ms.saturating_sub(spent))
            }
        }
    }

    /// Whether `elapsed` is past it.
    pub(super) fn is_past(self, elapsed: Duration) -> bool {
        self != Self::NONE && elapsed >= Duration::from_millis(u64::from(self.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(ms: u64) -> Duration {
        Duration::from_millis(ms)
    }

    #[test]
    fn milliseconds_round_up_as_the_nanoseconds_do() {
        for duration in [
            Duration::ZERO,
            Duration::from_nanos(1),
            Duration::from_micros(999_999),
            Duration::from_millis(1),
            Duration::new(3, 1),
            Duration::new(u64::MAX / 1_000, 999_999_999),
        ] {
            let slow = u64::try_from(duration.as_nanos().div_ceil(1_000_000)).unwrap_or(u64::MAX);
            assert_eq!(ceil_ms(duration), slow, "{duration:?}");
        }
        assert_eq!(ceil_ms(Duration::MAX), u64::MAX);
    }

    #[test]
    fn the_queue_time_counts_toward_the_callers_deadline() {
        // 100 ms from when it asked, 80 of them spent waiting, less a slack of 10 ms.
        let budget = Budget::new(Some(ms(100))).less(ms(80));
        assert!(!budget.is_past(ms(9)));
        assert!(budget.is_past(ms(10)));
    }

    #[test]
    fn a_wait_longer_than_the_deadline_makes_any_drop_past_it() {
        assert!(Budget::new(Some(ms(100)))
            .less(ms(150))
            .is_past(Duration::ZERO));
    }

    #[test]
    fn without_a_deadline_no_drop_is_past_one() {
        assert!(!Budget::NONE.less(ms(5)).is_past(ms(3_600_000)));
    }

    #[test]
    fn a_deadline_beyond_what_a_budget_holds_is_kept_as_the_longest_it_can() {
        let budget = Budget::new(Some(Duration::from_secs(60 * 60 * 24 * 365)));
        assert_eq!(budget, Budget(u32::MAX - 1));
        assert!(!budget.is_past(ms(1_000)));
    }
}
