//! [`Store`]: what a fleet limit asks of the store it is kept in. Everything else of the fleet
//! limit (its waiters, its health, its share while the store is out of reach, its background
//! work, its controller) is written once against this trait; the Redis store implements it.
//!
//! Each method is one atomic step on the store's side, answered with what the fleet needs to
//! know next (the capacity, the live replicas). What the store pushes (a place handed over, a
//! new capacity, a decision) comes as [`Event`]s on the channel it was made with.
//!
//! # What a store keeps, and what it must guarantee
//!
//! - **Places.** A *lease* is a place held by an operation: an id with an expiry the holder's
//!   process extends ([`refresh`](Store::refresh)). A *claim* is a place handed over to a
//!   waiter, held for the claim timeout only: its process takes it up by asking again
//!   ([`take`](Store::take) with the same id, or a refresh), which makes it a lease. At most
//!   `capacity` leases and claims together, never one place to two ids.
//! - **Tickets.** A waiter's place in the fleet's queue, first come, first served, with an expiry
//!   its process extends. A claim that expires untaken says its process is gone: every ticket
//!   of that process leaves the queue with it (ids are `process:count`).
//! - **Processes.** Each refresh (and each take) says its process is alive, until a lease TTL
//!   later: the live replicas, from which a process works out its share of the capacity.
//! - **The clock.** Every expiry is on the store's own clock, never a replica's.
//! - **Wake-ups.** A place handed over, a capacity set and a decision taken are pushed to every
//!   process; a wake-up lost is covered by the refresh.
//! - **An adaptive limit's windows.** The fleet's window is a number every process hears; an
//!   operation is marked with the window it was admitted in, and a failure is news only if it
//!   was admitted after the last decrease (the core's `Window`). Three rules keep that exact
//!   although processes hear late: a place handed over carries the window it was handed over in
//!   ([`Event::Handed`]); a decrease opens a window of its own, and what the window counted
//!   before it counts as the next window's, its failures stale; and counts judged against a
//!   decrease before the store's last ([`Tick::judged`]) count their failures as stale.
//!
//! # On other stores (checked on paper, not built)
//!
//! - **etcd.** Leases are etcd leases (`LeaseGrant`, kept alive by the refresh; a process's
//!   leases and tickets can share one etcd lease per process, so that its death drops them all
//!   at once). Each step is one transaction (`Txn` with compare on the mod revision of a
//!   `capacity` key and the count of keys under `holders/`); the queue is keys under `queue/`
//!   ordered by their create revision; wake-ups are a `Watch` on the limit's prefix. A claim is
//!   a key with a lease of its own, of the claim timeout.
//! - **PostgreSQL.** Rows: `holders(id, process, expires)`, `queue(id, process, arrival,
//!   expires)`, `processes(token, expires)`, `capacity`; each step a transaction at
//!   `SERIALIZABLE` (or one `SELECT ... FOR UPDATE` on the limit's row), with `now()` of the
//!   server; wake-ups by `NOTIFY` in the same transaction, heard with `LISTEN`.
//!
//! Both fit the trait as it stands: nothing in it is Redis's (scripts and channels are the
//! Redis store's own business). It stays private to this crate in this release: one store has
//! been built against it, and a seam is proved by its second user. When one comes, the fleet
//! half of this crate moves to a crate of its own, with the trait public there (as
//! opentelemetry-otlp writes its exporter once against a client trait of its own).

use std::future::Future;
use std::time::Duration;

use tower_resources_operation::adaptive::{Adaptive, Sample, Window};

use crate::error::Error;

