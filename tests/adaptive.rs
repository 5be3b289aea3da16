//! Adaptive limits: a controller finds the capacity of simulated servers on paused time, through
//! every form of the crate, with metrics on or off, and of real CPU-bound work.
//!
//! Each scenario prints, for its settled phase, the mean and the mode of the limit and of the
//! operations in flight (both read from the crate's metrics every 73 ms), the throughput and
//! the share of failures, and asserts a range for each with the reason for that range.
//! `cargo nextest run --test adaptive --no-capture` shows them.
//!
//! The simulated servers serve a request in 100 ms (give or take 10%) unless said otherwise;
//! 80 closed-loop clients (more than any limit here admits) keep every limit full, so that
//! where a limit settles is the controller's choice, not the load's.

mod support;

use std::ops::RangeInclusive;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;

use support::simulation::{run, within, Above, Figure, Figures, Form, Scenario, Server};
use support::Telemetry;
use tokio::sync::oneshot;
use tower::{service_fn, Layer as _, ServiceExt as _};
use tower_resources_operation::adaptive::{Adaptive, Algorithm, Sample, Vegas};
use tower_resources_operation::limit::{Ended, LimitPermit};
use tower_resources_operation::names::{
    LIMIT_ATTRIBUTE, LIMIT_BASELINE_INSTRUMENT, LIMIT_CAPACITY_INSTRUMENT,
    LIMIT_ESTIMATE_INSTRUMENT, LIMIT_INSTRUMENT, LIMIT_SCOPE_ATTRIBUTE, OPERATION_ATTRIBUTE,
};
use tower_resources_operation::per_request::{Choice, ChooseFn};
use tower_resources_operation::{
    Executor, Limit, Operation, OperationMetrics, ResourcesOperationLayer,
};

const MS: Duration = Duration::from_millis(1);

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

/// A limit named `judges` that starts at 1 and stays within `1..=max`.
fn adaptive<A: Algorithm + Clone + Sync>(algorithm: A, max: usize) -> Limit {
    Limit::builder(1)
        .name("judges")
        .adaptive(Adaptive::new(algorithm, 1..=max))
        .build()
}

/// A scenario's limit, run by Vegas: from 1 up to 64, more than any server here can take.
fn vegas() -> Limit {
    adaptive(Vegas::default(), 64)
}

/// 80 clients on `server` for `length` seconds, through the layer.
fn scenario(name: &'static str, server: Server, length: u64) -> Scenario {
    Scenario {
        name,
        server,
        clients: 80,
        length: secs(length),
        form: Form::Layer,
        events: Vec::new(),
    }
}

/// Runs `scenario` against `limit`, prints how the limit moved and what the controller
/// measured, and returns the figures of each phase (in seconds).
async fn simulate(scenario: Scenario, limit: Limit, phases: &[(u64, u64)]) -> Vec<Figures> {
    let telemetry = Telemetry::new();
    let run = run(scenario, limit, &telemetry).await;
    println!("{}: limit every 2 s: {}", run.name, run.trace(secs(2)));
    println!(
        "{}: baseline {:.1?} ms, estimate {:.1?} ms",
        run.name, run.baseline_ms, run.estimate_ms
    );
    assert!(
        run.baseline_ms.is_some() && run.estimate_ms.is_some(),
        "{}: the controller's gauges",
        run.name
    );
    phases
        .iter()
        .map(|(from, to)| run.report("", secs(*from), secs(*to)))
        .collect()
}

/// [`simulate`] with one phase, the settled one: the second half of the run, the first being
/// long enough for the limit to get where it goes. Its figures must lie within `bounds` (see
/// [`Figures::assert_within`]), the messages naming the scenario.
async fn settles(scenario: Scenario, limit: Limit, bounds: &[(&[Figure], RangeInclusive<f64>)]) {
    let (name, length) = (scenario.name, scenario.length.as_secs());
    let settled = simulate(scenario, limit, &[(length / 2, length)]).await;
    settled[0].assert_within(name, bounds);
}

// -------------------------------------------------------------------------------------------------
// The scenarios.

/// A link whose latency is the same at any load (100 ms, give or take 10%): the limit grows to
/// its max, or near it.
#[tokio::test(start_paused = true)]
async fn flat_latency_grows_near_max() {
    let server = Server::new(1 << 20, 100 * MS, Above::Ignores);
    // Nothing signals congestion and the clients keep the limit full; the slow start reaches
    // max (64 slots of 100 ms: 640 op/s) in a second. Vegas then reads `L × (1 − baseline /
    // run time)` operations waiting: at 56 in flight one of them is a rise of 2%, about what
    // the jitter leaves between a round trip's mean and a baseline taken from the faster ones,
    // so it may hold there: 0.85 max to max.
    settles(
        scenario("flat", server, 40),
        vegas(),
        &[
            (
                &[Figure::LimitMode, Figure::LimitMean, Figure::InFlight],
                54.0..=64.0,
            ),
            (&[Figure::Throughput], 540.0..=704.0),
            (&[Figure::Failures], 0.0..=0.0),
        ],
    )
    .await;
}

