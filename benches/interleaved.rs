//! The ratios of the performance targets, measured in interleaved rounds so they hold on a
//! shared machine.
//!
//! ```text
//! cargo bench --bench interleaved
//! cargo bench --bench interleaved --features experimental-bound-instruments
//! ```
//!
//! Criterion (`cargo bench --bench overhead`) measures one case after the other; on a virtual
//! machine whose neighbours come and go, the machine's speed drifts between cases, by a few
//! percent over seconds uncontended and by up to 2x contended, and the drift lands in the
//! ratios. Here every round runs each case once, in turn, and the report is the median time
//! per case and, for each ratio a target is about, the median of its per-round values.
//!
//! - uncontended: a current-thread runtime and a no-op inner service, driven reused
//!   (`ready` + `call`) and as `clone().oneshot()` (hyper, axum);
//! - contended: a 2-worker runtime, 64 tasks through one limit of 4, an inner service that
//!   yields once.
//!
//! The cases are those of `overhead`: tower's limit, this layer with metrics disabled and on,
//! the floor (tower's limit plus only the unavoidable metrics work, a timed wait among it) and,
//! uncontended, the naive peer-style layer. Contended, two more: the floor with lock-free
//! histograms in place of the SDK's, to show what the contended floor would be if the SDK took
//! no lock per record; and the floor as it was before it timed the wait (`floor_untimed`: a
//! queue time of 0 for every operation), so that the ratio to it stays in sight.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{
    bare, contended_run, floor, http_oneshot, layer, lock_free_floor, naive, oneshot, reused,
    sdk_meter, server_run, HttpFrames, Noop, YieldOnce,
};
use tokio::runtime::Runtime;
use tokio::sync::Semaphore;
use tower::limit::ConcurrencyLimit;
use tower::{Layer, Service};
use tower_resources_operation::{Acquire, Limit, OperationMetrics, ResourcesOperationLayer};

const ROUNDS: usize = 31;
/// Operations per case and round, uncontended (some 10 ms of tower's limit).
const UNCONTENDED_OPERATIONS: u64 = 200_000;
/// Operations per case and round, contended: 64 tasks x 1,000.
const CONTENDED_OPERATIONS: u64 = 64_000;

fn median(values: &mut [f64]) -> f64 {
    quartiles(values)[1]
}

/// The first quartile, the median and the third quartile of `values`.
fn quartiles(values: &mut [f64]) -> [f64; 3] {
    values.sort_by(f64::total_cmp);
    let at = |quarter: usize| values[(values.len() - 1) * quarter / 4];
    [at(1), at(2), at(3)]
}

/// A case: its name and how to run it for a number of operations.
type Case<'a> = (&'static str, Box<dyn FnMut(u64) -> Duration + 'a>);

/// The case `name`: `run` on a clone of `service` for a number of operations.
fn case<'a, S>(name: &'static str, service: S, run: impl Fn(S, u64) -> Duration + 'a) -> Case<'a>
where
    S: Clone + 'a,
{
    (name, Box::new(move |n| run(service.clone(), n)))
}

/// The performance targets, for the sections they are stated for: `(section, case,
/// reference, the most the ratio may be)`. The bound build (`--features
/// experimental-bound-instruments`) is held to the same ones.
const TARGETS: &[(&str, &str, &str, f64)] = &[
    ("uncontended", "layer_disabled", "tower_limit", 0.80),
    ("uncontended", "layer_metrics", "floor", 1.10),
    ("contended", "layer_metrics", "floor", 1.05),
];

/// Runs every case once per round, `ROUNDS` times, and prints the median ns per operation of
/// each case, then the median per-round ratio of each pair `(case, reference)` in `ratios`,
/// with its quartiles: how far the machine moved that ratio from one round to the next. A
/// ratio with a target (`TARGETS`, for a section whose title starts with its name) says
/// whether its median is within it.
fn report(
    title: &str,
    operations: u64,
    cases: &mut [Case<'_>],
    ratios: &[(&str, &str)],
) -> std::collections::BTreeMap<&'static str, f64> {
    let mut times = vec![Vec::with_capacity(ROUNDS); cases.len()];
    for _ in 0..ROUNDS {
        for (case, (_, run)) in cases.iter_mut().enumerate() {
            times[case].push(run(operations).as_nanos() as f64 / operations as f64);
        }
    }
    let index = |name: &str| cases.iter().position(|(n, _)| *n == name).unwrap();

    println!("\n{title}; {ROUNDS} interleaved rounds");
    let mut medians = std::collections::BTreeMap::new();
    for (case, (name, _)) in cases.iter().enumerate() {
        let ns = median(&mut times[case].clone());
        medians.insert(*name, ns);
        println!("  {name:<16} {ns:>8.1} ns/op");
    }
    for (case, reference) in ratios {
        let (c, r) = (index(case), index(reference));
        let mut per_round: Vec<f64> = (0..ROUNDS).map(|i| times[c][i] / times[r][i]).collect();
        let [low, mid, high] = quartiles(&mut per_round);
        let target = TARGETS
            .iter()
            .find(|(section, c, r, _)| title.starts_with(section) && c == case && r == reference)
            .map(|&(.., most)| match mid <= most {
                true => format!("   target <= {most:.2}: met"),
                false => format!("   target <= {most:.2}: MISSED"),
            })
            .unwrap_or_default();
        println!(
            "  {:<34} {mid:>6.3}x   (quartiles {low:.3} to {high:.3}){target}",
            format!("{case} / {reference}"),
        );
    }
    medians
}