/// What a fleet limit asks of its store. See [the module](self).
pub(crate) trait Store: Send + Sync + 'static {
    /// The store's address, as messages say it (without a password).
    fn address(&self) -> &str;

    /// Connects (and starts hearing what is pushed) if that is not done yet, or else checks
    /// that the store answers now.
    fn connect(&self) -> impl Future<Output = Result<(), Error>> + Send;

    /// Asks for a place for `id`: takes a free one (none waiting before it), takes up the one
    /// handed over to it (its claim), keeps its ticket (extended), queues it, or turns it away
    /// (the queue is at its bound).
    fn take(&self, id: &str) -> impl Future<Output = Result<Taken, Error>> + Send;

    /// Gives back the leases, claims and tickets `ids`, and hands the places freed to the
    /// first waiters. Returns the capacity.
    fn release(&self, ids: &[String]) -> impl Future<Output = Result<usize, Error>> + Send;

    /// Says this process is alive; extends its leases and tickets, makes its claims leases,
    /// and makes leases of the places it admitted on its share while the store was out of
    /// reach; says what became of each.
    fn refresh(&self, books: &Refresh<'_>)
        -> impl Future<Output = Result<Refreshed, Error>> + Send;

    /// Sets the fleet's capacity, hands new places to the first waiters, and tells every
    /// process. Returns it.
    fn set_capacity(&self, capacity: usize) -> impl Future<Output = Result<usize, Error>> + Send;

    /// The fleet's state now; says the member `member` is alive (it asks).
    fn state(&self, member: &str) -> impl Future<Output = Result<State, Error>> + Send;

    /// An adaptive limit's tick: this process's counts into the fleet's window, the leader's
    /// lease kept or taken, and the window taken if this process leads and it is due.
    fn tick(&self, tick: &Tick<'_>) -> impl Future<Output = Result<Ticked, Error>> + Send;

    /// The leader's decision on the window it took: the capacity from now on, unless this
    /// process no longer leads or the window is no longer current (then `None`).
    fn decide(
        &self,
        decision: &Decision<'_>,
    ) -> impl Future<Output = Result<Option<usize>, Error>> + Send;
}

/// What a [`take`](Store::take) answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Taken {
    pub(crate) answer: Answer,
    /// The fleet's capacity.
    pub(crate) capacity: usize,
    /// The processes alive in the fleet, this one included.
    pub(crate) replicas: usize,
}

/// Whether a place was taken.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Answer {
    /// The id holds a lease.
    Granted,
    /// The id waits in the queue.
    Queued,
    /// The queue is at its bound: no lease, no ticket.
    Full,
}

/// This process's ids, for a [`refresh`](Store::refresh).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Refresh<'a> {
    /// This process's token.
    pub(crate) process: &'a str,
    /// Leases its permits hold.
    pub(crate) held: &'a [String],
    /// Places it admitted on its share, to be made leases whatever the capacity (they run).
    pub(crate) unheard: &'a [String],
    /// Its waiters' ids (tickets, or claims not yet taken up).
    pub(crate) waiting: &'a [String],
}

/// What a [`refresh`](Store::refresh) answered: the fleet's capacity, replicas and places, and
/// one status per id, in the order given.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Refreshed {
    pub(crate) capacity: usize,
    pub(crate) replicas: usize,
    /// Leases and claims held, by every member.
    pub(crate) fleet_held: usize,
    /// Of those, held by members not heard from within half a lease TTL.
    pub(crate) fleet_unheard: usize,
    pub(crate) held: Vec<Status>,
    pub(crate) unheard: Vec<Status>,
    pub(crate) waiting: Vec<Status>,
}

/// What became of one id.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Status {
    /// It holds a lease (a waiter's claim was taken up).
    Holds,
    /// It waits in the queue.
    Waits,
    /// A lease found lost, and taken back: its place was free and nobody waited.
    TakenBack,
    /// Gone: a lost lease whose place may be another's, or a ticket that left the queue.
    Gone,
}

/// The fleet's state, read now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct State {
    pub(crate) capacity: usize,
    /// Leases and claims held, by every process.
    pub(crate) active: usize,
    /// Of those, held by members not heard from within half a lease TTL.
    pub(crate) unheard: usize,
    /// Tickets waiting, from every process.
    pub(crate) queued: usize,
    /// Processes alive.
    pub(crate) replicas: usize,
    /// Whether a controller sets the capacity (an adaptive limit ticked within a lease TTL).
    pub(crate) adaptive: bool,
}

/// An adaptive limit's tick.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Tick<'a> {
    /// This process's id as a candidate for the leader's lease.
    pub(crate) candidate: &'a str,
    pub(crate) leader_ttl: Duration,
    /// The window this process's counts were taken in.
    pub(crate) seen: u64,
    pub(crate) counts: Window,
    /// The window of the last decrease the counts' failures were judged against (0 for none).
    /// A store whose last decrease is later counts them as stale: each was admitted before it
    /// (the process had not heard of the window after it), and judged news by a process that
    /// had not heard of it yet, or ended before it was decided and was counted after.
    pub(crate) judged: u64,
    /// The shortest window, the longest, and the share of ends that may be failures before
    /// the window is due at once.
    pub(crate) shortest: Duration,
    pub(crate) longest: Duration,
    pub(crate) tolerance: f64,
    /// This process has no algorithm yet: if it leads, the tick answers what the last
    /// leader's measured ([`Ticked::handed`]), for the one it starts.
    pub(crate) starting: bool,
}

