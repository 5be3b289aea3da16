//! [`Choice`]: what a request is, to a layer over many routes, and [`ChooseOperation`]: what
//! makes that choice.

use crate::attributes::{Executor, Operation};

/// What a request is, to a layer over many routes: an operation of some series, under the
/// layer's limit or one of its [named limits](super::PerRequestLayer::limits), or not
/// limited.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Choice {
    /// Limited, and recorded as `operation` on `executor`.
    Limited {
        /// The request's operation.
        operation: Operation,
        /// Where it runs.
        executor: Executor,
        /// The name of the limit it takes its permit from, among the layer's
        /// [`limits`](super::PerRequestLayer::limits); `None` for the layer's own.
        limit: Option<&'static str>,
    },
    /// Not limited and not recorded: a health check, `/metrics`.
    Unlimited,
}

impl Choice {
    /// [`Choice::Limited`] with `operation` and `executor`, under the layer's own limit.
    pub const fn limited(operation: Operation, executor: Executor) -> Self {
        Choice::Limited {
            operation,
            executor,
            limit: None,
        }
    }

    /// This choice, under the layer's limit named `limit` (see
    /// [`limits`](super::PerRequestLayer::limits)) rather than its own. An unlimited
    /// choice stays unlimited.
    ///
    /// ```
    /// use tower_resources_operation::per_request::Choice;
    /// use tower_resources_operation::{Executor, Operation};
    ///
    /// let verify = Choice::limited(Operation::Verify, Executor::Subprocess).on("verifiers");
    /// assert!(matches!(verify, Choice::Limited { limit: Some("verifiers"), .. }));
    /// ```
    pub const fn on(self, limit: &'static str) -> Self {
        match self {
            Choice::Limited {
                operation,
                executor,
                ..
            } => Choice::Limited {
                operation,
                executor,
                limit: Some(limit),
            },
            Choice::Unlimited => Choice::Unlimited,
        }
    }

    /// What a request that no rule names is, unless told otherwise: limited, as
    /// `other`/`other`.
    pub const OTHER: Choice = Choice::limited(Operation::Other, Executor::Other);
}

/// Chooses, from a request, its operation and executor, or that it is not limited.
///
/// The choice is bounded whatever the request: it is one of NeMo Gym's values or none. The
/// crate's rule table ([`ByRoute`](super::ByRoute)) is a chooser, and so is any closure in a
/// [`ChooseFn`].
pub trait ChooseOperation<Req>: KnownChoices {
    /// What `request` is.
    fn choose(&self, request: &Req) -> Choice;
}

/// What a chooser knows of the choices it can make, whatever the request: rules know them, a
/// closure does not. A layer reports their series from the moment it makes its service, 0
/// included, and checks then that each limit they name is one it has.
///
/// A chooser of your own that knows nothing in advance says so with an empty
/// `impl KnownChoices for MyChooser {}`.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a chooser of a per-request layer",
    note = "a closure chooses through `per_request::ChooseFn::new(|request| ...)`; a type of your \
            own implements `ChooseOperation<Req>` and `KnownChoices`"
)]
pub trait KnownChoices {
    /// Every choice this chooser can make, if it knows them. Defaults to none.
    fn choices(&self) -> Vec<Choice> {
        Vec::new()
    }
}

/// A chooser from a closure `Fn(&Req) -> Choice`, as tower's `service_fn` makes a service. It
/// knows no choice in advance: a series it chooses reports from its first request on.
///
/// ```
/// use tower_resources_operation::per_request::{Choice, ChooseFn};
/// use tower_resources_operation::{Executor, Operation, ResourcesOperationLayer};
///
/// // Requests for even numbers are judged; odd ones run unlimited.
/// let layer = ResourcesOperationLayer::new(4).per_request(ChooseFn::new(|n: &u32| match n % 2 {
///     0 => Choice::limited(Operation::Judge, Executor::Inline),
///     _ => Choice::Unlimited,
/// }));
/// # drop(layer);
/// ```
#[derive(Clone, Copy, Debug)]
pub struct ChooseFn<F>(F);

impl<F> ChooseFn<F> {
    /// A chooser that calls `choose` on each request.
    pub fn new(choose: F) -> Self {
        Self(choose)
    }
}

impl<F> KnownChoices for ChooseFn<F> {}

impl<F, Req> ChooseOperation<Req> for ChooseFn<F>
where
    F: Fn(&Req) -> Choice,
{
    fn choose(&self, request: &Req) -> Choice {
        (self.0)(request)
    }
}