/// A server with a queue of its own above N = 16 at once: the run time grows with every
/// operation above N, and nothing fails.
#[tokio::test(start_paused = true)]
async fn a_server_that_defers_above_n_settles_near_n() {
    let server = Server::new(16, 100 * MS, Above::Defers);
    // Vegas keeps 1 or 2 operations waiting at the server: N + 1 or N + 2, and the mean of a
    // round trip's run times (give or take 10%) moves the estimate by about one more. Never
    // below N: the server would idle. 16 slots of 100 ms: 160 op/s.
    settles(
        scenario("defers16", server, 60),
        vegas(),
        &[
            (
                &[Figure::LimitMean, Figure::LimitMode, Figure::InFlight],
                16.0..=19.0,
            ),
            (&[Figure::Throughput], 152.0..=168.0),
            (&[Figure::Failures], 0.0..=0.0),
        ],
    )
    .await;
}

/// A server that answers an error at once (after 5 ms, a `503`) to any request above N = 16:
/// the limit settles at N or just under, and each probe above N costs about one failure.
#[tokio::test(start_paused = true)]
async fn a_server_that_fails_above_n_settles_near_n() {
    let server = Server::new(16, 100 * MS, Above::Fails);
    let scenario = Scenario {
        form: Form::Scoped,
        ..scenario("fails16", server, 60)
    };
    settles(
        scenario,
        vegas(),
        &[
            // The first failure above N closes its window and takes 10% (at least one place)
            // away; the limit then climbs back one place a round trip, and waits longer below
            // N after each probe that costs more than its own failure. So it spends most of its
            // time at N or a place or two under: 0.8 N to 1.1 N.
            (&[Figure::LimitMean, Figure::InFlight], 12.8..=17.6),
            (&[Figure::LimitMode], 14.0..=17.0),
            // About one failure per probe: a few percent at most.
            (&[Figure::Failures], 0.0..=0.05),
            (&[Figure::Throughput], 136.0..=176.0),
        ],
    )
    .await;
}

/// The server of `defers16` behind a jittery link: each run time is off by up to ±50%, and one
/// in 20 takes 3 times as long (a mean of 110 ms). The ideal is still N = 16, and the limit
/// must not collapse below it chasing the noise.
#[tokio::test(start_paused = true)]
async fn a_jittery_link_with_a_fixed_ideal_does_not_collapse() {
    let server = Server::new(16, 100 * MS, Above::Defers).jitter(0.5, 20, 3.0);
    settles(
        scenario("jitter16", server, 60),
        vegas(),
        &[
            // No reading of the settled phase below 0.6 N: a round trip whose spikes read as a
            // queue takes a few places away, and the limit climbs back one place, then two, a
            // round trip. Up to 1.25 N on average: the queue of 1 or 2 that Vegas keeps, read
            // through the noise.
            (&[Figure::LowestLimit], 9.6..=24.0),
            (&[Figure::LimitMean, Figure::InFlight], 15.0..=20.0),
            // 16 slots of 110 ms: 145 op/s.
            (&[Figure::Throughput], 138.0..=153.0),
            (&[Figure::Failures], 0.0..=0.0),
        ],
    )
    .await;
}

/// A slow link: 2 s per request, a queue of its own above N = 8.
#[tokio::test(start_paused = true)]
async fn a_slow_link_settles_near_n() {
    let server = Server::new(8, secs(2), Above::Defers);
    let scenario = Scenario {
        clients: 40,
        ..scenario("slow8", server, 240)
    };
    settles(
        scenario,
        vegas(),
        &[
            // A window lasts one turnover of the limit (about 2 s here), and the run times it
            // sees started a window earlier: the controller overshoots and comes back, swinging
            // between N and about 1.7 N. So a wider range than for fast operations: N to 2 N.
            (&[Figure::LimitMean, Figure::InFlight], 8.0..=16.0),
            (&[Figure::LowestLimit], 6.0..=16.0),
            // 8 slots of 2 s: 4 op/s.
            (&[Figure::Throughput], 3.8..=4.2),
            (&[Figure::Failures], 0.0..=0.0),
        ],
    )
    .await;
}

