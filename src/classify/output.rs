//! [`OperationOutput`]: what a value says of how its operation ended.

use std::process::{ExitStatus, Output};

use http::HeaderMap;

use super::any_error_outcome;
use crate::attributes::Outcome;

/// What a value says of how the operation that returned it ended.
///
/// The [`DefaultClassifier`](super::DefaultClassifier), the classifier of
/// [`ResourcesOperationLayer::new`](crate::ResourcesOperationLayer::new), reads it from each
/// response of the inner service, and [`resources_operation`](crate::resources_operation) from
/// the output of its work.
///
/// | value | outcome |
/// |---|---|
/// | `http::Response` | its status, as [`HttpClassifier`](super::HttpClassifier) reads it: a `5xx` is `error`, a `408` or `504` `timeout`, a `499` `cancelled`, any other `ok` |
/// | `http::Response` of gRPC (`content-type: application/grpc…`, status 200) | its `grpc-status`, as [`HttpClassifier`](super::HttpClassifier) reads it: in the head, or, in the body-end form, in the trailers |
/// | `std::process::Output`, `ExitStatus` | `ok` if the process exited with success, `error` otherwise (a verifier that failed, or was killed) |
/// | `Result<T, E>` | `ok`; an `Err` is what [`TimeoutClassifier`](super::TimeoutClassifier) says of the error (`timeout` for an `Elapsed`, `error` otherwise) |
/// | `()`, `bool`, `char`, numbers, `String`, `str`, `Vec<T>`, `Option<T>` | `ok`: they carry no verdict |
/// | `&T`, `Box<T>` | what `T` says |
///
/// Implement it for a type of your own whose values say how the work went; it should be cheap
/// and must not panic (if it does, the value still goes to the caller and the operation is
/// recorded as `error`).
#[diagnostic::on_unimplemented(
    message = "tower-resources-operation cannot tell how an operation that returned `{Self}` ended",
    label = "`{Self}` does not implement `OperationOutput`",
    note = "implement `classify::OperationOutput` for `{Self}` (which of its values are an `error`?), or give the layer a classifier of its own (a closure of the result)"
)]
pub trait OperationOutput {
    /// The outcome of an operation whose work returned `self`.
    fn outcome(&self) -> Outcome;

    /// In the layer's body-end form
    /// ([`until_body_end`](crate::ResourcesOperationLayer::until_body_end)): whether the end of
    /// the stream decides the outcome, rather than [`outcome`](Self::outcome), and how, as
    /// [`ClassifyOutcome::classify_at_end`](super::ClassifyOutcome::classify_at_end) says.
    /// Defaults to `None`; a gRPC response whose head carries no `grpc-status` ends with its
    /// trailers'.
    fn outcome_at_end(&self) -> Option<fn(Option<&HeaderMap>) -> Outcome> {
        None
    }
}

impl<T, E: 'static> OperationOutput for Result<T, E> {
    fn outcome(&self) -> Outcome {
        match self {
            Ok(_) => Outcome::Ok,
            Err(error) => any_error_outcome(error),
        }
    }
}

impl OperationOutput for ExitStatus {
    fn outcome(&self) -> Outcome {
        if self.success() {
            Outcome::Ok
        } else {
            Outcome::Error
        }
    }
}

impl OperationOutput for Output {
    fn outcome(&self) -> Outcome {
        self.status.outcome()
    }
}

impl<T: OperationOutput + ?Sized> OperationOutput for &T {
    #[inline]
    fn outcome(&self) -> Outcome {
        (**self).outcome()
    }

    fn outcome_at_end(&self) -> Option<fn(Option<&HeaderMap>) -> Outcome> {
        (**self).outcome_at_end()
    }
}

impl<T: OperationOutput + ?Sized> OperationOutput for Box<T> {
    #[inline]
    fn outcome(&self) -> Outcome {
        (**self).outcome()
    }

    fn outcome_at_end(&self) -> Option<fn(Option<&HeaderMap>) -> Outcome> {
        (**self).outcome_at_end()
    }
}

/// Values that carry no verdict: the work answered, so it is `ok`.
macro_rules! no_verdict {
    ($($value:ty),* $(,)?) => {
        $(
            impl OperationOutput for $value {
                #[inline]
                fn outcome(&self) -> Outcome {
                    Outcome::Ok
                }
            }
        )*
    };
}

no_verdict!(
    (),
    bool,
    char,
    u8,
    u16,
    u32,
    u64,
    u128,
    usize,
    i8,
    i16,
    i32,
    i64,
    i128,
    isize,
    f32,
    f64,
    String,
    str,
);

impl<T> OperationOutput for Vec<T> {
    #[inline]
    fn outcome(&self) -> Outcome {
        Outcome::Ok
    }
}

impl<T> OperationOutput for Option<T> {
    #[inline]
    fn outcome(&self) -> Outcome {
        Outcome::Ok
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(unix)]
    #[test]
    fn a_process_is_read_by_its_exit_status() {
        use std::os::unix::process::ExitStatusExt;

        assert_eq!(ExitStatus::from_raw(0).outcome(), Outcome::Ok);
        // Exit code 1, then killed by SIGKILL.
        assert_eq!(ExitStatus::from_raw(1 << 8).outcome(), Outcome::Error);
        assert_eq!(ExitStatus::from_raw(9).outcome(), Outcome::Error);
        let output = Output {
            status: ExitStatus::from_raw(2 << 8),
            stdout: Vec::new(),
            stderr: b"verifier: no such answer".to_vec(),
        };
        assert_eq!(output.outcome(), Outcome::Error);
    }

    #[test]
    fn a_result_is_ok_or_what_its_error_says_and_plain_values_are_ok() {
        let elapsed: Result<(), _> = Err(tower::timeout::error::Elapsed::new());
        assert_eq!(elapsed.outcome(), Outcome::Timeout);
        let failed: Result<(), _> = Err(std::fmt::Error);
        assert_eq!(failed.outcome(), Outcome::Error);
        assert_eq!(Ok::<_, std::fmt::Error>(()).outcome(), Outcome::Ok);
        assert_eq!("verified".outcome(), Outcome::Ok);
        assert_eq!(Box::new(false).outcome(), Outcome::Ok);
        assert_eq!(None::<u8>.outcome(), Outcome::Ok);
    }
}
