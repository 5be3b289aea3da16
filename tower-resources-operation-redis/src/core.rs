//! What a limit's handles, permits and background task share: its settings, its Redis names,
//! its books, and the fleet's operations, each one script call: ask for a place, give places
//! back, refresh this process's leases and tickets, set the capacity, read the fleet's state.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis::{FromRedisValue, Script, ScriptInvocation};
use tokio::sync::OnceCell;
use tower_resources_operation::limit::Reading;

use crate::error::Error;
use crate::fleet_control::{decide_arguments, tick_arguments, Counts, FleetControl, Known, Ticked};
use crate::health::{warn, Health};
use crate::keeper::Doorbell;
use crate::limit::Fleet;
use crate::scripts::{Asked, HOLDS, SCRIPTS, TAKEN_BACK, WAITS};
use crate::transport::Transport;
use crate::waiters::{lock, Local, Slot, GRANTED, POLL};

/// One limit in one process.
pub(crate) struct Core {
    pub(crate) name: &'static str,
    pub(crate) keys: Keys,
    pub(crate) transport: Transport,
    pub(crate) health: Health,
    /// How the handles hurry the background task.
    pub(crate) keeper: Doorbell,
    /// The capacity this process was built with.
    pub(crate) configured: usize,
    /// Whether the first call makes `configured` the fleet's capacity.
    pub(crate) overwrite: bool,
    overwritten: OnceCell<()>,
    /// Whether the first capacity read from Redis was compared with `configured`.
    capacity_checked: AtomicBool,
    pub(crate) max_queued: Option<usize>,
    pub(crate) fail_open: bool,
    pub(crate) lease_ttl: Duration,
    pub(crate) call_timeout: Duration,
    pub(crate) fallback_poll: Duration,
    pub(crate) local: Mutex<Local>,
    /// The fleet's capacity, as last read.
    pub(crate) capacity: AtomicUsize,
    /// This process's leases held by permits, and its waiters with a ticket.
    pub(crate) active: AtomicUsize,
    pub(crate) queued: AtomicUsize,
    pub(crate) failed_open: AtomicU64,
    pub(crate) leases_lost: AtomicU64,
    /// The controller, for an adaptive limit.
    pub(crate) adaptive: Option<FleetControl>,
}

/// The Redis names of one limit: one hash slot, `{prefix:name}:...`.
#[derive(Debug)]
pub(crate) struct Keys {
    capacity: String,
    holders: String,
    queue: String,
    waiting: String,
    arrivals: String,
    adaptive: String,
    window: String,
    leader: String,
    pub(crate) channel: String,
}

impl Keys {
    pub(crate) fn new(prefix: &str, name: &str) -> Self {
        let slot = format!("{{{prefix}:{name}}}");
        Self {
            capacity: format!("{slot}:capacity"),
            holders: format!("{slot}:holders"),
            queue: format!("{slot}:queue"),
            waiting: format!("{slot}:waiting"),
            arrivals: format!("{slot}:arrivals"),
            adaptive: format!("{slot}:adaptive"),
            window: format!("{slot}:window"),
            leader: format!("{slot}:leader"),
            channel: format!("{slot}:wake"),
        }
    }
}

/// What [`Core::new`] is made of: the builder's settings.
pub(crate) struct Settings {
    pub(crate) name: &'static str,
    pub(crate) keys: Keys,
    pub(crate) transport: Transport,
    pub(crate) capacity: usize,
    pub(crate) overwrite: bool,
    pub(crate) max_queued: Option<usize>,
    pub(crate) fail_open: bool,
    pub(crate) lease_ttl: Duration,
    pub(crate) call_timeout: Duration,
    pub(crate) fallback_poll: Duration,
    pub(crate) adaptive: Option<FleetControl>,
}

