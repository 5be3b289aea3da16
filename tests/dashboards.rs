//! The dashboard and the alert rules in dashboards/: the Grafana dashboard and the alert rules
//! query only the crate's series (as the Prometheus exporter names them, the histograms with or
//! without the `_milliseconds` unit suffix that `without_units()` leaves out), every dashboard
//! query follows the `job` and `instance` variables and the `operation` or `limit` one of its
//! series, the alert unit tests see every alert both fire and stay quiet, and the alert rules
//! (and the dashboard's queries) pass `promtool check rules` and the rules their own
//! `promtool test rules` unit tests.
//!
//! The promtool half needs `promtool` on PATH (Debian's `prometheus` package ships it): those
//! tests are `#[ignore]`d, so `cargo test` counts them as ignored, and
//! `cargo test -- --include-ignored` runs them (and fails them, saying what to install, if
//! `promtool` is missing).

mod support;

use std::collections::BTreeSet;
use std::process::Command;

use support::prometheus::{
    label, load_dashboard, panel_queries, panels, require_binary, root, TempDir,
};

/// The series the crate's instruments become in Prometheus: the two histograms, the
/// `queued`, `active` and `limit` gauges, the `rejected` and `abandoned` counters (monotonic
/// sums, to which the exporter appends `_total`), a named limit's `capacity`, `active` and
/// `queued`, and an adaptive limit's baseline and estimated run time.
const SERIES: [&str; 17] = [
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
    // The fleet limit's (tower-resources-operation-redis): places held by members not heard from.
    "gym_resources_limit_unheard",
];

/// The histograms' series, the first six of [`SERIES`]: named `..._ms_bucket` with
/// `without_units()`, `..._ms_milliseconds_bucket` without it, so the dashboard and the alerts
/// select them as `{__name__=~"..._ms(_milliseconds)?_bucket"}`.
const HISTOGRAM_SERIES: &[&str] = SERIES.split_at(6).0;

/// The prefix of a named limit's series, which carry the limit's name instead of an operation.
const LIMIT_SERIES_PREFIX: &str = "gym_resources_limit_";

/// The labels a query may select or group by: the crate's attributes, `le`, and the target's.
const LABELS: [&str; 9] = [
    label::OPERATION,
    label::LIMIT,
    label::LIMIT_SCOPE,
    label::EXECUTOR,
    label::OUTCOME,
    label::REJECTION,
    "le",
    "job",
    "instance",
];

/// The template variables of the dashboard, with the label each one selects.
const VARIABLES: [(&str, &str); 4] = [
    ("job", "job"),
    ("instance", "instance"),
    ("operation", "nemo_gym_resources_operation"),
    ("limit", "nemo_gym_resources_limit"),
];

/// The variables every selector of a per-(operation, executor) series follows.
const SERIES_VARIABLES: [(&str, &str); 3] = [
    ("job", "job"),
    ("instance", "instance"),
    ("operation", "nemo_gym_resources_operation"),
];

/// The variables every selector of a named limit's series follows.
const LIMIT_VARIABLES: [(&str, &str); 3] = [
    ("job", "job"),
    ("instance", "instance"),
    ("limit", "nemo_gym_resources_limit"),
];

/// What every alert rule groups a per-series sum by: limits are per process and per series.
const ALERT_GROUPING: &str =
    "job, instance, nemo_gym_resources_operation, nemo_gym_resources_executor";

/// What every alert rule groups a named limit's sum by: per process and per limit.
const LIMIT_GROUPING: &str = "job, instance, nemo_gym_resources_limit";

/// What the fleet's rule groups a fleet limit's series by: the limit alone, over every replica.
const FLEET_GROUPING: &str = "nemo_gym_resources_limit";

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

/// The series a `__name__` matcher (`op`, `value`) selects, if the checks accept it, and whether
/// it was named exactly (`="..."`): one of the crate's series by its name, or one of its
/// histogram series with or without the exporter's unit suffix,
/// `=~"gym_resources_operation_duration_ms(_milliseconds)?_bucket"`.
fn name_matcher(op: &str, value: &str) -> Option<(&'static str, bool)> {
    match op {
        "=" => SERIES
            .iter()
            .find(|series| **series == value)
            .map(|s| (*s, true)),
        "=~" => HISTOGRAM_SERIES
            .iter()
            .find(|series| {
                let (stem, suffix) = series.rsplit_once('_').expect("a suffix");
                value == format!("{stem}(_milliseconds)?_{suffix}")
            })
            .map(|s| (*s, false)),
        _ => None,
    }
}

