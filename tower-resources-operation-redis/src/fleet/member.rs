//! [`Member`]: one process's part in a fleet limit: its settings, its store, its books, its
//! health, what it knows of the fleet (capacity, replicas), and each step it takes on the store
//! with what that step changes here. [`Handle`]: what the limit's handles, waiters and places
//! share, which the background task outlives by nothing.

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::mpsc::UnboundedSender;
use tokio::sync::{Notify, OnceCell};
use tokio::time::Instant;
use tower_resources_operation::limit::{Capacity, Reading, Scope};

use super::books::{is_own, lock, process_token, Books, Slot, ASK, GRANTED};
use super::control::FleetControl;
use super::doorbell::Doorbell;
use super::health::{Change, Health};
use super::store::{Answer, Event, Refresh, State, Status, Store};
use crate::error::Error;
use crate::log::{inform, warn};

/// What a fleet limit answers while its store cannot be reached.
///
/// A fleet limit that protects a shared resource should neither stop the fleet (every caller
/// turned away) nor lift the limit (every caller admitted) while the store it is kept in is
/// away. Google's Doorman hands each client a safe capacity to fall back on; a fleet limit
/// works its own out: its share of the fleet's last capacity.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Unreachable {
    /// Each replica admits up to its share of the fleet's last capacity, that capacity divided
    /// by the replicas alive when it last reached the store (rounded down, and at least 1), and
    /// queues the rest locally; so the fleet runs at most that capacity meanwhile, once the
    /// operations admitted before the outage have ended. A replica that never reached the store
    /// has no share: it turns operations away, as `Closed` does. The default.
    #[default]
    Share,
    /// Turns every operation away as `unavailable` (HTTP `503`, gRPC `UNAVAILABLE`).
    Closed,
    /// Admits every operation without the fleet limit, counted in
    /// `gym.resources.limit.failed_open`.
    Open,
}

/// What a member is made with: the builder's settings, as checked.
pub(crate) struct Settings {
    pub(crate) name: Arc<str>,
    /// The capacity this process was built with.
    pub(crate) capacity: usize,
    /// Whether the first call makes `capacity` the fleet's.
    pub(crate) overwrite: bool,
    pub(crate) max_queued: Option<usize>,
    pub(crate) unreachable: Unreachable,
    pub(crate) lease_ttl: Duration,
    pub(crate) call_timeout: Duration,
    pub(crate) fallback_poll: Duration,
    pub(crate) claim_timeout: Duration,
}

/// One process's part in one fleet limit.
pub(crate) struct Member<S> {
    pub(crate) settings: Settings,
    pub(crate) store: S,
    pub(crate) health: Health,
    /// How the handles and the listener hurry the refresh loop.
    pub(crate) doorbell: Doorbell,
    overwritten: OnceCell<()>,
    /// Whether the first capacity read from the store was compared with `configured`.
    capacity_checked: AtomicBool,
    /// Held while a first reading is compared and said.
    saying: Mutex<()>,
    /// Whether a fixed replica in an adaptive fleet was said.
    control_checked: AtomicBool,
    pub(crate) books: Mutex<Books>,
    /// The fleet's capacity, as last read.
    pub(crate) capacity: AtomicUsize,
    /// The processes alive in the fleet, as last read (0: the store was never reached).
    pub(crate) replicas: AtomicUsize,
    /// This process's places (leases, and places on its share), and its waiters.
    pub(crate) active: AtomicUsize,
    pub(crate) queued: AtomicUsize,
    pub(crate) failed_open: AtomicU64,
    pub(crate) leases_lost: AtomicU64,
    /// Serialises admissions on the share, and wakes its waiters as places end.
    share_lock: Mutex<()>,
    /// After the store answers again, this process admits nothing new until then (ns since
    /// `origin`; 0 for not), half a fallback poll: every other replica reaches the store by
    /// then too (each probes every quarter of a fallback poll while it is down), and so has
    /// told it of the places it admitted on its share, and stopped admitting on it. Only then
    /// is the store's count of places the fleet's.
    settling: AtomicU64,
    origin: Instant,
    pub(crate) share_freed: Notify,
    /// The controller, for an adaptive limit.
    pub(crate) control: Option<FleetControl>,
}

