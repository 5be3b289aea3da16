//! Shared by the tests that read the crate's series as Prometheus does (through the real
//! exporter, `prometheus`, `promtool`) and the dashboard files: the exporter pipeline and its text
//! format, the labels' names, finding the binaries (a test that needs one is `#[ignore]`d, so
//! that a machine without them counts it as not run, and fails saying what to install when it
//! is run without them), temp dirs, free ports, and the dashboard's queries.
#![allow(dead_code, unreachable_pub)]

use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use opentelemetry::metrics::MeterProvider as _;
use opentelemetry_sdk::metrics::SdkMeterProvider;
use tower_resources_operation::names::METER_NAME;
use tower_resources_operation::OperationMetrics;

/// The crate's labels as Prometheus has them: the attribute keys with dots as underscores.
/// Spelled out, not derived from the attribute keys, so that a test of the names catches a
/// change to them.
pub mod label {
    pub const OPERATION: &str = "nemo_gym_resources_operation";
    pub const EXECUTOR: &str = "nemo_gym_resources_executor";
    pub const OUTCOME: &str = "nemo_gym_resources_operation_outcome";
    pub const REJECTION: &str = "nemo_gym_resources_operation_rejection";
    pub const LIMIT: &str = "nemo_gym_resources_limit";
    pub const LIMIT_SCOPE: &str = "nemo_gym_resources_limit_scope";
}

/// The crate's metrics through the real `opentelemetry-prometheus` exporter into a registry of
/// their own: what an app's `/metrics` serves, without the app.
pub struct Exporter {
    /// What `/metrics` encodes.
    pub registry: prometheus::Registry,
    /// Kept as long as the exporter is read: dropping it shuts the reader down.
    pub provider: SdkMeterProvider,
    /// On the provider's meter named [`METER_NAME`], as an app makes them.
    pub metrics: OperationMetrics,
}

impl Exporter {
    /// The exporter as the README sets it up, `without_units()`: the names the dashboards and
    /// the alerts query.
    pub fn without_units() -> Self {
        Self::build(false)
    }

    /// The exporter left at its default, which appends each instrument's unit to its name.
    pub fn with_units() -> Self {
        Self::build(true)
    }

    fn build(units: bool) -> Self {
        let registry = prometheus::Registry::new();
        let mut exporter = opentelemetry_prometheus::exporter().with_registry(registry.clone());
        if !units {
            exporter = exporter.without_units();
        }
        let provider = SdkMeterProvider::builder()
            .with_reader(exporter.build().expect("exporter"))
            .build();
        let metrics = OperationMetrics::new(&provider.meter(METER_NAME));
        Self {
            registry,
            provider,
            metrics,
        }
    }

    /// What `/metrics` would serve now.
    pub fn text(&self) -> String {
        text(&self.registry)
    }
}

/// `registry` in the Prometheus text format, as `/metrics` serves it.
pub fn text(registry: &prometheus::Registry) -> String {
    prometheus::TextEncoder::new()
        .encode_to_string(&registry.gather())
        .expect("encode the registry")
}

/// The repository root (where Cargo.toml is).
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

pub const DASHBOARD: &str = "dashboards/grafana/resources-operations.json";
pub const ALERTS: &str = "dashboards/prometheus/alerts.yml";
pub const ALERT_TESTS: &str = "dashboards/prometheus/alerts.test.yml";

/// `name` on `PATH`, if it is there.
pub fn find_on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|candidate| is_executable(candidate))
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    path.metadata()
        .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// `name` on `PATH`. A test that calls this is `#[ignore]`d with the reason above, so it runs
/// only when asked for (`--include-ignored`); asked for, a missing binary fails it, saying what to
/// install, rather than letting it pass without running.
pub fn require_binary(name: &str, test: &str) -> PathBuf {
    find_on_path(name).unwrap_or_else(|| {
        panic!(
            "`{name}` is not on PATH, so {test} cannot run. Install it (Debian/Ubuntu: \
             `apt-get install prometheus`, which ships `prometheus` and `promtool`), or leave \
             out --include-ignored to skip the tests that need it (they show as ignored)."
        )
    })
}

/// A directory under the system temp dir, removed when dropped.
#[derive(Debug)]
pub struct TempDir(PathBuf);

impl TempDir {
    pub fn new(prefix: &str) -> Self {
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default();
        let path = std::env::temp_dir().join(format!("{prefix}-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&path).expect("create temp dir");
        Self(path)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A port on 127.0.0.1 that was free a moment ago: bound to port 0, read, released.
pub fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    listener.local_addr().expect("local addr").port()
}

/// Percent-encodes everything but RFC 3986's unreserved characters, for a query parameter.
pub fn urlencode(text: &str) -> String {
    let mut out = String::with_capacity(text.len() * 3);
    for byte in text.bytes() {
        match byte {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                out.push(byte as char)
            }
            _ => out.push_str(&format!("%{byte:02X}")),
        }
    }
    out
}

/// One query of a dashboard panel.
#[derive(Clone, Debug)]
pub struct PanelQuery {
    pub panel: String,
    pub ref_id: String,
    pub expr: String,
}

/// Every panel of a dashboard, rows' nested panels included, in order.
pub fn panels(dashboard: &serde_json::Value) -> Vec<&serde_json::Value> {
    fn walk<'a>(panels: &'a serde_json::Value, out: &mut Vec<&'a serde_json::Value>) {
        for panel in panels.as_array().into_iter().flatten() {
            out.push(panel);
            if let Some(nested) = panel.get("panels") {
                walk(nested, out);
            }
        }
    }
    let mut out = Vec::new();
    walk(&dashboard["panels"], &mut out);
    out
}

/// Every `expr` of every panel target.
pub fn panel_queries(dashboard: &serde_json::Value) -> Vec<PanelQuery> {
    panels(dashboard)
        .into_iter()
        .flat_map(|panel| {
            let title = panel["title"].as_str().unwrap_or("<untitled>").to_owned();
            panel["targets"]
                .as_array()
                .into_iter()
                .flatten()
                .map(move |target| PanelQuery {
                    panel: title.clone(),
                    ref_id: target["refId"].as_str().unwrap_or("").to_owned(),
                    expr: target["expr"].as_str().unwrap_or("").to_owned(),
                })
        })
        .collect()
}

pub fn load_dashboard() -> serde_json::Value {
    let path = root().join(DASHBOARD);
    let text =
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("parse {}: {e}", path.display()))
}

/// A panel's expression as Prometheus would get it from Grafana with every job, instance,
/// operation and named limit selected, and a rate interval of `rate_interval`.
pub fn substitute_grafana_variables(expr: &str, rate_interval: &str) -> String {
    let mut expr = expr.replace("$__rate_interval", rate_interval);
    for variable in ["job", "instance", "operation", "limit"] {
        expr = expr
            .replace(&format!("${{{variable}:regex}}"), ".*")
            .replace(&format!("${{{variable}}}"), ".*")
            .replace(&format!("${variable}"), ".*");
    }
    expr
}

/// Whether a dashboard or alert expression reads a named limit's series
/// (`gym_resources_limit_*`), which only a limit given a name reports.
pub fn reads_named_limits(expr: &str) -> bool {
    expr.contains("gym_resources_limit_")
}