/// What a PromQL expression names, read with a small tokenizer: enough for the dashboard's
/// queries (selectors, `by (...)`, function calls, binary operators, numbers, durations).
#[derive(Debug, Default, PartialEq)]
struct Names {
    /// The series selected, by name or by a `__name__` matcher; a matcher the checks do not
    /// accept is kept as written, so that it is not one of the crate's series.
    metrics: BTreeSet<String>,
    /// The series named exactly, which a unit suffix would change.
    exact: BTreeSet<String>,
    labels: BTreeSet<String>,
    functions: BTreeSet<String>,
}

/// Whether `c` may start a PromQL name (of a series, a label or a function; `:` is for
/// recording rules).
fn is_ident_start(c: char) -> bool {
    c.is_ascii_alphabetic() || c == '_' || c == ':'
}

/// Whether `c` may go on a PromQL name.
fn is_ident_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || c == ':'
}

/// Whether `c` opens a PromQL string.
fn is_quote(c: char) -> bool {
    matches!(c, '"' | '\'' | '`')
}

/// From `*i`, past the name there (if any); the name.
fn read_ident(chars: &[char], i: &mut usize) -> String {
    let start = *i;
    while *i < chars.len() && is_ident_char(chars[*i]) {
        *i += 1;
    }
    chars[start..*i].iter().collect()
}

/// From `*i`, past any white space.
fn skip_space(chars: &[char], i: &mut usize) {
    while *i < chars.len() && chars[*i].is_whitespace() {
        *i += 1;
    }
}

/// From an opening quote, past the closing one.
fn skip_string(chars: &[char], i: &mut usize) {
    let open = chars[*i];
    *i += 1;
    while *i < chars.len() && chars[*i] != open {
        if chars[*i] == '\\' {
            *i += 1;
        }
        *i += 1;
    }
    *i += 1;
}

/// From an opening brace, the text up to the closing one (outside strings), and past it.
fn read_braces(chars: &[char], i: &mut usize) -> String {
    *i += 1;
    let start = *i;
    while *i < chars.len() && chars[*i] != '}' {
        if is_quote(chars[*i]) {
            skip_string(chars, i);
        } else {
            *i += 1;
        }
    }
    let text: String = chars[start..(*i).min(chars.len())].iter().collect();
    *i += 1;
    text
}

/// Skips, from `*i`, what names no series, label or function, for both tokenizers below: a
/// string, a range or subquery (`[...]`: durations and Grafana variables), or a Grafana variable
/// outside a string (`$name` or `${...}`). Whether there was one.
fn skip_nameless(chars: &[char], i: &mut usize) -> bool {
    match chars[*i] {
        c if is_quote(c) => skip_string(chars, i),
        '[' => {
            while *i < chars.len() && chars[*i] != ']' {
                *i += 1;
            }
            *i += 1;
        }
        '$' => {
            *i += 1;
            if *i < chars.len() && chars[*i] == '{' {
                read_braces(chars, i);
            } else {
                read_ident(chars, i);
            }
        }
        _ => return false,
    }
    true
}

/// Walks `expr` for a tokenizer: skips what names nothing ([`skip_nameless`]) and hands `step`
/// the rest, with the characters and the position of what comes next, which `step` moves past
/// what it reads.
fn walk(expr: &str, mut step: impl FnMut(&[char], &mut usize)) {
    let chars: Vec<char> = expr.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        if !skip_nameless(&chars, &mut i) {
            step(&chars, &mut i);
        }
    }
}

