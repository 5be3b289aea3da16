//! Against a real Prometheus server: the example's app (examples/axum.rs) in-process on
//! 127.0.0.1, scraped every second by a `prometheus` child process, driven with a limit that is
//! too small, then asked with PromQL what the README, the dashboard and the alerts ask.
//!
//! Without a `prometheus` binary on PATH the test says so loudly and passes, unless
//! `REQUIRE_PROMETHEUS=1` (as in CI), which makes it fail.

#[path = "../examples/axum.rs"]
#[allow(dead_code)]
mod app;
mod support;

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::Value;
use tower::Layer as _;
use tower_resources_operation::adaptive::{Adaptive, Aimd};
use tower_resources_operation::{
    Executor, Limit, Operation, OperationMetrics, ResourcesOperationLayer,
};

use support::http::serve;
use support::prometheus::{require_binary, TempDir};

/// How long to wait for Prometheus to start, or to have scraped what was done; a safety net so
/// a broken setup fails instead of hanging, not a performance bound.
const PATIENCE: Duration = Duration::from_secs(20);

/// A `prometheus` child process scraping one target every second; killed when dropped, panics
/// included.
struct Prometheus {
    child: Child,
    addr: SocketAddr,
    log: PathBuf,
    /// Declared last: removed after the process is gone.
    _dir: TempDir,
}

impl Prometheus {
    /// Starts Prometheus on a free port of 127.0.0.1, scraping `target`, and waits until it is
    /// ready. Tries another port if the one picked was taken in the meantime.
    async fn start(binary: &Path, target: SocketAddr) -> Self {
        let mut last_log = String::new();
        for _ in 0..3 {
            let dir = TempDir::new("tower-resources-operation-prometheus");
            let config = dir.path().join("prometheus.yml");
            std::fs::write(
                &config,
                format!(
                    "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n\
                     scrape_configs:\n  - job_name: app\n    static_configs:\n      - targets: [\"{target}\"]\n"
                ),
            )
            .expect("write prometheus.yml");
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
                _dir: dir,
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
                return true;
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

    /// The `data.result` of an instant query. HTTP/1.0, so Go answers without chunking.
    async fn query(&self, promql: &str) -> Vec<Value> {
        let path = format!(
            "/api/v1/query?query={}",
            support::prometheus::urlencode(promql)
        );
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
        self.by_label(&promql, "nemo_gym_resources_operation").await
    }

    /// The value of each element of a query's result, by the value of `label`.
    async fn by_label(&self, promql: &str, label: &str) -> BTreeMap<String, f64> {
        self.query(promql)
            .await
            .iter()
            .map(|element| {
                (
                    element["metric"][label].as_str().unwrap_or("").to_owned(),
                    sample_value(&element["value"]),
                )
            })
            .collect()
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

const SHARED_LIMIT: usize = 2;
const TOOL_LIMIT: usize = 2;
/// How long each operation of the burst runs.
const WORK_MS: u64 = 150;
const VERIFIES: usize = 16;
const JUDGES: usize = 8;
const TOOLS: usize = 4;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_prometheus_sees_the_limit_bind() {
    let Some(binary) = require_binary("prometheus", "tests/prometheus_server.rs") else {
        return;
    };

    let telemetry = app::Telemetry::new(None).expect("telemetry");
    let config = app::Config {
        shared_limit: SHARED_LIMIT,
        tool_limit: TOOL_LIMIT,
        verify_deadline: Duration::from_secs(10),
    };
    let target = serve(app::app(&config, &telemetry)).await;

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
        .adaptive(Adaptive::new(Aimd::default(), 1..=4))
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

    let prometheus = Prometheus::start(&binary, target).await;
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
            "nemo_gym_resources_operation",
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
            "nemo_gym_resources_operation",
        )
        .await;
    assert!(verify(&ratio) > 1.0, "{ratio:?}");

    // The live counts as scraped: the shared limit never above 2, the tool's never above 2;
    // during the burst (away from its edges) the shared limit full and work queued.
    let shared = r#"{nemo_gym_resources_operation=~"verify|judge"}"#;
    let active = prometheus
        .raw_sums(&format!("gym_resources_operation_active{shared}[2m]"))
        .await;
    let queued = prometheus
        .raw_sums(&format!("gym_resources_operation_queued{shared}[2m]"))
        .await;
    assert!(
        active.values().all(|&v| v <= SHARED_LIMIT as f64),
        "{active:?}"
    );
    let tool_peak = prometheus
        .scalar(r#"max_over_time(gym_resources_operation_active{nemo_gym_resources_operation="tool"}[2m])"#)
        .await;
    assert!(
        tool_peak.is_some_and(|v| v <= TOOL_LIMIT as f64),
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
    for &(t, active, queued) in &inside {
        assert_eq!(active, SHARED_LIMIT as f64, "active at {t}: {inside:?}");
        assert!(queued > 0.0, "queued at {t}: {inside:?}");
    }

    // Every query of the dashboard returns data from this server.
    let dashboard = support::prometheus::load_dashboard();
    let queries = support::prometheus::panel_queries(&dashboard);
    assert!(!queries.is_empty());
    for query in queries {
        let expr = support::prometheus::substitute_grafana_variables(&query.expr, "1m");
        let result = prometheus.query(&expr).await;
        assert!(
            !result.is_empty(),
            "panel {:?} query {}: no data for {expr}",
            query.panel,
            query.ref_id
        );
    }
}
