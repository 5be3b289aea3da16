//! [`Member`]: one process's part in a fleet limit: its settings, its store, its books, its
//! health, what it knows of the fleet, and each step it takes on the store with what that step
//! changes here. Its share ([`share`](super::share)) and its checks of the fleet's settings
//! ([`checks`](super::checks)) are in files of their own. [`Handle`]: what the limit's handles,
//! waiters and places share, which the background task outlives by nothing.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::mpsc::UnboundedSender;
use tokio::time::Instant;
use tower_resources_operation::limit::{Capacity, Reading, Scope};

use super::books::{lock, Books, Counts, ASK, GRANTED};
use super::checks::{Built, Checks};
use super::control::FleetControl;
use super::doorbell::Doorbell;
use super::health::{Change, Health};
use super::share::{Share, Unreachable};
use super::store::{Answer, Event, Refresh, State, Status, Store};
use crate::error::Error;
use crate::log::{inform, warn};

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
    pub(crate) books: Mutex<Books>,
    pub(crate) counts: Counts,
    /// The fleet's capacity, as last read (the configured one until then).
    pub(crate) capacity: AtomicUsize,
    /// The fleet's places held, and those held by members it has not heard from, as the last
    /// refresh read them.
    pub(crate) places: Places,
    pub(crate) share: Share,
    pub(crate) checks: Checks,
    /// The controller, for an adaptive limit.
    pub(crate) control: Option<FleetControl>,
}

/// The fleet's places, as the store counted them at this member's last refresh.
#[derive(Debug, Default)]
pub(crate) struct Places {
    /// Leases and claims held, by every member.
    pub(crate) held: AtomicUsize,
    /// Of those, held by members the fleet has not heard from within half a lease TTL
    /// (a refresh comes every third): a member that died holding them, until they lapse.
    pub(crate) unheard: AtomicUsize,
}

impl<S: Store> Member<S> {
    pub(crate) fn new(
        store: S,
        settings: Settings,
        token: Arc<str>,
        control: Option<FleetControl>,
    ) -> Self {
        Self {
            capacity: AtomicUsize::new(settings.capacity),
            settings,
            store,
            health: Health::new(),
            doorbell: Doorbell::default(),
            books: Mutex::new(Books::new(token)),
            counts: Counts::default(),
            places: Places::default(),
            share: Share::default(),
            checks: Checks::default(),
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
            self.counts.active.load(Ordering::Relaxed),
            self.counts.queued.load(Ordering::Relaxed),
        )
        .with_run_times(baseline, estimate)
        .with_scope(scope)
    }

