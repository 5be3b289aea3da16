//! How a layer speaks its protocol: how it answers an operation that its limit turned away, and
//! where it reads how long a caller waits.
//!
//! A layer's constructor picks its protocol: none (`()`) for
//! [`new`](crate::ResourcesOperationLayer::new), [`Http`] for
//! [`new_for_http`](crate::ResourcesOperationLayer::new_for_http), and its gRPC form
//! ([`Http::grpc`]) for [`new_for_grpc`](crate::ResourcesOperationLayer::new_for_grpc);
//! [`protocol`](crate::ResourcesOperationLayer::protocol) changes it. A rejection makes the
//! service's `poll_ready` ready, and `call` answers it without calling the inner service, as
//! tower's `LoadShed` does.
//!
//! A limit that cannot admit an operation (closed, or its store out of reach) turns it away too,
//! with [`Rejection::Unavailable`]: every protocol that answers a rejection answers that one
//! (HTTP `503`, gRPC `UNAVAILABLE`).
//!
//! The generic layer's protocol is `()`, no protocol: no answer to a rejection, and no
//! deadline, as tower's `ConcurrencyLimit`, whose error type need not hold a rejection. So such
//! a layer refuses, when it makes its service, a limit that may turn an operation away (a queue
//! bound, a queue timeout, a store that may be out of reach): give it a protocol that answers
//! first, such as [`RejectAsError`]. A limit that fails all the same (a semaphore closed while
//! services use it) ends the caller with a panic that names the limit and the cause: there is no
//! response and no error of the service's type to answer with, and a panic is better than a
//! caller that waits for good. tower's limit panics there too.

use std::time::Duration;

use http::header::{HeaderName, CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderValue, Request, Response, StatusCode};

use crate::attributes::Rejection;
use crate::rejected::Rejected;

/// How a layer answers a rejection, and reads a caller's deadline, for a service that takes
/// `Req` and answers `Res` or fails with `Err`.
///
/// Every `Fn(Rejected) -> Result<Res, Err>` is one, with no deadline:
///
/// ```
/// use tower::{service_fn, Layer, ServiceExt};
/// use tower_resources_operation::{Limit, Rejected, ResourcesOperationLayer};
///
/// #[derive(Debug)]
/// enum VerifierError {
///     Busy,
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// // One at a time, and none waiting: a busy verifier answers with its own error.
/// let verifier = ResourcesOperationLayer::new(Limit::with_max_queued(1, 0))
///     .protocol(|_: Rejected| Err(VerifierError::Busy))
///     .layer(service_fn(|answer: u32| async move { Ok::<_, VerifierError>(answer == 42) }));
/// assert!(verifier.oneshot(42).await.unwrap());
/// # }
/// ```
pub trait Protocol<Req, Res, Err> {
    /// Whether it answers rejections at all: every protocol does but `()`, none. A layer whose
    /// protocol does not turns a limit that may reject away when it makes its service, and
    /// panics, naming the limit, where it would have to answer one.
    const ANSWERS: bool = true;

    /// The answer to an operation turned away for `rejected`.
    fn answer(&self, rejected: Rejected) -> Result<Res, Err>;

    /// How long the caller of `request` waits for it, if the request (or the server) says: an
    /// operation dropped once that long has passed since it asked for its permit ends as
    /// `timeout`, not `cancelled`. Defaults to `None`.
    fn deadline(&self, request: &Req) -> Option<Duration> {
        let _ = request;
        None
    }

    /// Whether `request` went through the server's router and matched no route (axum's
    /// fallback, which answers 404): a layer of one operation that sees one wraps the whole
    /// Router, and says so once. Defaults to `false` (not known).
    fn unrouted(&self, request: &Req) -> bool {
        let _ = request;
        false
    }

    /// How long the server lets any request take, if the protocol was told
    /// (`server_timeout`): an operation dropped while it still waits for its permit once that
    /// long has passed is counted as [`Rejection::Deadline`], not as a caller who left.
    /// Defaults to `None`.
    fn server_deadline(&self) -> Option<Duration> {
        None
    }
}

impl<F, Req, Res, Err> Protocol<Req, Res, Err> for F
where
    F: Fn(Rejected) -> Result<Res, Err>,
{
    fn answer(&self, rejected: Rejected) -> Result<Res, Err> {
        self(rejected)
    }
}

/// No protocol, the generic layer's: no answer to a rejection, no deadline (see the
/// [module](self)).
impl<Req, Res, Err> Protocol<Req, Res, Err> for () {
    const ANSWERS: bool = false;

