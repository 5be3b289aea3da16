//! The body-end form of the layer (`.until_body_end()`): an operation whose response body streams
//! holds its permit, counts as `active` and runs until the body ends.
//!
//! Over a real axum server on 127.0.0.1 with hyper clients: a streamed body keeps its operation
//! going (and the default head-end form does not), a client that hangs up mid-stream ends it
//! `cancelled`, a body error ends it `error`, and a limit of 1 makes a second request wait for
//! the first body's end. With `oneshot` on layered services and `http_body` bodies: an empty body
//! ends at once, trailers end it (and decide the outcome with the `HttpClassifier`), `size_hint`,
//! `is_end_stream` and data frames pass through, `set_outcome` in `poll_frame` (or in the service,
//! before the head) wins, a panic in `poll_frame` is `crashed`, a body dropped past the request's
//! deadline is `timeout` (before it `cancelled`; one that ends on its own keeps its outcome), and
//! with metrics disabled the permit is still held until the body ends.

mod support;

use std::collections::{BTreeMap, VecDeque};
use std::convert::Infallible;
use std::io;
use std::net::SocketAddr;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::task::{ready, Context, Poll, Waker};
use std::time::Duration;

use axum::body::Body;
use axum::routing::{get, MethodRouter};
use axum::Router;
use bytes::Bytes;
use futures_util::Stream;
use http::header::HeaderName;
use http::{HeaderMap, HeaderValue, Request, Response, StatusCode};
use http_body::{Body as HttpBody, Frame, SizeHint};
use http_body_util::{BodyExt, Empty, Full};
use hyper::body::Incoming;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tower::{Layer, Service, ServiceExt};

use support::http::{serve, verify_layer, Client};
use support::reliability::{quiet_expected_panics, EXPECTED_PANIC};
use support::{eventually, only, panic_message, Telemetry, DEADLINE};
use tower_resources_operation::classify::HttpClassifier;
use tower_resources_operation::names::{
    ACTIVE_INSTRUMENT, DURATION_INSTRUMENT, EXECUTOR_ATTRIBUTE, OPERATION_ATTRIBUTE,
    QUEUED_INSTRUMENT, QUEUE_DURATION_INSTRUMENT,
};
use tower_resources_operation::protocol::Http;
use tower_resources_operation::{
    set_outcome, AtBodyEnd, Limit, OperationMetrics, Outcome, ResourcesOperationLayer,
};

/// Chunks of a streamed body.
const CHUNKS: usize = 5;
/// Time between two chunks of a streamed body.
const GAP: Duration = Duration::from_millis(40);
/// How long a streamed body streams at least, from its first chunk to its end.
const STREAMED: Duration = Duration::from_millis(40 * (CHUNKS as u64 - 1));

/// The series of the layers on the server.
const VERIFY: [(&str, &str); 2] = [
    (OPERATION_ATTRIBUTE, "verify"),
    (EXECUTOR_ATTRIBUTE, "subprocess"),
];

fn ms(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1000.0
}

fn chunk(i: usize) -> Bytes {
    Bytes::from(format!("chunk {i};"))
}

// ---------------------------------------------------------------------------------------------
// A server whose bodies the test feeds
// ---------------------------------------------------------------------------------------------

/// How many response bodies stream now, and the most that ever streamed at once.
#[derive(Debug, Default)]
struct Streams {
    now: AtomicUsize,
    max: AtomicUsize,
}

impl Streams {
    fn start(&self) {
        let now = self.now.fetch_add(1, SeqCst) + 1;
        self.max.fetch_max(now, SeqCst);
    }

    fn stop(&self) {
        self.now.fetch_sub(1, SeqCst);
    }

    fn max(&self) -> usize {
        self.max.load(SeqCst)
    }
}

type Item = Result<Bytes, io::Error>;

/// A response body stream that yields what the test sends, and ends when the test drops its
/// sender. It counts itself in [`Streams`] from its first poll until it ends, fails or is dropped.
struct Fed {
    rx: mpsc::UnboundedReceiver<Item>,
    streams: Arc<Streams>,
    /// Counted in `streams` now.
    counted: bool,
    /// Ended or failed: never counted again.
    over: bool,
}

impl Fed {
    fn stop(&mut self) {
        if self.counted {
            self.counted = false;
            self.streams.stop();
        }
        self.over = true;
    }
}

impl Stream for Fed {
    type Item = Item;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Item>> {
        let this = &mut *self;
        if !this.counted && !this.over {
            this.counted = true;
            this.streams.start();
        }
        let item = ready!(this.rx.poll_recv(cx));
        if !matches!(item, Some(Ok(_))) {
            // The end or an error: this body streams no more, before its operation ends.
            this.stop();
        }
        Poll::Ready(item)
    }
}

