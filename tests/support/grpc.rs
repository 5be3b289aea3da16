//! A gRPC server and its clients, for the tonic tests (`tonic`, `tonic_streaming`): tonic-health's
//! generated `grpc.health.v1.Health` (so no `protoc` is needed) around a [`Backend`] of the tests'
//! own, on 127.0.0.1.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc::{self, UnboundedReceiver, UnboundedSender};
use tokio::sync::Notify;
use tonic::codegen::tokio_stream::Stream;
use tonic::server::NamedService;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Channel, Endpoint, Server};
use tonic::{Code, Request, Response, Status, Streaming};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::health_server::{Health, HealthServer};
use tonic_health::pb::{HealthCheckRequest, HealthCheckResponse};
use tower::{Layer, Service};

use tower_resources_operation::classify::HttpClassifier;
use tower_resources_operation::protocol::Http;
use tower_resources_operation::{HttpLayer, Limit, ResourcesOperationLayer};

use super::{within, Load, Telemetry, DEADLINE};

/// The gRPC layer of `new_for_grpc` on a [`Limit`].
pub type GrpcLayer = HttpLayer;

/// [`GrpcLayer`] on `limit`, recording to `telemetry`.
pub fn grpc_layer(telemetry: &Telemetry, limit: &Limit) -> GrpcLayer {
    ResourcesOperationLayer::new_for_grpc(limit.clone()).metrics(telemetry.metrics.clone())
}

/// How long a `slow` check runs.
pub const SLOW_CHECK: Duration = Duration::from_millis(100);

// ---------------------------------------------------------------------------------------------
// The server side.

/// One message of a `Watch` stream, or the status that ends it.
pub type Item = Result<HealthCheckResponse, Status>;
type WatchStream = Pin<Box<dyn Stream<Item = Item> + Send>>;

/// The handlers.
///
/// `Check` does what the requested service name says: `ok` answers SERVING at once, `slow` after
/// [`SLOW_CHECK`] counted in `load`; `internal`, `deadline`, `cancelled` fail with that status
/// (tonic answers trailers-only); `hang` signals `hanging`, then never answers; any other name is
/// NOT_FOUND.
///
/// `Watch` hands the test a [`WatchCall`] and streams whatever the test feeds it, until the test
/// drops the feed (a normal end: tonic sends trailers with `grpc-status` 0) or feeds an `Err`
/// (tonic sends that status in the trailers).
#[derive(Debug)]
pub struct Backend {
    watches: UnboundedSender<WatchCall>,
    checks: AtomicUsize,
    /// Signalled when a `hang` check starts.
    pub hanging: Notify,
    /// The `slow` checks that run now, and the most that ran at once.
    pub load: Load,
}

/// One `Watch` call as its handler started it: the test's end of its stream.
#[derive(Debug)]
pub struct WatchCall {
    pub service: String,
    pub feed: UnboundedSender<Item>,
}

impl Backend {
    /// How many times the `Check` handler was called.
    pub fn checks(&self) -> usize {
        self.checks.load(Ordering::SeqCst)
    }
}

pub fn serving() -> HealthCheckResponse {
    HealthCheckResponse {
        status: ServingStatus::Serving as i32,
    }
}

#[tonic::async_trait]
impl Health for Backend {
    async fn check(
        &self,
        request: Request<HealthCheckRequest>,
    ) -> Result<Response<HealthCheckResponse>, Status> {
        self.checks.fetch_add(1, Ordering::SeqCst);
        match request.into_inner().service.as_str() {
            "ok" => Ok(Response::new(serving())),
            "slow" => {
                self.load.work(SLOW_CHECK).await;
                Ok(Response::new(serving()))
            }
            "internal" => Err(Status::internal("the probe broke")),
            "deadline" => Err(Status::deadline_exceeded("the probe ran out of time")),
            "cancelled" => Err(Status::cancelled("the probe was called off")),
            "hang" => {
                self.hanging.notify_one();
                std::future::pending().await
            }
            other => Err(Status::not_found(format!("no probe {other:?}"))),
        }
    }