/// The leader's decision on the window it took.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Decision<'a> {
    pub(crate) leader: &'a str,
    /// The window that opened as the leader took the last: the decision is dropped unless it
    /// is still open (and the leader still leads).
    pub(crate) window: u64,
    /// The capacity from now on.
    pub(crate) capacity: usize,
    /// What the fleet knows after it: the window open after it (the next one after a decrease,
    /// which opens one of its own), the first window after the last decrease, what the
    /// algorithm measured.
    pub(crate) known: Known,
    /// What the algorithm hands over: what a next leader starts from.
    pub(crate) handover: &'a str,
}

/// What a store pushes to every process of the fleet.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Event {
    /// Places were handed over to these waiters, to be claimed within the claim timeout, in
    /// the fleet's window `window` (an adaptive limit's: what their operations were admitted
    /// in, whenever their processes hear of it; 0 for a fixed limit).
    Handed { window: u64, ids: Vec<String> },
    /// The fleet's capacity is now this.
    Capacity(usize),
    /// The leader decided a window.
    Decided(Known),
    /// A window is due: the leader ticks at once.
    Due,
    /// The connection dropped or was made again: pushed wake-ups may have been lost.
    Reconnected,
}

/// What a tick or a decision says of the fleet's adaptive state.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Known {
    pub(crate) epoch: u64,
    /// The first window after the fleet's last decrease (0 for none).
    pub(crate) decreased: u64,
    pub(crate) rtt_us: Option<u64>,
    pub(crate) baseline_us: Option<u64>,
    pub(crate) estimate_us: Option<u64>,
}

/// What a tick answered.
#[derive(Clone, Debug)]
pub(crate) struct Ticked {
    pub(crate) capacity: usize,
    pub(crate) leads: bool,
    pub(crate) age_ms: u64,
    pub(crate) known: Known,
    /// The window, if this process took it.
    pub(crate) taken: Option<TakenWindow>,
    /// What the last leader's algorithm handed over ([`Algorithm::handover`]): for a leader
    /// that has no algorithm yet (it asked, [`Tick::starting`](super::store::Tick::starting)),
    /// else empty.
    ///
    /// [`Algorithm::handover`]: tower_resources_operation::adaptive::Algorithm::handover
    pub(crate) handed: String,
}

/// A window the leader took.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct TakenWindow {
    /// The fleet's counts, every process's ticks added up.
    pub(crate) counts: Window,
    /// The fleet's places held, sampled at each tick: how many samples, their sum, the most.
    pub(crate) samples: u64,
    pub(crate) active_sum: u64,
    pub(crate) peak: u64,
}

impl TakenWindow {
    /// A window as the store kept it, field by field (a hash as `HGETALL` lists it): the
    /// fleet's counts ([`Window::from_fields`]) and the load the store sampled. A field this
    /// crate did not write is skipped.
    pub(crate) fn from_fields(fields: &[(String, String)]) -> Self {
        let mut window = TakenWindow::default();
        let mut counts = Vec::new();
        for (name, value) in fields {
            let Ok(value) = value.parse::<i64>() else {
                continue;
            };
            let value = u64::try_from(value).unwrap_or(0);
            match name.as_str() {
                "samples" => window.samples = value,
                "active_sum" => window.active_sum = value,
                "peak" => window.peak = value,
                name => counts.push((name, value)),
            }
        }
        window.counts = Window::from_fields(counts);
        window
    }

    /// The sample the algorithm decides from, at `capacity`: the core's, with the fleet's
    /// load as the store sampled it and the window's length.
    pub(crate) fn sample(&self, capacity: usize, adaptive: &Adaptive, age_ms: u64) -> Sample {
        let mut sample = self.counts.sample(capacity, adaptive);
        sample.peak_in_flight = usize::try_from(self.peak).unwrap_or(usize::MAX);
        if self.samples > 0 {
            sample.in_flight = self.active_sum as f64 / self.samples as f64;
        }
        sample.elapsed = Duration::from_millis(age_ms);
        sample
    }

    /// Whether few operations ended in the window, whenever admitted: fewer than half its
    /// capacity. Such a window (a hand-over, or a stall while a dead process's places lapse)
    /// measured too little to grow on.
    pub(crate) fn is_thin(&self, capacity: usize) -> bool {
        self.counts.ends().saturating_mul(2) < capacity as u64
    }
}