    #[track_caller]
    fn answer(&self, rejected: Rejected) -> Result<Res, Err> {
        unanswerable::<Self>(rejected)
    }
}

/// Answers a rejection with the service's error, made from [`Rejected`]: for generic services
/// whose error converts from it, as `BoxError` does (found again with `downcast_ref`).
#[derive(Clone, Copy, Debug, Default)]
pub struct RejectAsError;

impl<Req, Res, Err: From<Rejected>> Protocol<Req, Res, Err> for RejectAsError {
    fn answer(&self, rejected: Rejected) -> Result<Res, Err> {
        Err(rejected.into())
    }
}

/// HTTP: a rejection is an empty `503 Service Unavailable` (or the status you choose, with
/// `Retry-After` if you give one); a caller's deadline is the server's own timeout, or a request
/// header, whichever is shorter. A limit that cannot admit
/// ([`Rejection::Unavailable`]) is always answered `503`, whatever status rejections get: the
/// server, not the caller, is in trouble.
///
/// ```
/// use std::time::Duration;
/// use http::StatusCode;
/// use tower_resources_operation::protocol::Http;
///
/// let http = Http::new()
///     .rejection_status(StatusCode::TOO_MANY_REQUESTS)
///     .retry_after(Duration::from_secs(2))
///     .server_timeout(Duration::from_secs(30));
/// # drop(http);
/// ```
#[derive(Clone, Debug)]
pub struct Http {
    status: StatusCode,
    retry_after: Option<HeaderValue>,
    deadline: Deadline,
    /// Whether it speaks gRPC's form ([`grpc`](Self::grpc)).
    grpc: bool,
}

impl Default for Http {
    fn default() -> Self {
        Self::new()
    }
}

impl Http {
    /// `503 Service Unavailable`, no `Retry-After`, no deadline.
    pub fn new() -> Self {
        Self {
            status: StatusCode::SERVICE_UNAVAILABLE,
            retry_after: None,
            deadline: Deadline::default(),
            grpc: false,
        }
    }

    /// gRPC's form, for tonic services: a rejection is a trailers-only response with
    /// `grpc-status` 8, RESOURCE_EXHAUSTED (as tonic answers tower's `Overloaded`), or 14,
    /// UNAVAILABLE, for a limit that cannot admit ([`Rejection::Unavailable`]); a caller's
    /// deadline is its `grpc-timeout`, or the server's own timeout (tonic's `Server::timeout`),
    /// whichever is shorter.
    ///
    /// tonic enforces both outside the layer: when one passes it drops the call and answers
    /// CANCELLED, so the layer sees a drop. With the deadline known, a call dropped while it
    /// runs, at its deadline, counts as `timeout` rather than `cancelled`; one dropped while it
    /// still waits for a permit is an abandoned wait, as every caller that gives up in the queue
    /// is. A client that gives up by its own clock may hang up a little before the server's
    /// deadline: such a drop counts as `cancelled`.
    pub fn grpc() -> Self {
        Self {
            deadline: Deadline {
                header: Some(HeaderName::from_static("grpc-timeout")),
                at_most: None,
            },
            grpc: true,
            ..Self::new()
        }
    }

    /// Answers rejections with `status` instead (for example `429 Too Many Requests`); not in
    /// gRPC's form, whose status is its `grpc-status`.
    pub fn rejection_status(mut self, status: StatusCode) -> Self {
        self.status = status;
        self
    }

    /// Adds `Retry-After` to rejections, in whole seconds, rounded up.
    pub fn retry_after(mut self, after: Duration) -> Self {
        let seconds = after.as_secs() + u64::from(after.subsec_nanos() > 0);
        self.retry_after = Some(HeaderValue::from(seconds));
        self
    }

    /// The server gives up on every request after `timeout` (tower-http's `TimeoutLayer` or
    /// tower's `Timeout` outside this layer): an operation dropped past it is `timeout`, not
    /// `cancelled`.
    pub fn server_timeout(mut self, timeout: Duration) -> Self {
        self.deadline.at_most = Some(timeout);
        self
    }

    /// Each request may say how long its caller waits, in header `name`: a whole number of
    /// milliseconds (`250`), or `grpc-timeout`'s form (`250m`, `2S`). A value in neither form is
    /// no deadline; the shorter of it and the server's timeout counts.
    pub fn deadline_header(mut self, name: HeaderName) -> Self {
        self.deadline.header = Some(name);
        self
    }
}