impl<S: Store> Member<S> {
    pub(crate) fn new(store: S, settings: Settings, control: Option<FleetControl>) -> Self {
        Self {
            capacity: AtomicUsize::new(settings.capacity),
            settings,
            store,
            health: Health::new(),
            doorbell: Doorbell::default(),
            overwritten: OnceCell::new(),
            capacity_checked: AtomicBool::new(false),
            saying: Mutex::new(()),
            control_checked: AtomicBool::new(false),
            books: Mutex::default(),
            replicas: AtomicUsize::new(0),
            active: AtomicUsize::new(0),
            queued: AtomicUsize::new(0),
            failed_open: AtomicU64::new(0),
            leases_lost: AtomicU64::new(0),
            share_lock: Mutex::new(()),
            share_freed: Notify::new(),
            settling: AtomicU64::new(0),
            origin: Instant::now(),
            control,
        }
    }

    /// What the metrics report of this limit in this process: the fleet's capacity, or while
    /// it runs on its share, that share.
    pub(crate) fn reading(&self) -> Reading {
        let (baseline, estimate) = self
            .control
            .as_ref()
            .map(FleetControl::measured)
            .unwrap_or_default();
        let (capacity, scope) = match self.running_on_share() {
            Some(share) => (share, Scope::Share),
            None => (self.capacity.load(Ordering::Relaxed), Scope::Fleet),
        };
        Reading::new(
            capacity,
            self.active.load(Ordering::Relaxed),
            self.queued.load(Ordering::Relaxed),
        )
        .with_run_times(baseline, estimate)
        .with_scope(scope)
    }

    /// This process's share of the fleet's last capacity, if it knows one: that capacity over
    /// the replicas alive, rounded down, and at least 1.
    pub(crate) fn share(&self) -> Option<usize> {
        let replicas = self.replicas.load(Ordering::Relaxed);
        (replicas > 0).then(|| (self.capacity.load(Ordering::Relaxed) / replicas).max(1))
    }

    /// The share it runs on now, if it does: the store is out of reach (or answers again, and
    /// the fleet is settling), and it knows one.
    pub(crate) fn running_on_share(&self) -> Option<usize> {
        match self.settings.unreachable {
            Unreachable::Share if self.health.is_down() || self.is_settling() => self.share(),
            _ => None,
        }
    }

    /// Whether the store answers again but the fleet has not all told it of its places yet.
    pub(crate) fn is_settling(&self) -> bool {
        self.settling.load(Ordering::Acquire) != 0
    }

    /// When the fleet has settled, if it is settling.
    pub(crate) fn settled_at(&self) -> Option<Instant> {
        match self.settling.load(Ordering::Acquire) {
            0 => None,
            ns => Some(self.origin + Duration::from_nanos(ns)),
        }
    }

    /// After a refresh: once the fleet has settled, back on the fleet limit, and every waiter
    /// on the share asks the store.
    pub(crate) fn settle(&self) {
        if self.settled_at().is_some_and(|at| Instant::now() >= at)
            && self.settling.swap(0, Ordering::AcqRel) != 0
        {
            self.poll_all();
            self.share_freed.notify_waiters();
        }
    }

    /// Takes a place on the share, if this process holds fewer places than its share.
    pub(crate) fn take_on_share(&self, share: usize) -> bool {
        let _serial = lock(&self.share_lock);
        if self.active.load(Ordering::Relaxed) < share {
            self.active.fetch_add(1, Ordering::Relaxed);
            return true;
        }
        false
    }

    /// `call`, noting whether the store answered; first, once, makes the configured capacity
    /// the fleet's if the limit was built to.
    async fn call<T>(&self, call: impl Future<Output = Result<T, Error>>) -> Result<T, Error> {
        if self.settings.overwrite && !self.overwritten.initialized() {
            let stored = self
                .overwritten
                .get_or_try_init(|| async {
                    let capacity = self.store.set_capacity(self.settings.capacity).await?;
                    self.capacity.store(capacity, Ordering::Relaxed);
                    Ok::<_, Error>(())
                })
                .await;
            if let Err(error) = stored {
                self.note(Some(&error));
                return Err(error);
            }
        }
        let result = call.await;
        self.note(result.as_ref().err());
        result
    }

