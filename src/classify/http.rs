//! [`HttpClassifier`]: HTTP responses by their status, gRPC responses by their `grpc-status`.

use http::header::CONTENT_TYPE;
use http::{HeaderMap, HeaderName, Response, StatusCode};

use super::{ClassifyOutcome, OperationOutput};
use crate::attributes::Outcome;

/// Lowest and highest status code an [`HttpClassifier`] can be told about.
const FIRST_STATUS: u16 = 100;
const LAST_STATUS: u16 = 999;
const WORDS: usize = (LAST_STATUS - FIRST_STATUS) as usize / 64 + 1;

/// Classifies `http::Response`s by status code ([`new`](Self::new)), or gRPC responses by
/// their `grpc-status` ([`grpc`](Self::grpc), the classifier of
/// [`new_for_grpc`](crate::ResourcesOperationLayer::new_for_grpc)).
///
/// - `504 Gateway Timeout` and `408 Request Timeout` are [`Outcome::Timeout`];
/// - `499` (client closed the request) is [`Outcome::Cancelled`];
/// - the error statuses, by default every `5xx`, are [`Outcome::Error`];
/// - everything else is [`Outcome::Ok`];
/// - an `Err` from the service is [`Outcome::Error`] (wrap it in a
///   [`TimeoutClassifier`](super::TimeoutClassifier) for `timeout` on an `Elapsed`).
///
/// Which statuses count as errors can be changed; the three above keep their outcome. In the
/// body-end form the status decides at the head; a body that fails or is dropped before its end
/// still ends the operation as `error` or `cancelled`.
///
/// In gRPC's form, a response is read by its `grpc-status` (gRPC answers `200` whatever the
/// call did): `0` (OK) is `ok`, `1` (CANCELLED) `cancelled`, `4` (DEADLINE_EXCEEDED)
/// `timeout`, any other code `error`.
///
/// - **At the head** (the default form of the layer): the `grpc-status` header of a trailers-only
///   response, which is how tonic answers a handler's `Err(Status)`; no header is `ok`. A status
///   sent in the trailers, after a body, is not seen there.
/// - **At the end of the body** (the layer's
///   [`until_body_end`](crate::ResourcesOperationLayer::until_body_end) form): a trailers-only
///   response still decides at the head; any other decides at the end of its stream, from the
///   `grpc-status` of its trailers, so a server stream that fails midway is an error. A stream
///   that ends without trailers, or trailers without `grpc-status`, is `ok`, as tower-http's
///   `GrpcErrorsAsFailures` says.
///
/// ```
/// use http::StatusCode;
/// use tower_resources_operation::classify::{ClassifyOutcome, HttpClassifier};
/// use tower_resources_operation::Outcome;
///
/// let classifier = HttpClassifier::new().with_error_status(StatusCode::TOO_MANY_REQUESTS);
/// let response = http::Response::builder().status(429).body(()).unwrap();
/// let outcome =
///     ClassifyOutcome::<_, std::convert::Infallible>::classify(&classifier, Ok(&response));
/// assert_eq!(outcome, Outcome::Error);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HttpClassifier {
    /// Bit `code - 100` is set for each status that counts as an error.
    errors: [u64; WORDS],
    /// Whether it reads `grpc-status` rather than the status.
    grpc: bool,
}

impl Default for HttpClassifier {
    fn default() -> Self {
        Self::new()
    }
}

impl HttpClassifier {
    /// Every `5xx` is an error.
    pub const fn new() -> Self {
        Self {
            errors: [0; WORDS],
            grpc: false,
        }
        .with_error_range(500, 599)
    }

    /// gRPC's form: each response by its `grpc-status`, in its head or, in the body-end form,
    /// in its trailers.
    pub const fn grpc() -> Self {
        Self {
            grpc: true,
            ..Self::new()
        }
    }

    /// Also counts `status` as an error.
    pub const fn with_error_status(self, status: StatusCode) -> Self {
        let code = status.as_u16();
        self.with_error_range(code, code)
    }

    /// Also counts every `4xx` as an error (but `408` stays `timeout` and `499` `cancelled`).
    pub const fn with_client_errors(self) -> Self {
        self.with_error_range(400, 499)
    }

