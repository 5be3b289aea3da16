//! A limit of your own, written only on the crate's public seams, reports and adapts exactly as
//! the crate's `Limit` does: its name, capacity and live counts through `Capacity::of_limit`,
//! each operation's end through `Acquire::ended`, and an adaptive controller through
//! `Adaptive::controller`.

mod support;

use std::convert::Infallible;
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use support::Telemetry;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tower::{service_fn, Layer as _, ServiceExt as _};
use tower_resources_operation::adaptive::{Adaptive, Algorithm, Controller, Sample};
use tower_resources_operation::classify::DefaultClassifier;
use tower_resources_operation::limit::{Capacity, Ended, Reading};
use tower_resources_operation::names::{
    ACTIVE_INSTRUMENT, LIMIT_ACTIVE_INSTRUMENT, LIMIT_ATTRIBUTE, LIMIT_CAPACITY_INSTRUMENT,
    LIMIT_INSTRUMENT, LIMIT_QUEUED_INSTRUMENT, OPERATION_ATTRIBUTE,
};
use tower_resources_operation::{
    Acquire, Executor, Limit, Operation, Outcome, Rejected, ResourcesOperationLayer,
};

/// A pool of places on tokio's semaphore, with counts of its own, that can be resized: what a
/// third party would write, on the public API only.
#[derive(Clone)]
struct Pool {
    state: Arc<PoolState>,
}

struct PoolState {
    places: Arc<Semaphore>,
    capacity: AtomicUsize,
    held: AtomicUsize,
    queued: AtomicUsize,
    /// Places taken out of circulation by a resize down, given back by a resize up.
    parked: Mutex<Vec<OwnedSemaphorePermit>>,
    gauge: Capacity,
    control: Option<Controller>,
    /// What the limit heard, for the test.
    heard: Mutex<Vec<Outcome>>,
}

impl Pool {
    fn new(name: &'static str, capacity: usize, adaptive: Option<&Adaptive>) -> Self {
        let state = Arc::new_cyclic(|me: &Weak<PoolState>| {
            let read = {
                let me = me.clone();
                move || {
                    let state = me.upgrade()?;
                    Some(Reading::new(
                        state.capacity.load(SeqCst),
                        state.held.load(SeqCst),
                        state.queued.load(SeqCst),
                    ))
                }
            };
            let control = adaptive.map(|adaptive| {
                let me = me.clone();
                adaptive.controller(capacity, move |capacity| {
                    if let Some(state) = me.upgrade() {
                        state.resize(capacity);
                    }
                })
            });
            PoolState {
                places: Arc::new(Semaphore::new(capacity)),
                capacity: AtomicUsize::new(capacity),
                held: AtomicUsize::new(0),
                queued: AtomicUsize::new(0),
                parked: Mutex::new(Vec::new()),
                gauge: Capacity::of_limit(Some(name), read).unwrap(),
                control,
                heard: Mutex::new(Vec::new()),
            }
        });
        Self { state }
    }
}

impl PoolState {
    fn resize(&self, capacity: usize) {
        let mut parked = self.parked.lock().unwrap();
        let old = self.capacity.swap(capacity, SeqCst);
        if capacity > old {
            for _ in old..capacity {
                match parked.pop() {
                    Some(permit) => drop(permit),
                    None => self.places.add_permits(1),
                }
            }
        } else {
            for _ in capacity..old {
                if let Ok(permit) = Arc::clone(&self.places).try_acquire_owned() {
                    parked.push(permit);
                }
            }
        }
    }
}

/// A place of the pool.
struct PoolPermit {
    _place: OwnedSemaphorePermit,
    state: Arc<PoolState>,
}

impl Drop for PoolPermit {
    fn drop(&mut self) {
        self.state.held.fetch_sub(1, SeqCst);
    }
}

impl Acquire for Pool {
    type Permit = PoolPermit;

    fn acquire(&self) -> impl Future<Output = Result<PoolPermit, Rejected>> + Send {
        let state = Arc::clone(&self.state);
        async move {
            state.queued.fetch_add(1, SeqCst);
            let place = Arc::clone(&state.places).acquire_owned().await;
            state.queued.fetch_sub(1, SeqCst);
            let place = place.map_err(|_| Rejected::closed())?;
            state.held.fetch_add(1, SeqCst);
            Ok(PoolPermit {
                _place: place,
                state,
            })
        }
    }

    fn capacity(&self) -> Option<Capacity> {
        Some(self.state.gauge.clone())
    }

    fn hears_ends(&self) -> bool {
        true
    }

    fn ended(permit: &PoolPermit, ended: &Ended) {
        let state = &permit.state;
        state.heard.lock().unwrap().push(ended.outcome());
        if let Some(control) = &state.control {
            control.ended(ended, state.held.load(SeqCst));
        }
    }
}

