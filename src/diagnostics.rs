//! Mistakes that would otherwise record nothing, or the wrong thing, without a word: each is
//! reported once per process, as a `tracing` warning to the subscriber in place (with the
//! `tracing` feature), or on standard error when there is none, or without the feature.

use std::sync::atomic::{AtomicBool, Ordering};

/// A mistake worth one warning.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Mistake {
    /// The global meter provider is OpenTelemetry's no-op one (or keeps no callback: it has no
    /// reader).
    NoGlobalProvider,
    /// More than one `OperationMetrics` is alive: if two share a meter, each hides the other's
    /// live counts.
    SeveralMetrics,
    /// A per-request choice named a limit that its layer was not given.
    UnknownLimit,
    /// A layer of one operation counted a request that axum matched to no route: it wraps
    /// the whole Router, fallback (404) included.
    RouterWide,
    /// A request reached a limit whose place it already holds: one limit applied twice on its
    /// path.
    NestedLimit,
}

impl Mistake {
    const ALL: usize = 5;

    fn message(self) -> &'static str {
        match self {
            Mistake::NoGlobalProvider => {
                "no OpenTelemetry meter provider is installed (the global one is OpenTelemetry's \
                 no-op provider, or one without a reader, which keeps nothing to export), so \
                 operations are limited but not recorded. Install yours with \
                 opentelemetry::global::set_meter_provider before the first request, or give the \
                 layer its metrics with .metrics(OperationMetrics::new(&meter))"
            }
            Mistake::SeveralMetrics => {
                "a second OperationMetrics was made while another is alive. Two made from one \
                 meter each report the live counts (queued, active, limit) of the same series, \
                 and OpenTelemetry keeps only one of them: make one OperationMetrics per meter \
                 and clone it. (Metrics on different meter providers are fine.)"
            }
            Mistake::RouterWide => {
                "a layer of one operation counted a request that matched no route (axum's \
                 fallback, a 404): it wraps the whole Router, so every 404 counts as its \
                 operation, ok. Put the layer on the routes it limits (.route(..).layer(..)), \
                 or make it per_request(ByMatchedPath::new()..) to choose by route"
            }
            Mistake::NestedLimit => {
                "a request reached a limit whose place it already holds: the same limit is \
                 applied twice on its path (on a route and on the Router, in two layers of one \
                 stack, or by a handler that calls resources_operation on its own layer's \
                 limit). Waiting for a second place would halve the limit, and deadlock once \
                 every place is held by a request that waits for another, so it runs on the \
                 place it holds, and only the outer layer records it (its operation, queue \
                 time, run time and outcome). Remove one of the two"
            }
            Mistake::UnknownLimit => {
                "a per-request choice named a limit that its layer was not given (see \
                 PerRequest limits): such requests take the layer's own limit"
            }
        }
    }
}

/// Reports `mistake`, the first time only; what `detail` makes (only then) is added to the
/// message.
pub(crate) fn report(mistake: Mistake, detail: impl FnOnce() -> String) {
    static REPORTED: [AtomicBool; Mistake::ALL] = [const { AtomicBool::new(false) }; Mistake::ALL];
    if REPORTED[mistake as usize].swap(true, Ordering::Relaxed) {
        return;
    }
    warn(&format!(
        "tower-resources-operation: {}{}",
        mistake.message(),
        detail()
    ));
}

/// Warns whoever runs the process, once per call: as a `tracing` warning (target
/// `tower_resources_operation`) when a subscriber is installed and the `tracing` feature is on,
/// and on standard error otherwise (with no subscriber, the default setup, `tracing` would drop
/// it).
pub(crate) fn warn(message: &str) {
    #[cfg(feature = "tracing")]
    if has_subscriber() {
        tracing::warn!(target: crate::names::TARGET, "{message}");
        return;
    }
    eprintln!("WARN {}: {message}", crate::names::TARGET);
}

/// Whether a `tracing` subscriber other than the no-op one is in place.
#[cfg(feature = "tracing")]
fn has_subscriber() -> bool {
    !tracing::dispatcher::get_default(|dispatch| dispatch.is::<tracing::subscriber::NoSubscriber>())
}