impl Core {
    pub(crate) fn new(settings: Settings) -> Self {
        Self {
            name: settings.name,
            keys: settings.keys,
            transport: settings.transport,
            health: Health::new(settings.name, settings.fail_open, settings.fallback_poll),
            keeper: Doorbell::default(),
            configured: settings.capacity,
            overwrite: settings.overwrite,
            overwritten: OnceCell::new(),
            capacity_checked: AtomicBool::new(false),
            max_queued: settings.max_queued,
            fail_open: settings.fail_open,
            lease_ttl: settings.lease_ttl,
            call_timeout: settings.call_timeout,
            fallback_poll: settings.fallback_poll,
            local: Mutex::default(),
            capacity: AtomicUsize::new(settings.capacity),
            active: AtomicUsize::new(0),
            queued: AtomicUsize::new(0),
            failed_open: AtomicU64::new(0),
            leases_lost: AtomicU64::new(0),
            adaptive: settings.adaptive,
        }
    }

    /// What the metrics report of this limit in this process.
    pub(crate) fn reading(&self) -> Reading {
        let (baseline, estimate) = self
            .adaptive
            .as_ref()
            .map(FleetControl::measured)
            .unwrap_or_default();
        Reading::new(
            self.capacity.load(Ordering::Relaxed),
            self.active.load(Ordering::Relaxed),
            self.queued.load(Ordering::Relaxed),
        )
        .with_run_times(baseline, estimate)
    }

