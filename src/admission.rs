//! [`Admission`]: what a service holds for its next operation, and the one step its
//! `poll_ready` asks of it, as tower's limit asks its `PollSemaphore`.

use std::future::Future;
use std::mem::{self, ManuallyDrop};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio_util::sync::ReusableBoxFuture;

use crate::attributes::Rejection;
use crate::config::{Config, Recording};
use crate::limit::Acquire;
use crate::operation::{scope, Asking, Free, Lifecycle};
use crate::rejected::Rejected;

/// The box a wait for a permit runs in.
type Boxed<P> = Option<ReusableBoxFuture<'static, Result<P, Rejected>>>;

/// What a service holds for its next operation: the box its waits run in, where the operation
/// stands while it holds no permit, and the operation itself, which `poll_ready` admits and
/// `call` hands to its response future.
///
/// Dropped empty, as every `clone().oneshot()` service is once it was called, it costs a few
/// compares in line: the drop glue of its parts is out of line ([`release`](Self::release)),
/// reached only when one of them holds something.
pub(crate) struct Admission<L: Acquire> {
    /// The allocation a wait for a permit runs in, kept from one wait to the next (as
    /// tokio-util's `PollSemaphore` keeps its). A clone starts with none.
    boxed: ManuallyDrop<Boxed<L::Permit>>,
    standing: Standing,
    /// The next operation.
    operation: ManuallyDrop<Lifecycle<L>>,
}

/// Where a service's next operation stands while it holds no permit.
#[derive(Debug)]
enum Standing {
    /// Nothing in progress, nothing to answer: the path of a free permit.
    Idle,
    /// Its wait runs in the box.
    Waiting,
    /// Turned away, for `call` to answer.
    Rejected(Rejected),
    /// Its request already holds a place of the limit (an operation around it on the request's
    /// path holds one): `call` runs it on that place.
    Nested,
}

/// What one step of [`Admission::poll`] came to.
pub(crate) enum Admit {
    /// The operation holds its permit: the inner service's readiness is next.
    Admitted,
    /// Its request holds a place of the limit already: it runs on that place.
    Nested,
    /// The limit turned it away, or could not admit it, just now: the service answers it.
    Refused(Rejected),
    /// It was turned away at an earlier step: `call` answers it.
    Answer,
}

impl<L: Acquire> Admission<L> {
    #[inline]
    pub(crate) fn new() -> Self {
        Self {
            boxed: ManuallyDrop::new(None),
            standing: Standing::Idle,
            operation: ManuallyDrop::new(Lifecycle::new()),
        }
    }

    /// The path of a free permit, in line: [`Free::Admitted`] if the next operation holds its
    /// permit, from an earlier step or taken just now (one check of where it stands, then one
    /// of the limit). Otherwise [`poll`](Self::poll) goes on from where it stands, told whether
    /// the limit was found busy.
    #[inline(always)]
    pub(crate) fn admit_free<C, P>(&mut self, config: &Config<C, L, P>) -> Free {
        if self.operation.is_admitted() {
            return Free::Admitted;
        }
        let recording = config.recording();
        if self.stands_aside(recording) {
            return Free::Ask;
        }
        self.operation.admit_free(&config.limit, recording)
    }

    /// One step of admitting the next operation after [`admit_free`](Self::admit_free) found
    /// no permit (`busy`: the limit had none free): by its wait, until the limit admits it or
    /// turns it away. A request that already holds a place of this limit is admitted on it.
    /// `deadline` is how long the server lets a request take, if the layer knows.
    #[inline(always)]
    pub(crate) fn poll<C, P>(
        &mut self,
        config: &Config<C, L, P>,
        busy: bool,
        deadline: impl FnOnce() -> Option<Duration>,
        cx: &mut Context<'_>,
    ) -> Poll<Admit>
    where
        L: Clone + Send + Sync + 'static,
        L::Permit: Send + 'static,
    {
        let recording = config.recording();
        if self.stands_aside(recording) {
            match self.standing {
                Standing::Rejected(_) => return Poll::Ready(Admit::Answer),
                Standing::Idle | Standing::Nested => return Poll::Ready(Admit::Nested),
                // The wait in progress goes on below: a wait in progress is asked, not the
                // limit, so that a place freed meanwhile goes to the head of its queue.
                Standing::Waiting => {}
            }
        }
        let mut asking = ServiceWait {
            limit: &config.limit,
            timeout: config.queue_timeout,
            boxed: &mut self.boxed,
            standing: &mut self.standing,
            busy,
        };
        let admitted = std::task::ready!(self.operation.poll_admit(
            &mut asking,
            recording.series.as_ref(),
            recording.records,
            recording.key,
            || recording.capacity.as_ref(),
            deadline,
            cx
        ));
        Poll::Ready(match admitted {
            Ok(()) => Admit::Admitted,
            Err(refused) => Admit::Refused(refused),
        })
    }

