//! What an adaptive limit's controller costs per operation, next to the same limit without one,
//! all in one run so the ratios hold on a noisy machine.
//!
//! ```text
//! cargo bench --bench adaptive
//! ```
//!
//! The controller's bounds are the limit's capacity (`n..=n`), so that both limits admit as many
//! at once and the difference is the controller's work alone: an admission adds to one atomic,
//! an end to three and reads the clock, and once per window the algorithm runs.
//!
//! - `uncontended/*`: a current-thread runtime, a no-op inner service, a limit of 64, driven as
//!   a reused service (`ready` + `call`) and as `clone().oneshot()`.
//! - `contended/*`: a 2-worker runtime, 64 tasks through a limit of 4, the inner service yields
//!   once; time per operation.
//!
//! Each with metrics recorded through a real SDK (`metrics`), and with metrics disabled
//! (`disabled`: an adaptive limit then records into its controller alone).

mod common;

use std::time::Duration;

use common::{contended_run, oneshot, reused, sdk_meter, Noop, YieldOnce};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use tower::limit::ConcurrencyLimitLayer;
use tower::Layer;
use tower_resources_operation::adaptive::{Adaptive, Gradient};
use tower_resources_operation::{
    Executor, Limit, Operation, OperationMetrics, ResourcesOperationLayer,
};

/// A limit of `n`, with a controller held at `n` or without one.
fn limit(n: usize, adaptive: bool) -> Limit {
    let builder = Limit::builder(n).name("bench");
    match adaptive {
        true => builder.adaptive(Adaptive::new(Gradient::default(), n..=n)),
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

fn uncontended(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let (_provider, meter) = sdk_meter();
    let metrics = OperationMetrics::new(&meter);

    let tower = ConcurrencyLimitLayer::new(64).layer(Noop);
    let cases = [
        ("metrics", false, metrics.clone()),
        ("metrics_adaptive", true, metrics),
        ("disabled", false, OperationMetrics::disabled()),
        ("disabled_adaptive", true, OperationMetrics::disabled()),
    ]
    .map(|(name, adaptive, metrics)| (name, layer(limit(64, adaptive), metrics).layer(Noop)));

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
    let metrics = OperationMetrics::new(&meter);
    let cases = [
        ("metrics", false, metrics.clone()),
        ("metrics_adaptive", true, metrics),
        ("disabled", false, OperationMetrics::disabled()),
        ("disabled_adaptive", true, OperationMetrics::disabled()),
    ]
    .map(|(name, adaptive, metrics)| (name, layer(limit(4, adaptive), metrics).layer(YieldOnce)));

    let mut group = c.benchmark_group("contended");
    for (name, service) in &cases {
        group.bench_function(*name, |b| {
            b.iter_custom(|iters| contended_run(service.clone(), iters))
        });
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    targets = uncontended, contended
}
criterion_main!(benches);
