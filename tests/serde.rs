#![cfg(feature = "serde")]
//! The `serde` feature: `Operation`, `Executor` and `Outcome` are NeMo Gym's lower-case strings
//! in both directions, so a config file names them as the metrics export them, and a name that
//! is not one of them is an error that lists the valid values.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::json;
use tower_resources_operation::names::{EXECUTORS, OPERATIONS, OUTCOMES};
use tower_resources_operation::{Executor, Operation, Outcome};

/// A limit as a service might read it from its config file.
#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct LimitConfig {
    operation: Operation,
    executor: Executor,
    max: usize,
}

#[test]
fn values_serialize_to_nemo_gyms_strings() {
    let operations: Vec<_> = Operation::ALL.iter().map(|v| json!(v)).collect();
    assert_eq!(
        operations,
        [
            json!("verify"),
            json!("tool"),
            json!("judge"),
            json!("other")
        ]
    );
    let executors: Vec<_> = Executor::ALL.iter().map(|v| json!(v)).collect();
    assert_eq!(
        executors,
        [
            json!("inline"),
            json!("thread"),
            json!("process"),
            json!("subprocess"),
            json!("other")
        ]
    );
    let outcomes: Vec<_> = Outcome::ALL.iter().map(|v| json!(v)).collect();
    assert_eq!(
        outcomes,
        [
            json!("ok"),
            json!("error"),
            json!("timeout"),
            json!("cancelled"),
            json!("crashed")
        ]
    );
}

#[test]
fn serde_agrees_with_the_exported_attribute_values_both_ways() {
    for (value, name) in Operation::ALL.iter().zip(OPERATIONS) {
        assert_eq!(serde_json::to_string(value).unwrap(), format!("\"{name}\""));
        assert_eq!(
            serde_json::from_value::<Operation>(json!(name)).unwrap(),
            *value
        );
        assert_eq!(value.as_str(), *name);
    }
    for (value, name) in Executor::ALL.iter().zip(EXECUTORS) {
        assert_eq!(serde_json::to_string(value).unwrap(), format!("\"{name}\""));
        assert_eq!(
            serde_json::from_value::<Executor>(json!(name)).unwrap(),
            *value
        );
        assert_eq!(value.as_str(), *name);
    }
    for (value, name) in Outcome::ALL.iter().zip(OUTCOMES) {
        assert_eq!(serde_json::to_string(value).unwrap(), format!("\"{name}\""));
        assert_eq!(
            serde_json::from_value::<Outcome>(json!(name)).unwrap(),
            *value
        );
        assert_eq!(value.as_str(), *name);
    }
}

#[test]
fn a_config_struct_round_trips() {
    let text = r#"{"operation":"verify","executor":"subprocess","max":4}"#;
    let config: LimitConfig = serde_json::from_str(text).unwrap();
    assert_eq!(
        config,
        LimitConfig {
            operation: Operation::Verify,
            executor: Executor::Subprocess,
            max: 4,
        }
    );
    assert_eq!(serde_json::to_string(&config).unwrap(), text);
}

#[test]
fn values_work_as_map_keys() {
    let counts: BTreeMap<Outcome, u64> = [(Outcome::Ok, 7), (Outcome::Timeout, 2)].into();
    let text = serde_json::to_string(&counts).unwrap();
    assert_eq!(text, r#"{"ok":7,"timeout":2}"#);
    assert_eq!(
        serde_json::from_str::<BTreeMap<Outcome, u64>>(&text).unwrap(),
        counts
    );
}

/// Checks that `error` names every one of `valid`, in backquotes.
fn assert_lists(error: &str, valid: &[&str]) {
    for name in valid {
        assert!(
            error.contains(&format!("`{name}`")),
            "{name} missing: {error}"
        );
    }
}

#[test]
fn an_unknown_name_is_an_error_that_lists_the_valid_values() {
    let config_error = |text: &str| {
        serde_json::from_str::<LimitConfig>(text)
            .unwrap_err()
            .to_string()
    };
    let error = config_error(r#"{"operation":"verfy","executor":"subprocess","max":4}"#);
    assert!(error.contains("verfy"), "{error}");
    assert_lists(&error, OPERATIONS);

    let error = config_error(r#"{"operation":"judge","executor":"gpu","max":4}"#);
    assert!(error.contains("gpu"), "{error}");
    assert_lists(&error, EXECUTORS);

    let error = serde_json::from_value::<Outcome>(json!("failed"))
        .unwrap_err()
        .to_string();
    assert_lists(&error, OUTCOMES);
}

#[test]
fn only_the_exact_lower_case_strings_are_accepted() {
    // As `FromStr`: no Rust variant names, no other case, no padding, no numbers.
    for input in [
        json!("Verify"),
        json!("VERIFY"),
        json!(" verify"),
        json!(0),
        json!(null),
    ] {
        assert!(
            serde_json::from_value::<Operation>(input.clone()).is_err(),
            "{input} was accepted"
        );
    }
    assert!(serde_json::from_value::<Executor>(json!("Subprocess")).is_err());
    assert!(serde_json::from_value::<Outcome>(json!("Ok")).is_err());
    assert!(serde_json::from_value::<Outcome>(json!("")).is_err());
}
