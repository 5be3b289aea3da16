//! Requests through a real axum server on 127.0.0.1, from 32 keep-alive HTTP/1 clients: the
//! throughput with this layer on the route, next to tower's global limit on the same route.
//!
//! ```text
//! cargo bench --bench end_to_end
//! ```
//!
//! Every case serves the same handler behind a limit of 8 that 32 clients share (so the limit
//! binds). The server runs on one thread and the clients on the other (a current-thread
//! runtime each: this machine has 2 cores, and a third thread would add its own noise). Each
//! round runs every case for a fixed time, in turn, and a case's figure is the median over the
//! rounds of its throughput divided by tower's in the same round: the machine's drift stays out
//! of the ratio. The standard error of that median says how small a difference the run can
//! show.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::routing::get;
use axum::Router;
use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use tokio::net::{TcpListener, TcpStream};
use tower::limit::GlobalConcurrencyLimitLayer;
use tower_resources_operation::{Executor, Operation, OperationMetrics, ResourcesOperationLayer};

mod common;

const CLIENTS: usize = 32;
const LIMIT: usize = 8;
const ROUNDS: usize = 60;
const PER_CASE: Duration = Duration::from_millis(150);

/// The work behind the limit: a yield, as an async handler that awaits something does.
async fn handler() -> &'static str {
    tokio::task::yield_now().await;
    "done"
}

/// Serves `app` on a free port of 127.0.0.1 until the runtime goes.
async fn serve(app: Router) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    address
}

/// Requests per second that `CLIENTS` keep-alive clients get from `address` in `PER_CASE`.
async fn load(address: SocketAddr) -> f64 {
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let clients: Vec<_> = (0..CLIENTS)
        .map(|_| {
            let (stop, done) = (Arc::clone(&stop), Arc::clone(&done));
            tokio::spawn(async move {
                let stream = TcpStream::connect(address).await.unwrap();
                stream.set_nodelay(true).unwrap();
                let (mut sender, connection) =
                    hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                        .await
                        .unwrap();
                tokio::spawn(connection);
                while !stop.load(Ordering::Relaxed) {
                    let request = http::Request::get("/verify")
                        .header("host", "127.0.0.1")
                        .body(Empty::<Bytes>::new())
                        .unwrap();
                    let response = sender.send_request(request).await.unwrap();
                    assert!(response.status().is_success());
                    response.into_body().collect().await.unwrap();
                    done.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    // Every connection is up before the clock starts.
    tokio::time::sleep(Duration::from_millis(20)).await;
    let before = done.load(Ordering::Relaxed);
    let started = Instant::now();
    tokio::time::sleep(PER_CASE).await;
    let served = done.load(Ordering::Relaxed) - before;
    let elapsed = started.elapsed();
    stop.store(true, Ordering::Relaxed);
    for client in clients {
        client.await.unwrap();
    }
    served as f64 / elapsed.as_secs_f64()
}

fn quartiles(values: &mut [f64]) -> [f64; 3] {
    values.sort_by(f64::total_cmp);
    let at = |quarter: usize| values[(values.len() - 1) * quarter / 4];
    [at(1), at(2), at(3)]
}

fn main() {
    if !std::env::args().any(|arg| arg == "--bench") {
        return;
    }
    let server = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let clients = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (_provider, meter) = common::sdk_meter();
    let metrics = OperationMetrics::new(&meter);
    let route = |layer| Router::new().route("/verify", get(handler).layer(layer));

    let cases: Vec<(&str, SocketAddr)> = server.block_on(async {
        let tower = Router::new().route(
            "/verify",
            get(handler).layer(GlobalConcurrencyLimitLayer::new(LIMIT)),
        );
        let ours = |metrics: OperationMetrics| {
            ResourcesOperationLayer::new_for_http(LIMIT)
                .operation(Operation::Verify)
                .executor(Executor::Inline)
                .metrics(metrics)
        };
        vec![
            ("tower_global_limit", serve(tower).await),
            (
                "layer_disabled",
                serve(route(ours(OperationMetrics::disabled()))).await,
            ),
            ("layer_metrics", serve(route(ours(metrics.clone()))).await),
        ]
    });

    // One round to warm the connections' paths up, not counted.
    for (_, address) in &cases {
        clients.block_on(load(*address));
    }
    let mut throughput = vec![Vec::new(); cases.len()];
    for _ in 0..ROUNDS {
        for (case, (_, address)) in cases.iter().enumerate() {
            throughput[case].push(clients.block_on(load(*address)));
        }
    }
    println!(
        "\n{CLIENTS} keep-alive clients, a limit of {LIMIT}, axum on 127.0.0.1; {ROUNDS} interleaved rounds of {} ms per case",
        PER_CASE.as_millis()
    );
    for (case, (name, _)) in cases.iter().enumerate() {
        let median = quartiles(&mut throughput[case].clone())[1];
        let mut ratios: Vec<f64> = (0..ROUNDS)
            .map(|round| throughput[case][round] / throughput[0][round])
            .collect();
        let [low, mid, high] = quartiles(&mut ratios);
        let mean = ratios.iter().sum::<f64>() / ratios.len() as f64;
        let deviation = (ratios.iter().map(|r| (r - mean).powi(2)).sum::<f64>()
            / (ratios.len() - 1) as f64)
            .sqrt();
        // The standard error of a median, from that of a mean (for a normal spread).
        let error = 1.2533 * deviation / (ratios.len() as f64).sqrt();
        println!(
            "  {name:<20} {median:>9.0} requests/s   {mid:.3}x tower's ± {error:.3} (quartiles {low:.3} to {high:.3})"
        );
    }
    drop(server);
}
