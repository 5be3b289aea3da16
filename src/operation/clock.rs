//! An operation's clock readings, in one word each ([`Tick`]), so that a record with its clock
//! stays small enough for a queued request's task to keep tower's size.

use std::sync::OnceLock;
use std::time::Duration;

use tokio::time::Instant;

/// A reading of tokio's clock (so that a paused clock is followed): nanoseconds since an instant
/// well before any this process can read, or [`UNKNOWN`](Tick::UNKNOWN).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Tick(u64);

/// How far before the first reading the clock's origin is: far enough that no instant this
/// process reads comes before it (a paused clock only moves forward from real time), close
/// enough that nanoseconds since it fit a word for centuries.
const BEFORE: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// The origin of every [`Tick`].
fn origin() -> Instant {
    static ORIGIN: OnceLock<Instant> = OnceLock::new();
    *ORIGIN.get_or_init(|| {
        let now = Instant::now();
        // A platform whose instants cannot go that far back gives the furthest it can.
        let mut before = BEFORE;
        loop {
            if let Some(origin) = now.checked_sub(before) {
                return origin;
            }
            before /= 2;
        }
    })
}

impl Tick {
    /// The clock could not be read (tokio's paused clock panics once its runtime's
    /// thread-locals are gone).
    pub(super) const UNKNOWN: Self = Self(0);

    /// `instant` as a tick; [`UNKNOWN`](Self::UNKNOWN) for `None`.
    #[inline]
    pub(super) fn of(instant: Option<Instant>) -> Self {
        let Some(instant) = instant else {
            return Self::UNKNOWN;
        };
        let since = instant.saturating_duration_since(origin());
        let nanos = since
            .as_secs()
            .saturating_mul(1_000_000_000)
            .saturating_add(u64::from(since.subsec_nanos()));
        Self(nanos.max(1))
    }

    /// The time from `self` to `to`: 0 if either is not known, or `to` is earlier.
    #[inline]
    pub(super) fn until(self, to: Tick) -> Duration {
        match (self, to) {
            (Self::UNKNOWN, _) | (_, Self::UNKNOWN) => Duration::ZERO,
            (Self(from), Self(to)) => Duration::from_nanos(to.saturating_sub(from)),
        }
    }

    /// Whether the clock was read.
    #[inline]
    pub(super) fn is_known(self) -> bool {
        self != Self::UNKNOWN
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_time_between_two_ticks_is_zero_when_either_is_unknown_or_the_end_is_earlier() {
        let at = Instant::now();
        let ms = Duration::from_millis;
        let (earlier, later) = (Tick::of(Some(at - ms(5))), Tick::of(Some(at + ms(5))));
        assert_eq!(earlier.until(later), ms(10));
        assert_eq!(later.until(earlier), Duration::ZERO);
        assert_eq!(Tick::UNKNOWN.until(later), Duration::ZERO);
        assert_eq!(earlier.until(Tick::of(None)), Duration::ZERO);
        assert!(earlier.is_known() && !Tick::UNKNOWN.is_known());
    }

    #[tokio::test(start_paused = true)]
    async fn a_paused_clock_is_followed() {
        let start = Tick::of(Some(Instant::now()));
        tokio::time::advance(Duration::from_secs(90)).await;
        let later = Tick::of(Some(Instant::now()));
        assert_eq!(start.until(later), Duration::from_secs(90));
    }
}