impl<B, RB: Default, Err> Protocol<Request<B>, Response<RB>, Err> for Http {
    fn answer(&self, rejected: Rejected) -> Result<Response<RB>, Err> {
        if self.grpc {
            return Ok(grpc_answer(&rejected));
        }
        let mut response = Response::new(RB::default());
        *response.status_mut() = match rejected.rejection() {
            Rejection::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            Rejection::Deadline => StatusCode::GATEWAY_TIMEOUT,
            Rejection::QueueFull | Rejection::QueueTimeout => self.status,
        };
        if let Some(after) = &self.retry_after {
            response.headers_mut().insert(RETRY_AFTER, after.clone());
        }
        Ok(response)
    }

    fn deadline(&self, request: &Request<B>) -> Option<Duration> {
        self.deadline.read(request)
    }

    /// With the `axum` feature: an axum `Router` gives every request it routes its
    /// `OriginalUri`, and those it matched to a route their `MatchedPath`. A request with
    /// neither (a plain `service_fn` under hyper, a test, a request sent to the layer
    /// directly) never went through a Router.
    #[cfg(feature = "axum")]
    fn unrouted(&self, request: &Request<B>) -> bool {
        if self.grpc {
            return false;
        }
        let extensions = request.extensions();
        extensions.get::<axum::extract::MatchedPath>().is_none()
            && extensions.get::<axum::extract::OriginalUri>().is_some()
    }

    fn server_deadline(&self) -> Option<Duration> {
        self.deadline.at_most
    }
}

/// gRPC's answer to a rejection: a trailers-only response.
fn grpc_answer<RB: Default>(rejected: &Rejected) -> Response<RB> {
    let mut response = Response::new(RB::default());
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
    let status = match rejected.rejection() {
        Rejection::Unavailable => "14",
        Rejection::Deadline => "4",
        Rejection::QueueFull | Rejection::QueueTimeout => "8",
    };
    headers.insert("grpc-status", HeaderValue::from_static(status));
    headers.insert("grpc-message", HeaderValue::from_static(rejected.message()));
    response
}

/// Where a caller's deadline comes from: a request header, a server-wide timeout, or both.
#[derive(Clone, Debug, Default)]
struct Deadline {
    header: Option<HeaderName>,
    at_most: Option<Duration>,
}

impl Deadline {
    fn read<B>(&self, request: &Request<B>) -> Option<Duration> {
        let own = self
            .header
            .as_ref()
            .and_then(|name| request.headers().get(name))
            .and_then(parse_timeout);
        match (own, self.at_most) {
            (Some(own), Some(at_most)) => Some(own.min(at_most)),
            (own, at_most) => own.or(at_most),
        }
    }
}

/// A timeout in milliseconds (`250`) or in `grpc-timeout`'s form, up to 8 digits and a unit
/// (`250m`; `H`, `M`, `S`, `m`, `u`, `n`).
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

/// Ends a caller whose limit turned it away when its layer cannot answer a rejection.
#[cold]
#[inline(never)]
#[track_caller]
pub(crate) fn unanswerable<L: ?Sized>(rejected: Rejected) -> ! {
    panic!(
        "tower-resources-operation: the limit ({}) turned an operation away ({rejected}), but \
         this layer cannot answer a rejection: give it a protocol that answers, such as \
         .protocol(RejectAsError) for a BoxError service, or use new_for_http / new_for_grpc",
        std::any::type_name::<L>()
    )
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

    #[test]
    fn the_shorter_of_the_header_and_the_server_timeout_counts() {
        let grpc = Http::grpc().server_timeout(Duration::from_secs(1));
        let request = |timeout: Option<&str>| {
            let mut request = Request::new(());
            if let Some(timeout) = timeout {
                request
                    .headers_mut()
                    .insert("grpc-timeout", timeout.parse().unwrap());
            }
            request
        };
        let read =
            |request: &Request<()>| Protocol::<_, Response<()>, ()>::deadline(&grpc, request);
        assert_eq!(
            read(&request(Some("250m"))),
            Some(Duration::from_millis(250))
        );
        assert_eq!(read(&request(Some("5S"))), Some(Duration::from_secs(1)));
        assert_eq!(read(&request(None)), Some(Duration::from_secs(1)));
        let http = Http::new();
        assert_eq!(
            Protocol::<_, Response<()>, ()>::deadline(&http, &request(Some("250m"))),
            None
        );
    }
}