/// A shallow knee: above N = 16 the run time grows by a quarter for each N more at once (at
/// 2 N it is 125 ms), and nothing fails.
#[tokio::test(start_paused = true)]
async fn a_shallow_knee_settles_where_a_queue_of_one_or_two_shows() {
    let knee = Server::new(16, 100 * MS, Above::Slows { slope: 0.25 });
    // `L × (1 − 100 ms / run time)` operations wait at L in flight: 1 at 20 (106 ms), 2 at 23
    // (111 ms). Vegas holds between, give or take a place for the jitter of 10%: 1.1 N to
    // 1.5 N. What those deliver: 18 at 103 ms is 174 op/s, 24 at 112.5 ms 213.
    settles(
        scenario("knee16", knee, 60),
        vegas(),
        &[
            (&[Figure::LimitMean, Figure::InFlight], 18.0..=24.0),
            (&[Figure::Throughput], 172.0..=215.0),
            (&[Figure::Failures], 0.0..=0.0),
        ],
    )
    .await;
}

/// A server whose capacity falls from 24 to 8 at 40 s and comes back at 80 s: the limit
/// follows it down and up again, both when the server queues and when it fails above it.
#[tokio::test(start_paused = true)]
async fn a_capacity_that_falls_and_comes_back_is_followed_down_and_up() {
    for (name, above, form) in [
        ("drop24to8/defers", Above::Defers, Form::Layer),
        ("drop24to8/fails", Above::Fails, Form::Scoped),
    ] {
        let server = Server::new(24, 100 * MS, above);
        let scenario = Scenario {
            form,
            events: vec![
                (secs(40), Box::new(|server: &Server| server.set_capacity(8))),
                (
                    secs(80),
                    Box::new(|server: &Server| server.set_capacity(24)),
                ),
            ],
            ..scenario(name, server, 120)
        };
        let phases = simulate(scenario, vegas(), &[(20, 40), (60, 80), (100, 120)]).await;
        for (figures, n) in phases.iter().zip([24.0, 8.0, 24.0]) {
            // Each phase as its own steady server (20 s is long enough to get there): one that
            // fails gets 0.8 N to 1.1 N (see `fails16`); one that queues gets N to 1.8 N. Not
            // the N + 2 of `defers16` once its capacity fell: a round trip at a lower load
            // measures the run time at low load again (how a server that became slower is
            // found), and at 1.5 N that run time still holds part of the server's own queue.
            let (range, failures) = match above {
                Above::Defers => (n..=1.8 * n, 0.0..=0.0),
                _ => (0.8 * n..=1.1 * n, 0.0..=0.1),
            };
            figures.assert_within(
                &format!("{name} at N = {n}:"),
                &[
                    (&[Figure::LimitMean, Figure::InFlight], range),
                    (&[Figure::Failures], failures),
                    (&[Figure::Throughput], 8.0 * n..=11.0 * n),
                ],
            );
        }
    }
}

// -------------------------------------------------------------------------------------------------
// Every form feeds the limit's one controller.

