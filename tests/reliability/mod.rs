//! Shared by the reliability tests (`stress`, `properties`, `soak`, `cardinality`, `faults`):
//! the books the test side keeps of how each operation ended, read against what the metrics
//! exported, a concurrency gauge for the inner work, and a panic hook that keeps the thousands
//! of deliberate panics out of the output.
#![allow(dead_code, unreachable_pub)]

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Once};

use tower_resources_operation::{
    Executor, Operation, Outcome, ACTIVE_INSTRUMENT, DURATION_INSTRUMENT, EXECUTOR_ATTRIBUTE,
    OPERATION_ATTRIBUTE, OUTCOME_ATTRIBUTE, QUEUED_INSTRUMENT, QUEUE_DURATION_INSTRUMENT,
};

use crate::support::{self, Telemetry};

/// Every deliberate panic of these tests carries this text; the hook below keeps them quiet.
pub const EXPECTED_PANIC: &str = "expected test panic";

/// Installs (once per test binary) a panic hook that drops the report of panics whose message
/// contains [`EXPECTED_PANIC`] and hands every other panic to the default hook.
pub fn quiet_expected_panics() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if support::panic_message(info.payload()).contains(EXPECTED_PANIC) {
                return;
            }
            default(info);
        }));
    });
}

/// One (operation, executor) series.
pub type Series = (Operation, Executor);

/// How many operations were admitted per series, and how many ended per series and outcome.
///
/// The test side fills one from what each operation did; [`Books::exported`] fills one from the
/// metrics. Both must be equal: nothing lost, nothing counted twice.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Books {
    /// Queue-duration samples per series: one per admitted operation.
    pub admitted: BTreeMap<Series, u64>,
    /// Duration samples per series and outcome: one per admitted operation, when it ended.
    pub ended: BTreeMap<(Operation, Executor, Outcome), u64>,
}

impl Books {
    /// An operation of `series` was admitted and ended as `outcome`.
    pub fn ended(&mut self, series: Series, outcome: Outcome) {
        *self.admitted.entry(series).or_default() += 1;
        *self.ended.entry((series.0, series.1, outcome)).or_default() += 1;
    }

    /// Adds `other`'s counts to these.
    pub fn merge(&mut self, other: &Books) {
        for (series, n) in &other.admitted {
            *self.admitted.entry(*series).or_default() += n;
        }
        for (key, n) in &other.ended {
            *self.ended.entry(*key).or_default() += n;
        }
    }

    /// Operations that ended as `outcome`, over every series.
    pub fn outcome_total(&self, outcome: Outcome) -> u64 {
        self.ended
            .iter()
            .filter(|((_, _, o), _)| *o == outcome)
            .map(|(_, n)| n)
            .sum()
    }

    /// Admitted operations, over every series.
    pub fn admitted_total(&self) -> u64 {
        self.admitted.values().sum()
    }

    /// What the two histograms exported, as books. Panics on an attribute value that is not
    /// one of NeMo Gym's strings, or a point without the expected attribute keys.
    pub fn exported(telemetry: &Telemetry) -> Books {
        let exported = telemetry.collect();
        let mut books = Books::default();
        for metric in &exported {
            let support::Data::Histogram(points) = &metric.data else {
                continue;
            };
            for point in points {
                if point.count == 0 {
                    continue;
                }
                let operation: Operation = attribute(&point.attributes, OPERATION_ATTRIBUTE);
                let executor: Executor = attribute(&point.attributes, EXECUTOR_ATTRIBUTE);
                if metric.name == QUEUE_DURATION_INSTRUMENT {
                    assert_eq!(point.attributes.len(), 2, "{point:?}");
                    *books.admitted.entry((operation, executor)).or_default() += point.count;
                } else if metric.name == DURATION_INSTRUMENT {
                    assert_eq!(point.attributes.len(), 3, "{point:?}");
                    let outcome: Outcome = attribute(&point.attributes, OUTCOME_ATTRIBUTE);
                    *books
                        .ended
                        .entry((operation, executor, outcome))
                        .or_default() += point.count;
                }
            }
        }
        books
    }
}

/// The attribute `key` of a point, parsed; panics if it is missing or not one of NeMo Gym's strings.
fn attribute<T>(attributes: &support::Attributes, key: &str) -> T
where
    T: std::str::FromStr,
    T::Err: std::fmt::Display,
{
    let value = attributes
        .get(key)
        .unwrap_or_else(|| panic!("no {key} in {attributes:?}"));
    value
        .parse()
        .unwrap_or_else(|e| panic!("{key}={value:?} is not one of NeMo Gym's values: {e}"))
}

/// Asserts that the metrics' books are `expected`, exactly.
pub fn assert_books(telemetry: &Telemetry, expected: &Books) {
    let exported = Books::exported(telemetry);
    assert_eq!(
        exported.ended, expected.ended,
        "duration samples per (operation, executor, outcome): exported (left) vs what the \
         operations did (right)"
    );
    assert_eq!(
        exported.admitted, expected.admitted,
        "queue-duration samples per (operation, executor): exported (left) vs admitted (right)"
    );
}

/// Every exported point of `queued` and `active`, as `(instrument, attributes, value)`.
pub fn live_points(telemetry: &Telemetry) -> Vec<(String, support::Attributes, i64)> {
    telemetry
        .collect()
        .into_iter()
        .filter(|m| m.name == QUEUED_INSTRUMENT || m.name == ACTIVE_INSTRUMENT)
        .flat_map(|m| match m.data {
            support::Data::Sum { points, .. } => points
                .into_iter()
                .map(|p| (m.name.clone(), p.attributes, p.value))
                .collect::<Vec<_>>(),
            other => panic!("{} is not an i64 sum: {other:?}", m.name),
        })
        .collect()
}

/// Asserts that every live count reads 0.
pub fn assert_live_counts_zero(telemetry: &Telemetry) {
    let points = live_points(telemetry);
    for (name, attributes, value) in &points {
        assert_eq!(*value, 0, "{name} {attributes:?} (all: {points:?})");
    }
}

/// How many inner services run now, and the most that ever ran at once.
#[derive(Debug, Default)]
pub struct Load {
    running: AtomicUsize,
    max: AtomicUsize,
}

impl Load {
    /// Counts one inner service as running until the guard drops.
    pub fn enter(self: &Arc<Self>) -> LoadGuard {
        let now = self.running.fetch_add(1, Ordering::SeqCst) + 1;
        self.max.fetch_max(now, Ordering::SeqCst);
        LoadGuard(Arc::clone(self))
    }

    /// The most that ever ran at once.
    pub fn max(&self) -> usize {
        self.max.load(Ordering::SeqCst)
    }

    /// How many run now.
    pub fn running(&self) -> usize {
        self.running.load(Ordering::SeqCst)
    }
}

/// One running inner service of a [`Load`].
#[derive(Debug)]
pub struct LoadGuard(Arc<Load>);

impl Drop for LoadGuard {
    fn drop(&mut self) {
        self.0.running.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A small deterministic generator (xorshift64*), so a run's mix is the same every time.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed.max(1))
    }

    pub fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// A number in `0..n`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}
