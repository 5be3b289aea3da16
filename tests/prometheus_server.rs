//! Against a real Prometheus server, scraping an axum app in-process on 127.0.0.1:
//!
//! - the example's app (examples/axum.rs), scraped every second, driven with a limit that is too
//!   small, then asked with PromQL what the README, the dashboard and the alerts ask;
//! - the Getting-started setup, one named limit of 2 with a queue of 8 shared by `/verify` and
//!   `/judge` under 14 clients, scraped every 250 ms by a Prometheus that evaluates
//!   dashboards/prometheus/alerts.yml (its `for:` shortened, see [`quick_rules`]): the per-limit
//!   `ResourcesOperationLimitSaturated` fires while each route's own series reads half used.
//!
//! They need a `prometheus` binary on PATH, so they are `#[ignore]`d: `cargo test` counts them
//! as ignored, and `cargo test -- --include-ignored` (the README's test command) runs them, and
//! fails them, saying what to install, if `prometheus` is missing.

#[path = "../examples/axum.rs"]
#[allow(dead_code)]
mod app;
mod support;

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::routing::get;
use axum::Router;
use serde_json::Value;
use tower::Layer as _;
use tower_resources_operation::adaptive::{Adaptive, Vegas};
use tower_resources_operation::{
    Executor, Limit, Operation, OperationMetrics, ResourcesOperationLayer,
};

use support::http::{serve, Client};
use support::prometheus::{label, reads_named_limits, require_binary, Exporter, TempDir};

/// How long to wait for Prometheus to start, or to have scraped what was done; a safety net so
/// a broken setup fails instead of hanging, not a performance bound.
const PATIENCE: Duration = Duration::from_secs(20);

/// How a [`Prometheus`] scrapes its target and what it evaluates.
struct Setup {
    /// The scrape interval, which is also the scrape timeout and the rule evaluation interval,
    /// in Prometheus' syntax (`1s`, `250ms`).
    interval: &'static str,
    /// The text of a rule file to load, if any.
    rules: Option<String>,
}

/// A `prometheus` child process scraping one target; killed when dropped, panics included.
struct Prometheus {
    child: Child,
    addr: SocketAddr,
    log: PathBuf,
    /// Declared last: removed after the process is gone.
    dir: TempDir,
}

impl Prometheus {
    /// Starts Prometheus on a free port of 127.0.0.1, scraping `target` as `setup` says, and
    /// waits until it is ready. Tries another port if the one picked was taken in the meantime.
    async fn start(binary: &Path, target: SocketAddr, setup: &Setup) -> Self {
        let mut last_log = String::new();
        for _ in 0..3 {
            let dir = TempDir::new("tower-resources-operation-prometheus");
            let config = dir.path().join("prometheus.yml");
            let interval = setup.interval;
            let mut text = format!(
                "global:\n  scrape_interval: {interval}\n  scrape_timeout: {interval}\n  \
                 evaluation_interval: {interval}\n\
                 scrape_configs:\n  - job_name: app\n    static_configs:\n      - targets: [\"{target}\"]\n"
            );
            if let Some(rules) = &setup.rules {
                let file = dir.path().join("rules.yml");
                std::fs::write(&file, rules).expect("write rules.yml");
                text.push_str(&format!("rule_files:\n  - {}\n", file.display()));
            }
            std::fs::write(&config, text).expect("write prometheus.yml");
            let addr: SocketAddr = format!("127.0.0.1:{}", support::prometheus::free_port())
                .parse()
                .unwrap();
            let log = dir.path().join("prometheus.log");
            let log_file = std::fs::File::create(&log).expect("create log");
            let child = Command::new(binary)
                .arg(format!("--config.file={}", config.display()))
                .arg(format!(
                    "--storage.tsdb.path={}",
                    dir.path().join("data").display()
                ))
                .arg(format!("--web.listen-address={addr}"))
                .arg("--log.level=warn")
                .stdin(Stdio::null())
                .stdout(log_file.try_clone().expect("log file"))
                .stderr(log_file)
                .spawn()
                .unwrap_or_else(|e| panic!("start {}: {e}", binary.display()));
            let mut prometheus = Prometheus {
                child,
                addr,
                log,
                dir,
            };
            if prometheus.wait_ready().await {
                return prometheus;
            }
            last_log = prometheus.log();
        }
        panic!("Prometheus did not start; its log:\n{last_log}");
    }