/// Makes `calls` calls of `call`, `clients` at a time.
async fn drive<F, Fut>(clients: usize, calls: usize, call: F)
where
    F: Fn() -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let done = Arc::new(AtomicUsize::new(0));
    let tasks: Vec<_> = (0..clients)
        .map(|_| {
            let (call, done) = (call.clone(), Arc::clone(&done));
            tokio::spawn(async move {
                while done.fetch_add(1, SeqCst) < calls {
                    call().await;
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
}

/// A server of 100 ms at any load.
fn flat() -> Arc<Server> {
    Arc::new(Server::new(1 << 20, 100 * MS, Above::Ignores))
}

#[tokio::test(start_paused = true)]
async fn the_layer_adapts_its_limit() {
    let telemetry = Telemetry::new();
    let limit = adaptive(Vegas::default(), 16);
    let server = flat();
    let service = ResourcesOperationLayer::new(limit.clone())
        .operation(Operation::Judge)
        .metrics(telemetry.metrics.clone())
        .layer(service_fn(move |()| {
            let server = Arc::clone(&server);
            async move { server.serve().await }
        }));
    drive(32, 2_000, move || {
        let service = service.clone();
        async move {
            service.oneshot(()).await.unwrap();
        }
    })
    .await;
    assert_eq!(limit.capacity(), 16, "grew from 1 to its max");
    let filter = [(OPERATION_ATTRIBUTE, "judge")];
    assert_eq!(telemetry.live_value(LIMIT_INSTRUMENT, &filter), 16);
}

#[tokio::test(start_paused = true)]
async fn the_scoped_api_adapts_its_limit() {
    let telemetry = Telemetry::new();
    let limit = adaptive(Vegas::default(), 16);
    let server = flat();
    let metrics = telemetry.metrics.clone();
    let (limit2, server2) = (limit.clone(), Arc::clone(&server));
    drive(32, 2_000, move || {
        let (limit, server, metrics) = (limit2.clone(), Arc::clone(&server2), metrics.clone());
        async move {
            let served = metrics
                .resources_operation(&limit, Operation::Tool, Executor::Thread, server.serve())
                .await;
            served.unwrap().unwrap();
        }
    })
    .await;
    assert_eq!(limit.capacity(), 16);
    let by_name = [(LIMIT_ATTRIBUTE, "judges")];
    assert_eq!(
        telemetry.live_value(LIMIT_CAPACITY_INSTRUMENT, &by_name),
        16
    );
}

/// Two routes' layers on clones of one limit: one controller hears both. The first route's
/// server never fails, so alone it grows the limit to its max; once the second route's server
/// fails above 4 at once, its failures bring the shared limit down.
#[tokio::test(start_paused = true)]
async fn a_limit_shared_by_two_routes_has_one_controller() {
    let telemetry = Telemetry::new();
    let limit = adaptive(Vegas::default(), 32);
    let route = |operation: Operation, server: Arc<Server>| {
        ResourcesOperationLayer::new(limit.clone())
            .operation(operation)
            .metrics(telemetry.metrics.clone())
            .layer(service_fn(move |()| {
                let server = Arc::clone(&server);
                async move { server.serve().await }
            }))
    };
    let verify = route(Operation::Verify, flat());
    let judge = route(
        Operation::Judge,
        Arc::new(Server::new(4, 100 * MS, Above::Fails)),
    );

    let verify_calls = {
        let verify = verify.clone();
        move || {
            let verify = verify.clone();
            async move {
                verify.oneshot(()).await.unwrap();
            }
        }
    };
    drive(40, 3_000, verify_calls.clone()).await;
    assert_eq!(
        limit.capacity(),
        32,
        "the verify route alone grows it to max"
    );

    let judge_calls = move || {
        let judge = judge.clone();
        async move {
            let _ = judge.oneshot(()).await;
        }
    };
    let both = tokio::spawn(drive(40, 3_000, verify_calls));
    drive(40, 3_000, judge_calls).await;
    both.await.unwrap();
    assert!(
        limit.capacity() < 32,
        "the judge route's failures lower the shared limit: {}",
        limit.capacity()
    );
    // Both series report the one limit's capacity.
    let capacity = limit.capacity() as i64;
    for operation in ["verify", "judge"] {
        let filter = [(OPERATION_ATTRIBUTE, operation)];
        assert_eq!(telemetry.live_value(LIMIT_INSTRUMENT, &filter), capacity);
    }
}

/// A per-request layer's named adaptive limit adapts from the requests that choose it.
#[tokio::test(start_paused = true)]
async fn a_per_request_named_limit_adapts() {
    let telemetry = Telemetry::new();
    let judges = adaptive(Vegas::default(), 16);
    let server = flat();
    let layer = ResourcesOperationLayer::new(64)
        .metrics(telemetry.metrics.clone())
        .per_request(ChooseFn::new(|_: &()| {
            Choice::limited(Operation::Judge, Executor::Inline).on("judges")
        }))
        .limits([judges.clone()]);
    let service = layer.layer(service_fn(move |()| {
        let server = Arc::clone(&server);
        async move { server.serve().await }
    }));
    drive(32, 2_000, move || {
        let service = service.clone();
        async move {
            service.oneshot(()).await.unwrap();
        }
    })
    .await;
    assert_eq!(judges.capacity(), 16);
}

/// With metrics off an adaptive limit's operations still feed its controller, through the
/// layer and the scoped API alike.
#[tokio::test(start_paused = true)]
async fn metrics_off_still_adapts() {
    // A server that fails above 6: the limit settles at 6 or just under.
    let layer_limit = adaptive(Vegas::default(), 32);
    let server = Arc::new(Server::new(6, 100 * MS, Above::Fails));
    let service = ResourcesOperationLayer::new(layer_limit.clone())
        .metrics(OperationMetrics::disabled())
        .layer(service_fn(move |()| {
            let server = Arc::clone(&server);
            async move { server.serve().await }
        }));
    drive(32, 3_000, move || {
        let service = service.clone();
        async move {
            let _ = service.oneshot(()).await;
        }
    })
    .await;
    assert!(
        (4..=7).contains(&layer_limit.capacity()),
        "{}",
        layer_limit.capacity()
    );

    let scoped_limit = adaptive(Vegas::default(), 16);
    let server = flat();
    let limit = scoped_limit.clone();
    drive(32, 2_000, move || {
        let (limit, server) = (limit.clone(), Arc::clone(&server));
        async move {
            let served = OperationMetrics::disabled()
                .resources_operation(&limit, Operation::Tool, Executor::Thread, server.serve())
                .await;
            served.unwrap().unwrap();
        }
    })
    .await;
    assert_eq!(scoped_limit.capacity(), 16);
}

/// A limit that keeps the series of every end it hears: a `Limit` underneath.
#[derive(Clone, Debug)]
struct Listens {
    limit: Limit,
    heard: Arc<std::sync::Mutex<Vec<(Operation, Executor)>>>,
}

impl Listens {
    fn new(limit: Limit) -> Self {
        Self {
            limit,
            heard: Arc::default(),
        }
    }

    fn take(&self) -> Vec<(Operation, Executor)> {
        std::mem::take(&mut self.heard.lock().unwrap())
    }
}

impl tower_resources_operation::Acquire for Listens {
    type Permit = (
        LimitPermit,
        Arc<std::sync::Mutex<Vec<(Operation, Executor)>>>,
    );

    async fn acquire(&self) -> Result<Self::Permit, tower_resources_operation::Rejected> {
        let permit = self.limit.acquire().await?;
        Ok((permit, Arc::clone(&self.heard)))
    }

    fn capacity(&self) -> Option<tower_resources_operation::limit::Capacity> {
        tower_resources_operation::Acquire::capacity(&self.limit)
    }

    fn hears_ends(&self) -> bool {
        true
    }

    fn ended((_, heard): &Self::Permit, ended: &Ended) {
        heard
            .lock()
            .unwrap()
            .push((ended.operation(), ended.executor()));
    }
}

/// A limit hears each operation's series (its operation and executor) with its end, through
/// every form, with metrics on or off: what lets a controller read mixed work by kind.
#[tokio::test]
async fn every_form_tells_the_limit_each_operations_series_metrics_on_or_off() {
    let telemetry = Telemetry::new();
    for metrics in [telemetry.metrics.clone(), OperationMetrics::disabled()] {
        let listens = Listens::new(Limit::new(4));
        let limit = listens.clone();
        let layer = ResourcesOperationLayer::new(limit.clone())
            .operation(Operation::Verify)
            .executor(Executor::Subprocess)
            .metrics(metrics.clone());
        let service = layer.layer(service_fn(|()| async { Ok::<_, &str>(()) }));
        service.oneshot(()).await.unwrap();
        assert_eq!(listens.take(), [(Operation::Verify, Executor::Subprocess)]);

        metrics
            .resources_operation(&limit, Operation::Judge, Executor::Inline, async {
                Ok::<_, &str>(())
            })
            .await
            .unwrap()
            .unwrap();
        assert_eq!(listens.take(), [(Operation::Judge, Executor::Inline)]);

        // Per request, into a named limit: the series each request chose.
        let named = Listens {
            limit: Limit::builder(4).name("shared").build(),
            heard: Arc::clone(&listens.heard),
        };
        let own = Listens::new(Limit::new(4));
        let per_request = ResourcesOperationLayer::new(own)
            .metrics(metrics.clone())
            .per_request(ChooseFn::new(|operation: &Operation| {
                Choice::limited(*operation, Executor::Thread).on("shared")
            }))
            .limits([named]);
        let service = per_request.layer(service_fn(|_: Operation| async { Ok::<_, &str>(()) }));
        for operation in [Operation::Tool, Operation::Other] {
            service.clone().oneshot(operation).await.unwrap();
        }
        assert_eq!(
            listens.take(),
            [
                (Operation::Tool, Executor::Thread),
                (Operation::Other, Executor::Thread)
            ]
        );
    }
}

// -------------------------------------------------------------------------------------------------
// Its rules.

/// The controller's gauges: a named adaptive limit reports its baseline and estimate in
/// milliseconds under its name alone; a limit with no name, or no controller, reports none.
#[tokio::test(start_paused = true)]
async fn a_named_adaptive_limit_reports_its_baseline_and_estimate() {
    let telemetry = Telemetry::new();
    let named = adaptive(Vegas::default(), 8);
    let unnamed = Limit::builder(1)
        .adaptive(Adaptive::new(Vegas::default(), 1..=8))
        .build();
    let fixed = Limit::builder(4).name("fixed").build();
    let server = flat();
    for limit in [named.clone(), unnamed, fixed] {
        let (metrics, server) = (telemetry.metrics.clone(), Arc::clone(&server));
        drive(8, 200, move || {
            let (limit, server, metrics) = (limit.clone(), Arc::clone(&server), metrics.clone());
            async move {
                let served = metrics
                    .resources_operation(&limit, Operation::Judge, Executor::Inline, server.serve())
                    .await;
                served.unwrap().unwrap();
            }
        })
        .await;
    }
    for instrument in [LIMIT_BASELINE_INSTRUMENT, LIMIT_ESTIMATE_INSTRUMENT] {
        let exported = telemetry
            .collect()
            .into_iter()
            .find(|m| m.name == instrument)
            .unwrap_or_else(|| panic!("{instrument} exported"));
        assert_eq!(exported.unit, "ms");
        assert!(exported.description.len() > 20, "{instrument} described");
        let support::Data::GaugeF64(points) = exported.data else {
            panic!("{instrument} is an f64 gauge")
        };
        assert_eq!(points.len(), 1, "only the named adaptive limit: {points:?}");
        let point = &points[0];
        assert_eq!(
            point.attributes.keys().collect::<Vec<_>>(),
            [LIMIT_ATTRIBUTE, LIMIT_SCOPE_ATTRIBUTE],
            "bounded: the limit's name and scope alone"
        );
        assert_eq!(point.attributes[LIMIT_ATTRIBUTE], "judges");
        assert_eq!(point.attributes[LIMIT_SCOPE_ATTRIBUTE], "process");
        // 100 ms give or take 10%, the moving average and the lowest of it.
        within(instrument, point.value, 85.0..=115.0);
    }
}

/// The limit's own rejections say it is too small for the demand: a controller that shrank
/// for them would turn away more. A flat server behind a limit that keeps nobody waiting grows
/// to max however many are turned away.
#[tokio::test(start_paused = true)]
async fn the_limits_own_rejections_do_not_shrink_it() {
    let limit = Limit::builder(1)
        .max_queued(0)
        .adaptive(Adaptive::new(Vegas::default(), 1..=16))
        .build();
    let server = flat();
    let rejected = Arc::new(AtomicUsize::new(0));
    let (l, s, r) = (limit.clone(), Arc::clone(&server), Arc::clone(&rejected));
    drive(32, 10_000, move || {
        let (limit, server, rejected) = (l.clone(), Arc::clone(&s), Arc::clone(&r));
        async move {
            let served = OperationMetrics::disabled()
                .resources_operation(&limit, Operation::Tool, Executor::Thread, async {
                    server.serve().await
                })
                .await;
            if served.is_err() {
                rejected.fetch_add(1, SeqCst);
                // A client that was turned away tries again a little later.
                tokio::time::sleep(50 * MS).await;
            }
        }
    })
    .await;
    assert!(rejected.load(SeqCst) > 1_000, "{}", rejected.load(SeqCst));
    assert_eq!(limit.capacity(), 16);
}

/// Lowering revokes nobody: operations that run when the controller lowers the capacity finish
/// with their own outcome, and the places above the new capacity go as they do.
#[tokio::test(start_paused = true)]
async fn lowering_the_capacity_revokes_no_running_operation() {
    let telemetry = Telemetry::new();
    let limit = Limit::builder(4)
        .adaptive(Adaptive::new(Vegas::default(), 1..=4))
        .build();
    let service = ResourcesOperationLayer::new(limit.clone())
        .metrics(telemetry.metrics.clone())
        .layer(service_fn(|fail: oneshot::Receiver<bool>| async move {
            match fail.await {
                Ok(true) => Err("failed"),
                _ => Ok::<_, &str>(()),
            }
        }));
    let mut held = Vec::new();
    for _ in 0..4 {
        let (finish, rx) = oneshot::channel();
        held.push((finish, tokio::spawn(service.clone().oneshot(rx))));
    }
    support::settle().await;
    assert_eq!(limit.available(), 0);

    // One fails: congestion closes the window at once, and the capacity drops to 3.
    let (fail, task) = held.pop().unwrap();
    fail.send(true).unwrap();
    assert!(task.await.unwrap().is_err());
    assert_eq!(limit.capacity(), 3);
    // The three still running finish `ok`, and their places come back as 3.
    for (finish, task) in held {
        finish.send(false).unwrap();
        task.await.unwrap().unwrap();
    }
    assert_eq!(telemetry.ended(&[], "ok"), 3);
    assert_eq!((limit.available(), limit.capacity()), (3, 3));
}

/// The capacity stays within the bounds: a limit built below them starts at their bottom, and
/// an algorithm that names a capacity outside them is clamped.
#[tokio::test(start_paused = true)]
async fn the_capacity_stays_within_the_bounds() {
    /// Names a capacity far outside any bounds, alternately too high and too low.
    #[derive(Clone)]
    struct Wild(bool);
    impl Algorithm for Wild {
        fn update(&mut self, _: &Sample) -> usize {
            self.0 = !self.0;
            if self.0 {
                1_000
            } else {
                0
            }
        }
    }

    let limit = Limit::builder(1)
        .adaptive(Adaptive::new(Wild(false), 3..=5))
        .build();
    assert_eq!(limit.capacity(), 3, "starts at the bottom of the bounds");
    let server = flat();
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..20 {
        let (l, s) = (limit.clone(), Arc::clone(&server));
        drive(8, 16, move || {
            let (limit, server) = (l.clone(), Arc::clone(&s));
            async move {
                let served = OperationMetrics::disabled()
                    .resources_operation(&limit, Operation::Tool, Executor::Thread, server.serve())
                    .await;
                served.unwrap().unwrap();
            }
        })
        .await;
        seen.insert(limit.capacity());
    }
    assert_eq!(seen, [3, 5].into(), "clamped to 3..=5");
}

/// An algorithm that panics keeps the capacity as it is, and the operations go on.
#[tokio::test(start_paused = true)]
async fn an_algorithm_that_panics_keeps_the_capacity() {
    #[derive(Clone)]
    struct Panics;
    impl Algorithm for Panics {
        fn update(&mut self, _: &Sample) -> usize {
            panic!("an algorithm's bug")
        }
    }
    let limit = Limit::builder(2)
        .adaptive(Adaptive::new(Panics, 1..=8))
        .build();
    let server = flat();
    let (l, s) = (limit.clone(), Arc::clone(&server));
    drive(4, 40, move || {
        let (limit, server) = (l.clone(), Arc::clone(&s));
        async move {
            let served = OperationMetrics::disabled()
                .resources_operation(&limit, Operation::Tool, Executor::Thread, server.serve())
                .await;
            served.unwrap().unwrap();
        }
    })
    .await;
    assert_eq!(limit.capacity(), 2);
}

// -------------------------------------------------------------------------------------------------
// Real work.

/// Runs one CPU-bound "verifier": a shell busy loop of `iterations`.
fn verifier(iterations: u64) {
    let status = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!(
            "i=0; while [ $i -lt {iterations} ]; do i=$((i+1)); done"
        ))
        .status()
        .expect("sh runs");
    assert!(status.success());
}

/// CPU-bound verifier subprocesses through a limit that starts at 1, within `1..=64`, and 16
/// clients per core: on a machine with C cores the run time holds up to about C at once and
/// grows past it, so the limit should settle near C (a queue of 1 or 2 above it), far below
/// the bounds and the clients. The test prints the mean capacity of the second half of the run
/// (on 2 cores, at most 8 is the goal: more only queues at the CPU) and asserts only that the
/// limit moved and stays sane: other work on the machine shares its cores. Measure on a quiet
/// machine:
///
/// ```text
/// cargo test --test adaptive cpu_bound -- --nocapture
/// ```
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cpu_bound_verifiers_settle_near_the_number_of_cores() {
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    // About 40 ms of one core per verifier, calibrated here.
    let probe = 20_000;
    let started = std::time::Instant::now();
    tokio::task::spawn_blocking(move || verifier(probe))
        .await
        .unwrap();
    let per_iteration = started.elapsed().as_secs_f64() / probe as f64;
    let iterations = ((0.04 / per_iteration) as u64).clamp(1_000, 2_000_000);

    let telemetry = Telemetry::new();
    let verifiers = Limit::builder(1)
        .name("verifiers")
        .adaptive(Adaptive::new(Vegas::default(), 1..=64))
        .build();
    let until = std::time::Instant::now() + secs(10);
    let mut readings = Vec::new();
    let clients: Vec<_> = (0..16 * cores)
        .map(|_| {
            let (limit, metrics) = (verifiers.clone(), telemetry.metrics.clone());
            tokio::spawn(async move {
                while std::time::Instant::now() < until {
                    let verified = metrics
                        .resources_operation(
                            &limit,
                            Operation::Verify,
                            Executor::Subprocess,
                            async {
                                tokio::task::spawn_blocking(move || verifier(iterations)).await
                            },
                        )
                        .await;
                    verified.unwrap().unwrap();
                }
            })
        })
        .collect();
    while std::time::Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(250)).await;
        readings.push(verifiers.capacity());
    }
    for client in clients {
        client.await.unwrap();
    }
    let by_name = [(LIMIT_ATTRIBUTE, "verifiers")];
    let baseline = telemetry.gauge_f64(LIMIT_BASELINE_INSTRUMENT, &by_name);
    let estimate = telemetry.gauge_f64(LIMIT_ESTIMATE_INSTRUMENT, &by_name);
    let settled = &readings[readings.len() / 2..];
    let mean = settled.iter().sum::<usize>() as f64 / settled.len() as f64;
    println!(
        "verifiers on {cores} cores ({iterations} iterations each): capacity every 0.25 s: \
         {readings:?}; settled mean {mean:.1}; baseline {baseline:.1?} ms, estimate \
         {estimate:.1?} ms"
    );
    assert!(
        readings.iter().any(|&capacity| capacity > 1),
        "the limit never moved from 1"
    );
    within("settled capacity", mean, 1.0..=64.0);
    assert!(baseline.is_some() && estimate.is_some());
}

/// `iterations` of a busy loop: a verifier's work, on whichever thread runs it.
fn busy(iterations: u64) -> u64 {
    let mut x = 0u64;
    for _ in 0..iterations {
        x = std::hint::black_box(x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1));
    }
    x
}