    /// `call`, noting whether the store answered; first, once, makes the configured capacity
    /// the fleet's if the limit was built to.
    async fn call<T>(&self, call: impl Future<Output = Result<T, Error>>) -> Result<T, Error> {
        let overwrite = async {
            let capacity = self.store.set_capacity(self.settings.capacity).await?;
            self.capacity.store(capacity, Ordering::Relaxed);
            Ok(())
        };
        if let Err(error) = self
            .checks
            .overwrite_once(self.settings.overwrite, overwrite)
            .await
        {
            self.note(Some(&error));
            return Err(error);
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
                        self.share.answer_while_down(
                            self.settings.unreachable,
                            self.capacity.load(Ordering::Relaxed)
                        ),
                        self.settings.fallback_poll
                    ));
                }
                self.doorbell.probe();
            }
            Change::Up(after) => {
                let settle =
                    self.settings.unreachable == Unreachable::Share && self.share().is_some();
                inform(&format!(
                    "the fleet limit {:?} reaches its store at {} again, after {after:?}{}",
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
                    self.share.settle_until(at);
                    self.doorbell.refresh_at(at);
                    // Waiters on the share stay there until then.
                    return;
                }
            }
        }
        self.poll_all();
        self.share.freed.notify_waiters();
    }

    /// The fleet's capacity, as a call returned it (the first is checked against this
    /// replica's).
    fn read_capacity(&self, capacity: usize) {
        self.capacity.store(capacity, Ordering::Relaxed);
        self.checks.read_capacity(capacity, &self.built());
    }

    /// What the checks compare and name.
    fn built(&self) -> Built<'_> {
        Built {
            name: &self.settings.name,
            capacity: self.settings.capacity,
            adaptive: self.control.is_some(),
            address: self.store.address(),
        }
    }

    /// This process's share of the fleet's last capacity, if it knows one.
    pub(crate) fn share(&self) -> Option<usize> {
        self.share.of(self.capacity.load(Ordering::Relaxed))
    }

    /// The share it runs on now, if it does: the store is out of reach (or answers again, and
    /// the fleet is settling), and it knows one.
    pub(crate) fn running_on_share(&self) -> Option<usize> {
        match self.settings.unreachable {
            Unreachable::Share if self.health.is_down() || self.share.is_settling() => self.share(),
            _ => None,
        }
    }

    /// After a refresh: once the fleet has settled, back on the fleet limit, and every waiter
    /// on the share asks the store.
    pub(crate) fn settle(&self) {
        if self.share.settled() {
            self.poll_all();
            self.share.freed.notify_waiters();
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
        if self.share.is_settling() {
            if let Some(answer) = self.health.last_answer() {
                return Err(answer);
            }
        }
        let taken = self.call(self.store.take(id)).await?;
        self.read_capacity(taken.capacity);
        self.share.read_replicas(taken.replicas);
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
        self.checks.capacity_set_here();
        let capacity = self.call(self.store.set_capacity(capacity)).await?;
        self.capacity.store(capacity, Ordering::Relaxed);
        Ok(capacity)
    }

    /// The fleet's state; the first read says whether this replica agrees with the fleet.
    pub(crate) async fn state(&self) -> Result<State, Error> {
        let token = lock(&self.books).token().to_owned();
        let state = self.call(self.store.state(&token)).await?;
        self.read_capacity(state.capacity);
        self.share.read_replicas(state.replicas);
        self.places.held.store(state.active, Ordering::Relaxed);
        self.places.unheard.store(state.unheard, Ordering::Relaxed);
        self.checks.check_control(state.adaptive, &self.built());
        Ok(state)
    }

    /// Says this process is alive, extends its leases and tickets, and acts on what became of
    /// them: a lost lease is counted (and taken back if its place was free), a waiter whose
    /// place was handed over is admitted, one whose ticket is gone asks again, a place admitted
    /// on the share becomes a lease. If the store cannot be reached, every waiter asks again,
    /// to get the configured answer.
    pub(crate) async fn refresh(&self) {
        let sent = lock(&self.books).to_refresh();
        let ids: Vec<String> = sent.waiting.iter().map(|(id, _)| id.clone()).collect();
        let books = Refresh {
            process: &sent.token,
            held: &sent.held,
            unheard: &sent.unheard,
            waiting: &ids,
        };
        let refreshed = match self.call(self.store.refresh(&books)).await {
            Ok(refreshed) => refreshed,
            Err(_) => {
                for (_, slot) in &sent.waiting {
                    slot.tell(ASK);
                }
                return;
            }
        };
        self.read_capacity(refreshed.capacity);
        self.share.read_replicas(refreshed.replicas);
        self.places
            .held
            .store(refreshed.fleet_held, Ordering::Relaxed);
        self.places
            .unheard
            .store(refreshed.fleet_unheard, Ordering::Relaxed);
        let (stray, lost) = lock(&self.books).refreshed(&sent, &refreshed.held, &refreshed.unheard);
        self.counts.leases_lost.fetch_add(lost, Ordering::Relaxed);
        if !stray.is_empty() {
            // If this fails, the leases expire within a lease TTL.
            let _ = self.release(&stray).await;
        }
        for ((_, slot), status) in sent.waiting.iter().zip(&refreshed.waiting) {
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
        } else if urgent || self.counts.queued.load(Ordering::Relaxed) > 0 {
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
                            None => foreign |= !books.is_own(id),
                        }
                    }
                }
                // A place handed to another process: if that process is gone, its claim
                // expires untaken, and this process's waiters find the place by a refresh
                // soon after, rather than at the next fallback poll.
                if foreign && self.counts.queued.load(Ordering::Relaxed) > 0 {
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
