//! No input adds a series: arbitrary operation and executor names, arbitrary HTTP statuses and
//! `grpc-status` bytes, errors and panics all land in NeMo Gym's bounded attribute values; and
//! the parsers and classifiers never panic, whatever they are given.

mod support;

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};

use http::{HeaderValue, Response, StatusCode};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use tower::{service_fn, Layer as _, ServiceExt as _};

use support::reliability::{self, assert_books, quiet_expected_panics, Books, EXPECTED_PANIC};
use support::{Data, Telemetry};
use tower_resources_operation::classify::{ClassifyOutcome, HttpClassifier, TimeoutClassifier};
use tower_resources_operation::limit::Scope;
use tower_resources_operation::names::{
    ABANDONED_INSTRUMENT, ACTIVE_INSTRUMENT, DURATION_INSTRUMENT, EXECUTORS, EXECUTOR_ATTRIBUTE,
    LIMIT_INSTRUMENT, LIMIT_SCOPE_ATTRIBUTE, OPERATIONS, OPERATION_ATTRIBUTE, OUTCOMES,
    OUTCOME_ATTRIBUTE, QUEUED_INSTRUMENT, QUEUE_DURATION_INSTRUMENT, REJECTED_INSTRUMENT,
    REJECTION_ATTRIBUTE,
};
use tower_resources_operation::{
    Executor, Limit, Operation, Outcome, Rejection, ResourcesOperationLayer,
};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A name that is sometimes one of NeMo Gym's values, sometimes nearly one, and sometimes anything at all.
fn name(values: &'static [&'static str]) -> impl Strategy<Value = String> {
    let values = values.to_vec();
    prop_oneof![
        proptest::sample::select(values.clone()).prop_map(str::to_owned),
        proptest::sample::select(values.clone()).prop_map(|v| v.to_uppercase()),
        proptest::sample::select(values).prop_map(|v| format!(" {v}")),
        "[a-z]{0,12}",
        any::<String>(),
    ]
}

/// Bytes a `HeaderValue` accepts: tab, visible ASCII, and obs-text.
fn header_bytes() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        proptest::sample::select(vec![
            b"0".to_vec(),
            b"1".to_vec(),
            b"4".to_vec(),
            b"14".to_vec(),
            b"00".to_vec(),
            b" 0".to_vec(),
            Vec::new(),
        ]),
        proptest::collection::vec(prop_oneof![Just(b'\t'), 0x20u8..0x7f, 0x80u8..=0xff], 0..8),
    ]
}

/// What the inner service does.
#[derive(Clone, Debug)]
enum Answer {
    /// An HTTP response with this status (100..=999).
    Status(u16),
    /// A response with this `grpc-status` header (or none).
    Grpc(Option<Vec<u8>>),
    /// An `Err`, a tower `Elapsed` one if `timeout`.
    Error { timeout: bool },
    /// A panic in the work.
    Panic,
}

fn answer() -> impl Strategy<Value = Answer> {
    prop_oneof![
        4 => (100u16..=999).prop_map(Answer::Status),
        3 => proptest::option::of(header_bytes()).prop_map(Answer::Grpc),
        1 => any::<bool>().prop_map(|timeout| Answer::Error { timeout }),
        1 => Just(Answer::Panic),
    ]
}

/// NeMo Gym's outcome rules, written out independently of the crate.
fn expected_outcome(answer: &Answer) -> Outcome {
    match answer {
        Answer::Status(408 | 504) => Outcome::Timeout,
        Answer::Status(499) => Outcome::Cancelled,
        Answer::Status(500..=599) => Outcome::Error,
        Answer::Status(_) => Outcome::Ok,
        Answer::Grpc(None) => Outcome::Ok,
        Answer::Grpc(Some(bytes)) => match bytes.as_slice() {
            b"0" => Outcome::Ok,
            b"1" => Outcome::Cancelled,
            b"4" => Outcome::Timeout,
            _ => Outcome::Error,
        },
        Answer::Error { timeout: true } => Outcome::Timeout,
        Answer::Error { timeout: false } => Outcome::Error,
        Answer::Panic => Outcome::Crashed,
    }
}

