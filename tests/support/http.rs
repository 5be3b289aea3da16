//! An axum server on 127.0.0.1 and hyper HTTP/1.1 clients of it, for the tests that go through
//! a real socket.

use std::future::Future;
use std::net::SocketAddr;

use axum::Router;
use bytes::Bytes;
use http::header::HOST;
use http::{Request, Response};
use http_body_util::{BodyExt as _, Empty};
use hyper::body::Incoming;
use hyper::client::conn::http1::{self, SendRequest};
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

use tower_resources_operation::classify::HttpClassifier;
use tower_resources_operation::protocol::Http;
use tower_resources_operation::{Executor, Limit, Operation, ResourcesOperationLayer};

use super::{within, Telemetry};

/// The HTTP layer on `limit`, for `verify` on a subprocess, recording to `telemetry`.
pub fn verify_layer(
    telemetry: &Telemetry,
    limit: &Limit,
) -> ResourcesOperationLayer<HttpClassifier, Limit, Http> {
    ResourcesOperationLayer::new_for_http(limit.clone())
        .operation(Operation::Verify)
        .executor(Executor::Subprocess)
        .metrics(telemetry.metrics.clone())
}

/// Serves `router` on an ephemeral port of 127.0.0.1.
pub async fn serve(router: Router) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    addr
}

/// A GET of `path`, as a hyper client sends it.
pub fn get_request(path: &str) -> Request<Empty<Bytes>> {
    Request::get(path)
        .header(HOST, "127.0.0.1")
        .body(Empty::new())
        .unwrap()
}

/// One hyper HTTP/1.1 client connection, kept alive across requests.
pub struct Client {
    sender: SendRequest<Empty<Bytes>>,
    /// Drives the connection and owns its socket; ends once the connection closes.
    driver: JoinHandle<hyper::Result<()>>,
}

impl Client {
    pub async fn open(addr: SocketAddr) -> Self {
        let stream = TcpStream::connect(addr).await.unwrap();
        let (sender, connection) = http1::handshake(TokioIo::new(stream)).await.unwrap();
        Self {
            sender,
            driver: tokio::spawn(connection),
        }
    }

    /// Sends `request` once the connection is ready for it; the response is not awaited:
    /// dropping it before it comes makes hyper close the connection.
    pub async fn send(
        &mut self,
        request: Request<Empty<Bytes>>,
    ) -> impl Future<Output = hyper::Result<Response<Incoming>>> {
        self.sender.ready().await.unwrap();
        self.sender.send_request(request)
    }

    /// GETs `path`; returns the response once its head has come.
    pub async fn response(&mut self, path: &str) -> Response<Incoming> {
        let response = self.send(get_request(path)).await;
        within(&format!("the head of GET {path}"), response)
            .await
            .unwrap()
    }

    /// Sends `request` and reads the whole response: its status and body.
    pub async fn exchange(&mut self, request: Request<Empty<Bytes>>) -> (u16, String) {
        let what = format!("the answer to {} {}", request.method(), request.uri());
        let response = self.send(request).await;
        within(&what, async {
            let response = response.await.unwrap();
            let status = response.status().as_u16();
            let body = response.into_body().collect().await.unwrap().to_bytes();
            (status, String::from_utf8(body.to_vec()).unwrap())
        })
        .await
    }

    /// GETs `path` and reads the whole response: its status and body.
    pub async fn get(&mut self, path: &str) -> (u16, String) {
        self.exchange(get_request(path)).await
    }

    /// Hangs up: the socket closes under whatever is in flight.
    pub fn hang_up(self) {
        drop(self.sender);
        self.driver.abort();
    }

    /// Lets go of the connection and waits until it has closed cleanly.
    pub async fn closed(self) {
        drop(self.sender);
        let closed = within("a client connection closing", self.driver).await;
        closed.unwrap().unwrap();
    }
}
