//! Thousands of requests through a real axum server on 127.0.0.1, from hyper HTTP/1.1 clients
//! on keep-alive connections, with a share of handlers panicking (caught by a layer outside the
//! limit) and a share of clients dropping their response mid-flight or while queued: what the
//! server recorded is exactly what the clients caused, and the live counts and permits all come
//! back.

mod support;

use std::collections::HashMap;
use std::future::Future;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use axum::http::{Request, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use tokio::sync::{oneshot, watch, Semaphore};
use tower::{Layer, Service};

use support::http::{get_request, serve, Client};
use support::reliability::{
    assert_books, assert_live_counts_zero, live_count, quiet_expected_panics, Books, Series,
    EXPECTED_PANIC,
};
use support::{eventually, within, Telemetry};
use tower_resources_operation::classify::HttpClassifier;
use tower_resources_operation::names::{
    ACTIVE_INSTRUMENT, DURATION_INSTRUMENT, OUTCOME_ATTRIBUTE, QUEUED_INSTRUMENT,
};
use tower_resources_operation::protocol::Http;
use tower_resources_operation::{Executor, Operation, Outcome, ResourcesOperationLayer};

/// `/ok` and `/fail`.
const VERIFY: Series = (Operation::Verify, Executor::Subprocess);
/// `/panic`.
const TOOL: Series = (Operation::Tool, Executor::Thread);
/// `/abandon/{id}`.
const JUDGE: Series = (Operation::Judge, Executor::Inline);
/// `/held`, on a limit of its own.
const HELD: Series = (Operation::Other, Executor::Process);

/// Answers 500 for a panic in the inner service's `call` or future, like tower-http's
/// `CatchPanicLayer`.
#[derive(Clone, Copy, Debug)]
struct CatchPanicLayer;

impl<S> Layer<S> for CatchPanicLayer {
    type Service = CatchPanic<S>;

    fn layer(&self, inner: S) -> CatchPanic<S> {
        CatchPanic(inner)
    }
}

#[derive(Clone, Debug)]
struct CatchPanic<S>(S);

impl<S, B> Service<Request<B>> for CatchPanic<S>
where
    S: Service<Request<B>, Response = Response>,
{
    type Response = Response;
    type Error = S::Error;
    type Future = CatchUnwind<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        CatchUnwind(
            catch_unwind(AssertUnwindSafe(|| self.0.call(request)))
                .ok()
                .map(Box::pin),
        )
    }
}

/// The inner future, or `None` once it panicked.
struct CatchUnwind<F>(Option<Pin<Box<F>>>);

impl<F, E> Future for CatchUnwind<F>
where
    F: Future<Output = Result<Response, E>>,
{
    type Output = Result<Response, E>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        if let Some(inner) = self.0.as_mut() {
            match catch_unwind(AssertUnwindSafe(|| inner.as_mut().poll(cx))) {
                Ok(poll) => return poll,
                Err(_) => self.0 = None,
            }
        }
        Poll::Ready(Ok(
            (StatusCode::INTERNAL_SERVER_ERROR, "panicked").into_response()
        ))
    }
}

/// What the handlers share with the test.
struct Signals {
    /// One sender per abandoned request, by id: its handler says it started.
    abandon_started: Mutex<HashMap<u64, oneshot::Sender<()>>>,
    /// The `/held` holder says it started.
    holder_started: Mutex<Option<oneshot::Sender<()>>>,
    /// Opens for the `/held` holder.
    gate: watch::Receiver<bool>,
}

async fn ok() -> &'static str {
    tokio::task::yield_now().await;
    "ok"
}

async fn fail() -> (StatusCode, &'static str) {
    (StatusCode::SERVICE_UNAVAILABLE, "fail")
}

async fn panics() -> &'static str {
    tokio::task::yield_now().await;
    panic!("{EXPECTED_PANIC}: handler")
}