impl Drop for Fed {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The bodies that the next requests will stream, in order.
#[derive(Default)]
struct Feeds {
    next: Mutex<VecDeque<Fed>>,
    streams: Arc<Streams>,
}

impl Feeds {
    /// The body of the next request that asks for one: what is sent here, until it is dropped.
    fn channel(&self) -> mpsc::UnboundedSender<Item> {
        let (tx, rx) = mpsc::unbounded_channel();
        self.next.lock().unwrap().push_back(Fed {
            rx,
            streams: Arc::clone(&self.streams),
            counted: false,
            over: false,
        });
        tx
    }

    fn take(&self) -> Fed {
        self.next
            .lock()
            .unwrap()
            .pop_front()
            .expect("a request nobody fed")
    }
}

/// A GET route whose handler answers at once with the next fed body, streamed.
fn streaming(feeds: &Arc<Feeds>) -> MethodRouter {
    let feeds = Arc::clone(feeds);
    get(move || {
        let fed = feeds.take();
        async move { Body::from_stream(fed) }
    })
}

/// The next frame of `body`, however long the server takes to send it (up to [`DEADLINE`]).
async fn next_frame(body: &mut Incoming) -> Option<Result<Frame<Bytes>, hyper::Error>> {
    tokio::time::timeout(DEADLINE, body.frame())
        .await
        .expect("no frame came")
}

/// The next data of `body`: what the server sent as one chunk.
async fn next_data(body: &mut Incoming) -> Bytes {
    next_frame(body)
        .await
        .expect("the body ended")
        .expect("the body failed")
        .into_data()
        .expect("a data frame")
}

// ---------------------------------------------------------------------------------------------
// Over a real server
// ---------------------------------------------------------------------------------------------

/// A `/stream` route served on 127.0.0.1 under a layer on a limit of 1, with what the test reads.
struct StreamRoute {
    telemetry: Telemetry,
    limit: Limit,
    feeds: Arc<Feeds>,
    addr: SocketAddr,
}

/// A stream opened on a [`StreamRoute`]: its head said `200`, its first chunk is read.
struct Opened {
    /// What the body yields next; the body ends when this is dropped.
    feed: mpsc::UnboundedSender<Item>,
    client: Client,
    body: Incoming,
}

impl StreamRoute {
    /// Serves the route with the body-end form of the layer, or (if `!until_body_end`) the
    /// default head-end form.
    async fn serve(until_body_end: bool) -> Self {
        let (telemetry, limit) = (Telemetry::new(), Limit::new(1));
        let feeds = Arc::new(Feeds::default());
        let layer = verify_layer(&telemetry, &limit);
        let route = if until_body_end {
            streaming(&feeds).layer(layer.until_body_end())
        } else {
            streaming(&feeds).layer(layer)
        };
        let addr = serve(Router::new().route("/stream", route)).await;
        Self {
            telemetry,
            limit,
            feeds,
            addr,
        }
    }