    /// Notes whether the store answered. At the start of an outage every waiter asks again
    /// (and is answered at once) and the background task asks the store at once; at its end
    /// every waiter asks again (a wake-up may have been lost meanwhile). Each is said once.
    pub(crate) fn note(&self, error: Option<&Error>) {
        match self.health.note(error) {
            Change::None => return,
            Change::Down => {
                if let Some(error) = error {
                    warn(&format!(
                        "{error}. Until it answers again the limit {}, and asks again every \
                         {:?} in the background",
                        self.answer_while_down(),
                        self.settings.fallback_poll
                    ));
                }
                self.doorbell.probe();
            }
            Change::Up(after) => {
                let settle =
                    self.settings.unreachable == Unreachable::Share && self.share().is_some();
                inform(&format!(
                    "tower-resources-operation-redis: the fleet limit {:?} reaches its store at \
                     {} again, after {after:?}{}",
                    self.settings.name,
                    self.store.address(),
                    match settle {
                        true =>
                            "; back on the fleet's capacity once every replica has told it \
                                 of the places it admitted on its share (within half a fallback \
                                 poll)",
                        false => "",
                    }
                ));
                if settle {
                    // The places admitted on the share while this call was under way: told to
                    // the store at once, by a refresh now.
                    if !lock(&self.books).unheard.is_empty() {
                        self.doorbell.probe();
                    }
                    let at = Instant::now() + self.settings.fallback_poll / 2;
                    let ns = u64::try_from(at.saturating_duration_since(self.origin).as_nanos())
                        .unwrap_or(u64::MAX)
                        .max(1);
                    self.settling.store(ns, Ordering::Release);
                    self.doorbell.refresh_at(at);
                    // Waiters on the share stay there until then.
                    return;
                }
            }
        }
        self.poll_all();
        self.share_freed.notify_waiters();
    }

    /// What the limit answers while the store is out of reach, in words.
    fn answer_while_down(&self) -> String {
        match (self.settings.unreachable, self.share()) {
            (Unreachable::Share, Some(share)) => format!(
                "runs on this replica's share of the fleet's last capacity: {share} at once \
                 ({} over {} replicas alive; queued locally beyond that)",
                self.capacity.load(Ordering::Relaxed),
                self.replicas.load(Ordering::Relaxed)
            ),
            (Unreachable::Share, None) => "turns operations away at once as unavailable: this \
                                           replica never reached the store, so it has no share \
                                           of the fleet's capacity"
                .to_owned(),
            (Unreachable::Closed, _) => {
                "turns operations away at once as unavailable (fail closed)".to_owned()
            }
            (Unreachable::Open, _) => {
                "admits operations at once without the fleet limit (fail open)".to_owned()
            }
        }
    }

    /// Connects if that is not done yet, or checks the store answers; then reads the fleet's
    /// state, so that a disagreement with this replica's settings is said now.
    pub(crate) async fn connect(&self) -> Result<(), Error> {
        self.call(self.store.connect()).await?;
        self.state().await.map(drop)
    }

    /// Asks for a place for `id`. While the store is down: the failure that started the
    /// outage, at once; while the fleet settles after it, the same (the waiter takes a place of
    /// its share).
    pub(crate) async fn take(&self, id: &str) -> Result<Answer, Error> {
        if let Some(answer) = self.health.answer() {
            return Err(answer);
        }
        if self.is_settling() {
            if let Some(answer) = self.health.last_answer() {
                return Err(answer);
            }
        }
        let taken = self.call(self.store.take(id)).await?;
        self.read_capacity(taken.capacity);
        self.read_replicas(taken.replicas);
        Ok(taken.answer)
    }

    /// Gives back the leases, claims and tickets `ids`.
    pub(crate) async fn release(&self, ids: &[String]) -> Result<(), Error> {
        let capacity = self.call(self.store.release(ids)).await?;
        self.read_capacity(capacity);
        Ok(())
    }

    /// Sets the fleet's capacity.
    pub(crate) async fn set_capacity(&self, capacity: usize) -> Result<usize, Error> {
        // What the caller sets is the fleet's from now on: neither compared nor overwritten.
        self.capacity_checked.store(true, Ordering::Relaxed);
        let _ = self.overwritten.set(());
        let capacity = self.call(self.store.set_capacity(capacity)).await?;
        self.capacity.store(capacity, Ordering::Relaxed);
        Ok(capacity)
    }

    /// The fleet's state; the first read says whether this replica agrees with the fleet.
    pub(crate) async fn state(&self) -> Result<State, Error> {
        let state = self.call(self.store.state()).await?;
        self.read_capacity(state.capacity);
        self.read_replicas(state.replicas);
        self.check_control(state.adaptive);
        Ok(state)
    }