    type WatchStream = WatchStream;

    async fn watch(
        &self,
        request: Request<HealthCheckRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        let (feed, items) = mpsc::unbounded_channel();
        let call = WatchCall {
            service: request.into_inner().service,
            feed,
        };
        self.watches
            .send(call)
            .expect("the test stopped listening for Watch calls");
        let stream = futures_util::stream::unfold(items, |mut items| async move {
            items.recv().await.map(|item| (item, items))
        });
        Ok(Response::new(Box::pin(stream)))
    }
}

impl WatchCall {
    /// Streams one SERVING message.
    pub fn send(&self) {
        self.feed
            .send(Ok(serving()))
            .expect("the server dropped the stream");
    }

    /// Fails the stream with `status`: tonic sends it in the trailers.
    pub fn fail(self, status: Status) {
        self.feed
            .send(Err(status))
            .expect("the server dropped the stream");
    }

    /// Ends the stream normally: tonic sends trailers with `grpc-status` 0.
    pub fn finish(self) {}

    /// Waits until the server has dropped the stream (the response body).
    pub async fn dropped(&self) {
        within("the server's drop of the stream", self.feed.closed()).await;
    }
}

/// A new [`Backend`] served on 127.0.0.1, and a connection to it.
pub struct Served {
    pub backend: Arc<Backend>,
    /// The `Watch` calls the handler starts, in order.
    pub watches: UnboundedReceiver<WatchCall>,
    pub addr: SocketAddr,
    pub channel: Channel,
}

impl Served {
    /// The next `Watch` call the handler started; fails the test after [`DEADLINE`].
    pub async fn next_watch(&mut self) -> WatchCall {
        within("a call of the Watch handler", self.watches.recv())
            .await
            .expect("the backend is gone")
    }

    /// Opens a `Watch` of `service` and streams `messages` SERVING messages through it, each read
    /// by the client: the stream, still open, and its call.
    pub async fn streaming(
        &mut self,
        service: &str,
        messages: usize,
    ) -> (Streaming<HealthCheckResponse>, WatchCall) {
        let mut stream = watch(&self.channel, service).await.unwrap();
        let call = self.next_watch().await;
        for _ in 0..messages {
            call.send();
            assert!(message(&mut stream).await.unwrap().is_some());
        }
        (stream, call)
    }

    /// Asserts that the `Watch` handler started no call the test has not taken yet.
    pub fn assert_no_watch_started(&mut self, why: &str) {
        if let Ok(call) = self.watches.try_recv() {
            panic!("the Watch handler was called ({:?}): {why}", call.service);
        }
    }
}

/// Serves a new [`Backend`] with the server that `serve` makes of it on a listener of an
/// ephemeral port of 127.0.0.1, and connects to it.
pub async fn serve_with<F>(serve: impl FnOnce(HealthServer<Backend>, TcpIncoming) -> F) -> Served
where
    F: Future<Output = Result<(), tonic::transport::Error>> + Send + 'static,
{
    let (watches, calls) = mpsc::unbounded_channel();
    let backend = Arc::new(Backend {
        watches,
        checks: AtomicUsize::new(0),
        hanging: Notify::new(),
        load: Load::default(),
    });
    let incoming = TcpIncoming::bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = incoming.local_addr().unwrap();
    let serving = serve(HealthServer::from_arc(Arc::clone(&backend)), incoming);
    tokio::spawn(async move { serving.await.unwrap() });
    Served {
        backend,
        watches: calls,
        addr,
        channel: connect(addr).await,
    }
}

/// A layer over the backend's generated server whose service `add_service` takes: one that
/// knows its gRPC name (the `NamedService` the `tonic` feature forwards).
pub trait PerService {
    /// Serves a new [`Backend`] on `server`, limited per service by this layer.
    fn serve_on(self, server: Server) -> impl Future<Output = Served>;
}