/// The inner service's answer to one request.
async fn respond(answer: Answer) -> Result<Response<()>, BoxError> {
    match answer {
        Answer::Status(code) => Ok(Response::builder().status(code).body(()).unwrap()),
        Answer::Grpc(bytes) => {
            let mut response = Response::new(());
            if let Some(bytes) = bytes {
                let value = HeaderValue::from_bytes(&bytes).unwrap();
                response.headers_mut().insert("grpc-status", value);
            }
            Ok(response)
        }
        Answer::Error { timeout: true } => Err(Box::new(tower::timeout::error::Elapsed::new())),
        Answer::Error { timeout: false } => Err("boom".into()),
        Answer::Panic => panic!("{EXPECTED_PANIC}"),
    }
}

/// Runs `answer` through a layer tagged with the lossy parses of `operation` and `executor`.
async fn run(
    telemetry: &Telemetry,
    limit: &Limit,
    operation: Operation,
    executor: Executor,
    answer: Answer,
) {
    let inner = service_fn(respond);
    let base = ResourcesOperationLayer::new(limit.clone())
        .operation(operation)
        .executor(executor)
        .metrics(telemetry.metrics.clone());
    let result = match &answer {
        Answer::Grpc(_) => {
            let service = base
                .classifier(TimeoutClassifier::wrap(HttpClassifier::grpc()))
                .layer(inner);
            tokio::task::spawn_local(service.oneshot(answer.clone())).await
        }
        _ => {
            let service = base
                .classifier(TimeoutClassifier::wrap(HttpClassifier::new()))
                .layer(inner);
            tokio::task::spawn_local(service.oneshot(answer.clone())).await
        }
    };
    match answer {
        Answer::Panic => assert!(result.unwrap_err().is_panic()),
        Answer::Error { .. } => assert!(result.unwrap().is_err()),
        _ => assert!(result.unwrap().is_ok()),
    }
}

/// Asserts that every exported series of the crate's four instruments stays within NeMo Gym's
/// values: at most 4 x 5 series for the queue histogram and the live counts, 4 x 5 x 5 for the
/// duration histogram, with exactly the expected attribute keys.
fn assert_series_bounded(telemetry: &Telemetry) {
    let exported = telemetry.collect();
    let names: BTreeSet<&str> = exported.iter().map(|m| m.name.as_str()).collect();
    let ours = BTreeSet::from([
        QUEUE_DURATION_INSTRUMENT,
        DURATION_INSTRUMENT,
        QUEUED_INSTRUMENT,
        ACTIVE_INSTRUMENT,
        LIMIT_INSTRUMENT,
        REJECTED_INSTRUMENT,
        ABANDONED_INSTRUMENT,
    ]);
    assert_eq!(names, ours, "instruments exported");

    for metric in &exported {
        let attribute_sets: Vec<_> = match &metric.data {
            Data::Histogram(points) => points.iter().map(|p| &p.attributes).collect(),
            Data::Sum { points, .. } | Data::Gauge(points) => {
                points.iter().map(|p| &p.attributes).collect()
            }
            Data::GaugeF64(points) => points.iter().map(|p| &p.attributes).collect(),
            Data::Other(other) => panic!("{}: {other}", metric.name),
        };
        let with_outcome = metric.name == DURATION_INSTRUMENT;
        let with_rejection = metric.name == REJECTED_INSTRUMENT;
        // The limit gauge, by whose capacity it is (process, fleet, share).
        let with_scope = metric.name == LIMIT_INSTRUMENT;
        let bound = OPERATIONS.len()
            * EXECUTORS.len()
            * if with_outcome {
                OUTCOMES.len()
            } else if with_rejection {
                Rejection::ALL.len()
            } else if with_scope {
                Scope::ALL.len()
            } else {
                1
            };
        assert!(
            attribute_sets.len() <= bound,
            "{}: {} series",
            metric.name,
            attribute_sets.len()
        );
        let distinct: BTreeSet<_> = attribute_sets.iter().collect();
        assert_eq!(distinct.len(), attribute_sets.len(), "{}", metric.name);
        for attributes in attribute_sets {
            let mut keys = vec![OPERATION_ATTRIBUTE, EXECUTOR_ATTRIBUTE];
            if with_outcome {
                keys.push(OUTCOME_ATTRIBUTE);
            }
            if with_rejection {
                keys.push(REJECTION_ATTRIBUTE);
            }
            if with_scope {
                keys.push(LIMIT_SCOPE_ATTRIBUTE);
            }
            let mut expected_keys: Vec<&str> = keys.clone();
            expected_keys.sort_unstable();
            let actual_keys: Vec<&str> = attributes.keys().map(String::as_str).collect();
            assert_eq!(actual_keys, expected_keys, "{}", metric.name);
            assert!(OPERATIONS.contains(&attributes[OPERATION_ATTRIBUTE].as_str()));
            assert!(EXECUTORS.contains(&attributes[EXECUTOR_ATTRIBUTE].as_str()));
            if with_outcome {
                assert!(OUTCOMES.contains(&attributes[OUTCOME_ATTRIBUTE].as_str()));
            }
            if with_rejection {
                let rejection = attributes[REJECTION_ATTRIBUTE].parse::<Rejection>();
                assert!(rejection.is_ok(), "{:?}", attributes[REJECTION_ATTRIBUTE]);
            }
            if with_scope {
                let scope = attributes[LIMIT_SCOPE_ATTRIBUTE].as_str();
                assert!(
                    Scope::ALL.iter().any(|known| known.as_str() == scope),
                    "{scope}"
                );
            }
        }
    }
}

