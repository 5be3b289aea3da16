//! In the default setup (the `tracing` feature on, and no subscriber installed, as in the
//! README's Getting started), each warning still reaches a person: on standard error, once.
//!
//! The warnings are once per process, so the mistakes are made in a child process (this test
//! binary, run again for the one test below that makes them), whose standard error is read.

use std::convert::Infallible;
use std::process::Command;

use opentelemetry::metrics::MeterProvider as _;
use opentelemetry_sdk::metrics::SdkMeterProvider;
use tower_resources_operation::{
    resources_operation, Executor, Limit, Operation, OperationMetrics,
};

const CHILD: &str = "TRO_WARNINGS_CHILD";

#[test]
fn without_a_subscriber_each_warning_goes_to_standard_error_once() {
    let output = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "mistakes_made_in_the_child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, "1")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "the child failed: {stderr}");
    assert_eq!(
        stderr.matches("no OpenTelemetry meter provider").count(),
        1,
        "{stderr}"
    );
    assert_eq!(
        stderr.matches("second OperationMetrics").count(),
        1,
        "{stderr}"
    );
    assert!(
        stderr.contains("WARN tower_resources_operation"),
        "{stderr}"
    );
}

/// Makes each mistake twice, with no `tracing` subscriber; does nothing unless run as the
/// child of the test above.
#[test]
fn mistakes_made_in_the_child() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    for _ in 0..2 {
        // No provider installed: recorded nowhere.
        let answer = runtime.block_on(resources_operation(
            &Limit::new(1),
            Operation::Verify,
            Executor::Inline,
            async { Ok::<u32, Infallible>(7) },
        ));
        assert_eq!(answer.unwrap().unwrap(), 7);
    }
    let provider = SdkMeterProvider::builder().build();
    let first = OperationMetrics::new(&provider.meter("first"));
    for _ in 0..2 {
        let _second = OperationMetrics::new(&provider.meter("second"));
    }
    drop(first);
}
