//! What the fleet limit tells whoever runs the process: its outages, its recoveries, and a
//! configured capacity that is not the fleet's. Under this crate's own `tracing` target,
//! `tower_resources_operation_redis`, so that a filter on it keeps them; on standard error
//! without the `tracing` feature, or without a subscriber (which would drop them).

/// The `tracing` target of this crate's lines.
pub(crate) const TARGET: &str = "tower_resources_operation_redis";

/// Something goes wrong that would otherwise go unseen.
pub(crate) fn warn(message: &str) {
    #[cfg(feature = "tracing")]
    if has_subscriber() {
        tracing::warn!(target: TARGET, "{message}");
        return;
    }
    eprintln!("WARN {TARGET}: {message}");
}

/// What ended a warning: the store reached again.
pub(crate) fn inform(message: &str) {
    #[cfg(feature = "tracing")]
    if has_subscriber() {
        tracing::info!(target: TARGET, "{message}");
        return;
    }
    eprintln!("INFO {TARGET}: {message}");
}

/// Whether a `tracing` subscriber other than the no-op one is in place.
#[cfg(feature = "tracing")]
fn has_subscriber() -> bool {
    !tracing::dispatcher::get_default(|dispatch| dispatch.is::<tracing::subscriber::NoSubscriber>())
}
