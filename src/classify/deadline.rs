//! [`Deadline`]: how long a request's caller waits, read from the request.

use std::time::Duration;

use http::header::HeaderName;
use http::{HeaderValue, Request};

use super::{ClassifyOutcome, MakeClassifier};

/// A classifier, cloned for every request as [`SharedClassifier`](crate::SharedClassifier)
/// does, plus the deadline of each request, read from a header of the request.
///
/// tonic enforces a request's `grpc-timeout`, and its `Server::timeout`, outside the layer: when
/// one passes it drops the call (and answers CANCELLED), so the layer sees a drop. With a
/// `Deadline`, an operation dropped once its deadline has passed since it asked for its permit
/// ends as `timeout`, not `cancelled` (within 10 ms, or a tenth of a short deadline: the request
/// reached the server a little before it reached the layer). An operation that ends on its own
/// keeps the outcome its classifier gives.
///
/// The gRPC layers ([`new_for_grpc`](crate::ResourcesOperationLayer::new_for_grpc) and the like)
/// read `grpc-timeout`; an HTTP layer reads the header it is told to with
/// [`deadline_header`](crate::ResourcesOperationLayer::deadline_header).
///
/// ```
/// use std::time::Duration;
/// use tower_resources_operation::{Deadline, GrpcClassifier, MakeClassifier};
///
/// let classifier = Deadline::grpc(GrpcClassifier).at_most(Duration::from_secs(30));
/// let request = http::Request::get("/pkg.Verifier/Verify")
///     .header("grpc-timeout", "250m")
///     .body(())
///     .unwrap();
/// let deadline = MakeClassifier::<_, http::Response<()>, ()>::deadline(&classifier, &request);
/// assert_eq!(deadline, Some(Duration::from_millis(250)));
/// ```
#[derive(Clone, Debug)]
pub struct Deadline<C> {
    classifier: C,
    header: HeaderName,
    at_most: Option<Duration>,
}

impl<C> Deadline<C> {
    /// `classifier`, and each request's deadline from its `grpc-timeout` header.
    pub fn grpc(classifier: C) -> Self {
        Self::header(HeaderName::from_static("grpc-timeout"), classifier)
    }

    /// `classifier`, and each request's deadline from its header `name`: a whole number of
    /// milliseconds (`250`), or `grpc-timeout`'s form, up to 8 digits and a unit (`250m`, `2S`;
    /// `H`, `M`, `S`, `m`, `u`, `n`). A value in neither form is no deadline.
    pub fn header(name: HeaderName, classifier: C) -> Self {
        Self {
            classifier,
            header: name,
            at_most: None,
        }
    }

    /// Every request has a deadline of at most `timeout` (tonic's `Server::timeout`): the
    /// shorter of this and the request's own counts.
    pub fn at_most(mut self, timeout: Duration) -> Self {
        self.at_most = Some(timeout);
        self
    }

    /// The classifier inside.
    pub fn classifier(&self) -> &C {
        &self.classifier
    }
}

impl<C, B, Res, Err> MakeClassifier<Request<B>, Res, Err> for Deadline<C>
where
    C: ClassifyOutcome<Res, Err> + Clone,
{
    type Classifier = C;

    fn make_classifier(&self, _request: &Request<B>) -> C {
        self.classifier.clone()
    }

    fn deadline(&self, request: &Request<B>) -> Option<Duration> {
        let own = request.headers().get(&self.header).and_then(parse_timeout);
        match (own, self.at_most) {
            (Some(own), Some(at_most)) => Some(own.min(at_most)),
            (own, at_most) => own.or(at_most),
        }
    }
}

/// A timeout in milliseconds (`250`) or in `grpc-timeout`'s form (`250m`).
fn parse_timeout(value: &HeaderValue) -> Option<Duration> {
    let value = value.as_bytes();
    if !value.is_empty() && value.iter().all(u8::is_ascii_digit) {
        return std::str::from_utf8(value)
            .ok()?
            .parse()
            .ok()
            .map(Duration::from_millis);
    }
    let (&unit, digits) = value.split_last()?;
    if digits.is_empty() || digits.len() > 8 || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let amount: u64 = std::str::from_utf8(digits).ok()?.parse().ok()?;
    Some(match unit {
        b'H' => Duration::from_secs(amount * 3600),
        b'M' => Duration::from_secs(amount * 60),
        b'S' => Duration::from_secs(amount),
        b'm' => Duration::from_millis(amount),
        b'u' => Duration::from_micros(amount),
        b'n' => Duration::from_nanos(amount),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(value: &str) -> Option<Duration> {
        parse_timeout(&HeaderValue::from_str(value).unwrap())
    }

    #[test]
    fn grpc_timeout_units_and_plain_milliseconds_parse() {
        assert_eq!(parse("250m"), Some(Duration::from_millis(250)));
        assert_eq!(parse("2S"), Some(Duration::from_secs(2)));
        assert_eq!(parse("1H"), Some(Duration::from_secs(3600)));
        assert_eq!(parse("3M"), Some(Duration::from_secs(180)));
        assert_eq!(parse("7u"), Some(Duration::from_micros(7)));
        assert_eq!(parse("9n"), Some(Duration::from_nanos(9)));
        assert_eq!(parse("1500"), Some(Duration::from_millis(1500)));
    }

    #[test]
    fn malformed_timeouts_are_no_deadline() {
        for value in ["", "m", "123456789m", "12x", "-5m", "1.5S", "5 m", "S5"] {
            assert_eq!(parse(value), None, "{value:?}");
        }
    }
}
