//! The dashboard and the alert rules in dashboards/: the Grafana dashboard queries only the
//! crate's series (as the Prometheus exporter names them without unit suffixes), and the alert
//! rules pass `promtool check rules` and their own `promtool test rules` unit tests.
//!
//! The promtool half needs `promtool` on PATH (Debian's `prometheus` package ships it): without
//! it the test says so loudly and passes, unless `REQUIRE_PROMETHEUS=1`.

mod prometheus_support;

use std::collections::BTreeSet;
use std::process::Command;

use prometheus_support::{load_dashboard, panel_queries, panels, require_binary, root};

/// The series the crate's four instruments become in Prometheus.
const SERIES: [&str; 8] = [
    "gym_resources_operation_queue_duration_ms_bucket",
    "gym_resources_operation_queue_duration_ms_sum",
    "gym_resources_operation_queue_duration_ms_count",
    "gym_resources_operation_duration_ms_bucket",
    "gym_resources_operation_duration_ms_sum",
    "gym_resources_operation_duration_ms_count",
    "gym_resources_operation_queued",
    "gym_resources_operation_active",
];

/// The labels a query may select or group by: the crate's attributes, `le`, and the target's.
const LABELS: [&str; 6] = [
    "nemo_gym_resources_operation",
    "nemo_gym_resources_executor",
    "nemo_gym_resources_operation_outcome",
    "le",
    "job",
    "instance",
];

/// PromQL functions and aggregations the dashboard may call.
const FUNCTIONS: [&str; 14] = [
    "sum",
    "avg",
    "max",
    "min",
    "count",
    "rate",
    "increase",
    "irate",
    "histogram_quantile",
    "avg_over_time",
    "max_over_time",
    "min_over_time",
    "clamp_min",
    "vector",
];

/// What a PromQL expression names, read with a small tokenizer: enough for the dashboard's
/// queries (selectors, `by (...)`, function calls, binary operators, numbers, durations).
#[derive(Debug, Default, PartialEq)]
struct Names {
    metrics: BTreeSet<String>,
    labels: BTreeSet<String>,
    functions: BTreeSet<String>,
}

fn names(expr: &str) -> Names {
    let chars: Vec<char> = expr.chars().collect();
    let mut names = Names::default();
    let mut i = 0;
    let ident_start = |c: char| c.is_ascii_alphabetic() || c == '_' || c == ':';
    let ident_char = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    let read_ident = |i: &mut usize| {
        let start = *i;
        while *i < chars.len() && ident_char(chars[*i]) {
            *i += 1;
        }
        chars[start..*i].iter().collect::<String>()
    };
    let skip_space = |i: &mut usize| {
        while *i < chars.len() && chars[*i].is_whitespace() {
            *i += 1;
        }
    };
    let skip_string = |i: &mut usize| {
        let quote = chars[*i];
        *i += 1;
        while *i < chars.len() && chars[*i] != quote {
            if chars[*i] == '\\' {
                *i += 1;
            }
            *i += 1;
        }
        *i += 1;
    };
    while i < chars.len() {
        let c = chars[i];
        if c.is_whitespace() {
            i += 1;
        } else if c == '"' || c == '\'' || c == '`' {
            skip_string(&mut i);
        } else if c == '[' {
            // A range or subquery: durations and Grafana variables, no names.
            while i < chars.len() && chars[i] != ']' {
                i += 1;
            }
            i += 1;
        } else if c == '{' {
            // Label matchers: `name op "value"`, comma-separated.
            i += 1;
            loop {
                skip_space(&mut i);
                if i >= chars.len() || chars[i] == '}' {
                    i += 1;
                    break;
                }
                if chars[i] == ',' {
                    i += 1;
                    continue;
                }
                if ident_start(chars[i]) {
                    names.labels.insert(read_ident(&mut i));
                } else if matches!(chars[i], '"' | '\'' | '`') {
                    skip_string(&mut i);
                } else {
                    i += 1; // =, !=, =~, !~
                }
            }
        } else if c == '$' {
            // A Grafana variable outside a string: `$name` or `${...}`.
            i += 1;
            if i < chars.len() && chars[i] == '{' {
                while i < chars.len() && chars[i] != '}' {
                    i += 1;
                }
                i += 1;
            } else {
                read_ident(&mut i);
            }
        } else if c.is_ascii_digit() || c == '.' {
            while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '.') {
                i += 1;
            }
        } else if ident_start(c) {
            let ident = read_ident(&mut i);
            let mut next = i;
            skip_space(&mut next);
            // A call: `f(`, or an aggregation written `sum by (...) (...)`.
            let mut after = next;
            let grouped = matches!(read_ident(&mut after).as_str(), "by" | "without");
            let call = next < chars.len() && chars[next] == '(' || grouped;
            match ident.as_str() {
                "by" | "without" | "on" | "ignoring" | "group_left" | "group_right" => {
                    if call {
                        i = next + 1;
                        while i < chars.len() && chars[i] != ')' {
                            if ident_start(chars[i]) {
                                names.labels.insert(read_ident(&mut i));
                            } else {
                                i += 1;
                            }
                        }
                        i += 1;
                    }
                }
                "and" | "or" | "unless" | "bool" | "offset" => {}
                _ if call => {
                    names.functions.insert(ident);
                }
                _ => {
                    names.metrics.insert(ident);
                }
            }
        } else {
            i += 1;
        }
    }
    names
}

