//! The shipped dashboard and alerts read a fleet limit's numbers as the fleet's: a real
//! Prometheus scrapes three replica processes of one saturated fleet limit (each serving its
//! `/metrics` through `opentelemetry-prometheus`, as the core crate's README sets it up), and
//! evaluates dashboards/prometheus/alerts.yml (its `for:` shortened):
//!
//! - the dashboard's "Utilisation per named limit" reads 1.0 ± 0.1, where adding up the
//!   capacity every replica reports would read a third;
//! - its capacity is the fleet's (4), not three times it;
//! - the fleet's `ResourcesOperationLimitSaturated` (scope `fleet`) fires, and the per-process
//!   rules, which no replica fills on its own, stay quiet.

mod support;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use opentelemetry::metrics::MeterProvider as _;
use opentelemetry_sdk::metrics::SdkMeterProvider;
use serde_json::Value;
use support::redis_server::{find_on_path, RedisServer};
use support::replicas::{
    commands, get, replica_or, say, this_test, within_thread, Replica, Settings,
};
use tower_resources_operation::names::METER_NAME;
use tower_resources_operation::{Executor, Operation, OperationMetrics};
use tower_resources_operation_redis::RedisLimit;

const NAME: &str = "fleet-dashboard";
const CAPACITY: usize = 4;

// ---------------------------------------------------------------------------------------------
// The replica: 8 callers always asking for the fleet limit, and `/metrics`
// ---------------------------------------------------------------------------------------------

fn run_replica(settings: Settings) {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
        .block_on(async move {
            let registry = prometheus::Registry::new();
            let exporter = opentelemetry_prometheus::exporter()
                .with_registry(registry.clone())
                .without_units()
                .build()
                .expect("the exporter");
            let provider = SdkMeterProvider::builder().with_reader(exporter).build();
            let meter = provider.meter(METER_NAME);
            let metrics = OperationMetrics::new(&meter);
            // With the fleet limit's own instruments, which the dead-holder panel reads.
            let limit = RedisLimit::builder(NAME, CAPACITY)
                .meter(&meter)
                .lease_ttl(Duration::from_secs(3))
                .call_timeout(Duration::from_secs(1))
                .build(settings["redis"].as_str())
                .unwrap();
            limit.ready().await.expect("Redis at the start");
            for _ in 0..get::<usize>(&settings, "clients") {
                let (limit, metrics) = (limit.clone(), metrics.clone());
                let mut observer = support::observer::connect(&settings["observer"]).await;
                tokio::spawn(async move {
                    loop {
                        let _ = metrics
                            .resources_operation(
                                &limit,
                                Operation::Judge,
                                Executor::Inline,
                                async {
                                    support::observer::enter(&mut observer).await;
                                    tokio::time::sleep(Duration::from_millis(300)).await;
                                    support::observer::leave(&mut observer, "r").await;
                                },
                            )
                            .await;
                    }
                });
            }
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            say(&format!("METRICS {}", listener.local_addr().unwrap()));
            let registry = Arc::new(registry);
            tokio::spawn(async move {
                loop {
                    let Ok((connection, _)) = listener.accept().await else {
                        continue;
                    };
                    tokio::spawn(serve_metrics(connection, Arc::clone(&registry)));
                }
            });
            // Until the test is done.
            let mut commands = commands();
            while let Some(command) = commands.recv().await {
                if command == "STOP" {
                    break;
                }
            }
            drop(provider);
            say("RESULT done=1");
        });
}

/// Answers one scrape with the registry in the Prometheus text format.
async fn serve_metrics(mut connection: tokio::net::TcpStream, registry: Arc<prometheus::Registry>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut request = Vec::new();
    let mut buffer = [0u8; 1024];
    while !request.windows(4).any(|w| w == b"\r\n\r\n") {
        match connection.read(&mut buffer).await {
            Ok(0) | Err(_) => return,
            Ok(n) => request.extend_from_slice(&buffer[..n]),
        }
    }
    let body = prometheus::TextEncoder::new()
        .encode_to_string(&registry.gather())
        .unwrap_or_default();
    let head = format!(
        "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n",
        body.len()
    );
    let _ = connection.write_all(head.as_bytes()).await;
    let _ = connection.write_all(body.as_bytes()).await;
}

// ---------------------------------------------------------------------------------------------
// Prometheus
// ---------------------------------------------------------------------------------------------

/// The repository's root, where dashboards/ is.
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace")
        .to_owned()
}

/// A `prometheus` process scraping `targets` every 250 ms and evaluating the shipped alert
/// rules (their `for:` shortened to 2 s) as often; killed when dropped.
struct Prometheus {
    child: Child,
    addr: SocketAddr,
    dir: PathBuf,
}