    /// `script` with the limit's keys and common arguments; the caller adds its own.
    fn invocation<'a>(&self, script: &'a Script) -> ScriptInvocation<'a> {
        let keys = &self.keys;
        let mut invocation = script.prepare_invoke();
        invocation
            .key(&keys.capacity)
            .key(&keys.holders)
            .key(&keys.queue)
            .key(&keys.waiting)
            .key(&keys.arrivals)
            .arg(&keys.channel)
            .arg(u64::try_from(self.lease_ttl.as_millis()).unwrap_or(u64::MAX))
            .arg(self.configured);
        invocation
    }

    /// Runs `invocation`, noting whether Redis answered; first, once, makes the configured
    /// capacity the fleet's if the limit was built to.
    ///
    /// Boxed, as every future that holds the `redis` crate's is here at some level: held
    /// inline, they nest deep enough to pass the compiler's layout depth limit in a caller's
    /// `async` block (one allocation per round trip to Redis costs nothing next to it).
    fn call<'a, T: FromRedisValue + Send + 'a>(
        &'a self,
        invocation: &'a ScriptInvocation<'_>,
    ) -> Pin<Box<dyn Future<Output = Result<T, Error>> + Send + 'a>> {
        Box::pin(async move {
            if self.overwrite && !self.overwritten.initialized() {
                self.overwritten
                    .get_or_try_init(|| async {
                        let capacity = self.configured;
                        self.store_capacity(capacity).await.map(drop)
                    })
                    .await?;
            }
            self.call_now(invocation).await
        })
    }

    /// Runs `invocation`, noting whether Redis answered.
    async fn call_now<T: FromRedisValue + Send>(
        &self,
        invocation: &ScriptInvocation<'_>,
    ) -> Result<T, Error> {
        let result = self.transport.invoke(invocation).await;
        self.note(result.as_ref().err());
        result
    }

    /// Notes whether Redis answered. At the start of an outage every waiter asks again (and is
    /// answered at once) and the background task asks Redis at once; at its end every waiter
    /// asks again (a wake-up may have been lost meanwhile).
    pub(crate) fn note(&self, error: Option<&Error>) {
        let changed = match error {
            Some(error) => {
                let started = self.health.failed(error);
                if started {
                    self.keeper.probe();
                }
                started
            }
            None => self.health.reached(),
        };
        if changed {
            self.poll_all();
        }
    }

    /// Connects and subscribes, if that is not done yet.
    pub(crate) async fn connect(&self) -> Result<(), Error> {
        let result = self.transport.connect().await;
        self.note(result.as_ref().err());
        result
    }

    /// Asks for a place for `id`: a lease, a ticket, or the queue is full. While Redis is down,
    /// the failure that started the outage, at once.
    pub(crate) async fn ask(&self, id: &str) -> Result<Asked, Error> {
        if let Some(answer) = self.health.answer() {
            return Err(answer);
        }
        let mut invocation = self.invocation(&SCRIPTS.acquire);
        let max_queued = self
            .max_queued
            .map_or(-1, |bound| i64::try_from(bound).unwrap_or(i64::MAX));
        invocation.arg(id).arg(max_queued);
        let (status, capacity): (i64, usize) = self.call(&invocation).await?;
        self.read_capacity(capacity);
        Ok(Asked::from_status(status))
    }

    /// Gives back the leases and tickets `ids`.
    pub(crate) async fn release(&self, ids: &[String]) -> Result<(), Error> {
        let mut invocation = self.invocation(&SCRIPTS.release);
        invocation.arg(ids);
        let capacity: usize = self.call(&invocation).await?;
        self.read_capacity(capacity);
        Ok(())
    }

    /// Sets the fleet's capacity.
    pub(crate) async fn set_capacity(&self, capacity: usize) -> Result<usize, Error> {
        // What the caller sets is the fleet's from now on: neither compared nor overwritten.
        self.capacity_checked.store(true, Ordering::Relaxed);
        let _ = self.overwritten.set(());
        self.store_capacity(capacity).await
    }

    async fn store_capacity(&self, capacity: usize) -> Result<usize, Error> {
        self.capacity_checked.store(true, Ordering::Relaxed);
        let mut invocation = self.invocation(&SCRIPTS.set_capacity);
        invocation.arg(capacity);
        let capacity: usize = self.call_now(&invocation).await?;
        self.capacity.store(capacity, Ordering::Relaxed);
        Ok(capacity)
    }

    /// An adaptive limit's `script`: the common keys and arguments, and the adaptive keys.
    fn fleet_invocation<'a>(&self, script: &'a Script) -> ScriptInvocation<'a> {
        let mut invocation = self.invocation(script);
        invocation
            .key(&self.keys.adaptive)
            .key(&self.keys.window)
            .key(&self.keys.leader);
        invocation
    }

    /// An adaptive limit's tick: this process's `counts` of window `seen` into the fleet's
    /// window, the leader's lease kept or taken, and the window taken if this process leads
    /// and it is due. Not noted in the limit's health: the controller's calls never change
    /// what a request gets.
    pub(crate) async fn fleet_tick(
        &self,
        control: &FleetControl,
        seen: u64,
        counts: Counts,
    ) -> Result<Ticked, Error> {
        let mut invocation = self.fleet_invocation(&SCRIPTS.fleet_tick);
        invocation.arg(tick_arguments(control, seen, counts));
        let fields: Vec<String> = self.transport.invoke(&invocation).await?;
        let ticked = Ticked::parse(&fields).ok_or_else(|| {
            Error::unexpected(self.name, self.transport.address(), "a malformed tick")
        })?;
        self.capacity.store(ticked.capacity, Ordering::Relaxed);
        Ok(ticked)
    }

    /// The leader's decision: the fleet's capacity from now on, and what its algorithm
    /// measured. Dropped by Redis if this process no longer leads: then `Ok(false)`.
    pub(crate) async fn fleet_decide(
        &self,
        control: &FleetControl,
        next: usize,
        known: &Known,
    ) -> Result<bool, Error> {
        let mut invocation = self.fleet_invocation(&SCRIPTS.fleet_decide);
        invocation.arg(decide_arguments(control, next, known));
        let capacity: i64 = self.transport.invoke(&invocation).await?;
        // A negative answer: another process leads now.
        let Ok(capacity) = usize::try_from(capacity) else {
            return Ok(false);
        };
        self.capacity.store(capacity, Ordering::Relaxed);
        control.learn(known);
        Ok(true)
    }

    /// The fleet's capacity, leases and tickets.
    pub(crate) async fn state(&self) -> Result<Fleet, Error> {
        let invocation = self.invocation(&SCRIPTS.state);
        let (capacity, active, queued): (usize, usize, usize) = self.call(&invocation).await?;
        self.read_capacity(capacity);
        Ok(Fleet {
            capacity,
            active,
            queued,
        })
    }

    /// The fleet's capacity, as a call returned it. The first one read is compared with the
    /// configured one: a difference is said once (the fleet's is kept).
    fn read_capacity(&self, capacity: usize) {
        self.capacity.store(capacity, Ordering::Relaxed);
        if self.capacity_checked.swap(true, Ordering::Relaxed) || capacity == self.configured {
            return;
        }
        warn(
            self.name,
            &format!(
                "tower-resources-operation-redis: the fleet limit {:?} was built with a capacity \
                 of {}, but the fleet's capacity stored in Redis at {} is {capacity}: it keeps \
                 the fleet's ({capacity}). The first process to reach Redis stores its capacity, \
                 and `set_capacity` changes it for the whole fleet; build with \
                 `overwrite_capacity()` to make {} the fleet's at this process's first call.",
                self.name,
                self.configured,
                self.transport.address(),
                self.configured,
            ),
        );
    }

    /// Extends this process's leases and tickets, in one call, and acts on what became of them:
    /// a lost lease is counted (and taken back if its place was free), a waiter whose place was
    /// handed over without its wake-up reaching it is admitted, one whose ticket is gone asks
    /// again. If Redis cannot be reached, every waiter asks again, to get the configured answer.
    ///
    /// While Redis is down it is also the background task's probe: with nothing to refresh it
    /// reads the fleet's state instead, so that the first answer ends the outage.
    pub(crate) async fn refresh(&self) {
        let (held, waiting): (Vec<String>, Vec<(String, Arc<Slot>)>) = {
            let local = lock(&self.local);
            (
                local.held.iter().cloned().collect(),
                local
                    .waiting
                    .iter()
                    .filter(|(_, slot)| slot.queued.load(Ordering::Relaxed))
                    .map(|(id, slot)| (id.clone(), Arc::clone(slot)))
                    .collect(),
            )
        };
        if held.is_empty() && waiting.is_empty() {
            if self.health.is_down() {
                let _ = self.state().await;
            }
            return;
        }
        let mut invocation = self.invocation(&SCRIPTS.refresh);
        invocation
            .arg(held.len())
            .arg(&held)
            .arg(waiting.iter().map(|(id, _)| id).collect::<Vec<_>>());
        let statuses: Vec<i64> = match self.call(&invocation).await {
            Ok(statuses) => statuses,
            Err(_) => {
                for (_, slot) in &waiting {
                    slot.tell(POLL);
                }
                return;
            }
        };
        let Some((&capacity, statuses)) = statuses.split_first() else {
            return;
        };
        self.read_capacity(usize::try_from(capacity).unwrap_or(0));
        let (of_held, of_waiting) = statuses.split_at(held.len().min(statuses.len()));
        for (id, &status) in held.iter().zip(of_held) {
            match status {
                HOLDS => {}
                TAKEN_BACK => {
                    self.leases_lost.fetch_add(1, Ordering::Relaxed);
                }
                _ => {
                    // Lost, and its place may be someone else's now: no longer extended.
                    self.leases_lost.fetch_add(1, Ordering::Relaxed);
                    lock(&self.local).held.remove(id);
                }
            }
        }
        for ((_, slot), &status) in waiting.iter().zip(of_waiting) {
            match status {
                HOLDS => slot.tell(GRANTED),
                WAITS => {}
                // Gone: it joins the queue again.
                _ => slot.tell(POLL),
            }
        }
    }

    /// How long the background task waits between refreshes: a third of the TTL, or the
    /// fallback poll while something waits, Redis is down, or a release is to be retried.
    pub(crate) fn every(&self, urgent: bool) -> Duration {
        if urgent || self.health.is_down() || self.queued.load(Ordering::Relaxed) > 0 {
            self.fallback_poll
        } else {
            self.lease_ttl / 3
        }
    }

    /// What was published on the limit's channel: places handed to waiters, or a new capacity.
    pub(crate) fn heard(&self, message: &str) {
        if let Some(ids) = message.strip_prefix("g ") {
            let local = lock(&self.local);
            for id in ids.split(' ') {
                if let Some(slot) = local.waiting.get(id) {
                    slot.tell(GRANTED);
                }
            }
        } else if let Some(capacity) = message.strip_prefix("c ") {
            if let Ok(capacity) = capacity.parse() {
                self.capacity.store(capacity, Ordering::Relaxed);
            }
        } else if let Some(control) = &self.adaptive {
            if let Some(decision) = message.strip_prefix("a ") {
                control.heard(decision);
            } else if message == "d" && control.leads() {
                control.doorbell.notify_one();
            }
        }
    }

    /// Every waiter asks again (the connection dropped or came back, Redis went away: wake-ups
    /// may be lost, or the answer is due now).
    pub(crate) fn poll_all(&self) {
        for slot in lock(&self.local).waiting.values() {
            slot.tell(POLL);
        }
    }
}
