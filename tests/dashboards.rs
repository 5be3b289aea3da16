//! The dashboard and the alert rules in dashboards/: the Grafana dashboard and the alert rules
//! query only the crate's series (as the Prometheus exporter names them without unit suffixes),
//! every dashboard query follows the `job`, `instance` and `operation` variables, the alert unit
//! tests see every alert both fire and stay quiet, and the alert rules (and the dashboard's
//! queries) pass `promtool check rules` and the rules their own `promtool test rules` unit tests.
//!
//! The promtool half needs `promtool` on PATH (Debian's `prometheus` package ships it): without
//! it the test says so loudly and passes, unless `REQUIRE_PROMETHEUS=1`.

mod support;

use std::collections::BTreeSet;
use std::process::Command;

use support::prometheus::{load_dashboard, panel_queries, panels, require_binary, root, TempDir};

/// The series the crate's instruments become in Prometheus: the two histograms, the `queued`,
/// `active` and `limit` gauges, the `rejected` and `abandoned` counters (monotonic sums, to
/// which the exporter appends `_total`), and the named limits' own: their capacity, active and
/// queued, and an adaptive limit's baseline and estimated run time.
const SERIES: [&str; 16] = [
    "gym_resources_operation_queue_duration_ms_bucket",
    "gym_resources_operation_queue_duration_ms_sum",
    "gym_resources_operation_queue_duration_ms_count",
    "gym_resources_operation_duration_ms_bucket",
    "gym_resources_operation_duration_ms_sum",
    "gym_resources_operation_duration_ms_count",
    "gym_resources_operation_queued",
    "gym_resources_operation_active",
    "gym_resources_operation_limit",
    "gym_resources_operation_rejected_total",
    "gym_resources_operation_abandoned_total",
    "gym_resources_limit_capacity",
    "gym_resources_limit_active",
    "gym_resources_limit_queued",
    "gym_resources_limit_adaptive_baseline_ms",
    "gym_resources_limit_adaptive_estimate_ms",
];

/// The prefix of the named limits' series, which carry the limit's name rather than the
/// operation: they follow every variable but `operation`.
const LIMIT_SERIES: &str = "gym_resources_limit_";

/// The labels a query may select or group by: the crate's attributes, `le`, and the target's.
const LABELS: [&str; 8] = [
    "nemo_gym_resources_operation",
    "nemo_gym_resources_limit",
    "nemo_gym_resources_executor",
    "nemo_gym_resources_operation_outcome",
    "nemo_gym_resources_operation_rejection",
    "le",
    "job",
    "instance",
];

/// The template variables every dashboard query follows, with the label each one selects.
const VARIABLES: [(&str, &str); 3] = [
    ("job", "job"),
    ("instance", "instance"),
    ("operation", "nemo_gym_resources_operation"),
];

/// What every alert rule groups by: limits are per process and per series.
const ALERT_GROUPING: &str =
    "job, instance, nemo_gym_resources_operation, nemo_gym_resources_executor";

/// PromQL functions and aggregations the dashboard and the alert rules may call.
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

    // The new instruments and the rejection label pass, joined on the target labels.
    assert_eq!(
        check_expr(
            r#"sum by (nemo_gym_resources_operation_rejection) (rate(gym_resources_operation_rejected_total{job=~"$job"}[5m])) / (sum by (job) (rate(gym_resources_operation_abandoned_total[5m])) or 0 * sum by (job) (gym_resources_operation_active and on (job, instance) gym_resources_operation_limit))"#
        ),
        Vec::<String>::new()
    );
    // A counter without the `_total` the exporter appends selects nothing.
    let untotalled = check_expr("rate(gym_resources_operation_rejected[5m])");
    assert!(
        untotalled
            .iter()
            .any(|p| p.contains("\"gym_resources_operation_rejected\"")),
        "{untotalled:?}"
    );
    // The rejection label without its `nemo_` prefix is not one the series have, nor a made-up
    // `reason`.
    let labels = check_expr(
        r#"sum by (reason) (rate(gym_resources_operation_rejected_total{gym_resources_operation_rejection="queue_full"}[5m]))"#,
    );
    assert!(
        labels.iter().any(|p| p.contains("\"reason\"")),
        "{labels:?}"
    );
    assert!(
        labels
            .iter()
            .any(|p| p.contains("\"gym_resources_operation_rejection\"")),
        "{labels:?}"
    );
}