/// Whether a query only names the crate's series, its labels and known functions; the
/// problems otherwise.
fn check_expr(expr: &str) -> Vec<String> {
    let names = names(expr);
    let mut problems = Vec::new();
    if names.metrics.is_empty() {
        problems.push("names no series".to_owned());
    }
    for metric in &names.metrics {
        if !SERIES.contains(&metric.as_str()) {
            problems.push(format!("series {metric:?} is not one of the crate's"));
        }
    }
    for label in &names.labels {
        if !LABELS.contains(&label.as_str()) {
            problems.push(format!("label {label:?} is not one the series have"));
        }
    }
    for function in &names.functions {
        if !FUNCTIONS.contains(&function.as_str()) {
            problems.push(format!("unexpected function {function:?}"));
        }
    }
    problems
}

#[test]
fn the_expression_check_catches_foreign_series_labels_and_unit_suffixes() {
    assert_eq!(
        check_expr(
            r#"sum by (le, nemo_gym_resources_operation) (rate(gym_resources_operation_duration_ms_bucket{nemo_gym_resources_operation=~"$operation"}[$__rate_interval])) / 1000"#
        ),
        Vec::<String>::new()
    );
    let foreign = check_expr(r#"sum by (route) (rate(http_requests_total{job="x"}[5m]))"#);
    assert!(
        foreign.iter().any(|p| p.contains("http_requests_total")),
        "{foreign:?}"
    );
    assert!(foreign.iter().any(|p| p.contains("route")), "{foreign:?}");
    // What the exporter would name the histogram without `without_units()`.
    let suffixed = check_expr("rate(gym_resources_operation_duration_ms_milliseconds_count[5m])");
    assert!(
        suffixed.iter().any(|p| p.contains("milliseconds")),
        "{suffixed:?}"
    );
    assert_eq!(check_expr("vector(1)"), vec!["names no series".to_owned()]);
}

#[test]
fn grafana_dashboard_queries_only_the_crates_series() {
    let dashboard = load_dashboard();

    // Importable: a datasource input, a recent schema, the operation variable.
    let inputs = dashboard["__inputs"].as_array().expect("__inputs");
    assert!(
        inputs
            .iter()
            .any(|i| i["name"] == "DS_PROMETHEUS" && i["pluginId"] == "prometheus"),
        "{inputs:?}"
    );
    let schema = dashboard["schemaVersion"].as_u64().expect("schemaVersion");
    assert!((36..=41).contains(&schema), "schemaVersion {schema}");
    let variables = dashboard["templating"]["list"]
        .as_array()
        .expect("templating");
    let operation = variables
        .iter()
        .find(|v| v["name"] == "operation")
        .expect("an `operation` template variable");
    let definition = operation["definition"].as_str().expect("definition");
    assert!(
        definition.contains("gym_resources_operation_queue_duration_ms_count")
            && definition.contains("nemo_gym_resources_operation"),
        "{definition}"
    );

    let datasource = serde_json::json!({"type": "prometheus", "uid": "${DS_PROMETHEUS}"});
    let mut ids = BTreeSet::new();
    let mut titles = BTreeSet::new();
    for panel in panels(&dashboard) {
        let title = panel["title"].as_str().unwrap_or_default();
        assert!(!title.is_empty(), "a panel without a title: {panel}");
        assert!(titles.insert(title), "two panels titled {title:?}");
        assert!(
            ids.insert(panel["id"].as_u64().expect("panel id")),
            "duplicate id"
        );
        if panel["type"] == "row" {
            continue;
        }
        assert!(
            panel["description"].as_str().is_some_and(|d| d.len() > 40),
            "panel {title:?} should say how to read it"
        );
        assert_eq!(panel["datasource"], datasource, "panel {title:?}");
        let targets = panel["targets"].as_array().expect("targets");
        assert!(!targets.is_empty(), "panel {title:?} has no query");
        let mut ref_ids = BTreeSet::new();
        for target in targets {
            assert_eq!(target["datasource"], datasource, "panel {title:?}");
            assert!(
                ref_ids.insert(target["refId"].as_str().expect("refId")),
                "panel {title:?}: duplicate refId"
            );
        }
    }

    let queries = panel_queries(&dashboard);
    assert!(queries.len() >= 8, "{} queries", queries.len());
    let mut problems = Vec::new();
    let mut used = BTreeSet::new();
    for query in &queries {
        for problem in check_expr(&query.expr) {
            problems.push(format!("{} {}: {problem}", query.panel, query.ref_id));
        }
        if !query
            .expr
            .contains(r#"nemo_gym_resources_operation=~"$operation""#)
        {
            problems.push(format!(
                "{} {}: does not follow the operation variable",
                query.panel, query.ref_id
            ));
        }
        used.extend(names(&query.expr).metrics);
    }
    assert!(problems.is_empty(), "{problems:#?}");

    // The panels the dashboard is for: queue and run quantiles, live counts, outcomes.
    for series in [
        "gym_resources_operation_queue_duration_ms_bucket",
        "gym_resources_operation_duration_ms_bucket",
        "gym_resources_operation_duration_ms_count",
        "gym_resources_operation_queued",
        "gym_resources_operation_active",
    ] {
        assert!(used.contains(series), "no panel reads {series}");
    }
    assert!(
        queries.iter().any(|q| q.expr.contains(
            "sum by (nemo_gym_resources_operation_outcome) (rate(gym_resources_operation_duration_ms_count"
        )),
        "no outcome-rate panel"
    );
}

/// Runs `promtool` with `args` in the repository root; panics with its output unless it
/// succeeds.
fn promtool(promtool: &std::path::Path, args: &[&str]) -> String {
    let output = Command::new(promtool)
        .args(args)
        .current_dir(root())
        .output()
        .unwrap_or_else(|e| panic!("run promtool: {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        output.status.success(),
        "promtool {} failed ({}):\n{text}",
        args.join(" "),
        output.status
    );
    text
}

#[test]
fn alert_rules_pass_promtool_check_and_their_unit_tests() {
    let Some(binary) = require_binary("promtool", "the alert rules' promtool checks") else {
        return;
    };
    let checked = promtool(&binary, &["check", "rules", prometheus_support::ALERTS]);
    assert!(checked.contains("SUCCESS: 3 rules found"), "{checked}");
    let tested = promtool(&binary, &["test", "rules", prometheus_support::ALERT_TESTS]);
    assert!(tested.contains("SUCCESS"), "{tested}");
}
