//! The second way to measure the uncontended cases of `interleaved`: a plain loop of one case,
//! for callgrind to count the instructions per operation (timing on a shared virtual machine
//! drifts; instruction counts do not).
//!
//! ```text
//! cargo bench --bench instructions --no-run        # prints the binary's path
//! valgrind --tool=callgrind --callgrind-out-file=/dev/null \
//!     target/release/deps/instructions-<hash> --bench <case> <operations> [<subscriber>]
//! ```
//!
//! Instructions per operation: the difference between two runs (250,000 and 50,000
//! operations), divided by 200,000, so that the setup cancels out. `<case>` is one of the names
//! printed when it runs without one: the driving pattern (`reused`: `ready` + `call`;
//! `oneshot`: `clone().oneshot()`, as hyper and axum drive a service per request) and the
//! service (tower's limit; this layer with metrics off or on; the floor: tower's limit plus the
//! SDK's records that any metrics layer makes, the denominator of the metrics-on ratios). `<subscriber>`: `no_subscriber`
//! (the default), `spans_filtered` (a subscriber at `INFO`, the operation's `DEBUG` spans
//! filtered out) or `spans_on` (recorded through `tracing-opentelemetry`).

mod common;

use std::time::Duration;

use common::spans::Spans;
use common::{bare, floor, layer, oneshot, queued_run, reused, sdk_meter, Noop, YieldOnce};
use tokio::runtime::Runtime;
use tower::limit::ConcurrencyLimit;
use tower::{Layer, Service};
use tower_resources_operation::OperationMetrics;

const CASES: &[&str] = &[
    "reused/tower",
    "reused/off",
    "reused/on",
    "oneshot/tower",
    "oneshot/off",
    "oneshot/on",
    "reused/floor",
    "oneshot/floor",
    "reused/bare",
    "oneshot/bare",
    "reused/bare_nested",
    "oneshot/bare_nested",
    "reused/floor_untimed",
    "oneshot/floor_untimed",
    "queued/tower",
    "queued/off",
    "queued/on",
    "queued/floor",
    "queued/floor_untimed",
];

fn drive<S>(pattern: &str, rt: &Runtime, service: S, operations: u64) -> Duration
where
    S: Service<()> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: std::fmt::Debug,
{
    match pattern {
        "reused" => reused(rt, service, operations),
        "queued" => queued_run(rt, service, operations),
        _ => oneshot(rt, service, operations),
    }
}

fn main() {
    let mut args = std::env::args()
        .skip(1)
        .filter(|arg| !arg.starts_with("--"));
    let (Some(case), Some(operations)) = (args.next(), args.next()) else {
        // `cargo test --benches` runs it with no case: nothing to count.
        println!("cases: {}", CASES.join(", "));
        return;
    };
    let operations: u64 = operations.parse().expect("a number of operations");
    let spans = match args.next() {
        Some(name) => Spans::parse(&name).expect("no_subscriber, spans_filtered or spans_on"),
        None => Spans::None,
    };
    spans.run(|| count(&case, operations));
}

fn count(case: &str, operations: u64) {
    let (pattern, service) = case.split_once('/').expect("pattern/service");
    let elapsed = match pattern {
        // 64 tasks through a limit of 4 whose inner service yields once: most of them wait.
        "queued" => count_with(pattern, service, YieldOnce, 4, operations),
        _ => count_with(pattern, service, Noop, 64, operations),
    };
    println!(
        "{case}: {operations} operations, {:.1} ns each",
        elapsed.as_nanos() as f64 / operations as f64
    );
}

fn count_with<I>(pattern: &str, service: &str, inner: I, max: usize, operations: u64) -> Duration
where
    I: Service<(), Response = (), Error = std::convert::Infallible> + Clone + Send + Sync + 'static,
    I::Future: Send + Unpin + 'static,
{
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let (_provider, meter) = sdk_meter();
    match service {
        "tower" => drive(pattern, &rt, ConcurrencyLimit::new(inner, max), operations),
        "off" => drive(
            pattern,
            &rt,
            layer(max, OperationMetrics::disabled()).layer(inner),
            operations,
        ),
        "on" => drive(
            pattern,
            &rt,
            layer(max, OperationMetrics::new(&meter)).layer(inner),
            operations,
        ),
        "floor" => drive(
            pattern,
            &rt,
            floor::Floor::new(inner, max, floor::Shared::new(&meter)),
            operations,
        ),
        "floor_untimed" => drive(
            pattern,
            &rt,
            floor::Floor::untimed(inner, max, floor::Shared::new(&meter)),
            operations,
        ),
        "bare" => drive(pattern, &rt, bare::Bare::<_>::new(inner, max), operations),
        "bare_nested" => drive(
            pattern,
            &rt,
            bare::Bare::<_, true>::new(inner, max),
            operations,
        ),
        other => panic!("no case {other:?}; the cases: {}", CASES.join(", ")),
    }
}