#[test]
fn arbitrary_names_statuses_headers_errors_and_panics_stay_within_nemo_gyms_series() {
    quiet_expected_panics();
    let telemetry = Telemetry::new();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let local = tokio::task::LocalSet::new();
    // One limit for every case, alive to the end, so that the limit gauge has its series too.
    let limit = Limit::new(2);
    let expected = std::sync::Mutex::new(Books::default());
    let cases = AtomicU64::new(0);

    let mut runner = TestRunner::new(Config {
        cases: 400,
        failure_persistence: None,
        ..Config::default()
    });
    runner
        .run(
            &(name(OPERATIONS), name(EXECUTORS), answer()),
            |(operation_name, executor_name, answer)| {
                let operation = Operation::from_str_lossy(&operation_name);
                let executor = Executor::from_str_lossy(&executor_name);
                // Lossy parsing keeps NeMo Gym's values and sends everything else to `other`.
                let exact_operation = OPERATIONS.contains(&operation_name.as_str());
                prop_assert_eq!(
                    operation.as_str() == operation_name,
                    exact_operation,
                    "{:?}",
                    operation_name
                );
                if !exact_operation {
                    prop_assert_eq!(operation, Operation::Other);
                }
                let exact_executor = EXECUTORS.contains(&executor_name.as_str());
                prop_assert_eq!(executor.as_str() == executor_name, exact_executor);
                if !exact_executor {
                    prop_assert_eq!(executor, Executor::Other);
                }

                let outcome = expected_outcome(&answer);
                local.block_on(
                    &runtime,
                    run(&telemetry, &limit, operation, executor, answer),
                );
                expected
                    .lock()
                    .unwrap()
                    .ended((operation, executor), outcome);
                cases.fetch_add(1, Ordering::Relaxed);
                Ok(())
            },
        )
        .unwrap();

    assert_series_bounded(&telemetry);
    let expected = expected.into_inner().unwrap();
    assert_eq!(expected.admitted_total(), cases.load(Ordering::Relaxed));
    // Every operation recorded once, with the outcome NeMo Gym's rules give its answer.
    assert_books(&telemetry, &expected);
    reliability::assert_live_counts_zero(&telemetry);
}

/// The longest [`ConfigError`] message for `attribute`: the fixed text, the quotes, and
/// at most 64 echoed bytes, each of which `{:?}` escapes to at most 6 characters (`\u{1f}`).
fn message_bound(attribute: &str, valid: &[&str]) -> usize {
    format!(
        "unknown {attribute} ; expected one of: {}",
        valid.join(", ")
    )
    .len()
        + 2
        + 64 * 6
}