fn names(expr: &str) -> Names {
    let mut names = Names::default();
    walk(expr, |chars, i| {
        let c = chars[*i];
        if c.is_whitespace() {
            *i += 1;
        } else if c == '{' {
            // Label matchers: `name op "value"`, comma-separated.
            *i += 1;
            loop {
                skip_space(chars, i);
                if *i >= chars.len() || chars[*i] == '}' {
                    *i += 1;
                    break;
                }
                if chars[*i] == ',' {
                    *i += 1;
                    continue;
                }
                if is_ident_start(chars[*i]) {
                    let label = read_ident(chars, i);
                    if label != "__name__" {
                        names.labels.insert(label);
                        continue;
                    }
                    // `__name__ op "value"`: which series it selects.
                    skip_space(chars, i);
                    let start = *i;
                    while *i < chars.len() && matches!(chars[*i], '=' | '!' | '~') {
                        *i += 1;
                    }
                    let op: String = chars[start..*i].iter().collect();
                    skip_space(chars, i);
                    let value_start = *i;
                    if *i < chars.len() && is_quote(chars[*i]) {
                        skip_string(chars, i);
                    }
                    let quoted: String = chars[value_start..*i].iter().collect();
                    let value = quoted.get(1..quoted.len().saturating_sub(1)).unwrap_or("");
                    match name_matcher(&op, value) {
                        Some((series, exact)) => {
                            names.metrics.insert(series.to_owned());
                            if exact {
                                names.exact.insert(series.to_owned());
                            }
                        }
                        None => {
                            names.metrics.insert(format!("{{__name__{op}{quoted}}}"));
                        }
                    }
                } else if is_quote(chars[*i]) {
                    skip_string(chars, i);
                } else {
                    *i += 1; // =, !=, =~, !~
                }
            }
        } else if c.is_ascii_digit() || c == '.' {
            while *i < chars.len() && (chars[*i].is_ascii_alphanumeric() || chars[*i] == '.') {
                *i += 1;
            }
        } else if is_ident_start(c) {
            let ident = read_ident(chars, i);
            let mut next = *i;
            skip_space(chars, &mut next);
            // A call: `f(`, or an aggregation written `sum by (...) (...)`.
            let mut after = next;
            let grouped = matches!(read_ident(chars, &mut after).as_str(), "by" | "without");
            let call = next < chars.len() && chars[next] == '(' || grouped;
            match ident.as_str() {
                "by" | "without" | "on" | "ignoring" | "group_left" | "group_right" => {
                    if call {
                        *i = next + 1;
                        while *i < chars.len() && chars[*i] != ')' {
                            if is_ident_start(chars[*i]) {
                                names.labels.insert(read_ident(chars, i));
                            } else {
                                *i += 1;
                            }
                        }
                        *i += 1;
                    }
                }
                "and" | "or" | "unless" | "bool" | "offset" => {}
                _ if call => {
                    names.functions.insert(ident);
                }
                _ => {
                    names.exact.insert(ident.clone());
                    names.metrics.insert(ident);
                }
            }
        } else {
            *i += 1;
        }
    });
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
    for series in &names.exact {
        if HISTOGRAM_SERIES.contains(&series.as_str()) {
            let (stem, suffix) = series.rsplit_once('_').expect("a suffix");
            problems.push(format!(
                "histogram series {series:?} named exactly: it selects nothing when the \
                 exporter keeps its unit suffix; select {{__name__=~\"{stem}(_milliseconds)?_{suffix}\"}}"
            ));
        }
    }
    problems
}