    /// The fleet's capacity, as a call returned it. The first one read is compared with the
    /// configured one: a difference is said once (the fleet's is kept).
    pub(crate) fn read_capacity(&self, capacity: usize) {
        self.capacity.store(capacity, Ordering::Relaxed);
        if self.capacity_checked.load(Ordering::Acquire) {
            return;
        }
        // Under a lock, so that a caller that finds it checked finds it said too (`ready`
        // returns after the warning, whichever call made it).
        let _said = lock(&self.saying);
        if self.capacity_checked.load(Ordering::Acquire) {
            return;
        }
        // Marked once said (a caller that finds it marked finds it said).
        let _mark = Mark(&self.capacity_checked);
        if capacity == self.settings.capacity || self.control.is_some() {
            return;
        }
        warn(&format!(
            "tower-resources-operation-redis: the fleet limit {:?} was built with a capacity of \
             {}, but the fleet's capacity stored at {} is {capacity}: it keeps the fleet's \
             ({capacity}). The first process to reach the store stores its capacity, and \
             `set_capacity` changes it for the whole fleet; build with `overwrite_capacity()` to \
             make {} the fleet's at this process's first call.",
            self.settings.name,
            self.settings.capacity,
            self.store.address(),
            self.settings.capacity,
        ));
    }

    /// The replicas alive, as a call returned them; kept as they were before an outage while the
    /// fleet settles after it (a store that lost its data counts only the replicas that reached
    /// it so far, and the share is worked out from the fleet as it was).
    fn read_replicas(&self, replicas: usize) {
        if !self.is_settling() {
            self.replicas.store(replicas, Ordering::Relaxed);
        }
    }

    /// Says, once, that this replica has a fixed capacity in a fleet whose capacity a
    /// controller sets. (The other way round cannot be told from a fleet that starts: its first
    /// adaptive replicas find no controller either.)
    fn check_control(&self, fleet_adaptive: bool) {
        if self.control.is_some() || !fleet_adaptive {
            return;
        }
        let _said = lock(&self.saying);
        if self.control_checked.load(Ordering::Acquire) {
            return;
        }
        let _mark = Mark(&self.control_checked);
        warn(&format!(
            "tower-resources-operation-redis: the fleet limit {:?} on {}: this replica has a \
             fixed capacity, but a controller sets the fleet's (an adaptive replica ticked \
             within a lease TTL): this replica admits whatever capacity the controller sets, and \
             never changes it. Build every replica of one limit the same way: all \
             `adaptive(..)`, or none",
            self.settings.name,
            self.store.address()
        ));
    }

    /// Says this process is alive, extends its leases and tickets, and acts on what became of
    /// them: a lost lease is counted (and taken back if its place was free), a waiter whose
    /// place was handed over is admitted, one whose ticket is gone asks again, a place admitted
    /// on the share becomes a lease. If the store cannot be reached, every waiter asks again,
    /// to get the configured answer.
    pub(crate) async fn refresh(&self) {
        let (held, unheard, waiting) = {
            let books = lock(&self.books);
            let waiting: Vec<(String, Arc<Slot>)> = books
                .waiting
                .iter()
                .filter(|(_, slot)| slot.queued.load(Ordering::Relaxed))
                .map(|(id, slot)| (id.clone(), Arc::clone(slot)))
                .collect();
            let held: Vec<String> = books.held.iter().cloned().collect();
            let unheard: Vec<String> = books.unheard.iter().cloned().collect();
            (held, unheard, waiting)
        };
        let ids: Vec<String> = waiting.iter().map(|(id, _)| id.clone()).collect();
        let books = Refresh {
            process: process_token(),
            held: &held,
            unheard: &unheard,
            waiting: &ids,
        };
        let refreshed = match self.call(self.store.refresh(&books)).await {
            Ok(refreshed) => refreshed,
            Err(_) => {
                for (_, slot) in &waiting {
                    slot.tell(ASK);
                }
                return;
            }
        };
        self.read_capacity(refreshed.capacity);
        self.read_replicas(refreshed.replicas);
        for (id, status) in held.iter().zip(&refreshed.held) {
            match status {
                Status::Holds | Status::Waits => {}
                Status::TakenBack => {
                    self.leases_lost.fetch_add(1, Ordering::Relaxed);
                }
                Status::Gone => {
                    // Lost, and its place may be someone else's now: no longer extended.
                    self.leases_lost.fetch_add(1, Ordering::Relaxed);
                    lock(&self.books).held.remove(id);
                }
            }
        }
        for id in unheard
            .iter()
            .zip(&refreshed.unheard)
            .filter_map(|(id, status)| (*status == Status::Holds).then_some(id))
        {
            let mut books = lock(&self.books);
            // Still running: a lease from now on, extended and given back as any other.
            if books.unheard.remove(id) {
                books.held.insert(id.clone());
            }
        }
        for ((_, slot), status) in waiting.iter().zip(&refreshed.waiting) {
            match status {
                Status::Holds => slot.tell(GRANTED),
                Status::Waits => {}
                // Gone: it joins the queue again.
                Status::TakenBack | Status::Gone => slot.tell(ASK),
            }
        }
    }