/// Says it started, then never ends: only the client hanging up ends it.
async fn abandon(signals: Arc<Signals>, uri: Uri) -> &'static str {
    let id: u64 = uri.path().rsplit('/').next().unwrap().parse().unwrap();
    let started = signals.abandon_started.lock().unwrap().remove(&id);
    started.expect("unknown abandon id").send(()).unwrap();
    std::future::pending().await
}

/// Holds `/held`'s only permit until the gate opens.
async fn held(signals: Arc<Signals>) -> &'static str {
    let started = signals.holder_started.lock().unwrap().take();
    // A second handler here would mean a queued request got the permit it gave up.
    started.expect("a given-up request ran").send(()).unwrap();
    signals.gate.clone().wait_for(|open| *open).await.unwrap();
    "held"
}

fn series_layer(
    semaphore: &Arc<Semaphore>,
    (operation, executor): Series,
    telemetry: &Telemetry,
) -> ResourcesOperationLayer<HttpClassifier, Arc<Semaphore>, Http> {
    ResourcesOperationLayer::new_for_http(Arc::clone(semaphore))
        .operation(operation)
        .executor(executor)
        .metrics(telemetry.metrics.clone())
}

fn cancelled(telemetry: &Telemetry) -> u64 {
    telemetry.count(DURATION_INSTRUMENT, &[(OUTCOME_ATTRIBUTE, "cancelled")])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_thousand_requests_with_panics_and_hang_ups_are_recorded_as_the_clients_caused() {
    const CONNECTIONS: usize = 16;
    const REQUESTS_PER_CONNECTION: usize = 1250;
    const ABANDONERS: u64 = 2;
    const ABANDONS_PER_ABANDONER: u64 = 150;
    const GIVEN_UP_IN_QUEUE: usize = 40;

    quiet_expected_panics();
    let telemetry = Telemetry::new();
    let (gate_tx, gate_rx) = watch::channel(false);
    let (holder_tx, holder_rx) = oneshot::channel();
    let signals = Arc::new(Signals {
        abandon_started: Mutex::default(),
        holder_started: Mutex::new(Some(holder_tx)),
        gate: gate_rx,
    });

    let slots = Arc::new(Semaphore::new(4));
    let held_limit = Arc::new(Semaphore::new(1));
    let verify = series_layer(&slots, VERIFY, &telemetry);
    let router = Router::new()
        .route("/ok", get(ok).layer(verify.clone()))
        .route("/fail", get(fail).layer(verify))
        .route(
            "/panic",
            get(panics).layer(series_layer(&slots, TOOL, &telemetry)),
        )
        .route(
            "/abandon/{id}",
            get({
                let signals = Arc::clone(&signals);
                move |uri: Uri| abandon(signals, uri)
            })
            .layer(series_layer(&slots, JUDGE, &telemetry)),
        )
        .route(
            "/held",
            get({
                let signals = Arc::clone(&signals);
                move || held(signals)
            })
            .layer(series_layer(&held_limit, HELD, &telemetry)),
        )
        .layer(CatchPanicLayer);
    let addr = serve(router).await;

    // Keep-alive clients: mostly /ok, one in twenty /panic, one in twenty /fail.
    let clients: Vec<_> = (0..CONNECTIONS)
        .map(|c| {
            tokio::spawn(async move {
                let mut connection = Client::open(addr).await;
                let mut statuses: HashMap<u16, u64> = HashMap::new();
                for i in 0..REQUESTS_PER_CONNECTION {
                    let (path, expected) = match (i + c) % 20 {
                        0 => ("/panic", (500, "panicked")),
                        1 => ("/fail", (503, "fail")),
                        _ => ("/ok", (200, "ok")),
                    };
                    let (status, body) = connection.get(path).await;
                    assert_eq!((status, body.as_str()), expected, "{path}");
                    *statuses.entry(status).or_default() += 1;
                }
                connection.closed().await;
                statuses
            })
        })
        .collect();

    // Clients that drop their response once its handler has started (it never ends by itself),
    // on a connection of its own, which hyper then closes.
    let abandoners: Vec<_> = (0..ABANDONERS)
        .map(|a| {
            let signals = Arc::clone(&signals);
            tokio::spawn(async move {
                for i in 0..ABANDONS_PER_ABANDONER {
                    let id = a * ABANDONS_PER_ABANDONER + i;
                    let (started_tx, started_rx) = oneshot::channel();
                    signals
                        .abandon_started
                        .lock()
                        .unwrap()
                        .insert(id, started_tx);
                    let mut connection = Client::open(addr).await;
                    let response = connection
                        .send(get_request(&format!("/abandon/{id}")))
                        .await;
                    started_rx.await.unwrap();
                    drop(response);
                    connection.closed().await;
                }
            })
        })
        .collect();

    // Clients that drop their response while queued behind the holder of /held's only permit:
    // their wait is taken back, and each counts once as abandoned, with no queue or run sample.
    let holder = tokio::spawn(async move {
        let mut connection = Client::open(addr).await;
        let answer = connection.get("/held").await;
        connection.closed().await;
        answer
    });
    within("the /held holder starting", holder_rx)
        .await
        .unwrap();
    let mut queued = Vec::new();
    for _ in 0..GIVEN_UP_IN_QUEUE {
        let mut connection = Client::open(addr).await;
        let response = connection.send(get_request("/held")).await;
        queued.push((connection, response));
    }
    eventually("every /held request queued", || {
        live_count(&telemetry, QUEUED_INSTRUMENT, HELD) == GIVEN_UP_IN_QUEUE as i64
    })
    .await;
    for (connection, response) in queued {
        drop(response);
        connection.closed().await;
    }
    eventually("the given-up waits taken back", || {
        live_count(&telemetry, QUEUED_INSTRUMENT, HELD) == 0
    })
    .await;
    gate_tx.send(true).unwrap();
    let (status, body) = within("the /held holder", holder).await.unwrap();
    assert_eq!((status, body.as_str()), (200, "held"));

    let mut statuses: HashMap<u16, u64> = HashMap::new();
    for client in clients {
        let counts = within("a keep-alive client", client).await.unwrap();
        for (status, n) in counts {
            *statuses.entry(status).or_default() += n;
        }
    }
    for abandoner in abandoners {
        within("an abandoning client", abandoner).await.unwrap();
    }
    let abandoned = ABANDONERS * ABANDONS_PER_ABANDONER;
    assert_eq!(
        statuses.values().sum::<u64>(),
        (CONNECTIONS * REQUESTS_PER_CONNECTION) as u64
    );

    // hyper drops the handler of a closed connection when it next reads the socket.
    eventually("every hang-up recorded and nothing left active", || {
        cancelled(&telemetry) >= abandoned
            && [VERIFY, TOOL, JUDGE, HELD].iter().all(|series| {
                live_count(&telemetry, ACTIVE_INSTRUMENT, *series) == 0
                    && live_count(&telemetry, QUEUED_INSTRUMENT, *series) == 0
            })
    })
    .await;

    let mut expected = Books::default();
    for (series, outcome, n) in [
        (VERIFY, Outcome::Ok, statuses[&200]),
        (VERIFY, Outcome::Error, statuses[&503]),
        (TOOL, Outcome::Crashed, statuses[&500]),
        (JUDGE, Outcome::Cancelled, abandoned),
        (HELD, Outcome::Ok, 1),
    ] {
        for _ in 0..n {
            expected.ended(series, outcome);
        }
    }
    for _ in 0..GIVEN_UP_IN_QUEUE {
        expected.abandoned(HELD);
    }
    assert_books(&telemetry, &expected);
    assert_live_counts_zero(&telemetry);
    assert_eq!(slots.available_permits(), 4);
    assert_eq!(held_limit.available_permits(), 1);
    assert!(signals.abandon_started.lock().unwrap().is_empty());
}