impl<L> PerService for L
where
    L: Layer<HealthServer<Backend>>,
    L::Service: Service<http::Request<tonic::body::Body>, Error = Infallible>
        + NamedService
        + Clone
        + Send
        + Sync
        + 'static,
    <L::Service as Service<http::Request<tonic::body::Body>>>::Response:
        axum::response::IntoResponse,
    <L::Service as Service<http::Request<tonic::body::Body>>>::Future: Send + 'static,
{
    async fn serve_on(self, mut server: Server) -> Served {
        serve_with(|health, incoming| {
            server
                .add_service(self.layer(health))
                .serve_with_incoming(incoming)
        })
        .await
    }
}

/// Serves a new [`Backend`] limited per service by `layer`, through `add_service`, and connects
/// to it.
pub async fn serve(layer: impl PerService) -> Served {
    layer.serve_on(Server::builder()).await
}

/// [`serve`] on a server that drops a call after `timeout` (`Server::timeout`), under `layer`
/// told so (`server_timeout`), which counts such a drop as `timeout`.
pub async fn serve_timing_out<E>(
    timeout: Duration,
    layer: ResourcesOperationLayer<HttpClassifier, Limit, Http, E>,
) -> Served
where
    ResourcesOperationLayer<HttpClassifier, Limit, Http, E>: PerService,
{
    let server = Server::builder().timeout(timeout);
    layer.server_timeout(timeout).serve_on(server).await
}

// ---------------------------------------------------------------------------------------------
// The client side.

/// A new HTTP/2 connection to `addr`.
pub async fn connect(addr: SocketAddr) -> Channel {
    Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap()
}

pub fn asking(service: &str) -> Request<HealthCheckRequest> {
    Request::new(HealthCheckRequest {
        service: service.to_owned(),
    })
}

/// One `Check` of `service` on `channel`.
pub async fn check(channel: &Channel, service: &str) -> Result<i32, Status> {
    let response = within(
        "the Check's answer",
        HealthClient::new(channel.clone()).check(asking(service)),
    )
    .await?;
    Ok(response.into_inner().status)
}

/// A `Check` of `hang` whose client deadline, 100 ms sent as `grpc-timeout`, passes: tonic gives
/// up on the call, and the client sees DEADLINE_EXCEEDED or CANCELLED.
pub async fn check_past_a_client_deadline(channel: &Channel) {
    let mut request = asking("hang");
    request.set_timeout(Duration::from_millis(100));
    let status = tokio::time::timeout(DEADLINE, HealthClient::new(channel.clone()).check(request))
        .await
        .expect("nobody enforced the client's deadline")
        .unwrap_err();
    assert!(
        matches!(status.code(), Code::DeadlineExceeded | Code::Cancelled),
        "{status:?}"
    );
}

/// Opens a `Watch` of `service` on `channel`: returns once the response head is in.
pub async fn watch(
    channel: &Channel,
    service: &str,
) -> Result<Streaming<HealthCheckResponse>, Status> {
    let response = within(
        "the Watch head",
        HealthClient::new(channel.clone()).watch(asking(service)),
    )
    .await?;
    Ok(response.into_inner())
}

/// The next message of `stream`: `Ok(None)` at a normal end, `Err` with the trailers' status.
pub async fn message(
    stream: &mut Streaming<HealthCheckResponse>,
) -> Result<Option<HealthCheckResponse>, Status> {
    within("the stream's next message", stream.message()).await
}

/// Reads `stream` to its end: the number of messages, and the status it ended with.
pub async fn drain(mut stream: Streaming<HealthCheckResponse>) -> (usize, Result<(), Status>) {
    let mut messages = 0;
    loop {
        match message(&mut stream).await {
            Ok(Some(response)) => {
                assert_eq!(response.status, ServingStatus::Serving as i32);
                messages += 1;
            }
            Ok(None) => return (messages, Ok(())),
            Err(status) => return (messages, Err(status)),
        }
    }
}
