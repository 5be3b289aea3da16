//! What the layer costs next to tower's own `ConcurrencyLimit`, all in one run so the ratios hold
//! on a noisy machine.
//!
//! ```text
//! cargo bench --bench overhead
//! ```
//!
//! - `uncontended/*`: a current-thread runtime and a no-op inner service, per operation, in the
//!   two ways services are driven: a reused service (`ready` + `call`) and `clone().oneshot()`,
//!   as hyper and axum do per request.
//! - `contended/*`: a 2-worker runtime, 64 tasks through a limit of 4, the inner service yields
//!   once; time per operation.
//!
//! The cases: tower's limit; this layer with metrics disabled; this layer with a real SDK meter
//! provider and reader (in the `spans` group, last, each also under a subscriber that filters
//! the operation's spans out, `*/spans_filtered`, and one that records them through
//! `tracing-opentelemetry`, `*/spans_on`; the others run with no subscriber); a naive peer-style layer (up-down counters and `KeyValue`s built per
//! call, as OpenTelemetry middlewares do it today); and the floor: tower's limit plus only the
//! unavoidable work (two clock reads, two histogram records with pre-built attributes, four
//! atomic adds).

mod common;

use std::sync::Arc;

use common::spans::Spans;
use common::{contended_run, floor, layer, naive, oneshot, reused, sdk_meter, Noop, YieldOnce};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use tokio::sync::Semaphore;
use tower::limit::{ConcurrencyLimit, ConcurrencyLimitLayer};
use tower::Layer;
use tower_resources_operation::OperationMetrics;

fn uncontended(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let (_provider, meter) = sdk_meter();
    let metrics = OperationMetrics::new(&meter);
    let naive = naive::Instruments::new(&meter);
    let floor = floor::Shared::new(&meter);

    let tower = ConcurrencyLimitLayer::new(64).layer(Noop);
    let disabled = layer(64, OperationMetrics::disabled()).layer(Noop);
    let enabled = layer(64, metrics).layer(Noop);
    let naive = naive::Naive::new(Noop, 64, naive);
    let floor = floor::Floor::new(Noop, 64, floor);

    let mut group = c.benchmark_group("uncontended");
    for pattern in ["reused", "oneshot"] {
        macro_rules! case {
            ($name:literal, $service:expr) => {
                group.bench_function(BenchmarkId::new($name, pattern), |b| {
                    b.iter_custom(|iters| match pattern {
                        "reused" => reused(&rt, $service.clone(), iters),
                        _ => oneshot(&rt, $service.clone(), iters),
                    })
                });
            };
        }
        case!("tower_limit", tower);
        case!("layer_disabled", disabled);
        case!("layer_metrics", enabled);
        case!("floor", floor);
        case!("naive_peer", naive);
    }
    group.finish();
}

fn contended(c: &mut Criterion) {
    let (_provider, meter) = sdk_meter();
    let metrics = OperationMetrics::new(&meter);

    let tower = ConcurrencyLimit::with_semaphore(YieldOnce, Arc::new(Semaphore::new(4)));
    let disabled = layer(4, OperationMetrics::disabled()).layer(YieldOnce);
    let enabled = layer(4, metrics).layer(YieldOnce);
    let floor = floor::Floor::new(YieldOnce, 4, floor::Shared::new(&meter));

    let mut group = c.benchmark_group("contended");
    group.bench_function("tower_limit", |b| {
        b.iter_custom(|iters| contended_run(tower.clone(), iters))
    });
    group.bench_function("layer_disabled", |b| {
        b.iter_custom(|iters| contended_run(disabled.clone(), iters))
    });
    group.bench_function("layer_metrics", |b| {
        b.iter_custom(|iters| contended_run(enabled.clone(), iters))
    });
    group.bench_function("floor", |b| {
        b.iter_custom(|iters| contended_run(floor.clone(), iters))
    });
    group.finish();
}

/// The layer under a subscriber: one that filters the operation's spans out, and one that
/// records them. Last, and each case under its own subscriber: once a subscriber has recorded a
/// callsite, `tracing` keeps that callsite's interest (and the process's maximum level) until
/// the next subscriber is made, so a case with no subscriber run after one would pay for spans
/// that go nowhere.
fn spans(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let (_provider, meter) = sdk_meter();
    let disabled = layer(64, OperationMetrics::disabled()).layer(Noop);
    let enabled = layer(64, OperationMetrics::new(&meter)).layer(Noop);

    let mut group = c.benchmark_group("spans");
    for spans in [Spans::Filtered, Spans::On] {
        for pattern in ["reused", "oneshot"] {
            let mut case =
                |name: &str, service: &tower_resources_operation::ResourcesOperation<Noop>| {
                    let id = BenchmarkId::new(format!("{name}/{}", spans.name()), pattern);
                    group.bench_function(id, |b| {
                        b.iter_custom(|iters| {
                            spans.run(|| match pattern {
                                "reused" => reused(&rt, service.clone(), iters),
                                _ => oneshot(&rt, service.clone(), iters),
                            })
                        })
                    });
                };
            case("layer_disabled", &disabled);
            case("layer_metrics", &enabled);
        }
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = common::short_criterion();
    targets = uncontended, contended, spans
}
criterion_main!(benches);
