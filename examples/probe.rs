use std::convert::Infallible;
use std::future::{ready, Ready};
use std::task::{Context, Poll};
use std::time::Instant;
use tower::{Layer, Service, ServiceExt};
use tower_resources_operation::{OperationMetrics, ResourcesOperationLayer};

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
fn reused<S: Service<()>>(rt: &tokio::runtime::Runtime, s: &mut S, n: u64) -> f64
where
    S::Error: std::fmt::Debug,
{
    rt.block_on(async {
        let t = Instant::now();
        for _ in 0..n {
            s.ready().await.unwrap().call(()).await.unwrap();
        }
        t.elapsed().as_nanos() as f64 / n as f64
    })
}
#[inline(never)]
fn oneshot<S: Service<()> + Clone>(rt: &tokio::runtime::Runtime, s: &S, n: u64) -> f64
where
    S::Error: std::fmt::Debug,
{
    rt.block_on(async {
        let t = Instant::now();
        for _ in 0..n {
            s.clone().oneshot(()).await.unwrap();
        }
        t.elapsed().as_nanos() as f64 / n as f64
    })
}

fn main() {
    let mode = std::env::args().nth(1).unwrap_or_else(|| "both".into());
    if mode == "sizes" {
        sizes();
        return;
    }
    let n = 200_000;
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let mut tower = tower::limit::ConcurrencyLimit::new(Noop, 64);
    let mut ours = ResourcesOperationLayer::new(64)
        .metrics(OperationMetrics::disabled())
        .layer(Noop);
    if mode == "limit" {
        use tower_resources_operation::{Acquire, Limit};
        let limit = Limit::new(64);
        let sem = std::sync::Arc::new(tokio::sync::Semaphore::new(64));
        let mut rs = vec![];
        for _ in 0..31 {
            let t = Instant::now();
            for _ in 0..n {
                let p = sem.clone().try_acquire_owned().unwrap();
                std::hint::black_box(&p);
                drop(p);
            }
            let a = t.elapsed().as_nanos() as f64 / n as f64;
            let t = Instant::now();
            for _ in 0..n {
                let p = limit.try_acquire().unwrap().unwrap();
                std::hint::black_box(&p);
                drop(p);
            }
            let b = t.elapsed().as_nanos() as f64 / n as f64;
            rs.push((b / a, a, b));
        }
        rs.sort_by(|x, y| x.0.total_cmp(&y.0));
        println!(
            "limit/semaphore {:.3}x ({:.1} vs {:.1} ns)",
            rs[15].0, rs[15].1, rs[15].2
        );
        return;
    }
    if mode == "tower_reused" {
        for _ in 0..100 {
            reused(&rt, &mut tower, n);
        }
        return;
    }
    if mode == "ours_reused" {
        for _ in 0..100 {
            reused(&rt, &mut ours, n);
        }
        return;
    }
    if mode == "old_reused" {
        for _ in 0..100 {
            reused(&rt, &mut ours, n);
        }
        return;
    }
    if mode == "ours" {
        for _ in 0..50 {
            reused(&rt, &mut ours, n);
            oneshot(&rt, &ours, n);
        }
        return;
    }
    if mode == "tower" {
        for _ in 0..50 {
            reused(&rt, &mut tower, n);
            oneshot(&rt, &tower, n);
        }
        return;
    }
    let (mut r, mut o) = (vec![], vec![]);
    let (mut tr, mut to_) = (vec![], vec![]);
    for _ in 0..31 {
        let a = reused(&rt, &mut tower, n);
        let b = reused(&rt, &mut ours, n);
        r.push(b / a);
        tr.push(a);
        let a = oneshot(&rt, &tower, n);
        let b = oneshot(&rt, &ours, n);
        o.push(b / a);
        to_.push(a);
    }
    let med = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    println!(
        "reused  {:.3}x (tower {:.1} ns)   oneshot {:.3}x (tower {:.1} ns)",
        med(&mut r),
        med(&mut tr),
        med(&mut o),
        med(&mut to_)
    );
}

#[allow(dead_code)]
fn sizes() {
    use tower_resources_operation::ResourcesOperation;
    type Svc = ResourcesOperation<Noop>;
    type Fut = <Svc as Service<()>>::Future;
    type TFut = <tower::limit::ConcurrencyLimit<Noop> as Service<()>>::Future;
    println!(
        "service {} future {} | tower service {} future {} | oneshot ours {} tower {}",
        std::mem::size_of::<Svc>(),
        std::mem::size_of::<Fut>(),
        std::mem::size_of::<tower::limit::ConcurrencyLimit<Noop>>(),
        std::mem::size_of::<TFut>(),
        std::mem::size_of::<tower::util::Oneshot<Svc, ()>>(),
        std::mem::size_of::<tower::util::Oneshot<tower::limit::ConcurrencyLimit<Noop>, ()>>()
    );
}
