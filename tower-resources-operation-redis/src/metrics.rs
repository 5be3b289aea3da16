//! The fleet limit's own instruments, registered only when asked
//! ([`RedisLimitBuilder::meter`](crate::RedisLimitBuilder::meter),
//! [`RedisLimit::register_metrics`](crate::RedisLimit::register_metrics)).
//!
//! | name | kind | unit | attributes | when |
//! |---|---|---|---|---|
//! | [`FAILED_OPEN_INSTRUMENT`] | observable counter (u64) | `{operation}` | [`LIMIT_ATTRIBUTE`] | at each collection: operations this process admitted without the fleet limit, failing open, because Redis could not be reached |
//! | [`LEASES_LOST_INSTRUMENT`] | observable counter (u64) | `{operation}` | [`LIMIT_ATTRIBUTE`] | at each collection: leases of this process found lost while their operations ran (Redis restarted without persistence, a pause longer than the TTL) |
//! | [`UNHEARD_INSTRUMENT`] | observable gauge (i64) | `{operation}` | [`LIMIT_ATTRIBUTE`] | at each collection: places of the fleet held by members it has not heard from within half a lease TTL, as this process's last refresh read them from Redis (the same figure in every replica: read it once) |
//!
//! A member that dies holding places stops reporting its `active`; until its leases lapse (a
//! lease TTL) the places it held read here, so that the stall does not read as a saturated
//! limit with nothing running.
//!
//! Each callback holds the limit weakly: once every handle and permit of a limit is gone, it
//! reports nothing more. The per-limit instruments of `tower-resources-operation`
//! (`gym.resources.limit.capacity`, `.active`, `.queued`, and `gym.resources.operation.limit`)
//! come through the layer's metrics, registered there, whether or not these are.
//!
//! ```
//! use opentelemetry::metrics::MeterProvider as _;
//! use opentelemetry_sdk::metrics::SdkMeterProvider;
//! use tower_resources_operation_redis::RedisLimit;
//!
//! let provider = SdkMeterProvider::builder().build();
//! let (judges, background) = RedisLimit::builder("judges", 8)
//!     .meter(&provider.meter("my-server"))
//!     .build_pair("redis://127.0.0.1:6379/")
//!     .unwrap();
//! # drop((judges, background));
//! ```

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use opentelemetry::metrics::Meter;
use opentelemetry::KeyValue;

use crate::fleet::member::{Handle, Member};
use crate::redis_store::RedisStore;

/// Observable counter, `{operation}`: operations a fleet limit admitted without itself because
/// it could not reach Redis and was told to [fail open](crate::RedisLimitBuilder::fail_open),
/// in this process, by [`LIMIT_ATTRIBUTE`].
pub const FAILED_OPEN_INSTRUMENT: &str = "gym.resources.limit.failed_open";

/// Observable counter, `{operation}`: leases of a fleet limit found lost while their
/// operations ran (Redis restarted without persistence, or the process paused past the lease
/// TTL), in this process, by [`LIMIT_ATTRIBUTE`].
pub const LEASES_LOST_INSTRUMENT: &str = "gym.resources.limit.leases_lost";

/// Observable gauge, `{operation}`: places of a fleet limit held by members the fleet has not
/// heard from within half a lease TTL (one that died holding them, until their leases lapse),
/// as this process last read them from Redis, by [`LIMIT_ATTRIBUTE`].
pub const UNHEARD_INSTRUMENT: &str = "gym.resources.limit.unheard";

/// Attribute key of a limit's name (`tower-resources-operation`'s, re-exported).
pub use tower_resources_operation::names::LIMIT_ATTRIBUTE;

/// Registers the limit's instruments on `meter`.
pub(crate) fn register(meter: &Meter, handle: &Arc<Handle<RedisStore>>) {
    for (name, description, count) in [
        (
            FAILED_OPEN_INSTRUMENT,
            "Operations a fleet limit admitted without itself, failing open, because it could not reach Redis.",
            (|member| &member.counts.failed_open) as fn(&Member<RedisStore>) -> &AtomicU64,
        ),
        (
            LEASES_LOST_INSTRUMENT,
            "Leases of a fleet limit found lost while their operations ran.",
            |member| &member.counts.leases_lost,
        ),
    ] {
        let limit: Weak<Handle<RedisStore>> = Arc::downgrade(handle);
        let attributes = [KeyValue::new(LIMIT_ATTRIBUTE, Arc::clone(&handle.member.settings.name))];
        meter
            .u64_observable_counter(name)
            .with_unit("{operation}")
            .with_description(description)
            .with_callback(move |observer| {
                if let Some(limit) = limit.upgrade() {
                    observer.observe(count(&limit.member).load(Ordering::Relaxed), &attributes);
                }
            })
            .build();
    }
    let limit: Weak<Handle<RedisStore>> = Arc::downgrade(handle);
    let attributes = [KeyValue::new(
        LIMIT_ATTRIBUTE,
        Arc::clone(&handle.member.settings.name),
    )];
    meter
        .i64_observable_gauge(UNHEARD_INSTRUMENT)
        .with_unit("{operation}")
        .with_description(
            "Places of a fleet limit held by members it has not heard from within half a lease TTL.",
        )
        .with_callback(move |observer| {
            if let Some(limit) = limit.upgrade() {
                let unheard = limit.member.places.unheard.load(Ordering::Relaxed);
                observer.observe(i64::try_from(unheard).unwrap_or(i64::MAX), &attributes);
            }
        })
        .build();
}