#[test]
fn grafana_dashboard_queries_only_the_crates_series() {
    let dashboard = load_dashboard();

    // Importable: a datasource input, a recent schema, the job, instance and operation variables.
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
    for (name, label) in VARIABLES {
        let variable = variables
            .iter()
            .find(|v| v["name"] == name)
            .unwrap_or_else(|| panic!("a `{name}` template variable"));
        // The values of the label on one of the crate's series, any number of them or All.
        let definition = variable["definition"].as_str().expect("definition");
        assert_eq!(variable["query"]["query"], definition, "{name}");
        let series = definition
            .strip_prefix("label_values(")
            .and_then(|rest| rest.strip_suffix(&format!(", {label})")))
            .unwrap_or_else(|| panic!("{name}: {definition}"));
        let series = series.split('{').next().unwrap_or_default();
        assert!(SERIES.contains(&series), "{name}: {definition}");
        assert_eq!(variable["multi"], true, "{name}");
        assert_eq!(variable["includeAll"], true, "{name}");
        assert_eq!(variable["allValue"], ".*", "{name}");
    }

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
        // Every selector follows every variable, so that one replica reads alone and a fleet
        // reads summed, panel by panel.
        let selectors = selectors(&query.expr);
        if selectors.is_empty() {
            problems.push(format!(
                "{} {}: selects no series",
                query.panel, query.ref_id
            ));
        }
        for (series, matchers) in selectors {
            for (variable, label) in VARIABLES {
                if series.starts_with(LIMIT_SERIES) && variable == "operation" {
                    continue;
                }
                if !matchers.contains(&format!(r#"{label}=~"${variable}""#)) {
                    problems.push(format!(
                        "{} {}: {series} does not follow the {variable} variable",
                        query.panel, query.ref_id
                    ));
                }
            }
        }
        used.extend(names(&query.expr).metrics);
    }
    assert!(problems.is_empty(), "{problems:#?}");

    // The panels the dashboard is for: queue and run quantiles, live counts against the limit,
    // outcomes, rejections and abandoned waits. Every series but the sums and the queue count,
    // which no panel needs.
    let unread = [
        "gym_resources_operation_queue_duration_ms_sum",
        "gym_resources_operation_queue_duration_ms_count",
        "gym_resources_operation_duration_ms_sum",
    ];
    for series in SERIES.iter().filter(|series| !unread.contains(series)) {
        assert!(used.contains(*series), "no panel reads {series}");
    }
    let has = |text: &str| queries.iter().any(|q| q.expr.contains(text));
    assert!(
        has("sum by (nemo_gym_resources_operation_outcome) (rate(gym_resources_operation_duration_ms_count"),
        "no outcome-rate panel"
    );
    assert!(
        has("sum by (nemo_gym_resources_operation_rejection) (rate(gym_resources_operation_rejected_total"),
        "no rejections-by-reason panel"
    );
    assert!(
        has("(rate(gym_resources_operation_abandoned_total"),
        "no abandoned-rate panel"
    );
    // Utilisation is active over the exported limit, not over the highest active seen.
    assert!(
        queries.iter().any(|q| {
            let names = names(&q.expr).metrics;
            q.expr.contains(" / ")
                && names.contains("gym_resources_operation_active")
                && names.contains("gym_resources_operation_limit")
        }),
        "no utilisation (active / limit) panel"
    );
    assert!(
        !has("max_over_time(gym_resources_operation_active"),
        "the observed ceiling stands in for the limit somewhere"
    );
}

/// Each selector of one of the crate's series in `expr`: the series and its `{...}` matchers
/// (empty without braces).
fn selectors(expr: &str) -> Vec<(&'static str, &str)> {
    let ident_char = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    let mut found = Vec::new();
    for series in SERIES {
        for (at, _) in expr.match_indices(series) {
            let end = at + series.len();
            let whole = !expr[..at].ends_with(ident_char) && !expr[end..].starts_with(ident_char);
            if !whole {
                continue;
            }
            let rest = expr[end..].trim_start();
            let matchers = rest
                .strip_prefix('{')
                .and_then(|rest| rest.split_once('}'))
                .map_or("", |(matchers, _)| matchers);
            found.push((series, matchers));
        }
    }
    found
}

#[test]
fn the_selector_check_sees_every_selector() {
    let expr = r#"sum(gym_resources_operation_active{job=~"$job", instance=~"$instance"}) / sum(gym_resources_operation_limit) + gym_resources_operation_queue_duration_ms_count {le="1"}"#;
    assert_eq!(
        selectors(expr),
        vec![
            (
                "gym_resources_operation_queue_duration_ms_count",
                r#"le="1""#
            ),
            (
                "gym_resources_operation_active",
                r#"job=~"$job", instance=~"$instance""#
            ),
            ("gym_resources_operation_limit", ""),
        ]
    );
}

/// Each alert rule of alerts.yml with its expression, read from the file's layout (`- alert:`
/// then `expr: |` and the lines indented under it): enough for the rules as written.
fn alert_rules() -> Vec<(String, String)> {
    let path = root().join(support::prometheus::ALERTS);
    let text =
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    let indent = |line: &str| line.len() - line.trim_start().len();
    let mut rules = Vec::new();
    let mut alert = None;
    let mut lines = text.lines().peekable();
    while let Some(line) = lines.next() {
        let trimmed = line.trim_start();
        if let Some(name) = trimmed.strip_prefix("- alert:") {
            alert = Some(name.trim().to_owned());
        } else if trimmed == "expr: |" {
            let name = alert.take().expect("an `expr` before its `- alert:`");
            let mut expr = String::new();
            while let Some(next) = lines.peek() {
                if !next.trim().is_empty() && indent(next) <= indent(line) {
                    break;
                }
                expr.push_str(next.trim());
                expr.push('\n');
                lines.next();
            }
            rules.push((name, expr));
        } else if trimmed.starts_with("expr:") {
            panic!("write every alert's expr as a block (`expr: |`): {line}");
        }
    }
    rules
}