/// CPU-bound verifiers on blocking threads (a busy loop of about 10 ms of one core each,
/// calibrated here), through a limit that starts at 1, within `1..=64`, and 16 clients per
/// core, for 20 s: on a machine with C cores each one more above C shares the cores by turns,
/// so the run time grows a little with each (not at once, as behind a server's queue). The
/// limit should settle near C (a queue of 1 or 2 above it), not climb with a baseline that
/// follows the queue up. The test prints the mean capacity of the second half of the run (on 2
/// cores, at most 8 is the goal: more only queues at the CPU) and asserts only that the limit
/// moved and stays within its bounds: other work on the machine shares its cores. Measure on a
/// quiet machine:
///
/// ```text
/// cargo test --test adaptive busy_loop -- --ignored --nocapture
/// ```
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "20 s of every core: cargo test --test adaptive busy_loop -- --ignored --nocapture"]
async fn busy_loop_verifiers_on_threads_settle_near_the_number_of_cores() {
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let probe = 10_000_000;
    let started = std::time::Instant::now();
    tokio::task::spawn_blocking(move || busy(probe))
        .await
        .unwrap();
    let per_iteration = started.elapsed().as_secs_f64() / probe as f64;
    let iterations = (0.01 / per_iteration) as u64;

    let verifiers = Limit::builder(1)
        .name("verifiers")
        .adaptive(Adaptive::new(Vegas::default(), 1..=64))
        .build();
    let until = std::time::Instant::now() + secs(20);
    let clients: Vec<_> = (0..16 * cores)
        .map(|_| {
            let limit = verifiers.clone();
            tokio::spawn(async move {
                while std::time::Instant::now() < until {
                    let verified = OperationMetrics::disabled()
                        .resources_operation(&limit, Operation::Verify, Executor::Thread, async {
                            tokio::task::spawn_blocking(move || busy(iterations)).await
                        })
                        .await;
                    verified.unwrap().unwrap();
                }
            })
        })
        .collect();
    let mut readings = Vec::new();
    while std::time::Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(250)).await;
        readings.push(verifiers.capacity());
    }
    for client in clients {
        client.await.unwrap();
    }
    let settled = &readings[readings.len() / 2..];
    let mean = settled.iter().sum::<usize>() as f64 / settled.len() as f64;
    println!(
        "busy-loop verifiers on {cores} cores ({iterations} iterations each): capacity every \
         0.25 s: {readings:?}; second half mean {mean:.2}"
    );
    assert!(
        readings.iter().any(|&capacity| capacity > 1),
        "the limit never moved from 1"
    );
    within("settled capacity", mean, 1.0..=64.0);
}

