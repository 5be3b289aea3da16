//! One layer over a whole axum `Router` or tonic `Server`, where each request chooses its
//! operation and executor, or to go unlimited.
//!
//! A [`PerRequestLayer`], made with
//! [`per_request`](crate::ResourcesOperationLayer::per_request), needs the request to
//! choose, which `poll_ready` does not have, so it takes its permit after `call`: its
//! `poll_ready` is always ready, and each limited request goes through a clone of the inner
//! service (which must be `Clone`) that waits for its permit in the response future, as the
//! layer's per-route form does. `queued` counts a request from `call` on (a per-route layer
//! counts it from its first `poll_ready`, which under hyper and axum is the same moment); an
//! unlimited request is neither limited nor recorded. Every choice is one of the bounded values,
//! whatever the request; a chooser that panics costs the request its choice (it is limited as
//! [`Choice::OTHER`]), never its answer.

mod choice;
mod layer;
mod rules;
mod service;

pub use choice::{Choice, ChooseFn, ChooseOperation, KnownChoices};
pub use layer::PerRequestLayer;
pub use rules::ByRoute;
pub use service::PerRequestOperation;