#[test]
fn alert_rules_query_only_the_crates_series_per_limit() {
    let rules = alert_rules();
    let names: Vec<&str> = rules.iter().map(|(name, _)| name.as_str()).collect();
    assert_eq!(
        names,
        [
            "ResourcesOperationLimitSaturated",
            "ResourcesOperationQueueTimeAboveRunTime",
            "ResourcesOperationRejectionRateHigh",
            "ResourcesOperationCancelledWhileQueueTimeHigh",
        ]
    );
    let mut problems = Vec::new();
    for (name, expr) in &rules {
        for problem in check_expr(expr) {
            problems.push(format!("{name}: {problem}"));
        }
        // Every aggregation keeps the target and the series (histograms `le` too).
        let by = expr.matches("sum by (").count();
        let grouped = expr.matches(&format!("sum by ({ALERT_GROUPING}")).count();
        if by == 0 || by != grouped {
            problems.push(format!("{name}: not every sum is by ({ALERT_GROUPING})"));
        }
    }
    assert!(problems.is_empty(), "{problems:#?}");
    let saturated = &rules[0].1;
    assert!(
        saturated.contains("(gym_resources_operation_active)\n>=\n")
            && saturated.contains("(gym_resources_operation_limit)")
            && !saturated.contains("max_over_time"),
        "{saturated}"
    );
    let rejections = &rules[2].1;
    for series in [
        "gym_resources_operation_rejected_total",
        "gym_resources_operation_queue_duration_ms_count",
        "gym_resources_operation_abandoned_total",
    ] {
        assert!(rejections.contains(series), "{rejections}");
    }
    assert!(
        rules[3]
            .1
            .contains("gym_resources_operation_abandoned_total"),
        "the give-up alert counts abandoned waits: {}",
        rules[3].1
    );
}

#[test]
fn alert_unit_tests_see_every_alert_fire_and_stay_quiet() {
    let path = root().join(support::prometheus::ALERT_TESTS);
    let text =
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    let mut cases = BTreeSet::new();
    let mut lines = text.lines().map(str::trim);
    while let Some(line) = lines.next() {
        if let Some(alert) = line.strip_prefix("alertname:") {
            let expected = lines.next().unwrap_or_default();
            let fires = match expected {
                "exp_alerts: []" => false,
                "exp_alerts:" => true,
                other => panic!("after `alertname: {alert}`: {other:?}"),
            };
            cases.insert((alert.trim().to_owned(), fires));
        }
    }
    for (alert, _) in alert_rules() {
        for fires in [true, false] {
            assert!(
                cases.contains(&(alert.clone(), fires)),
                "no unit test where {alert} {}",
                if fires { "fires" } else { "stays quiet" }
            );
        }
    }
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
    let checked = promtool(&binary, &["check", "rules", support::prometheus::ALERTS]);
    assert!(checked.contains("SUCCESS: 4 rules found"), "{checked}");
    let tested = promtool(
        &binary,
        &["test", "rules", support::prometheus::ALERT_TESTS],
    );
    assert!(tested.contains("SUCCESS"), "{tested}");
}

/// Every dashboard query is PromQL that Prometheus parses, with the variables as Grafana fills
/// them in when everything is selected: checked as recording rules.
#[test]
fn dashboard_queries_parse_with_promtool() {
    let Some(binary) = require_binary("promtool", "the dashboard queries' promtool check") else {
        return;
    };
    let dir = TempDir::new("tower-resources-operation-dashboard-rules");
    let mut rules = String::from("groups:\n  - name: dashboard\n    rules:\n");
    let queries = panel_queries(&load_dashboard());
    for (i, query) in queries.iter().enumerate() {
        let mut expr = query.expr.replace("$__rate_interval", "5m");
        for (variable, _) in VARIABLES {
            expr = expr.replace(&format!("${variable}"), ".*");
        }
        assert!(!expr.contains('$'), "{}: {expr}", query.panel);
        rules.push_str(&format!(
            "      - record: dashboard:query_{i}\n        expr: |\n          {expr}\n"
        ));
    }
    let file = dir.path().join("dashboard.rules.yml");
    std::fs::write(&file, rules).expect("write rules");
    let checked = promtool(
        &binary,
        &["check", "rules", file.to_str().expect("utf-8 path")],
    );
    assert!(
        checked.contains(&format!("SUCCESS: {} rules found", queries.len())),
        "{checked}"
    );
}