    /// Counts only `5xx` as errors again, undoing [`with_error_status`](Self::with_error_status)
    /// and [`with_client_errors`](Self::with_client_errors).
    pub const fn with_server_errors_only(self) -> Self {
        Self::new()
    }

    /// Also counts every status from `first` to `last` (inclusive) as an error.
    pub const fn with_error_range(mut self, first: u16, last: u16) -> Self {
        let mut code = if first < FIRST_STATUS {
            FIRST_STATUS
        } else {
            first
        };
        while code <= last && code <= LAST_STATUS {
            let bit = (code - FIRST_STATUS) as usize;
            self.errors[bit / 64] |= 1 << (bit % 64);
            code += 1;
        }
        self
    }

    /// Whether `status` counts as an error (before the timeout and cancel rules apply).
    pub const fn is_error(&self, status: StatusCode) -> bool {
        let bit = (status.as_u16() - FIRST_STATUS) as usize;
        self.errors[bit / 64] & (1 << (bit % 64)) != 0
    }

    /// The outcome of an HTTP response with `status`.
    pub const fn classify_status(&self, status: StatusCode) -> Outcome {
        match status.as_u16() {
            408 | 504 => Outcome::Timeout,
            499 => Outcome::Cancelled,
            _ if self.is_error(status) => Outcome::Error,
            _ => Outcome::Ok,
        }
    }
}

impl<B, E> ClassifyOutcome<Response<B>, E> for HttpClassifier {
    fn classify(&self, result: Result<&Response<B>, &E>) -> Outcome {
        match result {
            Ok(response) if self.grpc => grpc_outcome(response.headers()),
            Ok(response) => self.classify_status(response.status()),
            Err(_) => Outcome::Error,
        }
    }

    /// In gRPC's form, a response whose head carries no `grpc-status` (a stream) ends with the
    /// `grpc-status` of its trailers; one whose head does (trailers-only) is decided at the head.
    fn classify_at_end(&self, response: &Response<B>) -> Option<fn(Option<&HeaderMap>) -> Outcome> {
        match self.grpc && !response.headers().contains_key(GRPC_STATUS) {
            true => Some(grpc_trailers),
            false => None,
        }
    }
}

/// The outcome of a gRPC response head, or trailers, with these headers: no `grpc-status` is
/// `ok`.
fn grpc_outcome(headers: &HeaderMap) -> Outcome {
    match headers.get(GRPC_STATUS) {
        None => Outcome::Ok,
        Some(value) => match value.as_bytes() {
            b"0" => Outcome::Ok,
            b"1" => Outcome::Cancelled,
            b"4" => Outcome::Timeout,
            _ => Outcome::Error,
        },
    }
}

/// The outcome of a gRPC stream at its end: its trailers' `grpc-status`; no trailers is `ok`.
fn grpc_trailers(trailers: Option<&HeaderMap>) -> Outcome {
    trailers.map_or(Outcome::Ok, grpc_outcome)
}

/// The header, made once: a `&str` would be parsed into a header name at every lookup.
const GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");

/// An `http::Response` says how its operation ended by its status, or, for gRPC, by its
/// `grpc-status`: what [`HttpClassifier::new`] reads.
impl<B> OperationOutput for Response<B> {
    #[inline]
    fn outcome(&self) -> Outcome {
        // gRPC answers 200 whatever the call did, and says how it went in `grpc-status`; an
        // HTTP 200 carries none, and is `ok` either way. Any other status is HTTP's to read.
        const SERVER_ERRORS: HttpClassifier = HttpClassifier::new();
        match self.status() {
            StatusCode::OK if is_grpc(self.headers()) => grpc_outcome(self.headers()),
            status => SERVER_ERRORS.classify_status(status),
        }
    }

    fn outcome_at_end(&self) -> Option<fn(Option<&HeaderMap>) -> Outcome> {
        match is_grpc(self.headers()) && !self.headers().contains_key(GRPC_STATUS) {
            true => Some(grpc_trailers),
            false => None,
        }
    }
}