/// The uncontended cases, driven by `drive` (reused or oneshot).
fn uncontended<D>(title: &str, rt: &Runtime, drive: D)
where
    D: Fn(&Runtime, Box<dyn AnyCase>, u64) -> Duration,
{
    let (_provider, meter) = sdk_meter();
    let tower = ConcurrencyLimit::new(Noop, 64);
    let disabled = layer(64, OperationMetrics::disabled()).layer(Noop);
    let enabled = layer(64, OperationMetrics::new(&meter)).layer(Noop);
    let floor = floor::Floor::new(Noop, 64, floor::Shared::new(&meter));
    let naive = naive::Naive::new(Noop, 64, naive::Instruments::new(&meter));
    let bare = bare::Bare::<_>::new(Noop, 64);
    let bare_nested = bare::Bare::<_, true>::new(Noop, 64);
    let drive = &drive;
    report(
        title,
        UNCONTENDED_OPERATIONS,
        &mut [
            case("tower_limit", tower, |s, n| drive(rt, Box::new(s), n)),
            case("layer_disabled", disabled, |s, n| drive(rt, Box::new(s), n)),
            case("layer_metrics", enabled, |s, n| drive(rt, Box::new(s), n)),
            case("floor", floor, |s, n| drive(rt, Box::new(s), n)),
            case("naive_peer", naive, |s, n| drive(rt, Box::new(s), n)),
            case("bare_limit", bare, |s, n| drive(rt, Box::new(s), n)),
            case("bare_nested", bare_nested, |s, n| drive(rt, Box::new(s), n)),
        ],
        &[
            ("layer_disabled", "tower_limit"),
            ("bare_limit", "tower_limit"),
            ("bare_nested", "tower_limit"),
            ("layer_disabled", "bare_nested"),
            ("layer_metrics", "floor"),
            ("naive_peer", "layer_metrics"),
        ],
    );
}

/// A service of any case, so one closure drives them all. Each method runs the generic driver
/// on the concrete type, so the one dynamic call is per round, not per operation.
trait AnyCase {
    fn reused(self: Box<Self>, rt: &Runtime, iters: u64) -> Duration;
    fn oneshot(self: Box<Self>, rt: &Runtime, iters: u64) -> Duration;
}

impl<S> AnyCase for S
where
    S: Service<()> + Clone,
    S::Error: std::fmt::Debug,
{
    fn reused(self: Box<Self>, rt: &Runtime, iters: u64) -> Duration {
        reused(rt, *self, iters)
    }

    fn oneshot(self: Box<Self>, rt: &Runtime, iters: u64) -> Duration {
        oneshot(rt, *self, iters)
    }
}

/// Bounded waiting and the body-end form, uncontended, `clone().oneshot()` on HTTP services
/// whose body is read to its end: what a rejection costs next to an admitted operation, what a
/// bounded layer that turns nothing away costs next to an unbounded one, and what carrying the
/// operation in the body costs, per operation and per frame (bodies of 1 and of 8 frames).
fn bounded_and_body_end(rt: &Runtime) {
    let (_provider, meter) = sdk_meter();
    let metrics = OperationMetrics::new(&meter);
    let http = |limit: Limit| ResourcesOperationLayer::new_for_http(limit).metrics(metrics.clone());
    let one = HttpFrames { frames: 1 };
    let eight = HttpFrames { frames: 8 };
    let unbounded = http(Limit::new(64)).layer(eight);
    let bounded = http(Limit::with_max_queued(64, 8)).layer(eight);
    // Every operation of this one finds the limit full and no room to wait: turned away.
    let full = Limit::with_max_queued(1, 0);
    let _held = full.try_acquire().unwrap().unwrap();
    let rejecting = http(full.clone()).layer(eight);
    let body_end = http(Limit::new(64)).until_body_end().layer(eight);
    let off = || http(Limit::new(64)).metrics(OperationMetrics::disabled());
    let (head_off_1, head_off_8) = (off().layer(one), off().layer(eight));
    let (body_off_1, body_off_8) = (
        off().until_body_end().layer(one),
        off().until_body_end().layer(eight),
    );
    let mut cases: [Case<'_>; 8] = [
        case("head_end", unbounded, |s, n| http_oneshot(rt, s, n)),
        case("bounded", bounded, |s, n| http_oneshot(rt, s, n)),
        case("rejected", rejecting, |s, n| http_oneshot(rt, s, n)),
        case("body_end", body_end, |s, n| http_oneshot(rt, s, n)),
        case("head_off_1", head_off_1, |s, n| http_oneshot(rt, s, n)),
        case("body_off_1", body_off_1, |s, n| http_oneshot(rt, s, n)),
        case("head_off_8", head_off_8, |s, n| http_oneshot(rt, s, n)),
        case("body_off_8", body_off_8, |s, n| http_oneshot(rt, s, n)),
    ];
    let medians = report(
        "bounded waiting and body-end, HTTP clone().oneshot(), 8 frames read unless told",
        UNCONTENDED_OPERATIONS / 4,
        &mut cases,
        &[
            ("bounded", "head_end"),
            ("rejected", "head_end"),
            ("body_end", "head_end"),
            ("body_off_8", "head_off_8"),
        ],
    );
    let ns = |name: &str| medians[name];
    let per_operation = ns("body_off_1") - ns("head_off_1");
    let per_frame = ((ns("body_off_8") - ns("head_off_8")) - per_operation) / 7.0;
    println!(
        "  body-end, metrics off: {per_operation:.1} ns per operation, {per_frame:.1} ns per further frame"
    );
    assert_eq!(full.available(), 0, "the held permit kept the limit full");
}