/// The echo of `input` the message should carry: its first 64 bytes, cut on a char boundary.
fn echoed(input: &str) -> &str {
    let mut end = input.len().min(64);
    while !input.is_char_boundary(end) {
        end -= 1;
    }
    &input[..end]
}

fn check_parse<T>(input: &str, attribute: &str, valid: &[&str]) -> Result<(), TestCaseError>
where
    T: std::str::FromStr<Err = tower_resources_operation::ConfigError> + std::fmt::Display,
{
    match input.parse::<T>() {
        Ok(value) => {
            prop_assert!(valid.contains(&input));
            prop_assert_eq!(value.to_string(), input);
        }
        Err(error) => {
            prop_assert!(!valid.contains(&input));
            prop_assert_eq!(error.setting(), attribute);
            prop_assert_eq!(error.valid_values(), valid);
            let message = error.to_string();
            prop_assert!(
                message.len() <= message_bound(attribute, valid),
                "{}",
                message
            );
            let expected = format!(
                "unknown {attribute} {:?}; expected one of: {}",
                echoed(input),
                valid.join(", ")
            );
            prop_assert_eq!(message, expected);
        }
    }
    Ok(())
}

fn long_string() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<String>(),
        proptest::collection::vec(any::<char>(), 0..400).prop_map(String::from_iter),
        proptest::collection::vec(0u8..0x20, 0..200)
            .prop_map(|bytes| String::from_utf8(bytes).unwrap()),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn parsing_any_string_never_panics_and_its_error_message_is_bounded(input in long_string()) {
        check_parse::<Operation>(&input, "operation", OPERATIONS)?;
        check_parse::<Executor>(&input, "executor", EXECUTORS)?;
        check_parse::<Outcome>(&input, "outcome", OUTCOMES)?;
        prop_assert_eq!(
            Operation::from_str_lossy(&input),
            input.parse().unwrap_or(Operation::Other)
        );
        prop_assert_eq!(
            Executor::from_str_lossy(&input),
            input.parse().unwrap_or(Executor::Other)
        );
    }

    #[test]
    fn http_classifier_never_panics_on_any_status_or_error_range(
        code in any::<u16>(),
        first in any::<u16>(),
        last in any::<u16>(),
    ) {
        let Ok(status) = StatusCode::from_u16(code) else {
            prop_assert!(!(100..=999).contains(&code));
            return Ok(());
        };
        let default = HttpClassifier::new();
        prop_assert_eq!(default.classify_status(status), expected_outcome(&Answer::Status(code)));
        let response = Response::builder().status(status).body(()).unwrap();
        prop_assert_eq!(
            ClassifyOutcome::<_, BoxError>::classify(&default, Ok(&response)),
            expected_outcome(&Answer::Status(code))
        );

        let widened = HttpClassifier::new().with_error_range(first, last);
        let expected = match code {
            408 | 504 => Outcome::Timeout,
            499 => Outcome::Cancelled,
            500..=599 => Outcome::Error,
            _ if (first..=last).contains(&code) => Outcome::Error,
            _ => Outcome::Ok,
        };
        prop_assert_eq!(widened.classify_status(status), expected);
        prop_assert_eq!(widened.with_server_errors_only(), HttpClassifier::new());
    }

    #[test]
    fn grpc_classifier_never_panics_on_any_header_bytes(
        bytes in proptest::collection::vec(any::<u8>(), 0..16),
        second in proptest::option::of(header_bytes()),
    ) {
        let Ok(value) = HeaderValue::from_bytes(&bytes) else {
            return Ok(());
        };
        let mut response = http::Response::new(());
        let headers = response.headers_mut();
        headers.insert("content-type", HeaderValue::from_static("application/grpc"));
        headers.insert("grpc-status", value);
        if let Some(second) = second {
            // A repeated header: the first value decides.
            headers.append("grpc-status", HeaderValue::from_bytes(&second).unwrap());
        }
        prop_assert_eq!(
            ClassifyOutcome::<_, std::convert::Infallible>::classify(&HttpClassifier::grpc(), Ok(&response)),
            expected_outcome(&Answer::Grpc(Some(bytes)))
        );
    }
}