    /// How long the background task waits between refreshes: a third of the TTL, or the
    /// fallback poll while something waits or a release is to be retried, or a quarter of it
    /// while the store is down (so that every replica of a fleet on its share reaches the store
    /// within a quarter of a fallback poll of its return, and the fleet has settled half a
    /// fallback poll after).
    pub(crate) fn every(&self, urgent: bool) -> Duration {
        if self.health.is_down() {
            self.settings.fallback_poll / 4
        } else if urgent || self.queued.load(Ordering::Relaxed) > 0 {
            self.settings.fallback_poll
        } else {
            self.settings.lease_ttl / 3
        }
    }

    /// The fleet's window as this process last heard it (an adaptive limit's; 0 for a fixed
    /// one).
    pub(crate) fn window(&self) -> u64 {
        self.control.as_ref().map_or(0, |control| control.epoch())
    }

    /// What the store pushed.
    pub(crate) fn heard(&self, event: Event) {
        match event {
            Event::Handed { window, ids } => {
                let mut foreign = false;
                {
                    let books = lock(&self.books);
                    for id in &ids {
                        match books.waiting.get(id) {
                            // Its place: to be claimed, by asking again. Admitted in the
                            // window the store handed it over in, whatever this process has
                            // heard of since (a decision pushed after it, a tick answered
                            // before it was read).
                            Some(slot) => {
                                slot.handed_in.store(window, Ordering::Relaxed);
                                slot.tell(ASK);
                            }
                            None => foreign |= !is_own(id),
                        }
                    }
                }
                // A place handed to another process: if that process is gone, its claim
                // expires untaken, and this process's waiters find the place by a refresh
                // soon after, rather than at the next fallback poll.
                if foreign && self.queued.load(Ordering::Relaxed) > 0 {
                    let slack = self.settings.claim_timeout / 10 + Duration::from_millis(5);
                    self.doorbell
                        .refresh_at(Instant::now() + self.settings.claim_timeout + slack);
                }
            }
            Event::Capacity(capacity) => self.capacity.store(capacity, Ordering::Relaxed),
            Event::Decided(known) => {
                if let Some(control) = &self.control {
                    control.learn(&known);
                }
            }
            Event::Due => {
                if let Some(control) = self.control.as_ref().filter(|c| c.leads()) {
                    control.doorbell.notify_one();
                }
            }
            Event::Reconnected => self.poll_all(),
        }
    }

    /// Every waiter asks again (the connection dropped or came back, the store went away: a
    /// wake-up may be lost, or the answer is due now).
    pub(crate) fn poll_all(&self) {
        for slot in lock(&self.books).waiting.values() {
            slot.tell(ASK);
        }
    }
}

/// Sets its flag when dropped: after what it marks is done, however that ends.
struct Mark<'a>(&'a AtomicBool);

impl Drop for Mark<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

/// What a limit's handles, waiters and places share: the member, the way releases go to the
/// background task, and the limit's identity in the metrics. The background task ends once the
/// last of these is gone.
pub(crate) struct Handle<S> {
    pub(crate) member: Arc<Member<S>>,
    /// Leases, claims and tickets to give back, for the background task.
    releases: UnboundedSender<String>,
    /// What the metrics read, and the limit's identity there.
    pub(crate) gauge: Capacity,
}

impl<S> Handle<S> {
    pub(crate) fn new(
        member: Arc<Member<S>>,
        releases: UnboundedSender<String>,
        gauge: Capacity,
    ) -> Self {
        Self {
            member,
            releases,
            gauge,
        }
    }

    /// Gives the lease, claim or ticket `id` back, by the background task, at once.
    pub(crate) fn release(&self, id: String) {
        // If the task is gone, it expires within the TTL.
        let _ = self.releases.send(id);
    }
}
