//! The contended case as interleaved rounds, for ratios that hold on a shared machine.
//!
//! ```text
//! cargo bench --bench contended
//! ```
//!
//! A 2-worker runtime, 64 tasks through one limit of 4, an inner service that yields once:
//! tower's limit, this layer with metrics disabled, with metrics, and the floor (tower's limit
//! plus only the unavoidable metrics work). On a virtual machine whose neighbours come and go,
//! the time of a contended run drifts by 2x over seconds; criterion measures one case after the
//! other (`cargo bench --bench overhead -- contended`), so its ratios catch the drift. Here
//! every round runs each case once, in turn, and the report is the median per case and the
//! median of the per-round ratios.

mod common;

use std::sync::Arc;

use common::{contended_run, floor, layer, sdk_meter, YieldOnce};
use tokio::sync::Semaphore;
use tower::limit::ConcurrencyLimit;
use tower::Layer;
use tower_resources_operation::OperationMetrics;

const ROUNDS: usize = 31;
/// Operations per case and round: 64 tasks x 1,000.
const OPERATIONS: u64 = 64_000;

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn main() {
    // `cargo test --benches` runs bench targets with `--test`-like arguments; only measure when
    // asked to (cargo bench passes `--bench`).
    if !std::env::args().any(|arg| arg == "--bench") {
        return;
    }
    let (_provider, meter) = sdk_meter();
    let tower = ConcurrencyLimit::with_semaphore(YieldOnce, Arc::new(Semaphore::new(4)));
    let disabled = layer(4, OperationMetrics::disabled()).layer(YieldOnce);
    let enabled = layer(4, OperationMetrics::new(&meter)).layer(YieldOnce);
    let floor = floor::Floor {
        inner: ConcurrencyLimit::new(YieldOnce, 4),
        shared: floor::Shared::new(&meter),
    };

    let per_op = |elapsed: std::time::Duration| elapsed.as_nanos() as f64 / OPERATIONS as f64;
    let mut times: [Vec<f64>; 4] = Default::default();
    for _ in 0..ROUNDS {
        times[0].push(per_op(contended_run(tower.clone(), OPERATIONS)));
        times[1].push(per_op(contended_run(disabled.clone(), OPERATIONS)));
        times[2].push(per_op(contended_run(enabled.clone(), OPERATIONS)));
        times[3].push(per_op(contended_run(floor.clone(), OPERATIONS)));
    }
    let ratio = |case: usize| {
        let mut ratios: Vec<f64> = (0..ROUNDS).map(|r| times[case][r] / times[0][r]).collect();
        median(&mut ratios)
    };
    let ratios = [1.0, ratio(1), ratio(2), ratio(3)];

    println!("contended: 2 workers, 64 tasks, limit 4, inner service yields once; {ROUNDS} rounds");
    println!(
        "{:<16} {:>14} {:>18}",
        "case", "median ns/op", "x tower (median)"
    );
    for (i, name) in ["tower_limit", "layer_disabled", "layer_metrics", "floor"]
        .iter()
        .enumerate()
    {
        println!(
            "{name:<16} {:>14.0} {:>18.2}",
            median(&mut times[i].clone()),
            ratios[i]
        );
    }
}