    /// Waits for `/-/ready`; false if the process exited first (e.g. its port was taken).
    async fn wait_ready(&mut self) -> bool {
        let started = Instant::now();
        while started.elapsed() < PATIENCE {
            if let Ok(Some(status)) = self.child.try_wait() {
                eprintln!("prometheus exited early ({status}):\n{}", self.log());
                return false;
            }
            if let Ok((200, _)) = app::http_get(self.addr, "/-/ready", "HTTP/1.0").await {
                // Ready, but is it this one? A port free a moment ago may be another test's
                // Prometheus's by now (this one then exits); that one's answers must never pass
                // for this one's. Each has a data directory of its own.
                let data = self.dir.path().join("data").display().to_string();
                return match app::http_get(self.addr, "/api/v1/status/flags", "HTTP/1.0").await {
                    Ok((200, flags)) if flags.contains(&data) => true,
                    _ => {
                        eprintln!("another Prometheus answers on {}", self.addr);
                        false
                    }
                };
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!(
            "Prometheus not ready after {PATIENCE:?}; its log:\n{}",
            self.log()
        );
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The `data.result` of an instant query.
    async fn query(&self, promql: &str) -> Vec<Value> {
        self.instant_query(promql, None).await
    }

    /// The `data.result` of an instant query evaluated at `time` (unix seconds).
    async fn query_at(&self, promql: &str, time: f64) -> Vec<Value> {
        self.instant_query(promql, Some(time)).await
    }

    /// The `data.result` of an instant query, evaluated at `time` (unix seconds) if given, else
    /// now. HTTP/1.0, so Go answers without chunking.
    async fn instant_query(&self, promql: &str, time: Option<f64>) -> Vec<Value> {
        let mut path = format!(
            "/api/v1/query?query={}",
            support::prometheus::urlencode(promql)
        );
        if let Some(time) = time {
            path.push_str(&format!("&time={time:.3}"));
        }
        let (status, body) = app::http_get(self.addr, &path, "HTTP/1.0")
            .await
            .unwrap_or_else(|e| panic!("query {promql}: {e}"));
        let json: Value =
            serde_json::from_str(&body).unwrap_or_else(|e| panic!("query {promql}: {e}: {body}"));
        assert!(
            status == 200 && json["status"] == "success",
            "query {promql}: {status} {body}\nPrometheus log:\n{}",
            self.log()
        );
        json["data"]["result"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    }

    /// The value of a query that returns one element, `None` if it returns none.
    async fn scalar(&self, promql: &str) -> Option<f64> {
        let result = self.query(promql).await;
        match result.as_slice() {
            [] => None,
            [one] => Some(sample_value(&one["value"])),
            many => panic!("{promql}: expected one element, got {many:?}"),
        }
    }

    /// The 0.95 quantile of `histogram` over the last minute, by operation.
    async fn p95_per_operation(&self, histogram: &str) -> BTreeMap<String, f64> {
        let promql = format!(
            "histogram_quantile(0.95, sum by (le, nemo_gym_resources_operation) \
             (rate({histogram}_bucket[1m])))"
        );
        self.by_label(&promql, label::OPERATION).await
    }

    /// The value of each element of a query's result, by the value of `label`.
    async fn by_label(&self, promql: &str, label: &str) -> BTreeMap<String, f64> {
        values_by_label(&self.query(promql).await, label)
    }

    /// [`Prometheus::by_label`] of a query evaluated at `time` (unix seconds).
    async fn by_label_at(&self, promql: &str, label: &str, time: f64) -> BTreeMap<String, f64> {
        values_by_label(&self.query_at(promql, time).await, label)
    }

    /// Polls `promql` until it returns `expected`.
    async fn wait_for(&self, promql: &str, expected: f64) {
        let started = Instant::now();
        loop {
            let value = self.scalar(promql).await;
            if value == Some(expected) {
                return;
            }
            if started.elapsed() > PATIENCE {
                panic!(
                    "{promql} was {value:?}, not {expected}, after {PATIENCE:?}; up: {:?}\nPrometheus log:\n{}",
                    self.query("up").await,
                    self.log()
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Raw samples of a range selector, summed per scrape: unix milliseconds to the sum.
    async fn raw_sums(&self, selector: &str) -> BTreeMap<u64, f64> {
        let mut sums: BTreeMap<u64, f64> = BTreeMap::new();
        for series in self.query(selector).await {
            for point in series["values"].as_array().into_iter().flatten() {
                let millis = (point[0].as_f64().expect("timestamp") * 1000.0).round() as u64;
                *sums.entry(millis).or_default() += sample_value(point);
            }
        }
        sums
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The value of each element of a query's `result`, by the value of its `label`.
fn values_by_label(result: &[Value], label: &str) -> BTreeMap<String, f64> {
    result
        .iter()
        .map(|element| {
            (
                element["metric"][label].as_str().unwrap_or("").to_owned(),
                sample_value(&element["value"]),
            )
        })
        .collect()
}

/// `[timestamp, "value"]` to the value.
fn sample_value(pair: &Value) -> f64 {
    let text = pair[1].as_str().expect("sample value string");
    match text {
        "NaN" => f64::NAN,
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        other => other.parse().expect("sample value"),
    }
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock")
        .as_secs_f64()
}

/// The example's app as the first test runs it: limits of 2, and a deadline that the burst's
/// verifies stay well within.
const CONFIG: app::Config = app::Config {
    shared_limit: 2,
    tool_limit: 2,
    verify_deadline: Duration::from_secs(10),
};
/// How long each operation of the burst runs.
const WORK_MS: u64 = 150;
const VERIFIES: usize = 16;
const JUDGES: usize = 8;
const TOOLS: usize = 4;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs prometheus and promtool on PATH (apt-get install prometheus); run with --include-ignored"]
async fn a_real_prometheus_sees_the_limit_bind() {
    let binary = require_binary("prometheus", "tests/prometheus_server.rs");

    let telemetry = app::Telemetry::new(None).expect("telemetry");
    let target = serve(app::app(&CONFIG, &telemetry)).await;

    // One request per route first, so that every histogram series exists in the first scrape:
    // `rate` counts increases from a series' first sample on.
    let warm_up = ["/verify?ms=1", "/judge?ms=1", "/tool?ms=1"];
    assert_eq!(app::burst(target, &warm_up).await, [200, 200, 200]);

    // A named adaptive limit beside the app's, so that the dashboard's panels of named and
    // adaptive limits have data: a layer registers it with the app's metrics (which counts no
    // operation), and operations with metrics off feed its controller (one controller whatever
    // records), so the app's counts stay its own.
    let judges = Limit::builder(1)
        .name("judges")
        .adaptive(Adaptive::new(Vegas::default(), 1..=4))
        .build();
    let _registered = ResourcesOperationLayer::new(judges.clone())
        .metrics(telemetry.metrics.clone())
        .layer(tower::service_fn(|()| async { Ok::<_, Infallible>(()) }));
    for _ in 0..16 {
        let judged = OperationMetrics::disabled()
            .resources_operation(&judges, Operation::Other, Executor::Other, async {
                Ok::<_, Infallible>(())
            })
            .await;
        judged.unwrap().unwrap();
    }

    let setup = Setup {
        interval: "1s",
        rules: None,
    };
    let prometheus = Prometheus::start(&binary, target, &setup).await;
    prometheus
        .wait_for("sum(gym_resources_operation_duration_ms_count)", 3.0)
        .await;
    prometheus.wait_for(r#"up{job="app"}"#, 1.0).await;

    // The burst: 24 operations of 150 ms at once on a limit of 2 shared by verify and judge
    // (twelve rounds, so most of them wait), and 4 tool runs on their own limit of 2.
    let mut paths = Vec::new();
    for i in 0..VERIFIES + JUDGES {
        let route = if i % 3 == 2 { "judge" } else { "verify" };
        paths.push(format!("/{route}?ms={WORK_MS}"));
    }
    for _ in 0..TOOLS {
        paths.push(format!("/tool?ms={WORK_MS}"));
    }
    let burst_start = unix_now();
    let statuses = tokio::time::timeout(PATIENCE, app::burst(target, &paths))
        .await
        .expect("burst hung");
    let burst_end = unix_now();
    assert!(statuses.iter().all(|&s| s == 200), "{statuses:?}");

    // Wait for a scrape after the burst: every operation counted, nothing waiting or running.
    let total = (warm_up.len() + paths.len()) as f64;
    prometheus
        .wait_for("sum(gym_resources_operation_duration_ms_count)", total)
        .await;
    prometheus
        .wait_for("sum(gym_resources_operation_queued)", 0.0)
        .await;
    prometheus
        .wait_for("sum(gym_resources_operation_active)", 0.0)
        .await;

    // Counts per operation and per outcome.
    let per_operation = prometheus
        .by_label(
            "sum by (nemo_gym_resources_operation) (gym_resources_operation_duration_ms_count)",
            label::OPERATION,
        )
        .await;
    assert_eq!(
        per_operation,
        BTreeMap::from([
            ("judge".to_owned(), (JUDGES + 1) as f64),
            ("tool".to_owned(), (TOOLS + 1) as f64),
            ("verify".to_owned(), (VERIFIES + 1) as f64),
        ])
    );
    let per_outcome = prometheus
        .by_label(
            "sum by (nemo_gym_resources_operation_outcome) (gym_resources_operation_duration_ms_count)",
            "nemo_gym_resources_operation_outcome",
        )
        .await;
    assert_eq!(per_outcome, BTreeMap::from([("ok".to_owned(), total)]));
    let admitted = prometheus
        .scalar("sum(gym_resources_operation_queue_duration_ms_count)")
        .await;
    assert_eq!(admitted, Some(total));

    // The limit binds: for verify, the queue p95 is above the run p95.
    let queue_p95 = prometheus
        .p95_per_operation("gym_resources_operation_queue_duration_ms")
        .await;
    let run_p95 = prometheus
        .p95_per_operation("gym_resources_operation_duration_ms")
        .await;
    let verify = |p95: &BTreeMap<String, f64>| {
        p95.get("verify")
            .copied()
            .unwrap_or_else(|| panic!("no verify p95 in {p95:?}"))
    };
    let (queue, run) = (verify(&queue_p95), verify(&run_p95));
    assert!(
        queue > run,
        "verify: queue p95 {queue} ms should be above run p95 {run} ms; queue {queue_p95:?}, run {run_p95:?}"
    );
    assert!(
        run >= WORK_MS as f64 * 0.5,
        "run p95 {run} for {WORK_MS} ms of work"
    );

    // Mean queue time over mean run time, as the dashboard shows it: above 1 for verify.
    let ratio = prometheus
        .by_label(
            "(sum by (nemo_gym_resources_operation) (rate(gym_resources_operation_queue_duration_ms_sum[1m])) \
              / sum by (nemo_gym_resources_operation) (rate(gym_resources_operation_queue_duration_ms_count[1m]))) \
             / (sum by (nemo_gym_resources_operation) (rate(gym_resources_operation_duration_ms_sum[1m])) \
              / sum by (nemo_gym_resources_operation) (rate(gym_resources_operation_duration_ms_count[1m])))",
            label::OPERATION,
        )
        .await;
    assert!(verify(&ratio) > 1.0, "{ratio:?}");

    // The live counts as scraped: the shared limit never above 2, the tool's never above 2;
    // during the burst (away from its edges) work queued and the shared limit full, but for a
    // place in hand-over. The series count an operation from the poll that sees its place, so
    // a scrape between one's end and its waiter's first poll reads one fewer active (the
    // limit's own count has no such gap: `limit_gauge.rs`, and the next test's named limit).
    let shared = r#"{nemo_gym_resources_operation=~"verify|judge"}"#;
    let active = prometheus
        .raw_sums(&format!("gym_resources_operation_active{shared}[2m]"))
        .await;
    let queued = prometheus
        .raw_sums(&format!("gym_resources_operation_queued{shared}[2m]"))
        .await;
    assert!(
        active.values().all(|&v| v <= CONFIG.shared_limit as f64),
        "{active:?}"
    );
    let tool_peak = prometheus
        .scalar(r#"max_over_time(gym_resources_operation_active{nemo_gym_resources_operation="tool"}[2m])"#)
        .await;
    assert!(
        tool_peak.is_some_and(|v| v <= CONFIG.tool_limit as f64),
        "{tool_peak:?}"
    );
    let (from, to) = (
        ((burst_start + 0.3) * 1000.0) as u64,
        ((burst_end - 0.4) * 1000.0) as u64,
    );
    let inside: Vec<(u64, f64, f64)> = active
        .range(from..to.max(from))
        .map(|(&t, &a)| (t, a, queued.get(&t).copied().unwrap_or(f64::NAN)))
        .collect();
    eprintln!(
        "verify: queue p95 {queue:.0} ms, run p95 {run:.0} ms, mean queue/run {:.1}; \
         scrapes inside the burst (active, queued): {:?}",
        verify(&ratio),
        inside.iter().map(|&(_, a, q)| (a, q)).collect::<Vec<_>>()
    );
    if inside.is_empty() {
        eprintln!(
            "note: no scrape fell inside the burst ({burst_start:.3}..{burst_end:.3}); \
             samples: {active:?}"
        );
    }
    let full = CONFIG.shared_limit as f64;
    for &(t, active, queued) in &inside {
        assert!(
            active == full || active == full - 1.0,
            "active at {t}: {inside:?}"
        );
        assert!(queued > 0.0, "queued at {t}: {inside:?}");
    }

    // Every query of the dashboard returns data from this server, but those of the per-limit
    // panels, which only a named limit feeds: they return data if and only if the app names its
    // limits.
    let named = !prometheus
        .query("gym_resources_limit_capacity")
        .await
        .is_empty();
    every_dashboard_query_answers(&prometheus, named).await;
}

/// Asserts that every query of the dashboard returns data, with every variable at All; those
/// that read a named limit's series only if `named`, and then none if not.
async fn every_dashboard_query_answers(prometheus: &Prometheus, named: bool) {
    let dashboard = support::prometheus::load_dashboard();
    let queries = support::prometheus::panel_queries(&dashboard);
    assert!(!queries.is_empty());
    assert!(queries.iter().any(|query| reads_named_limits(&query.expr)));
    // An adaptive limit's series exist only where a limit has a controller, and a fleet limit's
    // only where the app runs one.
    let adaptive = !prometheus
        .query("gym_resources_limit_adaptive_baseline_ms")
        .await
        .is_empty();
    let fleet = !prometheus
        .query("gym_resources_limit_unheard")
        .await
        .is_empty();
    for query in queries {
        let expr = support::prometheus::substitute_grafana_variables(&query.expr, "1m");
        let result = prometheus.query(&expr).await;
        let expected = if query.expr.contains("gym_resources_limit_adaptive_") {
            adaptive
        } else if query.expr.contains("gym_resources_limit_unheard") {
            fleet
        } else {
            named || !reads_named_limits(&query.expr)
        };
        assert_eq!(
            !result.is_empty(),
            expected,
            "panel {:?} query {}: {result:?} for {expr}",
            query.panel,
            query.ref_id
        );
    }
}

/// The Getting-started setup: one limit of 2 places and a queue of 8, named, shared by `/verify`
/// and `/judge`.
const NAMED_LIMIT: &str = "verifiers";
const NAMED_CAPACITY: usize = 2;
const NAMED_MAX_QUEUED: usize = 8;
/// Clients that ask all the time: 7 on each route, 2 run, 8 wait, the rest are turned away.
const CLIENTS: usize = 14;
/// How long operations run: from 50 to 149 ms, 100 on average, in a fixed order. Varied, so
/// that the order in which the clients cycle through the limit drifts against the scrapes.
fn named_work() -> Duration {
    static CALLS: AtomicU64 = AtomicU64::new(0);
    let call = CALLS.fetch_add(1, Ordering::Relaxed);
    Duration::from_millis(50 + call * 37 % 100)
}
/// How long a client that was turned away waits before it asks again.
const RETRY_AFTER: Duration = Duration::from_millis(25);
/// The `for:` of every rule in the copy of alerts.yml this test loads, instead of 10 minutes.
const QUICK_FOR: &str = "3s";
/// The load lasts at least this long, so that the per-series averages have many scrapes in them.
const LOAD_AT_LEAST: Duration = Duration::from_secs(8);
/// What the saturation alert is called, per limit (`scope="limit"`) and per series.
const SATURATED: &str = "ResourcesOperationLimitSaturated";

/// dashboards/prometheus/alerts.yml with every rule's `for:` shortened to `for_`, so that a test
/// sees an alert fire within seconds instead of after 10 minutes. The expressions, their 5-minute
/// windows and the annotations are left as they are.
fn quick_rules(for_: &str) -> String {
    let path = support::prometheus::root().join(support::prometheus::ALERTS);
    let text =
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    let mut shortened = 0;
    let lines: Vec<String> = text
        .lines()
        .map(|line| {
            let trimmed = line.trim_start();
            if trimmed.starts_with("for:") {
                shortened += 1;
                format!("{}for: {for_}", &line[..line.len() - trimmed.len()])
            } else {
                line.to_owned()
            }
        })
        .collect();
    let rules = text
        .lines()
        .filter(|line| line.trim_start().starts_with("- alert:"))
        .count();
    assert!(
        rules > 0 && shortened == rules,
        "{shortened} `for:` for {rules} rules"
    );
    lines.join("\n") + "\n"
}

/// The Prometheus text exposition of `registry`.
async fn exposition(registry: prometheus::Registry) -> String {
    support::prometheus::text(&registry)
}

/// Stands in for a verifier or a judge.
async fn work() -> &'static str {
    tokio::time::sleep(named_work()).await;
    "done"
}

/// One client: asks for `path` over one keep-alive connection until `stop`, and again a while
/// after each rejection; how many it got answered (200) and turned away (503).
async fn ask_until(target: SocketAddr, path: &'static str, stop: Arc<AtomicBool>) -> (u64, u64) {
    let mut client = Client::open(target).await;
    let (mut answered, mut rejected) = (0, 0);
    while !stop.load(Ordering::Relaxed) {
        match client.get(path).await {
            (200, _) => answered += 1,
            (503, _) => {
                rejected += 1;
                tokio::time::sleep(RETRY_AFTER).await;
            }
            (status, body) => panic!("GET {path}: {status} {body}"),
        }
    }
    client.closed().await;
    (answered, rejected)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs prometheus and promtool on PATH (apt-get install prometheus); run with --include-ignored"]
async fn a_real_prometheus_fires_the_saturated_alert_for_a_named_limit_that_two_routes_share() {
    let binary = require_binary("prometheus", "tests/prometheus_server.rs");

    // The Getting-started app: the exporter without unit suffixes, one named limit shared by
    // two routes, and /metrics.
    let exporter = Exporter::without_units();
    let limit = Limit::builder(NAMED_CAPACITY)
        .max_queued(NAMED_MAX_QUEUED)
        .name(NAMED_LIMIT)
        .build();
    // A route of `work` under the named limit, tagged with its operation and executor.
    let limited = |operation, executor| {
        get(work).layer(
            ResourcesOperationLayer::new_for_http(limit.clone())
                .operation(operation)
                .executor(executor)
                .metrics(exporter.metrics.clone()),
        )
    };
    let registry = exporter.registry.clone();
    let router = Router::new()
        .route("/verify", limited(Operation::Verify, Executor::Subprocess))
        .route("/judge", limited(Operation::Judge, Executor::Inline))
        .route("/metrics", get(move || exposition(registry.clone())));
    let target = serve(router).await;

    // One request per route first, so that every series exists in the first scrape.
    assert_eq!(app::burst(target, &["/verify", "/judge"]).await, [200, 200]);

    let setup = Setup {
        interval: "250ms",
        rules: Some(quick_rules(QUICK_FOR)),
    };
    let prometheus = Prometheus::start(&binary, target, &setup).await;
    let named = format!(r#"{{nemo_gym_resources_limit="{NAMED_LIMIT}"}}"#);
    prometheus
        .wait_for(
            &format!("gym_resources_limit_capacity{named}"),
            NAMED_CAPACITY as f64,
        )
        .await;
    prometheus
        .wait_for(&format!("gym_resources_limit_active{named}"), 0.0)
        .await;

    // 14 clients, 7 per route, until the alert fires and for at least LOAD_AT_LEAST.
    let stop = Arc::new(AtomicBool::new(false));
    let load_start = unix_now();
    let started = Instant::now();
    let clients: Vec<_> = (0..CLIENTS)
        .map(|i| {
            let path = if i % 2 == 0 { "/verify" } else { "/judge" };
            tokio::spawn(ask_until(target, path, Arc::clone(&stop)))
        })
        .collect();
    let firing_alert = format!(r#"ALERTS{{alertname="{SATURATED}", alertstate="firing"}}"#);
    let firing = loop {
        let firing = prometheus.query(&firing_alert).await;
        if !firing.is_empty() && started.elapsed() >= LOAD_AT_LEAST {
            break firing;
        }
        assert!(
            started.elapsed() < LOAD_AT_LEAST + PATIENCE,
            "{SATURATED} not firing after {:?}: {firing:?}; the limit: {:?}, {:?}, {:?}\nPrometheus log:\n{}",
            started.elapsed(),
            prometheus.query("gym_resources_limit_capacity").await,
            prometheus.query("gym_resources_limit_active").await,
            prometheus.query("gym_resources_limit_queued").await,
            prometheus.log()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    let load_end = unix_now();
    stop.store(true, Ordering::Relaxed);
    let (mut answered, mut rejected) = (0, 0);
    for client in clients {
        let (a, r) = client.await.expect("client");
        answered += a;
        rejected += r;
    }

    // The alert that fires is the per-limit one, for the named limit, and only it.
    let labels: Vec<BTreeMap<String, String>> = firing
        .iter()
        .map(|alert| serde_json::from_value(alert["metric"].clone()).expect("labels"))
        .collect();
    let expected = BTreeMap::from(
        [
            ("__name__", "ALERTS"),
            ("alertname", SATURATED),
            ("alertstate", "firing"),
            ("instance", &target.to_string()),
            ("job", "app"),
            (label::LIMIT, NAMED_LIMIT),
            ("scope", "limit"),
            ("severity", "warning"),
        ]
        .map(|(k, v)| (k.to_owned(), v.to_owned())),
    );
    assert_eq!(labels, [expected]);
    // The per-series rule never even went pending: no route's own series fills the limit for
    // long, and while the named limit is saturated the per-limit rule speaks for it.
    let per_series = prometheus
        .query(&format!(
            r#"ALERTS{{alertname="{SATURATED}", scope="series"}}[5m]"#
        ))
        .await;
    assert!(per_series.is_empty(), "{per_series:?}");

    // Every request was answered or turned away: the server counted the same.
    assert!(rejected > 0, "nobody was turned away: {answered} answered");
    prometheus
        .wait_for(&format!("gym_resources_limit_queued{named}"), 0.0)
        .await;
    prometheus
        .wait_for(&format!("gym_resources_limit_active{named}"), 0.0)
        .await;
    prometheus
        .wait_for(
            r#"sum(gym_resources_operation_rejected_total{nemo_gym_resources_operation_rejection="queue_full"})"#,
            rejected as f64,
        )
        .await;
    prometheus
        .wait_for(
            "sum(gym_resources_operation_queue_duration_ms_count)",
            (answered + 2) as f64,
        )
        .await;

    // The named limit as scraped under load (away from its edges): full, with work waiting,
    // its queue at its bound at times and never above it.
    let (from, to) = (
        ((load_start + 1.0) * 1000.0) as u64,
        ((load_end - 0.3) * 1000.0) as u64,
    );
    let inside = |samples: BTreeMap<u64, f64>| -> Vec<f64> {
        samples.range(from..to.max(from)).map(|(_, &v)| v).collect()
    };
    let capacity = inside(
        prometheus
            .raw_sums(&format!("gym_resources_limit_capacity{named}[1m]"))
            .await,
    );
    let active = inside(
        prometheus
            .raw_sums(&format!("gym_resources_limit_active{named}[1m]"))
            .await,
    );
    let queued = inside(
        prometheus
            .raw_sums(&format!("gym_resources_limit_queued{named}[1m]"))
            .await,
    );
    eprintln!(
        "{answered} answered, {rejected} turned away; the named limit under load: active {active:?}, queued {queued:?}"
    );
    assert!(active.len() >= 10, "{active:?}");
    assert!(
        capacity.iter().all(|&c| c == NAMED_CAPACITY as f64),
        "{capacity:?}"
    );
    assert!(
        active.iter().all(|&a| a == NAMED_CAPACITY as f64),
        "{active:?}"
    );
    assert!(
        queued
            .iter()
            .all(|&q| q >= 1.0 && q <= NAMED_MAX_QUEUED as f64),
        "{queued:?}"
    );
    assert!(
        queued.contains(&(NAMED_MAX_QUEUED as f64)),
        "the queue never reached its bound: {queued:?}"
    );

    // Both routes were turned away while the load lasted.
    let window = format!("{}s", (load_end - load_start).floor() as u64 - 1);
    let rejections = prometheus
        .by_label_at(
            &format!(
                "sum by (nemo_gym_resources_operation) (increase(gym_resources_operation_rejected_total[{window}]))"
            ),
            label::OPERATION,
            load_end,
        )
        .await;
    assert_eq!(
        rejections.keys().collect::<Vec<_>>(),
        ["judge", "verify"],
        "{rejections:?}"
    );
    assert!(rejections.values().all(|&r| r > 0.0), "{rejections:?}");

    // The dashboard over the load. The named limit reads full. Each route's own series reads
    // about half of it, and together the whole: in the time they held places (busy slots, exact)
    // each route had k of the 10 clients that cycle through the 2 places and the 8 waiting
    // ones, k between 3 and 7 whichever 4 clients are the ones turned away; the utilisation panel,
    // which averages the scrapes, reads about the same and never full.
    let dashboard = support::prometheus::load_dashboard();
    let queries = support::prometheus::panel_queries(&dashboard);
    // What query A of the panel `title` reads over the load, by `label`.
    let panel_reading = |title: &str, label: &'static str| {
        let query = queries
            .iter()
            .find(|query| query.panel == title && query.ref_id == "A")
            .unwrap_or_else(|| panic!("no query A in a panel {title:?}"));
        let expr = support::prometheus::substitute_grafana_variables(&query.expr, &window);
        let prometheus = &prometheus;
        async move { prometheus.by_label_at(&expr, label, load_end).await }
    };
    let per_limit = panel_reading("Utilisation per named limit", label::LIMIT).await;
    let per_series = panel_reading("Utilisation of the limit", label::OPERATION).await;
    let busy = panel_reading("Busy slots (Little's law) and limit", label::OPERATION).await;
    let busy_share: BTreeMap<&String, f64> = busy
        .iter()
        .map(|(route, slots)| (route, slots / NAMED_CAPACITY as f64))
        .collect();
    eprintln!(
        "over the last {window} of the load: utilisation per limit {per_limit:?}, per series \
         {per_series:?}; busy slots per series over the limit {busy_share:?}"
    );
    assert_eq!(per_limit.len(), 1, "{per_limit:?}");
    assert!(
        per_limit.get(NAMED_LIMIT).is_some_and(|&u| u >= 0.95),
        "the named limit should read full: {per_limit:?}"
    );
    for reading in [&per_series, &busy] {
        assert_eq!(
            reading.keys().collect::<Vec<_>>(),
            ["judge", "verify"],
            "{reading:?}"
        );
    }
    assert!(
        busy_share.values().all(|&u| (0.25..=0.75).contains(&u)),
        "each route should hold about half of the limit: {busy_share:?}"
    );
    assert!(
        per_series.values().all(|&u| u <= 0.9),
        "no route's own utilisation reads the shared limit full: {per_series:?}"
    );
    for together in [
        per_series.values().sum::<f64>(),
        busy_share.values().sum::<f64>(),
    ] {
        assert!(
            (0.9..=1.05).contains(&together),
            "together the routes fill the limit: {per_series:?}, {busy_share:?}"
        );
    }

    // Every query of the dashboard returns data from this server, the per-limit ones included.
    every_dashboard_query_answers(&prometheus, true).await;
}