fn named(telemetry: &Telemetry, instrument: &str, name: &str) -> i64 {
    telemetry.live_value(instrument, &[(LIMIT_ATTRIBUTE, name)])
}

#[tokio::test]
async fn a_limit_of_your_own_reports_its_name_capacity_and_live_counts_like_the_crates() {
    let telemetry = Telemetry::new();
    let pool = Pool::new("pool", 2, None);
    let limit = Limit::builder(2).name("builtin").build();
    fn layer<L: Acquire + Clone>(
        limit: L,
        telemetry: &Telemetry,
    ) -> ResourcesOperationLayer<DefaultClassifier, L> {
        ResourcesOperationLayer::new(limit)
            .operation(Operation::Judge)
            .executor(Executor::Inline)
            .metrics(telemetry.metrics.clone())
    }
    let (release, held) = tokio::sync::watch::channel(false);
    let work = move |_: ()| {
        let mut held = held.clone();
        async move {
            let _ = held.wait_for(|go| *go).await;
            Ok::<_, Infallible>(())
        }
    };
    let own = layer(pool.clone(), &telemetry).layer(service_fn(work.clone()));
    let builtin = layer(limit.clone(), &telemetry).layer(service_fn(work));

    // Three on each limit of two: two run, one waits, on both.
    let mut tasks = Vec::new();
    for _ in 0..3 {
        tasks.push(tokio::spawn(own.clone().oneshot(())));
        tasks.push(tokio::spawn(builtin.clone().oneshot(())));
    }
    support::eventually("both limits full, one waiting on each", || {
        pool.state.queued.load(SeqCst) == 1 && limit.queued() == 1
    })
    .await;
    for name in ["pool", "builtin"] {
        assert_eq!(
            named(&telemetry, LIMIT_CAPACITY_INSTRUMENT, name),
            2,
            "{name}"
        );
        assert_eq!(
            named(&telemetry, LIMIT_ACTIVE_INSTRUMENT, name),
            2,
            "{name}"
        );
        assert_eq!(
            named(&telemetry, LIMIT_QUEUED_INSTRUMENT, name),
            1,
            "{name}"
        );
    }
    // Both limits serve the one series: its limit is the sum, its active count both.
    let judge = [(OPERATION_ATTRIBUTE, "judge")];
    assert_eq!(telemetry.live_value(LIMIT_INSTRUMENT, &judge), 4);
    assert_eq!(telemetry.live_value(ACTIVE_INSTRUMENT, &judge), 4);

    release.send(true).unwrap();
    for task in tasks {
        task.await.unwrap().unwrap();
    }
    for name in ["pool", "builtin"] {
        assert_eq!(
            named(&telemetry, LIMIT_ACTIVE_INSTRUMENT, name),
            0,
            "{name}"
        );
        assert_eq!(
            named(&telemetry, LIMIT_QUEUED_INSTRUMENT, name),
            0,
            "{name}"
        );
    }
    // The limit heard each of its operations end, before its place went back.
    assert_eq!(*pool.state.heard.lock().unwrap(), vec![Outcome::Ok; 3]);
}

/// One more while nothing fails, one less at the first failure: easy to follow.
#[derive(Clone)]
struct Steps;

impl Algorithm for Steps {
    fn update(&mut self, sample: &Sample) -> usize {
        if sample.congested > 0 {
            sample.capacity - 1
        } else {
            sample.capacity + 1
        }
    }
}

#[tokio::test]
async fn a_limit_of_your_own_is_adapted_by_the_crates_controller_with_metrics_off() {
    let adaptive = Adaptive::new(Steps, 1..=8).window(1, Duration::from_secs(3600));
    let pool = Pool::new("adapted", 2, Some(&adaptive));
    let service = ResourcesOperationLayer::new(pool.clone())
        .metrics(tower_resources_operation::OperationMetrics::disabled())
        .layer(service_fn(|fail: bool| async move {
            match fail {
                false => Ok(()),
                true => Err("the backend is overloaded"),
            }
        }));
    // A window of a capacity of 2 closes after 4 ends (twice the capacity): one step up.
    for _ in 0..3 {
        service.clone().oneshot(false).await.unwrap();
    }
    assert_eq!(pool.state.capacity.load(SeqCst), 2);
    service.clone().oneshot(false).await.unwrap();
    assert_eq!(pool.state.capacity.load(SeqCst), 3);
    // A failure closes the window at once: one step down.
    assert!(service.clone().oneshot(true).await.is_err());
    assert_eq!(pool.state.capacity.load(SeqCst), 2);
    let mut heard = vec![Outcome::Ok; 4];
    heard.push(Outcome::Error);
    assert_eq!(*pool.state.heard.lock().unwrap(), heard);
}