#[test]
fn the_expression_check_catches_foreign_series_labels_and_unit_suffixes() {
    assert_eq!(
        check_expr(
            r#"sum by (le, nemo_gym_resources_operation) (rate({__name__=~"gym_resources_operation_duration_ms(_milliseconds)?_bucket", nemo_gym_resources_operation=~"$operation"}[$__rate_interval])) / 1000"#
        ),
        Vec::<String>::new()
    );
    let foreign = check_expr(r#"sum by (route) (rate(http_requests_total{job="x"}[5m]))"#);
    assert!(
        foreign.iter().any(|p| p.contains("http_requests_total")),
        "{foreign:?}"
    );
    assert!(foreign.iter().any(|p| p.contains("route")), "{foreign:?}");
    // What the exporter names the histogram without `without_units()`, alone.
    let suffixed = check_expr("rate(gym_resources_operation_duration_ms_milliseconds_count[5m])");
    assert!(
        suffixed.iter().any(|p| p.contains("milliseconds")),
        "{suffixed:?}"
    );
    // The histogram without its unit suffix, alone: nothing once the exporter keeps it, whether
    // by name or by an exact `__name__`.
    for unsuffixed in [
        "rate(gym_resources_operation_duration_ms_count[5m])",
        r#"rate({__name__="gym_resources_operation_queue_duration_ms_bucket"}[5m])"#,
    ] {
        let problems = check_expr(unsuffixed);
        assert!(
            problems.len() == 1 && problems[0].contains("named exactly"),
            "{unsuffixed}: {problems:?}"
        );
    }
    // A `__name__` pattern selects only the crate's series, either way.
    for loose in [
        r#"rate({__name__=~"gym_resources_operation_duration_ms.*"}[5m])"#,
        r#"rate({__name__=~"gym_resources_operation_duration_ms(_milliseconds)?_bucket|http_.*"}[5m])"#,
        r#"{__name__!="gym_resources_operation_active"}"#,
    ] {
        let problems = check_expr(loose);
        assert!(
            problems.iter().any(|p| p.contains("__name__")),
            "{loose}: {problems:?}"
        );
    }
    assert_eq!(check_expr("vector(1)"), vec!["names no series".to_owned()]);
    assert_eq!(
        check_expr(r#"{__name__="gym_resources_operation_active", job="x"}"#),
        Vec::<String>::new()
    );

    // The counters, the limit series and the rejection label pass, joined on the target labels.
    assert_eq!(
        check_expr(
            r#"sum by (nemo_gym_resources_operation_rejection) (rate(gym_resources_operation_rejected_total{job=~"$job"}[5m])) / (sum by (job) (rate(gym_resources_operation_abandoned_total[5m])) or 0 * sum by (job) (gym_resources_operation_active and on (job, instance) gym_resources_operation_limit))"#
        ),
        Vec::<String>::new()
    );
    assert_eq!(
        check_expr(
            r#"sum by (nemo_gym_resources_limit) (gym_resources_limit_active{nemo_gym_resources_limit=~"$limit"}) / sum by (nemo_gym_resources_limit) (gym_resources_limit_capacity)"#
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
    // `reason`, nor a limit label without its prefix.
    let labels = check_expr(
        r#"sum by (reason, limit) (rate(gym_resources_operation_rejected_total{gym_resources_operation_rejection="queue_full"}[5m]))"#,
    );
    for label in ["reason", "limit", "gym_resources_operation_rejection"] {
        assert!(
            labels.iter().any(|p| p.contains(&format!("\"{label}\""))),
            "{label}: {labels:?}"
        );
    }
}

/// The variables a selector of `series` follows.
fn variables_of(series: &str) -> [(&'static str, &'static str); 3] {
    if series.starts_with(LIMIT_SERIES_PREFIX) {
        LIMIT_VARIABLES
    } else {
        SERIES_VARIABLES
    }
}

#[test]
fn grafana_dashboard_queries_only_the_crates_series() {
    let dashboard = load_dashboard();

    // Importable: a datasource input, a recent schema, the job, instance, operation and limit
    // variables.
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
        if label == "nemo_gym_resources_limit" {
            assert!(series.starts_with(LIMIT_SERIES_PREFIX), "{definition}");
        }
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
        // Every selector follows every variable of its series, so that one replica reads alone
        // and a fleet reads summed, panel by panel.
        let selectors = selectors(&query.expr);
        if selectors.is_empty() {
            problems.push(format!(
                "{} {}: selects no series",
                query.panel, query.ref_id
            ));
        }
        for (series, matchers) in selectors {
            for (variable, label) in variables_of(&series) {
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

    // The panels the dashboard is for: per named limit, its utilisation, live counts against
    // its capacity and its queue; per series, queue and run quantiles, live counts against the
    // limit, outcomes, rejections and abandoned waits. Every series but the sums and the queue
    // count, which no panel needs.
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
        has(
            r#"sum by (nemo_gym_resources_operation_outcome) (rate({__name__=~"gym_resources_operation_duration_ms(_milliseconds)?_count""#
        ),
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
    // Utilisation is active over the exported limit, not over the highest active seen: per
    // series, and per named limit over every route that shares it.
    let utilisation = |active: &str, limit: &str| {
        queries.iter().find(|q| {
            let names = names(&q.expr).metrics;
            q.expr.contains(" / ") && names.contains(active) && names.contains(limit)
        })
    };
    assert!(
        utilisation(
            "gym_resources_operation_active",
            "gym_resources_operation_limit"
        )
        .is_some(),
        "no utilisation (active / limit) panel"
    );
    let per_limit = utilisation("gym_resources_limit_active", "gym_resources_limit_capacity")
        .expect("no per-limit utilisation (gym_resources_limit_active / capacity) panel");
    assert!(
        per_limit
            .expr
            .starts_with("sum by (nemo_gym_resources_limit) ("),
        "{per_limit:?}"
    );
    assert!(
        has("sum by (nemo_gym_resources_limit) (gym_resources_limit_queued"),
        "no per-limit queue panel"
    );
    assert!(
        !has("max_over_time(gym_resources_operation_active"),
        "the observed ceiling stands in for the limit somewhere"
    );

    // A shared limit is read per limit: the per-limit panels, and the per-series panels that
    // show the limit, say so.
    for panel in panels(&dashboard) {
        let description = panel["description"].as_str().unwrap_or_default();
        let reads = |series: &str| {
            panel["targets"].as_array().into_iter().flatten().any(|t| {
                names(t["expr"].as_str().unwrap_or_default())
                    .metrics
                    .contains(series)
            })
        };
        if reads("gym_resources_limit_capacity") || reads("gym_resources_operation_limit") {
            assert!(
                description.contains("per limit, not per series"),
                "panel {}: {description}",
                panel["title"]
            );
        }
    }
}

/// Each selector in `expr` of one of the crate's series or with a `__name__` matcher: the series
/// (the crate's series a `__name__` matcher selects, the matcher as written if none, or `""`
/// when the braces name no series), and its `{...}` matchers (empty without braces). In the
/// order they appear.
fn selectors(expr: &str) -> Vec<(String, String)> {
    let mut found = Vec::new();
    walk(expr, |chars, i| {
        let c = chars[*i];
        if c == '{' {
            let matchers = read_braces(chars, i);
            let series = names(&format!("{{{matchers}}}"))
                .metrics
                .into_iter()
                .next()
                .unwrap_or_default();
            found.push((series, matchers));
        } else if is_ident_start(c) {
            let ident = read_ident(chars, i);
            if !SERIES.contains(&ident.as_str()) {
                return;
            }
            let mut next = *i;
            skip_space(chars, &mut next);
            let matchers = if next < chars.len() && chars[next] == '{' {
                *i = next;
                read_braces(chars, i)
            } else {
                String::new()
            };
            found.push((ident, matchers));
        } else {
            *i += 1;
        }
    });
    found
}

#[test]
fn the_selector_check_sees_every_selector() {
    let expr = r#"sum(gym_resources_operation_active{job=~"$job", instance=~"${instance}"}) / sum(gym_resources_limit_capacity) + rate({__name__=~"gym_resources_operation_queue_duration_ms(_milliseconds)?_count", le="1"}[$__rate_interval]) + gym_resources_operation_limit {le="}"} + {job="x"}"#;
    let found = selectors(expr);
    let found: Vec<(&str, &str)> = found
        .iter()
        .map(|(series, matchers)| (series.as_str(), matchers.as_str()))
        .collect();
    assert_eq!(
        found,
        vec![
            (
                "gym_resources_operation_active",
                r#"job=~"$job", instance=~"${instance}""#
            ),
            ("gym_resources_limit_capacity", ""),
            (
                "gym_resources_operation_queue_duration_ms_count",
                r#"__name__=~"gym_resources_operation_queue_duration_ms(_milliseconds)?_count", le="1""#
            ),
            ("gym_resources_operation_limit", r#"le="}""#),
            ("", r#"job="x""#),
        ]
    );
}

/// One alert rule of alerts.yml: its name, its `scope` label (for the rules that share a name),
/// its expression and its description.
#[derive(Debug)]
struct Rule {
    name: String,
    scope: Option<String>,
    expr: String,
    description: String,
}

/// Each alert rule of alerts.yml, read from the file's layout (`- alert:`, then `expr: |` and
/// `description: >-` with the lines indented under them, and a `scope:` label): enough for the
/// rules as written. Expression lines are trimmed and joined with newlines, description lines
/// with spaces.
fn alert_rules() -> Vec<Rule> {
    let path = root().join(support::prometheus::ALERTS);
    let text =
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    let indent = |line: &str| line.len() - line.trim_start().len();
    let mut rules: Vec<Rule> = Vec::new();
    let mut lines = text.lines().peekable();
    while let Some(line) = lines.next() {
        let trimmed = line.trim_start();
        let mut block = |separator: char| {
            let mut block = String::new();
            while let Some(next) = lines.peek() {
                if !next.trim().is_empty() && indent(next) <= indent(line) {
                    break;
                }
                if !next.trim().is_empty() {
                    block.push_str(next.trim());
                    block.push(separator);
                }
                lines.next();
            }
            block
        };
        if let Some(name) = trimmed.strip_prefix("- alert:") {
            rules.push(Rule {
                name: name.trim().to_owned(),
                scope: None,
                expr: String::new(),
                description: String::new(),
            });
            continue;
        }
        let Some(rule) = rules.last_mut() else {
            continue;
        };
        if trimmed == "expr: |" {
            assert!(rule.expr.is_empty(), "two exprs in {}", rule.name);
            rule.expr = block('\n');
        } else if trimmed.starts_with("expr:") {
            panic!("write every alert's expr as a block (`expr: |`): {line}");
        } else if trimmed == "description: >-" {
            rule.description = block(' ').trim_end().to_owned();
        } else if let Some(scope) = trimmed.strip_prefix("scope:") {
            rule.scope = Some(scope.trim().to_owned());
        }
    }
    rules
}

/// Each `sum by (...)` of `expr`: its grouping and the first series it sums.
fn groupings(expr: &str) -> Vec<(String, String)> {
    expr.match_indices("sum by (")
        .map(|(at, open)| {
            let rest = &expr[at + open.len()..];
            let (grouping, rest) = rest.split_once(')').expect("a closing parenthesis");
            let series = selectors(rest)
                .into_iter()
                .next()
                .map(|(series, _)| series)
                .unwrap_or_default();
            (grouping.to_owned(), series)
        })
        .collect()
}

#[test]
fn alert_rules_query_only_the_crates_series_per_limit() {
    let rules = alert_rules();
    let rule_names: Vec<(&str, Option<&str>)> = rules
        .iter()
        .map(|rule| (rule.name.as_str(), rule.scope.as_deref()))
        .collect();
    assert_eq!(
        rule_names,
        [
            ("ResourcesOperationLimitSaturated", Some("limit")),
            ("ResourcesOperationLimitSaturated", Some("fleet")),
            ("ResourcesOperationLimitSaturated", Some("series")),
            ("ResourcesOperationQueueTimeAboveRunTime", None),
            ("ResourcesOperationRejectionRateHigh", None),
            ("ResourcesOperationCancelledWhileQueueTimeHigh", None),
            ("ResourcesOperationTimeoutRateHigh", None),
            ("ResourcesOperationDeadlinePassedInQueue", None),
        ]
    );
    let mut problems = Vec::new();
    for rule in &rules {
        let name = &rule.name;
        for problem in check_expr(&rule.expr) {
            problems.push(format!("{name}: {problem}"));
        }
        // Every aggregation keeps the target and the series, or the target and the named limit
        // (histograms `le` too); the fleet's rule keeps the fleet limit alone.
        let groupings = groupings(&rule.expr);
        if groupings.is_empty() {
            problems.push(format!("{name}: no sum by (...)"));
        }
        for (grouping, series) in groupings {
            let expected = if rule.scope.as_deref() == Some("fleet") {
                FLEET_GROUPING.to_owned()
            } else if series.starts_with(LIMIT_SERIES_PREFIX) {
                LIMIT_GROUPING.to_owned()
            } else if series.ends_with("_bucket") {
                format!("{ALERT_GROUPING}, le")
            } else {
                ALERT_GROUPING.to_owned()
            };
            if grouping != expected {
                problems.push(format!(
                    "{name}: sum by ({grouping}) of {series:?}, not by ({expected})"
                ));
            }
        }
        if rule.description.len() < 100 {
            problems.push(format!("{name}: no description to act on"));
        }
    }
    assert!(problems.is_empty(), "{problems:#?}");

    let metrics = |rule: &Rule| names(&rule.expr).metrics;
    // Per named limit: its own queue, active and capacity, nothing per series.
    let per_limit = &rules[0];
    assert_eq!(
        metrics(per_limit),
        BTreeSet::from(
            [
                "gym_resources_limit_queued",
                "gym_resources_limit_active",
                "gym_resources_limit_capacity"
            ]
            .map(String::from)
        ),
        "{}",
        per_limit.expr
    );
    // Of limits whose capacity adds up over processes (a process's own, or a fleet limit on
    // its share): a fleet limit's is the same on every replica.
    let not_fleet = r#"{nemo_gym_resources_limit_scope!="fleet"}"#;
    assert!(
        per_limit
            .expr
            .contains(&format!("(gym_resources_limit_active{not_fleet})\n>=\n"))
            && per_limit
                .expr
                .contains(&format!("(gym_resources_limit_queued{not_fleet})\n> 0\n"))
            && per_limit
                .expr
                .contains(&format!("(gym_resources_limit_capacity{not_fleet})\n")),
        "{}",
        per_limit.expr
    );
    // Per fleet limit: every replica's queue added up (a fleet limit queues only while all its
    // places are held), of a fleet limit whose capacity is read once.
    let per_fleet = &rules[1];
    assert_eq!(
        metrics(per_fleet),
        BTreeSet::from(
            ["gym_resources_limit_queued", "gym_resources_limit_capacity"].map(String::from)
        ),
        "{}",
        per_fleet.expr
    );
    let fleet = r#"{nemo_gym_resources_limit_scope="fleet"}"#;
    for part in [
        format!("sum by (nemo_gym_resources_limit) (gym_resources_limit_queued{fleet})\n> 0\n"),
        format!("max by (nemo_gym_resources_limit) (gym_resources_limit_capacity{fleet})\n"),
    ] {
        assert!(
            per_fleet.expr.contains(&part),
            "{part} in {}",
            per_fleet.expr
        );
    }
    // Per series, held back while a named limit of the same process is saturated: exactly the
    // per-limit condition; of the limits of its process only (a fleet limit is named). Its
    // active is read at its highest over 2 minutes (a scrape during a hand-over reads one
    // below), against the limit the series exports, never against an observed ceiling.
    let per_series = &rules[2];
    assert!(
        per_series
            .expr
            .contains("(max_over_time(gym_resources_operation_active[2m]))\n>=\n")
            && per_series
                .expr
                .contains(&format!("(gym_resources_operation_limit{not_fleet})"))
            && per_series.expr.matches("max_over_time").count() == 1,
        "{}",
        per_series.expr
    );
    let held_back = format!("unless on (job, instance)\n(\n{})\n", per_limit.expr);
    assert!(
        per_series.expr.ends_with(&held_back),
        "the per-series rule should end with\n{held_back}\nnot\n{}",
        per_series.expr
    );
    let rejections = &rules[4];
    for series in [
        "gym_resources_operation_rejected_total",
        "gym_resources_operation_queue_duration_ms_count",
        "gym_resources_operation_abandoned_total",
    ] {
        assert!(metrics(rejections).contains(series), "{}", rejections.expr);
    }
    // The give-up alert counts abandoned waits, and tells the server's own timeouts apart from
    // callers who give up.
    let give_up = &rules[5];
    assert!(
        metrics(give_up).contains("gym_resources_operation_abandoned_total"),
        "the give-up alert counts abandoned waits: {}",
        give_up.expr
    );
    for words in [
        "TimeoutLayer on the whole Router",
        "records as cancelled unless it is told that timeout with .server_timeout(t), in which case it records timeout",
        "ResourcesOperationTimeoutRateHigh",
    ] {
        assert!(give_up.description.contains(words), "{words:?}: {}", give_up.description);
    }
    let timeouts = &rules[6];
    assert!(
        timeouts
            .expr
            .contains(r#"nemo_gym_resources_operation_outcome="timeout""#),
        "{}",
        timeouts.expr
    );
    assert!(
        timeouts.description.contains(".server_timeout(t)"),
        "{}",
        timeouts.description
    );
}

/// What alerts.test.yml expects at one evaluation: the alert, and the labels of each alert
/// expected to fire (none: expected quiet).
#[derive(Debug)]
struct Expectation {
    alert: String,
    firing: Vec<BTreeSet<String>>,
}

/// Every `alertname:` of alerts.test.yml with what it expects, read from the file's layout.
fn alert_expectations() -> Vec<Expectation> {
    let path = root().join(support::prometheus::ALERT_TESTS);
    let text =
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    let mut expectations: Vec<Expectation> = Vec::new();
    let mut in_labels = false;
    let mut lines = text.lines().map(str::trim);
    while let Some(line) = lines.next() {
        if let Some(alert) = line.strip_prefix("alertname:") {
            let expected = lines.next().unwrap_or_default();
            match expected {
                "exp_alerts: []" | "exp_alerts:" => {}
                other => panic!("after `alertname: {alert}`: {other:?}"),
            }
            expectations.push(Expectation {
                alert: alert.trim().to_owned(),
                firing: Vec::new(),
            });
            in_labels = false;
        } else if line == "- exp_labels:" {
            expectations
                .last_mut()
                .expect("exp_labels after an alertname")
                .firing
                .push(BTreeSet::new());
            in_labels = true;
        } else if line == "exp_annotations:" || line.starts_with('-') {
            in_labels = false;
        } else if in_labels {
            if let Some((label, value)) = line.split_once(": ") {
                let firing = &mut expectations.last_mut().expect("an alertname").firing;
                firing
                    .last_mut()
                    .expect("an alert")
                    .insert(format!("{label}={value}"));
            }
        }
    }
    expectations
}

#[test]
fn alert_unit_tests_see_every_alert_fire_and_stay_quiet() {
    let expectations = alert_expectations();
    for rule in alert_rules() {
        let scope = rule
            .scope
            .as_ref()
            .map(|scope| format!("scope=\"{scope}\""));
        let fires = expectations.iter().any(|e| {
            e.alert == rule.name
                && e.firing
                    .iter()
                    .any(|labels| scope.as_ref().is_none_or(|scope| labels.contains(scope)))
        });
        let quiet = expectations
            .iter()
            .any(|e| e.alert == rule.name && e.firing.is_empty());
        let rule = format!("{} (scope {:?})", rule.name, rule.scope);
        assert!(fires, "no unit test where {rule} fires");
        assert!(quiet, "no unit test where {rule} stays quiet");
    }
    // The per-limit rule fires, alone, where each route's series shows its shared limit half
    // used: the Getting-started setup.
    let getting_started = expectations
        .iter()
        .filter(|e| e.alert == "ResourcesOperationLimitSaturated")
        .find(|e| {
            e.firing.len() == 1
                && e.firing[0].contains(r#"scope="limit""#)
                && e.firing[0].contains(r#"instance="resources-0:9464""#)
        });
    assert!(getting_started.is_some(), "{expectations:#?}");
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
#[ignore = "needs prometheus and promtool on PATH (apt-get install prometheus); run with --include-ignored"]
fn alert_rules_pass_promtool_check_and_their_unit_tests() {
    let binary = require_binary("promtool", "the alert rules' promtool checks");
    let checked = promtool(&binary, &["check", "rules", support::prometheus::ALERTS]);
    assert!(
        checked.contains(&format!("SUCCESS: {} rules found", alert_rules().len())),
        "{checked}"
    );
    let tested = promtool(
        &binary,
        &["test", "rules", support::prometheus::ALERT_TESTS],
    );
    assert!(tested.contains("SUCCESS"), "{tested}");
}

/// Every dashboard query is PromQL that Prometheus parses, with the variables as Grafana fills
/// them in when everything is selected: checked as recording rules.
#[test]
#[ignore = "needs prometheus and promtool on PATH (apt-get install prometheus); run with --include-ignored"]
fn dashboard_queries_parse_with_promtool() {
    let binary = require_binary("promtool", "the dashboard queries' promtool check");
    let dir = TempDir::new("tower-resources-operation-dashboard-rules");
    let mut rules = String::from("groups:\n  - name: dashboard\n    rules:\n");
    let queries = panel_queries(&load_dashboard());
    for (i, query) in queries.iter().enumerate() {
        let expr = support::prometheus::substitute_grafana_variables(&query.expr, "5m");
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