/// Whether a response is gRPC's (`application/grpc`, `+proto` and the like, and gRPC-Web), whose
/// HTTP status says nothing of the call.
fn is_grpc(headers: &HeaderMap) -> bool {
    headers
        .get(CONTENT_TYPE)
        .is_some_and(|value| value.as_bytes().starts_with(b"application/grpc"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outcome(classifier: HttpClassifier, status: u16) -> Outcome {
        classifier.classify_status(StatusCode::from_u16(status).unwrap())
    }

    #[test]
    fn default_http_rules() {
        let c = HttpClassifier::new();
        assert_eq!(outcome(c, 200), Outcome::Ok);
        assert_eq!(outcome(c, 404), Outcome::Ok);
        assert_eq!(outcome(c, 429), Outcome::Ok);
        assert_eq!(outcome(c, 500), Outcome::Error);
        assert_eq!(outcome(c, 503), Outcome::Error);
        assert_eq!(outcome(c, 599), Outcome::Error);
        assert_eq!(outcome(c, 504), Outcome::Timeout);
        assert_eq!(outcome(c, 408), Outcome::Timeout);
        assert_eq!(outcome(c, 499), Outcome::Cancelled);
        assert_eq!(outcome(c, 600), Outcome::Ok);
        assert_eq!(outcome(c, 999), Outcome::Ok);
        assert_eq!(outcome(c, 100), Outcome::Ok);
    }

    #[test]
    fn error_statuses_can_be_widened_and_reset() {
        let c = HttpClassifier::new().with_error_status(StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(outcome(c, 429), Outcome::Error);
        assert_eq!(outcome(c, 404), Outcome::Ok);
        let c = HttpClassifier::new().with_client_errors();
        assert_eq!(outcome(c, 404), Outcome::Error);
        assert_eq!(outcome(c, 408), Outcome::Timeout);
        assert_eq!(outcome(c, 499), Outcome::Cancelled);
        assert_eq!(outcome(c.with_server_errors_only(), 404), Outcome::Ok);
        let c = HttpClassifier::new().with_error_range(0, 2000);
        assert_eq!(outcome(c, 100), Outcome::Error);
        assert_eq!(outcome(c, 999), Outcome::Error);
    }

    #[test]
    fn a_response_says_its_outcome_by_its_status_or_for_grpc_by_its_grpc_status() {
        let response = |status: u16, headers: &[(&str, &str)]| {
            let mut builder = Response::builder().status(status);
            for (name, value) in headers {
                builder = builder.header(*name, *value);
            }
            builder.body(()).unwrap()
        };
        assert_eq!(response(200, &[]).outcome(), Outcome::Ok);
        assert_eq!(response(404, &[]).outcome(), Outcome::Ok);
        assert_eq!(response(500, &[]).outcome(), Outcome::Error);
        assert_eq!(response(504, &[]).outcome(), Outcome::Timeout);
        assert_eq!(response(499, &[]).outcome(), Outcome::Cancelled);
        assert!(response(500, &[]).outcome_at_end().is_none());

        // gRPC: the HTTP status is 200 whatever happened.
        let grpc = [("content-type", "application/grpc")];
        let failed = [
            ("content-type", "application/grpc+proto"),
            ("grpc-status", "13"),
        ];
        assert_eq!(response(200, &failed).outcome(), Outcome::Error);
        assert!(
            response(200, &failed).outcome_at_end().is_none(),
            "decided at the head"
        );
        let streaming = response(200, &grpc);
        assert_eq!(streaming.outcome(), Outcome::Ok);
        let at_end = streaming.outcome_at_end().expect("decided by the trailers");
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", "4".parse().unwrap());
        assert_eq!(at_end(Some(&trailers)), Outcome::Timeout);
        assert_eq!(at_end(None), Outcome::Ok);
        // A gRPC answer that is not a 200 (a proxy's 503) is read as HTTP.
        assert_eq!(response(503, &grpc).outcome(), Outcome::Error);
    }

    #[test]
    fn grpc_status_header_rules() {
        let mut headers = HeaderMap::new();
        assert_eq!(grpc_outcome(&headers), Outcome::Ok);
        for (code, expected) in [
            ("0", Outcome::Ok),
            ("1", Outcome::Cancelled),
            ("4", Outcome::Timeout),
            ("2", Outcome::Error),
            ("14", Outcome::Error),
            ("garbage", Outcome::Error),
        ] {
            headers.insert("grpc-status", code.parse().unwrap());
            assert_eq!(grpc_outcome(&headers), expected, "{code}");
        }
    }
}
