//! Where an operation's outcome is decided, for every way it can end.

use crate::attributes::Outcome;
use crate::guard::guarded;

/// How an admitted operation ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Ending {
    /// Its work returned: the classifier decides.
    Returned,
    /// Its service said it will not be called (an error from the inner `poll_ready`), or its
    /// body failed.
    Failed,
    /// Its work panicked.
    Crashed,
    /// It was dropped before its work returned: its caller went away.
    Dropped,
}

/// The outcome of an operation that ended as `end`: what [`set_outcome`](crate::set_outcome)
/// `chose` wins; then a returned work is what `classify` says (`error` if the classifier panics,
/// or was not made), a failure is `error`, a panic `crashed`, and a drop `cancelled`, or
/// `timeout` once the caller's deadline has passed (`past_deadline`).
pub(super) fn decide(
    chosen: Option<Outcome>,
    end: Ending,
    classify: impl FnOnce() -> Option<Outcome>,
    past_deadline: impl FnOnce() -> bool,
) -> Outcome {
    if let Some(chosen) = chosen {
        return chosen;
    }
    match end {
        Ending::Returned => guarded(classify).flatten().unwrap_or(Outcome::Error),
        Ending::Failed => Outcome::Error,
        Ending::Crashed => Outcome::Crashed,
        Ending::Dropped if past_deadline() => Outcome::Timeout,
        Ending::Dropped => Outcome::Cancelled,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chosen_outcome_wins_over_every_ending() {
        for end in [
            Ending::Returned,
            Ending::Failed,
            Ending::Crashed,
            Ending::Dropped,
        ] {
            let outcome = decide(Some(Outcome::Timeout), end, || Some(Outcome::Ok), || false);
            assert_eq!(outcome, Outcome::Timeout, "{end:?}");
        }
    }

    #[test]
    fn each_ending_has_its_outcome() {
        let ok = || Some(Outcome::Ok);
        assert_eq!(decide(None, Ending::Returned, ok, || false), Outcome::Ok);
        assert_eq!(decide(None, Ending::Failed, ok, || false), Outcome::Error);
        assert_eq!(
            decide(None, Ending::Crashed, ok, || false),
            Outcome::Crashed
        );
        assert_eq!(
            decide(None, Ending::Dropped, ok, || false),
            Outcome::Cancelled
        );
        assert_eq!(decide(None, Ending::Dropped, ok, || true), Outcome::Timeout);
    }

    #[test]
    fn a_classifier_that_panics_or_was_not_made_is_an_error() {
        assert_eq!(
            decide(None, Ending::Returned, || None, || false),
            Outcome::Error
        );
        let panics = || -> Option<Outcome> { panic!("a classifier that panics") };
        assert_eq!(
            decide(None, Ending::Returned, panics, || false),
            Outcome::Error
        );
    }
}
