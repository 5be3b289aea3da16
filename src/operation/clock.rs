//! An operation's clock readings ([`Tick`]): tokio's clock, so that a paused clock is followed,
//! or nothing where it could not be read.
//!
//! A tick is tokio's `Instant` (two words) unless the `tracing` feature is on: then it is one
//! word, nanoseconds since an origin, so that the record with its spans' word keeps the size a
//! queued request's task needs to stay in tower's size class. Each reading then costs a
//! subtraction and a conversion, which the default build does not pay.

use std::time::Duration;

use tokio::time::Instant;

/// A reading of tokio's clock, if it could be read.
#[cfg(not(feature = "tracing"))]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Tick(Option<Instant>);

#[cfg(not(feature = "tracing"))]
impl Tick {
    /// `instant` as a tick; `None`: the clock could not be read (tokio's paused clock panics
    /// once its runtime's thread-locals are gone).
    #[inline]
    pub(super) fn of(instant: Option<Instant>) -> Self {
        Self(instant)
    }

    /// The time from `self` to `to`: 0 if either is not known, or `to` is earlier.
    #[inline]
    pub(super) fn until(self, to: Tick) -> Duration {
        match (self.0, to.0) {
            (Some(from), Some(to)) => to.saturating_duration_since(from),
            _ => Duration::ZERO,
        }
    }

    /// Whether the clock was read.
    #[inline]
    pub(super) fn is_known(self) -> bool {
        self.0.is_some()
    }
}

/// A reading of tokio's clock: nanoseconds since an instant well before any this process can
/// read, or 0 if it could not be read.
#[cfg(feature = "tracing")]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Tick(u64);

/// How far before the first reading the clock's origin is: far enough that no instant this
/// process reads comes before it (a paused clock only moves forward from real time), close
/// enough that nanoseconds since it fit a word for centuries.
#[cfg(feature = "tracing")]
const BEFORE: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// The origin of every [`Tick`].
#[cfg(feature = "tracing")]
fn origin() -> Instant {
    static ORIGIN: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
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

#[cfg(feature = "tracing")]
impl Tick {
    /// `instant` as a tick; `None`: the clock could not be read (tokio's paused clock panics
    /// once its runtime's thread-locals are gone).
    #[inline]
    pub(super) fn of(instant: Option<Instant>) -> Self {
        let Some(instant) = instant else {
            return Self(0);
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
        match (self.0, to.0) {
            (0, _) | (_, 0) => Duration::ZERO,
            (from, to) => Duration::from_nanos(to.saturating_sub(from)),
        }
    }

    /// Whether the clock was read.
    #[inline]
    pub(super) fn is_known(self) -> bool {
        self.0 != 0
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
        assert_eq!(Tick::of(None).until(later), Duration::ZERO);
        assert_eq!(earlier.until(Tick::of(None)), Duration::ZERO);
        assert!(earlier.is_known() && !Tick::of(None).is_known());
    }

    #[tokio::test(start_paused = true)]
    async fn a_paused_clock_is_followed() {
        let start = Tick::of(Some(Instant::now()));
        tokio::time::advance(Duration::from_secs(90)).await;
        let later = Tick::of(Some(Instant::now()));
        assert_eq!(start.until(later), Duration::from_secs(90));
    }
}
