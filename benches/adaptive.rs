//! What an adaptive limit's controller costs per operation, next to the same limit without one,
//! all in one run so the ratios hold on a noisy machine.
//!
//! ```text
//! cargo bench --bench adaptive
//! ```
//!
//! The controller's bounds are the limit's capacity (`n..=n`), so that both limits admit as many
//! at once and the difference is the controller's work alone: at this rate it hears a sample of
//! the operations (a random draw at each admission), each of those is timed and added to the
//! window, and once per window (2 ms or more) the algorithm runs.
//!
//! - `uncontended/*`: a current-thread runtime, a no-op inner service, a limit of 64, driven as
//!   a reused service (`ready` + `call`) and as `clone().oneshot()`.
//! - `contended/*`: a 2-worker runtime, 64 tasks through a limit of 4, the inner service yields
//!   once; time per operation.
//!
//! Each with metrics recorded through a real SDK (`metrics`), and with metrics disabled
//! (`disabled`: an adaptive limit then records into its controller alone).
//!
//! Criterion measures one case after the other, and on a shared machine the speed drifts
//! between cases (see `interleaved`). So after criterion, `cargo bench` also runs the same cases
//! in interleaved rounds and prints the median per-round ratio of each case with its controller
//! to the same case without, with its quartiles.

mod common;

use std::time::Duration;

use tokio::runtime::Runtime;

use common::{contended_run, oneshot, reused, sdk_meter, Noop, YieldOnce};
use criterion::{criterion_group, BenchmarkId, Criterion};
use opentelemetry::metrics::Meter;
use tower::limit::ConcurrencyLimitLayer;
use tower::Layer;
use tower_resources_operation::adaptive::{Adaptive, Vegas};
use tower_resources_operation::{
    Executor, Limit, Operation, OperationMetrics, ResourcesOperationLayer,
};

/// A limit of `n`, with a controller held at `n` or without one.
fn limit(n: usize, adaptive: bool) -> Limit {
    let builder = Limit::builder(n).name("bench");
    match adaptive {
        true => builder.adaptive(Adaptive::new(Vegas::default(), n..=n)),
        false => builder,
    }
    .build()
}

fn layer(limit: Limit, metrics: OperationMetrics) -> ResourcesOperationLayer {
    ResourcesOperationLayer::new(limit)
        .operation(Operation::Verify)
        .executor(Executor::Subprocess)
        .metrics(metrics)
}

/// The service the layer makes around `S`.
type ResourcesOperationService<S> = tower_resources_operation::ResourcesOperation<S>;

/// The four cases around `inner` at a limit of `n`: metrics recorded through `meter`, then
/// disabled, each without a controller and with one.
fn cases<S: Clone>(
    meter: &Meter,
    n: usize,
    inner: S,
) -> [(&'static str, ResourcesOperationService<S>); 4] {
    let metrics = OperationMetrics::new(meter);
    [
        ("metrics", false, metrics.clone()),
        ("metrics_adaptive", true, metrics),
        ("disabled", false, OperationMetrics::disabled()),
        ("disabled_adaptive", true, OperationMetrics::disabled()),
    ]
    .map(|(name, adaptive, metrics)| {
        (
            name,
            layer(limit(n, adaptive), metrics).layer(inner.clone()),
        )
    })
}

fn uncontended(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let (_provider, meter) = sdk_meter();

    let tower = ConcurrencyLimitLayer::new(64).layer(Noop);
    let cases = cases(&meter, 64, Noop);

    let mut group = c.benchmark_group("uncontended");
    for pattern in ["reused", "oneshot"] {
        let drive = |b: &mut criterion::Bencher<'_>, service: &_| {
            b.iter_custom(|iters| match pattern {
                "reused" => reused(&rt, Clone::clone(service), iters),
                _ => oneshot(&rt, Clone::clone(service), iters),
            })
        };
        group.bench_function(BenchmarkId::new("tower_limit", pattern), |b| {
            b.iter_custom(|iters| match pattern {
                "reused" => reused(&rt, tower.clone(), iters),
                _ => oneshot(&rt, tower.clone(), iters),
            })
        });
        for (name, service) in &cases {
            group.bench_function(BenchmarkId::new(*name, pattern), |b| drive(b, service));
        }
    }
    group.finish();
}

fn contended(c: &mut Criterion) {
    let (_provider, meter) = sdk_meter();
    let cases = cases(&meter, 4, YieldOnce);

    let mut group = c.benchmark_group("contended");
    for (name, service) in &cases {
        group.bench_function(*name, |b| {
            b.iter_custom(|iters| contended_run(service.clone(), iters))
        });
    }
    group.finish();
}

/// Rounds of the interleaved pass.
const ROUNDS: usize = 31;

/// The four cases around `inner` at a limit of `n`, driven by `drive` for a number of
/// operations: each run once per round, `ROUNDS` times. Prints the median ns per operation of
/// each and the median per-round ratio of each adaptive case to its plain one.
fn interleaved<S>(
    title: &str,
    n: usize,
    inner: S,
    operations: u64,
    drive: impl Fn(&ResourcesOperationService<S>, u64) -> Duration,
) where
    S: Clone,
{
    let (_provider, meter) = sdk_meter();
    let cases = cases(&meter, n, inner);
    let mut times = vec![Vec::with_capacity(ROUNDS); cases.len()];
    for _ in 0..ROUNDS {
        for (case, (_, service)) in cases.iter().enumerate() {
            times[case].push(drive(service, operations).as_nanos() as f64 / operations as f64);
        }
    }
    let quartiles = |values: &[f64]| {
        let mut values = values.to_vec();
        values.sort_by(f64::total_cmp);
        let at = |quarter: usize| values[(values.len() - 1) * quarter / 4];
        [at(1), at(2), at(3)]
    };
    println!("\n{title}; {ROUNDS} interleaved rounds");
    for (case, (name, _)) in cases.iter().enumerate() {
        println!("  {name:<18} {:>8.1} ns/op", quartiles(&times[case])[1]);
    }
    for (adaptive, plain) in [(1, 0), (3, 2)] {
        let ratios: Vec<f64> = (0..ROUNDS)
            .map(|round| times[adaptive][round] / times[plain][round])
            .collect();
        let [low, mid, high] = quartiles(&ratios);
        println!(
            "  {:<36} {mid:>6.3}x   (quartiles {low:.3} to {high:.3})",
            format!("{} / {}", cases[adaptive].0, cases[plain].0)
        );
    }
}

fn interleaved_rounds() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let rt: &Runtime = &rt;
    interleaved(
        "uncontended, reused ready + call, limit 64",
        64,
        Noop,
        200_000,
        |service, n| reused(rt, service.clone(), n),
    );
    interleaved(
        "uncontended, clone().oneshot(), limit 64",
        64,
        Noop,
        200_000,
        |service, n| oneshot(rt, service.clone(), n),
    );
    interleaved(
        "contended: 2 workers, 64 tasks, limit 4, inner service yields once",
        4,
        YieldOnce,
        64_000,
        |service, n| contended_run(service.clone(), n),
    );
}

criterion_group! {
    name = benches;
    config = common::short_criterion();
    targets = uncontended, contended
}

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
    // Only under `cargo bench` (not `cargo test --benches`), and not when criterion was asked
    // for some cases only.
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "--bench") && !args.iter().any(|a| !a.starts_with('-')) {
        interleaved_rounds();
    }
}