impl Prometheus {
    fn start(targets: &[String]) -> Self {
        let binary = find_on_path("prometheus").expect(
            "`prometheus` on PATH (Debian/Ubuntu: apt-get install prometheus): this test needs it",
        );
        let dir = std::env::temp_dir().join(format!(
            "tro-fleet-prometheus-{}-{}",
            std::process::id(),
            support::replicas::now_ms()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let rules = std::fs::read_to_string(root().join("dashboards/prometheus/alerts.yml"))
            .expect("the shipped alert rules");
        let rules: String = rules
            .lines()
            .map(|line| match line.trim_start().strip_prefix("for:") {
                Some(_) => format!("{}for: 2s\n", &line[..line.len() - line.trim_start().len()]),
                None => format!("{line}\n"),
            })
            .collect();
        std::fs::write(dir.join("rules.yml"), rules).unwrap();
        let targets: Vec<String> = targets.iter().map(|t| format!("\"{t}\"")).collect();
        std::fs::write(
            dir.join("prometheus.yml"),
            format!(
                "global:\n  scrape_interval: 250ms\n  scrape_timeout: 250ms\n  \
                 evaluation_interval: 250ms\nrule_files:\n  - {}\nscrape_configs:\n  - job_name: \
                 replicas\n    static_configs:\n      - targets: [{}]\n",
                dir.join("rules.yml").display(),
                targets.join(", ")
            ),
        )
        .unwrap();
        // A port free a moment ago may be another test's Prometheus's by now (this one then
        // exits): retry on another until the one that answers is this one (its data directory).
        for _ in 0..10 {
            let port = TcpListener::bind("127.0.0.1:0")
                .unwrap()
                .local_addr()
                .unwrap()
                .port();
            let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
            let child = Command::new(&binary)
                .arg(format!(
                    "--config.file={}",
                    dir.join("prometheus.yml").display()
                ))
                .arg(format!(
                    "--storage.tsdb.path={}",
                    dir.join("data").display()
                ))
                .arg(format!("--web.listen-address={addr}"))
                .arg("--log.level=warn")
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::inherit())
                .spawn()
                .expect("start prometheus");
            let mut child = child;
            let data = dir.join("data").display().to_string();
            let started = Instant::now();
            let ours = loop {
                if let Ok(Some(_)) = child.try_wait() {
                    break false;
                }
                if get_http(addr, "/-/ready").0 == 200 {
                    break get_http(addr, "/api/v1/status/flags").1.contains(&data);
                }
                assert!(
                    started.elapsed() < Duration::from_secs(30),
                    "Prometheus is not ready"
                );
                std::thread::sleep(Duration::from_millis(100));
            };
            if ours {
                return Self { child, addr, dir };
            }
            // Not this one: stop it; the next try keeps the directory.
            let _ = child.kill();
            let _ = child.wait();
        }
        panic!("Prometheus did not start on any of 10 free ports");
    }

    /// An instant query's `data.result`.
    fn query(&self, promql: &str) -> Vec<Value> {
        let (status, body) = get_http(
            self.addr,
            &format!("/api/v1/query?query={}", encode(promql)),
        );
        assert_eq!(status, 200, "{promql}: {body}");
        let answer: Value = serde_json::from_str(&body).expect("JSON");
        answer["data"]["result"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    }

    /// The value of the fleet limit's series in a query's answer.
    fn of_limit(&self, promql: &str) -> Option<f64> {
        self.query(promql)
            .iter()
            .find(|sample| sample["metric"]["nemo_gym_resources_limit"] == NAME)
            .and_then(|sample| sample["value"][1].as_str()?.parse().ok())
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `GET path` over HTTP/1.0: the status and the body (0 if nothing answered).
fn get_http(addr: SocketAddr, path: &str) -> (u16, String) {
    let Ok(mut stream) = TcpStream::connect(addr) else {
        return (0, String::new());
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
    if write!(stream, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").is_err() {
        return (0, String::new());
    }
    let mut response = String::new();
    if stream.read_to_string(&mut response).is_err() {
        return (0, String::new());
    }
    let status = response
        .split(' ')
        .nth(1)
        .and_then(|status| status.parse().ok())
        .unwrap_or(0);
    let body = response
        .split_once("\r\n\r\n")
        .map_or(String::new(), |(_, body)| body.to_owned());
    (status, body)
}

fn encode(text: &str) -> String {
    text.bytes()
        .map(|byte| match byte {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (byte as char).to_string()
            }
            _ => format!("%{byte:02X}"),
        })
        .collect()
}

/// A query of the dashboard, by its panel's title and its reference, as Grafana sends it with
/// every job, instance and limit selected.
fn dashboard_query(title: &str, reference: &str) -> String {
    let dashboard: Value = serde_json::from_str(
        &std::fs::read_to_string(root().join("dashboards/grafana/resources-operations.json"))
            .expect("the dashboard"),
    )
    .expect("JSON");
    fn panels(value: &Value, found: &mut Vec<Value>) {
        for panel in value["panels"].as_array().into_iter().flatten() {
            found.push(panel.clone());
            panels(panel, found);
        }
    }
    let mut all = Vec::new();
    panels(&dashboard, &mut all);
    let panel = all
        .iter()
        .find(|panel| panel["title"] == title)
        .unwrap_or_else(|| panic!("a panel {title:?}"));
    let expr = panel["targets"]
        .as_array()
        .unwrap()
        .iter()
        .find(|target| target["refId"] == reference)
        .and_then(|target| target["expr"].as_str())
        .expect("the query")
        .replace("$__rate_interval", "8s");
    ["job", "instance", "limit", "operation"]
        .iter()
        .fold(expr, |expr, variable| {
            expr.replace(&format!("${variable}"), ".*")
        })
}

#[test]
#[ignore = "needs redis-server and prometheus on PATH (apt-get install redis-server prometheus): cargo test -- --include-ignored runs it"]
fn the_dashboard_and_the_alerts_read_a_saturated_fleet_limit_as_the_fleets() {
    replica_or(run_replica, || {
        let (redis, observer) = (RedisServer::start_required(), RedisServer::start_required());
        let settings: Settings = [
            ("test", this_test()),
            ("redis", redis.url()),
            ("observer", observer.url()),
            ("clients", "8".to_owned()),
        ]
        .into_iter()
        .map(|(key, value)| (key.to_owned(), value))
        .collect();
        let (replicas, targets) =
            within_thread("the replicas", Duration::from_secs(60), move || {
                let mut replicas: Vec<Replica> =
                    (0..3).map(|_| Replica::start(&settings)).collect();
                let targets: Vec<String> = replicas
                    .iter_mut()
                    .map(|replica| {
                        replica
                            .until("METRICS ")
                            .trim_start_matches("METRICS ")
                            .to_owned()
                    })
                    .collect();
                (replicas, targets)
            });
        let prometheus = Prometheus::start(&targets);
        // Scrapes over 8 s (each replica's places, sampled at its own scrape, move between
        // them in between: the average over many scrapes is the fleet's), and past the rules'
        // shortened `for:`.
        std::thread::sleep(Duration::from_secs(11));

        let utilisation = prometheus
            .of_limit(&dashboard_query("Utilisation per named limit", "A"))
            .expect("the fleet limit's utilisation");
        let capacity = prometheus
            .of_limit(&dashboard_query("Active and capacity per named limit", "B"))
            .expect("the fleet limit's capacity");
        // What the panel read before 0.5: the capacity every replica reports, added up.
        let added_up = prometheus
            .of_limit(
                "sum by (nemo_gym_resources_limit) (avg_over_time(gym_resources_limit_active[8s])) \
                 / sum by (nemo_gym_resources_limit) (gym_resources_limit_capacity)",
            )
            .expect("the old reading");
        // Every member is alive and heard from: the dead-holder panel reads the fleet, and 0.
        let unheard = prometheus
            .of_limit(&dashboard_query(
                "Fleet: places held by members not heard from",
                "A",
            ))
            .expect("the fleet limit's unheard places");
        let seen = support::observer::Seen::read(&observer);
        let firing = prometheus
            .query(r#"ALERTS{alertname="ResourcesOperationLimitSaturated", alertstate="firing"}"#);
        let most = seen.most_between(0, u64::MAX);
        println!(
            "three replicas of a fleet limit of {CAPACITY}, 24 callers: the dashboard's \
             utilisation {utilisation:.3} (capacities added up: {added_up:.3}), capacity \
             {capacity}, unheard {unheard}; at most {most} at once, counted outside the limit; firing: {firing:?}"
        );
        assert!(most <= CAPACITY as i64, "{most} at once");
        assert!(
            (0.9..=1.1).contains(&utilisation),
            "utilisation {utilisation:.3}"
        );
        assert_eq!(capacity, CAPACITY as f64, "the fleet's capacity, read once");
        assert_eq!(unheard, 0.0, "places held by members not heard from");
        assert_eq!(firing.len(), 1, "one alert, the fleet's: {firing:?}");
        assert_eq!(firing[0]["metric"]["scope"], "fleet", "{firing:?}");
        assert_eq!(firing[0]["metric"]["nemo_gym_resources_limit"], NAME);

        let mut replicas = replicas;
        within_thread("the replicas stop", Duration::from_secs(60), move || {
            for replica in &mut replicas {
                replica.tell("STOP");
            }
            for replica in replicas {
                replica.result();
            }
        });
    });
}