/// The baseline gauge reads the run time at low load, within 10%, where the server keeps a
/// queue of its own: 6 slots of 40 to 47 ms, behind an adaptive limit that 24 clients keep full.
/// (`baseline.rs` pins the cause of a drift found on real time: a round trip at 8 closed on
/// the 6 operations that found a slot must not make 8 a load without a queue.)
#[tokio::test(start_paused = true)]
async fn the_baseline_reads_the_low_load_run_time_behind_a_server_queue() {
    use tower_resources_operation::adaptive::Vegas;

    let telemetry = Telemetry::new();
    let limit = adaptive(Vegas::default(), 32);
    let slots = Arc::new(tokio::sync::Semaphore::new(6));
    let next = Arc::new(AtomicUsize::new(0));
    let metrics = telemetry.metrics.clone();
    let (started, run) = (tokio::time::Instant::now(), secs(6));
    let clients: Vec<_> = (0..24)
        .map(|_| {
            let (limit, slots, metrics) = (limit.clone(), Arc::clone(&slots), metrics.clone());
            let next = Arc::clone(&next);
            tokio::spawn(async move {
                while started.elapsed() < run {
                    let (slots, next) = (Arc::clone(&slots), Arc::clone(&next));
                    let work = async move {
                        let _slot = slots.acquire().await.expect("open");
                        // 40 to 47 ms, as a real one varies: ends that arrive one by one.
                        let jitter = (next.fetch_add(1, SeqCst) as u64)
                            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
                            >> 61;
                        tokio::time::sleep(Duration::from_millis(40 + jitter)).await;
                        Ok::<_, std::convert::Infallible>(())
                    };
                    let served = metrics
                        .resources_operation(&limit, Operation::Judge, Executor::Inline, work)
                        .await;
                    served.unwrap().unwrap();
                }
            })
        })
        .collect();
    for client in clients {
        client.await.unwrap();
    }
    let exported = telemetry
        .collect()
        .into_iter()
        .find(|m| m.name == LIMIT_BASELINE_INSTRUMENT)
        .expect("the baseline exported");
    let support::Data::GaugeF64(points) = exported.data else {
        panic!("an f64 gauge")
    };
    println!(
        "baseline {:.1} ms, capacity {}",
        points[0].value,
        limit.capacity()
    );
    // The run time without a queue is 43.5 ms on average: within 10%.
    within("baseline (ms)", points[0].value, 39.2..=47.9);
    // 6 slots, and a queue of 1 to 2 kept in front of them (a place more, for the mix of
    // operations admitted before the last step).
    assert!(
        (6..=9).contains(&limit.capacity()),
        "capacity {}",
        limit.capacity()
    );
}
