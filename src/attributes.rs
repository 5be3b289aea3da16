//! The bounded attribute values: which operation, on which executor, how it ended, and why it
//! was turned away.
//!
//! Each attribute is an enum, so no input can add a series: the exported values are exactly NeMo
//! Gym's strings ([`names::OPERATIONS`](crate::names::OPERATIONS) and the others), and this
//! crate's rejection reasons.

use std::fmt;
use std::str::FromStr;

use crate::error::ConfigError;

macro_rules! bounded_attribute {
    (
        $(#[$meta:meta])*
        $name:ident, $what:literal {
            $( $(#[$variant_meta:meta])* $variant:ident => $value:literal, )+
        }
    ) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        #[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
        #[cfg_attr(all(docsrs, feature = "serde"), doc(cfg(feature = "serde")))]
        pub enum $name {
            $( $(#[$variant_meta])* #[cfg_attr(feature = "serde", serde(rename = $value))] $variant, )+
        }

        impl $name {
            /// Every value, in the order of the matching constant (`OPERATIONS`, ...).
            pub const ALL: &'static [$name] = &[$($name::$variant),+];

            /// The lower-case string of this value, as exported in the attribute.
            pub const fn as_str(self) -> &'static str {
                match self {
                    $( $name::$variant => $value, )+
                }
            }

            /// Position in [`Self::ALL`]; indexes the pre-built attribute tables.
            pub(crate) const fn index(self) -> usize {
                self as usize
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl FromStr for $name {
            type Err = ConfigError;

            /// Parses the exact lower-case string; anything else is an error that lists the valid
            /// values.
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                const VALUES: &[&str] = &[$($value),+];
                match s {
                    $( $value => Ok($name::$variant), )+
                    _ => Err(ConfigError::attribute($what, VALUES, s)),
                }
            }
        }
    };
}

bounded_attribute! {
    /// What kind of limited work this is. Exported as
    /// [`OPERATION_ATTRIBUTE`](crate::names::OPERATION_ATTRIBUTE).
    Operation, "operation" {
        /// Checking a result, such as running a verifier.
        Verify => "verify",
        /// Running a tool on behalf of a caller.
        Tool => "tool",
        /// Asking a judge, such as a model call that grades an answer.
        Judge => "judge",
        /// Anything else; also where unknown names go in a lossy parse.
        Other => "other",
    }
}

bounded_attribute! {
    /// Where the limited work runs. Exported as [`EXECUTOR_ATTRIBUTE`](crate::names::EXECUTOR_ATTRIBUTE).
    Executor, "executor" {
        /// On the task that handles the request.
        Inline => "inline",
        /// On a thread, such as `tokio::task::spawn_blocking`.
        Thread => "thread",
        /// In a worker process of a pool.
        Process => "process",
        /// In a child process started for the work.
        Subprocess => "subprocess",
        /// Anything else; also where unknown names go in a lossy parse.
        Other => "other",
    }
}

bounded_attribute! {
    /// How admitted work ended. Exported as [`OUTCOME_ATTRIBUTE`](crate::names::OUTCOME_ATTRIBUTE) on the
    /// duration histogram, whose count per outcome is the number of operations that ended so.
    Outcome, "outcome" {
        /// The work returned normally.
        Ok => "ok",
        /// The work failed.
        Error => "error",
        /// The work ran out of time.
        Timeout => "timeout",
        /// The work was dropped before it finished (the caller went away).
        Cancelled => "cancelled",
        /// The work panicked.
        Crashed => "crashed",
    }
}

bounded_attribute! {
    /// Why an operation was turned away without a permit. Exported as
    /// [`REJECTION_ATTRIBUTE`](crate::names::REJECTION_ATTRIBUTE) on
    /// [`REJECTED_INSTRUMENT`](crate::names::REJECTED_INSTRUMENT), an addition of this crate to NeMo Gym's
    /// instruments.
    Rejection, "rejection" {
        /// The limit's queue was full ([`Limit::with_max_queued`](crate::Limit::with_max_queued)).
        QueueFull => "queue_full",
        /// The operation waited as long as its layer lets one wait
        /// ([`queue_timeout`](crate::ResourcesOperationLayer::queue_timeout)).
        QueueTimeout => "queue_timeout",
        /// The limit could not admit any operation: it is closed, or the store it lives in
        /// could not be reached in time ([`Rejected::failed`](crate::Rejected::failed),
        /// [`Rejected::closed`](crate::Rejected::closed)).
        Unavailable => "unavailable",
        /// The server's deadline for the request passed while it waited for the limit, and the
        /// server dropped it ([`server_timeout`](crate::ResourcesOperationLayer::server_timeout)):
        /// work the limit made wait past the server's patience, before it ever ran. A caller
        /// who left before any deadline the layer knows is `abandoned` instead.
        Deadline => "deadline",
    }
}

/// An (operation, executor) pair as one small number: the series an operation belongs to, as
/// its limit hears it, with metrics on or off. Bounded: one of [`SeriesKey::COUNT`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct SeriesKey(u8);

impl SeriesKey {
    /// How many there are: every operation on every executor.
    pub(crate) const COUNT: usize = Operation::ALL.len() * Executor::ALL.len();

    /// The key of `operation` on `executor`.
    #[inline]
    pub(crate) const fn new(operation: Operation, executor: Executor) -> Self {
        Self((operation.index() * Executor::ALL.len() + executor.index()) as u8)
    }

    /// The key of the `index`-th series, `None` past the last.
    pub(crate) const fn from_index(index: usize) -> Option<Self> {
        match index < Self::COUNT {
            true => Some(Self(index as u8)),
            false => None,
        }
    }

    /// Its position, below [`SeriesKey::COUNT`].
    #[inline]
    pub(crate) const fn index(self) -> usize {
        self.0 as usize
    }

    pub(crate) const fn operation(self) -> Operation {
        Operation::ALL[self.index() / Executor::ALL.len()]
    }

    pub(crate) const fn executor(self) -> Executor {
        Executor::ALL[self.index() % Executor::ALL.len()]
    }
}

impl Operation {
    /// Parses a name, mapping anything that is not one of NeMo Gym's values to
    /// [`Operation::Other`], so names from requests or config can never add a series.
    pub fn from_str_lossy(name: &str) -> Self {
        name.parse().unwrap_or(Operation::Other)
    }
}

impl Executor {
    /// Parses a name, mapping anything that is not one of NeMo Gym's values to
    /// [`Executor::Other`], so names from requests or config can never add a series.
    pub fn from_str_lossy(name: &str) -> Self {
        name.parse().unwrap_or(Executor::Other)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_value_round_trips_through_its_string() {
        for op in Operation::ALL {
            assert_eq!(op.as_str().parse::<Operation>(), Ok(*op));
            assert_eq!(op.to_string(), op.as_str());
        }
        for ex in Executor::ALL {
            assert_eq!(ex.as_str().parse::<Executor>(), Ok(*ex));
        }
        for out in Outcome::ALL {
            assert_eq!(out.as_str().parse::<Outcome>(), Ok(*out));
        }
        for rejection in Rejection::ALL {
            assert_eq!(rejection.as_str().parse::<Rejection>(), Ok(*rejection));
        }
    }

    #[test]
    fn a_series_key_names_its_operation_and_executor_and_every_pair_has_one() {
        let mut seen = std::collections::BTreeSet::new();
        for &operation in Operation::ALL {
            for &executor in Executor::ALL {
                let key = SeriesKey::new(operation, executor);
                assert_eq!((key.operation(), key.executor()), (operation, executor));
                assert_eq!(SeriesKey::from_index(key.index()), Some(key));
                seen.insert(key.index());
            }
        }
        assert_eq!(seen.len(), SeriesKey::COUNT);
        assert_eq!(SeriesKey::from_index(SeriesKey::COUNT), None);
    }

    #[test]
    fn indexes_match_positions_in_all() {
        for (i, op) in Operation::ALL.iter().enumerate() {
            assert_eq!(op.index(), i);
        }
        for (i, ex) in Executor::ALL.iter().enumerate() {
            assert_eq!(ex.index(), i);
        }
        for (i, out) in Outcome::ALL.iter().enumerate() {
            assert_eq!(out.index(), i);
        }
        for (i, rejection) in Rejection::ALL.iter().enumerate() {
            assert_eq!(rejection.index(), i);
        }
    }

    #[test]
    fn nemo_gyms_value_lists_are_the_enums_values_in_order() {
        use crate::names::{EXECUTORS, OPERATIONS, OUTCOMES};
        let strings = |all: &[&'static str]| all.to_vec();
        assert_eq!(
            OPERATIONS,
            strings(
                &Operation::ALL
                    .iter()
                    .map(|v| v.as_str())
                    .collect::<Vec<_>>()
            )
        );
        assert_eq!(
            EXECUTORS,
            strings(&Executor::ALL.iter().map(|v| v.as_str()).collect::<Vec<_>>())
        );
        assert_eq!(
            OUTCOMES,
            strings(&Outcome::ALL.iter().map(|v| v.as_str()).collect::<Vec<_>>())
        );
        let unknown = "verfy".parse::<Operation>().unwrap_err();
        assert_eq!(unknown.valid_values(), OPERATIONS);
    }
}