    /// Whether the next operation is answered from where it stands rather than by asking the
    /// limit: only an idle service whose request holds no place of its limit asks it.
    #[inline(always)]
    fn stands_aside(&self, recording: &Recording) -> bool {
        !matches!(self.standing, Standing::Idle) || recording.limit_id.is_some_and(scope::holds)
    }

    /// The next operation, admitted or not.
    #[inline(always)]
    pub(crate) fn operation(&mut self) -> &mut Lifecycle<L> {
        &mut self.operation
    }

    /// Whether the next operation holds its permit.
    #[inline(always)]
    pub(crate) fn is_admitted(&self) -> bool {
        self.operation.is_admitted()
    }

    /// The limit turned the operation away: `call` answers `rejected`.
    pub(crate) fn reject(&mut self, rejected: Rejected) {
        self.standing = Standing::Rejected(rejected);
    }

    /// The rejection to answer, which `call` takes once.
    pub(crate) fn take_rejection(&mut self) -> Option<Rejected> {
        match mem::replace(&mut self.standing, Standing::Idle) {
            Standing::Rejected(rejected) => Some(rejected),
            other => {
                self.standing = other;
                None
            }
        }
    }

    /// Whether the request was found on a place of the limit already (and said so).
    pub(crate) fn is_nested(&self) -> bool {
        matches!(self.standing, Standing::Nested)
    }

    /// The request holds a place of the limit: `call` runs it on that place; `false` undoes it
    /// (the inner service will not be called).
    pub(crate) fn nest(&mut self, nested: bool) {
        self.standing = match nested {
            true => Standing::Nested,
            false => Standing::Idle,
        };
    }

    /// Whether the next call runs on a place its request holds: taken once, by `call`.
    pub(crate) fn take_nested(&mut self) -> bool {
        let nested = self.is_nested();
        if nested {
            self.standing = Standing::Idle;
        }
        nested
    }

    /// Where it stands, as `Debug` shows it.
    pub(crate) fn describe(&self) -> &'static str {
        match self.standing {
            _ if self.operation.is_admitted() => "admitted",
            Standing::Rejected(_) => "rejected",
            Standing::Nested => "on its request's place",
            Standing::Waiting => "waiting",
            Standing::Idle => "idle",
        }
    }

    /// Drops what its parts hold: a wait's allocation, a rejection, a permit, a record (which
    /// then ends as its drop means).
    #[cold]
    #[inline(never)]
    fn release(&mut self) {
        let boxed = mem::take(&mut *self.boxed);
        let operation = mem::replace(&mut *self.operation, Lifecycle::new());
        self.standing = Standing::Idle;
        drop(boxed);
        drop(operation);
    }
}

impl<L: Acquire> Drop for Admission<L> {
    #[inline]
    fn drop(&mut self) {
        let empty = self.boxed.is_none()
            && matches!(self.standing, Standing::Idle)
            && self.operation.is_empty();
        if !empty {
            self.release();
        }
    }
}

/// A service's wait for its permit, for [`Lifecycle::poll_admit`]: kept across `poll_ready`
/// calls in the service's box, and turned away with [`Rejection::QueueTimeout`] once it has
/// waited `timeout`, if there is one.
struct ServiceWait<'a, L: Acquire> {
    limit: &'a L,
    timeout: Option<Duration>,
    boxed: &'a mut Boxed<L::Permit>,
    standing: &'a mut Standing,
    /// The limit was asked for a free place a moment ago, and had none: the wait starts
    /// without asking again.
    busy: bool,
}

impl<L> Asking for ServiceWait<'_, L>
where
    L: Acquire + Clone + Send + Sync + 'static,
    L::Permit: Send + 'static,
{
    type Permit = L::Permit;

    #[inline]
    fn is_waiting(&self) -> bool {
        matches!(self.standing, Standing::Waiting)
    }

    #[inline(always)]
    fn try_now(&mut self) -> Option<Result<L::Permit, Rejected>> {
        match self.busy {
            true => None,
            false => self.limit.try_acquire(),
        }
    }

    fn poll_wait(&mut self, cx: &mut Context<'_>) -> Poll<Result<L::Permit, Rejected>> {
        if !self.is_waiting() {
            let next = self.limit.clone().acquire_owned();
            match self.timeout {
                None => start(self.boxed, next),
                Some(timeout) => start(self.boxed, async move {
                    tokio::time::timeout(timeout, next)
                        .await
                        .unwrap_or_else(|_| Err(Rejected::new(Rejection::QueueTimeout)))
                }),
            }
            *self.standing = Standing::Waiting;
        }
        let Some(future) = self.boxed.as_mut() else {
            unreachable!("a wait was started above")
        };
        let acquired = std::task::ready!(future.poll(cx));
        *self.standing = Standing::Idle;
        Poll::Ready(acquired)
    }
}

/// Starts the wait `next` in `boxed`, in the allocation of the last one if it fits.
fn start<P>(
    boxed: &mut Boxed<P>,
    next: impl Future<Output = Result<P, Rejected>> + Send + 'static,
) {
    match boxed {
        Some(future) => future.set(next),
        None => *boxed = Some(ReusableBoxFuture::new(next)),
    }
}