fn main() {
    // `cargo test --benches` runs bench targets with `--test`-like arguments; only measure when
    // asked to (cargo bench passes `--bench`).
    if !std::env::args().any(|arg| arg == "--bench") {
        return;
    }

    // `cargo bench --bench interleaved -- <word>` runs the sections whose title has <word>.
    let filter = std::env::args()
        .skip(1)
        .find(|arg| !arg.starts_with("--"))
        .unwrap_or_default();
    let wanted = |title: &str| title.contains(filter.as_str());

    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    if wanted("uncontended, reused") {
        uncontended("uncontended, reused ready + call", &rt, |rt, s, n| {
            s.reused(rt, n)
        });
    }
    if wanted("uncontended, clone().oneshot()") {
        uncontended("uncontended, clone().oneshot()", &rt, |rt, s, n| {
            s.oneshot(rt, n)
        });
    }
    if wanted("bounded waiting and body-end") {
        bounded_and_body_end(&rt);
    }
    if wanted("contended: 2 workers") {
        contended(
            "contended: 2 workers, 64 tasks, limit 4, inner service yields once",
            false,
            4,
        );
    }
    if wanted("contended, a server's setup") {
        contended(
            "contended, a server's setup: 8 workers, 256 tasks, limit 16, the inner call holds its permit across a yield",
            true,
            16,
        );
    }
}

/// The contended cases through a limit of `max`: 2 workers and 64 tasks, or a server's setup.
fn contended(title: &str, server: bool, max: usize) {
    fn run<S>(server: bool) -> impl Fn(S, u64) -> Duration
    where
        S: Service<()> + Clone + Send + 'static,
        S::Future: Send,
        S::Error: std::fmt::Debug,
    {
        move |service, n| match server {
            true => server_run(service, n),
            false => contended_run(service, n),
        }
    }
    let (_provider, meter) = sdk_meter();
    let tower = ConcurrencyLimit::with_semaphore(YieldOnce, Arc::new(Semaphore::new(max)));
    let disabled = layer(max, OperationMetrics::disabled()).layer(YieldOnce);
    let enabled = layer(max, OperationMetrics::new(&meter)).layer(YieldOnce);
    let floor = floor::Floor::new(YieldOnce, max, floor::Shared::new(&meter));
    let untimed = floor::Floor::untimed(YieldOnce, max, floor::Shared::new(&meter));
    let lock_free = floor::Floor::new(YieldOnce, max, lock_free_floor::Shared::new());
    report(
        title,
        CONTENDED_OPERATIONS,
        &mut [
            case("tower_limit", tower, run(server)),
            case("layer_disabled", disabled, run(server)),
            case("layer_metrics", enabled, run(server)),
            case("floor", floor, run(server)),
            case("floor_untimed", untimed, run(server)),
            case("lock_free_floor", lock_free.clone(), run(server)),
        ],
        &[
            ("layer_disabled", "tower_limit"),
            ("layer_metrics", "tower_limit"),
            ("floor", "tower_limit"),
            ("layer_metrics", "floor"),
            ("layer_metrics", "floor_untimed"),
            ("lock_free_floor", "tower_limit"),
        ],
    );
    // The lock-free floor's histograms really counted every operation of every round.
    let recorded = lock_free.shared.duration.0.count();
    assert_eq!(recorded, lock_free.shared.queue.0.count());
    assert!(recorded >= ROUNDS as u64 * CONTENDED_OPERATIONS);
    // ...and timed the waits: most of its operations waited, so their queue times add up.
    assert!(lock_free.shared.queue.0.total() > 0.0);
}
