use std::convert::Infallible;
use std::future::{ready, Ready};
use std::task::{Context, Poll};
use tower::{Layer, Service, ServiceExt};
use tower_resources_operation::*;

#[derive(Clone, Copy)]
struct Noop;
impl Service<()> for Noop {
    type Response = ();
    type Error = Infallible;
    type Future = Ready<Result<(), Infallible>>;
    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }
    fn call(&mut self, _: ()) -> Self::Future {
        ready(Ok(()))
    }
}

#[inline(never)]
async fn reused<S: Service<()>>(mut s: S, n: u64)
where
    S::Error: std::fmt::Debug,
{
    for _ in 0..n {
        s.ready().await.unwrap().call(()).await.unwrap();
    }
}
#[inline(never)]
async fn oneshot<S: Service<()> + Clone>(s: S, n: u64)
where
    S::Error: std::fmt::Debug,
{
    for _ in 0..n {
        s.clone().oneshot(()).await.unwrap();
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let case = args[1].as_str();
    let n: u64 = args[2].parse().unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let tower = tower::limit::ConcurrencyLimitLayer::new(64).layer(Noop);
    let disabled = ResourcesOperationLayer::new(64)
        .metrics(OperationMetrics::disabled())
        .layer(Noop);
    rt.block_on(async {
        match case {
            "tower_reused" => reused(tower, n).await,
            "tower_oneshot" => oneshot(tower, n).await,
            "disabled_reused" => reused(disabled, n).await,
            "disabled_oneshot" => oneshot(disabled, n).await,
            _ => {}
        }
    });
}