    /// Opens one stream and reads its first chunk.
    async fn open(&self) -> Opened {
        let feed = self.feeds.channel();
        feed.send(Ok(chunk(0))).unwrap();
        let mut client = Client::open(self.addr).await;
        let response = client.response("/stream").await;
        assert_eq!(response.status(), StatusCode::OK, "the head said ok");
        let mut body = response.into_body();
        assert_eq!(next_data(&mut body).await, chunk(0));
        Opened { feed, client, body }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_body_keeps_its_operation_active_and_its_permit_held_until_it_ends() {
    let route = StreamRoute::serve(true).await;
    let StreamRoute {
        telemetry, limit, ..
    } = &route;
    let Opened { feed, mut body, .. } = route.open().await;
    let streaming_since = Instant::now();

    // Mid-stream: the head went out long ago, the operation goes on.
    for i in 1..CHUNKS {
        assert_eq!(
            telemetry.live_value(ACTIVE_INSTRUMENT, &VERIFY),
            1,
            "chunk {i}"
        );
        assert_eq!(limit.available(), 0, "the permit is held mid-stream");
        assert_eq!(telemetry.count(DURATION_INSTRUMENT, &[]), 0, "ended early");
        tokio::time::sleep(GAP).await;
        feed.send(Ok(chunk(i))).unwrap();
        assert_eq!(next_data(&mut body).await, chunk(i));
    }
    assert_eq!(telemetry.live_value(ACTIVE_INSTRUMENT, &VERIFY), 1);
    assert_eq!(limit.available(), 0);
    drop(feed);
    assert!(next_frame(&mut body).await.is_none(), "the body ends");
    assert!(streaming_since.elapsed() >= STREAMED);

    eventually("the operation ended with its body", || {
        telemetry.count(DURATION_INSTRUMENT, &[]) == 1
    })
    .await;
    assert_eq!(telemetry.outcomes(&VERIFY), only("ok"));
    assert_eq!(telemetry.live_value(ACTIVE_INSTRUMENT, &VERIFY), 0);
    assert_eq!(
        limit.available(),
        1,
        "the permit is back once the body ended"
    );
    let max = telemetry.max(DURATION_INSTRUMENT, &VERIFY).unwrap();
    let sum = telemetry.sum(DURATION_INSTRUMENT, &VERIFY);
    assert!(
        max >= ms(STREAMED) && sum >= ms(STREAMED),
        "run time {max} ms (sum {sum}) for a body that streamed {STREAMED:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_the_default_head_end_form_the_same_stream_ends_its_operation_when_the_head_goes_out() {
    let route = StreamRoute::serve(false).await;
    let StreamRoute {
        telemetry, limit, ..
    } = &route;
    let Opened { feed, mut body, .. } = route.open().await;

    // Mid-stream: the operation ended with the head, before the first chunk went out.
    for i in 1..CHUNKS {
        assert_eq!(
            telemetry.live_value(ACTIVE_INSTRUMENT, &VERIFY),
            0,
            "chunk {i}"
        );
        assert_eq!(limit.available(), 1, "the permit went back with the head");
        assert_eq!(telemetry.outcomes(&VERIFY), only("ok"));
        tokio::time::sleep(GAP).await;
        feed.send(Ok(chunk(i))).unwrap();
        assert_eq!(next_data(&mut body).await, chunk(i));
    }
    drop(feed);
    assert!(next_frame(&mut body).await.is_none(), "the body ends");

    assert_eq!(telemetry.outcomes(&VERIFY), only("ok"));
    let max = telemetry.max(DURATION_INSTRUMENT, &VERIFY).unwrap();
    assert!(
        max < ms(STREAMED),
        "run time {max} ms: the head-end form timed the body ({STREAMED:?})"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_hangs_up_mid_stream_ends_the_operation_cancelled_and_frees_the_permit() {
    let route = StreamRoute::serve(true).await;
    let StreamRoute {
        telemetry,
        limit,
        feeds,
        ..
    } = &route;
    let Opened { feed, client, body } = route.open().await;
    assert_eq!(telemetry.live_value(ACTIVE_INSTRUMENT, &VERIFY), 1);
    assert_eq!(limit.available(), 0);

    drop(body);
    client.hang_up();

    // The stream goes on (an endless feed): the server notices the hang-up when it reads or
    // writes the closed socket.
    let mut i = 1;
    eventually(
        "the hang-up ended the operation and freed the permit",
        || {
            let _ = feed.send(Ok(chunk(i)));
            i += 1;
            telemetry.count(DURATION_INSTRUMENT, &[]) == 1 && limit.available() == 1
        },
    )
    .await;
    assert_eq!(telemetry.outcomes(&VERIFY), only("cancelled"));
    assert_eq!(telemetry.live_value(ACTIVE_INSTRUMENT, &VERIFY), 0);
    assert_eq!(feeds.streams.now.load(SeqCst), 0, "the body was dropped");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_fails_mid_stream_ends_the_operation_error() {
    let route = StreamRoute::serve(true).await;
    let StreamRoute {
        telemetry, limit, ..
    } = &route;
    let Opened { feed, mut body, .. } = route.open().await;
    feed.send(Ok(chunk(1))).unwrap();
    assert_eq!(next_data(&mut body).await, chunk(1));
    assert_eq!(limit.available(), 0);

    feed.send(Err(io::Error::other("the stream broke")))
        .unwrap();
    let end = next_frame(&mut body).await;
    assert!(
        matches!(end, Some(Err(_))),
        "the client sees a truncated body: {end:?}"
    );

    eventually("the body error ended the operation", || {
        telemetry.count(DURATION_INSTRUMENT, &[]) == 1 && limit.available() == 1
    })
    .await;
    assert_eq!(telemetry.outcomes(&VERIFY), only("error"));
    assert_eq!(telemetry.live_value(ACTIVE_INSTRUMENT, &VERIFY), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_limit_of_one_a_second_request_waits_for_the_first_body_to_end() {
    let route = StreamRoute::serve(true).await;
    let StreamRoute {
        telemetry,
        limit,
        feeds,
        addr,
    } = &route;
    let addr = *addr;

    // The first request's body is fed by the test; the second's is one chunk, then its end.
    let first_feed = feeds.channel();
    let second_feed = feeds.channel();
    second_feed.send(Ok(Bytes::from_static(b"second"))).unwrap();
    drop(second_feed);

    first_feed.send(Ok(chunk(0))).unwrap();
    let mut first = Client::open(addr).await;
    let mut first_body = first.response("/stream").await.into_body();
    assert_eq!(next_data(&mut first_body).await, chunk(0));

    let second = tokio::spawn(async move {
        let mut client = Client::open(addr).await;
        let response = client.response("/stream").await;
        response.into_body().collect().await.unwrap().to_bytes()
    });
    eventually("the second request waits for the permit", || {
        limit.queued() == 1
    })
    .await;
    assert_eq!(telemetry.live_value(QUEUED_INSTRUMENT, &VERIFY), 1);
    let waiting_since = Instant::now();

    // The rest of the first body, while the second request waits.
    for i in 1..CHUNKS {
        tokio::time::sleep(GAP).await;
        first_feed.send(Ok(chunk(i))).unwrap();
        assert_eq!(next_data(&mut first_body).await, chunk(i));
        assert!(
            !second.is_finished(),
            "the second ran while the first streamed"
        );
        assert_eq!(limit.queued(), 1, "chunk {i}");
    }
    drop(first_feed);
    assert!(next_frame(&mut first_body).await.is_none());
    let first_ended = Instant::now();

    assert!(first_ended - waiting_since >= STREAMED);
    let second_body = tokio::time::timeout(DEADLINE, second)
        .await
        .expect("the second request was never served")
        .unwrap();
    assert_eq!(second_body, Bytes::from_static(b"second"));

    assert_eq!(feeds.streams.max(), 1, "two bodies streamed at once");
    eventually("both operations ended", || {
        telemetry.count(DURATION_INSTRUMENT, &[]) == 2
    })
    .await;
    assert_eq!(
        telemetry.outcomes(&VERIFY),
        BTreeMap::from([("ok".to_owned(), 2)])
    );
    let queued = telemetry.max(QUEUE_DURATION_INSTRUMENT, &VERIFY).unwrap();
    assert!(
        queued >= ms(STREAMED),
        "the second waited {queued} ms, while the first body streamed {STREAMED:?} more"
    );
    assert_eq!(limit.available(), 1);
    assert_eq!(telemetry.live_value(QUEUED_INSTRUMENT, &VERIFY), 0);
    assert_eq!(telemetry.live_value(ACTIVE_INSTRUMENT, &VERIFY), 0);
}

// ---------------------------------------------------------------------------------------------
// The body rules, with oneshot
// ---------------------------------------------------------------------------------------------

type HttpBodyEnd = ResourcesOperationLayer<HttpClassifier, Limit, Http, AtBodyEnd>;
type GrpcBodyEnd = tower_resources_operation::HttpLayer<Limit, AtBodyEnd>;

/// An HTTP layer on `limit`, in the body-end form.
fn http_layer(telemetry: &Telemetry, limit: &Limit) -> HttpBodyEnd {
    ResourcesOperationLayer::new_for_http(limit.clone())
        .metrics(telemetry.metrics.clone())
        .until_body_end()
}

/// An HTTP layer on `limit` that reads each request's deadline from `x-request-timeout`, in the
/// body-end form.
fn deadline_layer(telemetry: &Telemetry, limit: &Limit) -> HttpBodyEnd {
    ResourcesOperationLayer::new_for_http(limit.clone())
        .protocol(Http::new().deadline_header(HeaderName::from_static("x-request-timeout")))
        .metrics(telemetry.metrics.clone())
        .until_body_end()
}

/// A gRPC layer on `limit`, in the body-end form.
fn grpc_layer(telemetry: &Telemetry, limit: &Limit) -> GrpcBodyEnd {
    ResourcesOperationLayer::new_for_grpc(limit.clone())
        .metrics(telemetry.metrics.clone())
        .until_body_end()
}

/// The one operation ended `outcome`, and its permit is back.
fn assert_ended(telemetry: &Telemetry, limit: &Limit, outcome: &str) {
    assert_eq!(limit.available(), 1, "the permit is back");
    assert_eq!(telemetry.outcomes(&[]), only(outcome));
}

/// A service that answers its one request with `response`.
fn answering<B: Send + 'static>(
    response: Response<B>,
) -> impl Service<Request<()>, Response = Response<B>, Error = Infallible> {
    let mut response = Some(response);
    tower::service_fn(move |_request: Request<()>| {
        let response = response.take().expect("one request");
        async move { Ok::<_, Infallible>(response) }
    })
}

/// A body of the given frames, then its end. `is_end_stream` is true once it returned its end
/// (`None`), or, if `eager`, once it has no frame left. Past its frames it may instead never end
/// ([`Frames::endless`]) or panic ([`Frames::then_panic`]), and it may choose its operation's
/// outcome when first polled ([`Frames::choosing_timeout`]).
///
/// The bodies of this file are `Default`, as an HTTP or gRPC layer needs of its service's body:
/// the empty body it answers a rejection with.
#[derive(Default)]
struct Frames {
    frames: VecDeque<Frame<Bytes>>,
    hint: SizeHint,
    eager: bool,
    after: AfterFrames,
    /// Calls `set_outcome(Timeout)` in its first `poll_frame`.
    choose_timeout: bool,
    /// What that `set_outcome` returned: whether it saw the operation.
    chose: Option<bool>,
    done: bool,
}

/// What a [`Frames`] body does once its frames are out.
#[derive(Default)]
enum AfterFrames {
    #[default]
    End,
    Pend,
    Panic,
}

impl Frames {
    fn new(frames: impl IntoIterator<Item = Frame<Bytes>>) -> Self {
        Self {
            frames: frames.into_iter().collect(),
            ..Self::default()
        }
    }

    fn data(chunks: &[&'static str]) -> Self {
        Self::new(
            chunks
                .iter()
                .map(|c| Frame::data(Bytes::from_static(c.as_bytes()))),
        )
    }

    fn with_trailers(mut self, trailers: HeaderMap) -> Self {
        self.frames.push_back(Frame::trailers(trailers));
        self
    }

    /// A body that never sends anything and never ends.
    fn endless() -> Self {
        Self {
            after: AfterFrames::Pend,
            ..Self::default()
        }
    }

    /// Past its frames, panics when polled.
    fn then_panic(mut self) -> Self {
        self.after = AfterFrames::Panic;
        self
    }

    /// Calls `set_outcome(Timeout)` in its first `poll_frame`, then streams its frames.
    fn choosing_timeout(mut self) -> Self {
        self.choose_timeout = true;
        self
    }
}

impl HttpBody for Frames {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if self.choose_timeout && self.chose.is_none() {
            self.chose = Some(set_outcome(Outcome::Timeout));
        }
        if let Some(frame) = self.frames.pop_front() {
            return Poll::Ready(Some(Ok(frame)));
        }
        match self.after {
            AfterFrames::End => {
                self.done = true;
                Poll::Ready(None)
            }
            AfterFrames::Pend => Poll::Pending,
            AfterFrames::Panic => panic!("{EXPECTED_PANIC}: the body broke"),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done || (self.eager && self.frames.is_empty())
    }

    fn size_hint(&self) -> SizeHint {
        self.hint
    }
}

/// Polls `body` for its next frame, which must be ready.
async fn frame<B: HttpBody + Unpin>(body: &mut B) -> Option<Frame<B::Data>>
where
    B::Error: std::fmt::Debug,
{
    body.frame().await.map(|frame| frame.unwrap())
}

fn trailers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
    pairs
        .iter()
        .map(|(name, value)| {
            (
                HeaderName::from_static(name),
                HeaderValue::from_static(value),
            )
        })
        .collect()
}

fn grpc_response<B>(body: B) -> Response<B> {
    Response::builder()
        .header("content-type", "application/grpc")
        .body(body)
        .unwrap()
}

#[tokio::test]
async fn a_body_empty_from_the_start_ends_its_operation_at_once() {
    let (telemetry, limit) = (Telemetry::new(), Limit::new(1));
    let service =
        http_layer(&telemetry, &limit).layer(answering(Response::new(Empty::<Bytes>::new())));

    let response = service.oneshot(Request::new(())).await.unwrap();

    assert!(response.body().is_end_stream());
    assert_eq!(limit.available(), 1, "the permit is back with the response");
    assert_eq!(telemetry.outcomes(&[]), only("ok"));
    assert_eq!(telemetry.live_value(ACTIVE_INSTRUMENT, &[]), 0);
    drop(response);
    assert_eq!(telemetry.outcomes(&[]), only("ok"), "one end, not two");
}

#[tokio::test]
async fn a_body_whose_last_frame_is_trailers_ends_its_operation_when_that_frame_is_read() {
    let (telemetry, limit) = (Telemetry::new(), Limit::new(1));
    let body = Frames::data(&["a", "b"]).with_trailers(trailers(&[("x-checksum", "ab")]));
    let service = http_layer(&telemetry, &limit).layer(answering(Response::new(body)));

    let mut body = service.oneshot(Request::new(())).await.unwrap().into_body();
    for data in ["a", "b"] {
        assert_eq!(limit.available(), 0, "held before {data}");
        let frame = frame(&mut body).await.unwrap();
        assert_eq!(frame.into_data().unwrap(), data);
        assert_eq!(
            telemetry.count(DURATION_INSTRUMENT, &[]),
            0,
            "ended at {data}"
        );
    }
    assert_eq!(limit.available(), 0);
    assert_eq!(telemetry.live_value(ACTIVE_INSTRUMENT, &[]), 1);

    let frame = frame(&mut body).await.unwrap();
    assert_eq!(
        frame.into_trailers().unwrap(),
        trailers(&[("x-checksum", "ab")])
    );
    assert_eq!(limit.available(), 1, "the trailers ended the operation");
    assert_eq!(telemetry.outcomes(&[]), only("ok"));
    assert_eq!(telemetry.live_value(ACTIVE_INSTRUMENT, &[]), 0);

    assert!(body.frame().await.is_none());
    drop(body);
    assert_eq!(telemetry.outcomes(&[]), only("ok"), "one end, not two");
}

#[tokio::test]
async fn with_the_grpc_classifier_the_grpc_status_of_the_trailers_decides() {
    for (code, outcome) in [
        ("0", "ok"),
        ("4", "timeout"),
        ("1", "cancelled"),
        ("13", "error"),
    ] {
        let (telemetry, limit) = (Telemetry::new(), Limit::new(1));
        let layer = grpc_layer(&telemetry, &limit);
        let body = Frames::data(&["message"]).with_trailers(trailers(&[("grpc-status", code)]));
        let service = layer.layer(answering(grpc_response(body)));

        let mut body = service.oneshot(Request::new(())).await.unwrap().into_body();
        assert!(frame(&mut body).await.unwrap().is_data());
        assert_eq!(
            limit.available(),
            0,
            "grpc-status {code}: held after the message"
        );
        assert_eq!(
            telemetry.count(DURATION_INSTRUMENT, &[]),
            0,
            "grpc-status {code}"
        );
        assert!(frame(&mut body).await.unwrap().is_trailers());
        assert_eq!(
            limit.available(),
            1,
            "grpc-status {code}: freed at the trailers"
        );
        assert_eq!(telemetry.outcomes(&[]), only(outcome), "grpc-status {code}");
    }
}

#[tokio::test]
async fn the_grpc_classifier_given_to_classifier_reads_the_trailers_too() {
    for (code, outcome) in [("0", "ok"), ("4", "timeout"), ("13", "error")] {
        let (telemetry, limit) = (Telemetry::new(), Limit::new(1));
        let layer = ResourcesOperationLayer::new(limit.clone())
            .classifier(HttpClassifier::grpc())
            .metrics(telemetry.metrics.clone())
            .until_body_end();
        let body = Frames::data(&["message"]).with_trailers(trailers(&[("grpc-status", code)]));
        let service = layer.layer(answering(grpc_response(body)));

        let body = service.oneshot(Request::new(())).await.unwrap().into_body();
        body.collect().await.unwrap();
        assert_eq!(limit.available(), 1);
        assert_eq!(telemetry.outcomes(&[]), only(outcome), "grpc-status {code}");
    }
}

#[tokio::test]
async fn with_the_grpc_classifier_a_stream_that_ends_without_trailers_is_ok() {
    let (telemetry, limit) = (Telemetry::new(), Limit::new(1));
    let layer = grpc_layer(&telemetry, &limit);
    let service = layer.layer(answering(grpc_response(Frames::data(&["one", "two"]))));

    let mut body = service.oneshot(Request::new(())).await.unwrap().into_body();
    assert!(frame(&mut body).await.unwrap().is_data());
    assert!(frame(&mut body).await.unwrap().is_data());
    assert_eq!(limit.available(), 0, "not ended before its end");
    assert!(body.frame().await.is_none());

    assert_ended(&telemetry, &limit, "ok");
}

#[tokio::test]
async fn with_the_grpc_classifier_a_trailers_only_response_decides_at_the_head() {
    // A trailers-only response (tonic's answer to a handler's error): grpc-status in the head,
    // an empty body. It ends at once, with the head's status.
    for (code, outcome) in [("4", "timeout"), ("13", "error"), ("1", "cancelled")] {
        let (telemetry, limit) = (Telemetry::new(), Limit::new(1));
        let layer = grpc_layer(&telemetry, &limit);
        let mut response = grpc_response(Empty::<Bytes>::new());
        response
            .headers_mut()
            .insert("grpc-status", HeaderValue::from_static(code));
        let service = layer.layer(answering(response));

        let response = service.oneshot(Request::new(())).await.unwrap();
        assert_eq!(limit.available(), 1, "grpc-status {code}");
        assert_eq!(telemetry.outcomes(&[]), only(outcome), "grpc-status {code}");
        drop(response);
    }
}

#[tokio::test]
async fn with_the_grpc_classifier_an_error_in_the_head_stays_an_error_when_trailers_follow() {
    // The head decides even if trailers follow: an error in the head stays an error.
    let (telemetry, limit) = (Telemetry::new(), Limit::new(1));
    let layer = grpc_layer(&telemetry, &limit);
    let body = Frames::data(&["late"]).with_trailers(trailers(&[("grpc-status", "0")]));
    let mut response = grpc_response(body);
    response
        .headers_mut()
        .insert("grpc-status", HeaderValue::from_static("13"));
    let service = layer.layer(answering(response));
    let body = service.oneshot(Request::new(())).await.unwrap().into_body();
    assert_eq!(limit.available(), 0, "still held while the body streams");
    body.collect().await.unwrap();
    assert_ended(&telemetry, &limit, "error");
}

#[tokio::test]
async fn size_hint_is_end_stream_and_data_frames_pass_through_unchanged() {
    // A body with a size hint of its own, whose end shows as soon as its last frame is out.
    let (telemetry, limit) = (Telemetry::new(), Limit::new(1));
    let mut inner = Frames::data(&["hello", " ", "world"]);
    inner.hint = SizeHint::new();
    inner.hint.set_lower(3);
    inner.hint.set_upper(64);
    inner.eager = true;
    let service = http_layer(&telemetry, &limit).layer(answering(Response::new(inner)));
    let mut body = service.oneshot(Request::new(())).await.unwrap().into_body();

    let mut read = Vec::new();
    for expected in ["hello", " ", "world"] {
        let (outer, inner) = (body.size_hint(), body.get_ref().size_hint());
        assert_eq!(
            (outer.lower(), outer.upper()),
            (inner.lower(), inner.upper())
        );
        assert_eq!((outer.lower(), outer.upper()), (3, Some(64)));
        assert_eq!(body.is_end_stream(), body.get_ref().is_end_stream());
        assert!(!body.is_end_stream());
        assert_eq!(limit.available(), 0, "held before {expected:?}");
        let data = frame(&mut body).await.unwrap().into_data().unwrap();
        assert_eq!(data, expected);
        read.push(data);
    }
    assert_eq!(read.concat(), b"hello world");
    assert!(body.is_end_stream() && body.get_ref().is_end_stream());
    // A frame after which the body says it ended ends the operation, without a poll for `None`.
    assert_ended(&telemetry, &limit, "ok");

    // A `Full` body: an exact hint, one frame.
    let (telemetry, limit) = (Telemetry::new(), Limit::new(1));
    let full = Full::new(Bytes::from_static(b"exactly"));
    let service = http_layer(&telemetry, &limit).layer(answering(Response::new(full)));
    let mut body = service.oneshot(Request::new(())).await.unwrap().into_body();
    assert_eq!(body.size_hint().exact(), Some(7));
    assert_eq!(body.get_ref().size_hint().exact(), Some(7));
    assert!(!body.is_end_stream());
    assert_eq!(limit.available(), 0);
    let data = frame(&mut body).await.unwrap().into_data().unwrap();
    assert_eq!(data, Bytes::from_static(b"exactly"));
    assert!(body.is_end_stream());
    assert_eq!(body.size_hint().exact(), Some(0));
    assert_ended(&telemetry, &limit, "ok");
}

#[tokio::test]
async fn set_outcome_called_while_the_body_is_polled_wins_over_the_classifier() {
    // The head (200) says ok to the HTTP classifier.
    let (telemetry, limit) = (Telemetry::new(), Limit::new(1));
    let body = Frames::data(&["partial"]).choosing_timeout();
    let service = http_layer(&telemetry, &limit).layer(answering(Response::new(body)));
    let mut body = service.oneshot(Request::new(())).await.unwrap().into_body();
    assert_eq!(
        frame(&mut body).await.unwrap().into_data().unwrap(),
        "partial"
    );
    assert_eq!(
        body.get_ref().chose,
        Some(true),
        "set_outcome saw the operation"
    );
    assert!(body.frame().await.is_none());
    assert_ended(&telemetry, &limit, "timeout");

    // The trailers say OK to the gRPC classifier.
    let (telemetry, limit) = (Telemetry::new(), Limit::new(1));
    let layer = grpc_layer(&telemetry, &limit);
    let body = Frames::data(&["partial"])
        .with_trailers(trailers(&[("grpc-status", "0")]))
        .choosing_timeout();
    let service = layer.layer(answering(grpc_response(body)));
    let body = service.oneshot(Request::new(())).await.unwrap().into_body();
    body.collect().await.unwrap();
    assert_ended(&telemetry, &limit, "timeout");
}

#[tokio::test]
async fn a_panic_while_the_body_is_polled_ends_the_operation_crashed_and_goes_on() {
    quiet_expected_panics();
    let (telemetry, limit) = (Telemetry::new(), Limit::new(1));
    let service = http_layer(&telemetry, &limit).layer(answering(Response::new(
        Frames::data(&["first"]).then_panic(),
    )));
    let mut body = service.oneshot(Request::new(())).await.unwrap().into_body();
    assert_eq!(
        frame(&mut body).await.unwrap().into_data().unwrap(),
        "first"
    );
    assert_eq!(telemetry.live_value(ACTIVE_INSTRUMENT, &[]), 1);

    let mut cx = Context::from_waker(Waker::noop());
    let panicked = catch_unwind(AssertUnwindSafe(|| Pin::new(&mut body).poll_frame(&mut cx)))
        .expect_err("the panic goes on through the body");
    assert!(
        panic_message(&*panicked).contains(EXPECTED_PANIC),
        "{}",
        panic_message(&*panicked)
    );
    assert_eq!(telemetry.outcomes(&[]), only("crashed"));
    assert_eq!(telemetry.live_value(ACTIVE_INSTRUMENT, &[]), 0);

    drop(body);
    assert_eq!(
        limit.available(),
        1,
        "the permit is back once the body is dropped"
    );
    assert_eq!(telemetry.outcomes(&[]), only("crashed"), "one end, not two");
}

/// The HTTP body-end layer that reads deadlines from `x-request-timeout`, and a request with a
/// deadline of 1 s.
async fn dropped_after(elapsed: Duration) -> BTreeMap<String, u64> {
    let (telemetry, limit) = (Telemetry::new(), Limit::new(1));
    let layer = deadline_layer(&telemetry, &limit);
    let service = layer.layer(answering(Response::new(Frames::endless())));
    let request = Request::get("/slow")
        .header("x-request-timeout", "1000")
        .body(())
        .unwrap();

    let response = service.oneshot(request).await.unwrap();
    tokio::time::advance(elapsed).await;
    assert_eq!(limit.available(), 0, "held while the body streams");
    assert_eq!(telemetry.count(DURATION_INSTRUMENT, &[]), 0);
    drop(response); // the client hangs up
    assert_eq!(limit.available(), 1);
    assert_eq!(telemetry.live_value(ACTIVE_INSTRUMENT, &[]), 0);
    telemetry.outcomes(&[])
}

#[tokio::test(start_paused = true)]
async fn a_body_dropped_after_the_request_deadline_ends_the_operation_timeout() {
    assert_eq!(
        dropped_after(Duration::from_millis(1500)).await,
        only("timeout")
    );
}

#[tokio::test(start_paused = true)]
async fn a_body_dropped_before_the_request_deadline_ends_the_operation_cancelled() {
    assert_eq!(
        dropped_after(Duration::from_millis(200)).await,
        only("cancelled")
    );
}

#[tokio::test(start_paused = true)]
async fn a_body_dropped_without_a_deadline_header_ends_the_operation_cancelled() {
    let (telemetry, limit) = (Telemetry::new(), Limit::new(1));
    let layer = deadline_layer(&telemetry, &limit);
    let service = layer.layer(answering(Response::new(Frames::endless())));

    let response = service.oneshot(Request::new(())).await.unwrap();
    tokio::time::advance(Duration::from_secs(3600)).await;
    drop(response);
    assert_ended(&telemetry, &limit, "cancelled");
}

#[tokio::test]
async fn with_metrics_disabled_the_body_end_form_still_holds_the_permit_until_the_body_ends() {
    let limit = Limit::new(1);
    let layer = ResourcesOperationLayer::new(limit.clone())
        .metrics(OperationMetrics::disabled())
        .until_body_end();

    // A body that streams to its end.
    let service = layer.layer(answering(Response::new(Frames::data(&["a", "b"]))));
    let mut body = service.oneshot(Request::new(())).await.unwrap().into_body();
    assert_eq!(limit.available(), 0, "held with the response");
    assert_eq!(frame(&mut body).await.unwrap().into_data().unwrap(), "a");
    assert_eq!(limit.available(), 0);
    assert_eq!(frame(&mut body).await.unwrap().into_data().unwrap(), "b");
    assert_eq!(limit.available(), 0, "held until the end itself");
    assert!(body.frame().await.is_none());
    assert_eq!(limit.available(), 1, "back at the end");

    // A body dropped mid-stream.
    let service = layer.layer(answering(Response::new(Frames::data(&["a", "b"]))));
    let mut body = service.oneshot(Request::new(())).await.unwrap().into_body();
    assert_eq!(frame(&mut body).await.unwrap().into_data().unwrap(), "a");
    assert_eq!(limit.available(), 0);
    drop(body);
    assert_eq!(limit.available(), 1, "back when the body is dropped");

    // A body empty from the start.
    let service = layer.layer(answering(Response::new(Empty::<Bytes>::new())));
    let response = service.oneshot(Request::new(())).await.unwrap();
    assert_eq!(limit.available(), 1, "back with the response");
    drop(response);
}

#[tokio::test(start_paused = true)]
async fn a_body_that_ends_on_its_own_past_the_request_deadline_keeps_its_classifiers_outcome() {
    let (telemetry, limit) = (Telemetry::new(), Limit::new(1));
    let layer = deadline_layer(&telemetry, &limit);
    let service = layer.layer(answering(Response::new(Frames::data(&["late"]))));
    let request = Request::get("/slow")
        .header("x-request-timeout", "1000")
        .body(())
        .unwrap();

    let mut body = service.oneshot(request).await.unwrap().into_body();
    tokio::time::advance(Duration::from_millis(1500)).await;
    assert_eq!(frame(&mut body).await.unwrap().into_data().unwrap(), "late");
    assert!(body.frame().await.is_none());
    assert_ended(&telemetry, &limit, "ok");
}

#[tokio::test]
async fn set_outcome_called_by_the_service_before_the_head_wins_at_the_end_of_the_body() {
    let (telemetry, limit) = (Telemetry::new(), Limit::new(1));
    let service =
        http_layer(&telemetry, &limit).layer(tower::service_fn(|_request: Request<()>| async {
            assert!(set_outcome(Outcome::Timeout), "inside the operation");
            Ok::<_, Infallible>(Response::new(Frames::data(&["fallback"])))
        }));

    let mut body = service.oneshot(Request::new(())).await.unwrap().into_body();
    assert_eq!(limit.available(), 0, "held while the body streams");
    assert_eq!(telemetry.count(DURATION_INSTRUMENT, &[]), 0);
    assert_eq!(
        frame(&mut body).await.unwrap().into_data().unwrap(),
        "fallback"
    );
    assert!(body.frame().await.is_none());
    assert_ended(&telemetry, &limit, "timeout");
}
