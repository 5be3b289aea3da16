//! [`RedisLimitBuilder`]: a fleet limit's settings, and where its background work runs.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Duration;

use opentelemetry::metrics::Meter;
use tokio::sync::mpsc::unbounded_channel;
use tower_resources_operation::adaptive::Adaptive;
use tower_resources_operation::limit::Capacity;

use crate::error::Error;
use crate::fleet::assemble;
use crate::fleet::background::Background;
use crate::fleet::books::new_token;
use crate::fleet::control::{AdaptiveSettings, FleetControl};
use crate::fleet::member::Settings;
use crate::fleet::share::Unreachable;
use crate::limit::RedisLimit;
use crate::redis_store::{self, Address, Keys, RedisStore, Transport};

impl RedisLimit {
    /// A limit named `name` (shared by every process that names it), of `capacity` operations
    /// at once across the fleet if the fleet has no capacity yet: see [`RedisLimitBuilder`].
    ///
    /// The name is also the limit's attribute in the metrics: 1 to 64 characters among
    /// `A-Z a-z 0-9 _ . : / -`, starting with a letter. It may be a `&'static str` or a
    /// `String` read from configuration.
    ///
    /// ```
    /// use tower_resources_operation_redis::RedisLimit;
    ///
    /// let from_config = String::from("judges");
    /// let builder = RedisLimit::builder(from_config, 8);
    /// # drop(builder);
    /// ```
    ///
    /// # Panics
    ///
    /// If `name` cannot name a limit (the message says why), as `LimitBuilder::name` of
    /// `tower-resources-operation` does, or if `capacity` is 0, as `Limit::new(0)` does.
    #[track_caller]
    pub fn builder(name: impl Into<Cow<'static, str>>, capacity: usize) -> RedisLimitBuilder {
        RedisLimitBuilder::new(name.into(), capacity)
    }
}

/// Makes a [`RedisLimit`]: its lease TTL, call timeout, queue bound, what it does when Redis
/// cannot be reached, and where its background work runs.
///
/// ```
/// use std::time::Duration;
/// use tower_resources_operation_redis::{RedisLimit, Unreachable};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), tower_resources_operation_redis::Error> {
/// // Within a tokio runtime: `build` spawns the limit's background task on it.
/// let sandboxes = RedisLimit::builder("sandboxes", 32)
///     .lease_ttl(Duration::from_secs(15))
///     .max_queued(100)
///     .when_unreachable(Unreachable::Open)
///     .build("redis://127.0.0.1:6379/")?; // connects at the first call, not here
/// assert_eq!((sandboxes.name(), sandboxes.capacity()), ("sandboxes", 32));
/// # Ok(())
/// # }
/// ```
///
/// Outside a runtime, `build` says so, and `build_pair` hands the work to the caller:
///
/// ```
/// use tower_resources_operation_redis::{ErrorKind, RedisLimit};
///
/// let outside = RedisLimit::builder("sandboxes", 32).build("redis://127.0.0.1:6379/");
/// assert_eq!(outside.unwrap_err().kind(), ErrorKind::NoRuntime);
///
/// let (sandboxes, background) = RedisLimit::builder("sandboxes", 32)
///     .build_pair("redis://127.0.0.1:6379/")
///     .unwrap();
/// let runtime = tokio::runtime::Runtime::new().unwrap();
/// runtime.spawn(background);
/// # drop(sandboxes);
/// ```
#[derive(Clone, Debug)]
#[must_use = "a builder makes nothing until `build`"]
pub struct RedisLimitBuilder {
    name: Arc<str>,
    capacity: usize,
    /// `None`: the default, 2 s, or three call timeouts if that is longer.
    lease_ttl: Option<Duration>,
    call_timeout: Duration,
    fallback_poll: Duration,
    /// `None`: 250 ms, or a third of the TTL if that is shorter.
    claim_timeout: Option<Duration>,
    max_queued: Option<usize>,
    unreachable: Unreachable,
    overwrite_capacity: bool,
    key_prefix: String,
    meters: Vec<Meter>,
    adaptive: Option<AdaptiveSettings>,
    adaptive_tick: Duration,
}

impl RedisLimitBuilder {
    #[track_caller]
    fn new(name: Cow<'static, str>, capacity: usize) -> Self {
        // The name becomes a metric attribute: refused here, as the core refuses a `Limit`'s.
        if let Err(error) = Capacity::of_limit(Some(&name), || None) {
            panic!("{error}");
        }
        assert!(
            capacity > 0,
            "tower-resources-operation-redis: the fleet limit {name:?} has a capacity of 0, \
             which admits nothing; give it 1 or more (set_capacity(0) pauses a fleet that \
             serves)"
        );
        Self {
            name: Arc::from(name),
            capacity,
            lease_ttl: None,
            call_timeout: Duration::from_millis(500),
            fallback_poll: Duration::from_secs(1),
            claim_timeout: None,
            max_queued: None,
            unreachable: Unreachable::Share,
            overwrite_capacity: false,
            key_prefix: "tro".to_owned(),
            meters: Vec::new(),
            adaptive: None,
            adaptive_tick: Duration::from_millis(50),
        }
    }

    /// How long a held place outlives a member that stops extending it (see
    /// [choosing the TTL](crate#choosing-the-lease-ttl)). Defaults to 2 s, or to three call
    /// timeouts if that is longer; at least three times the call timeout, and at least 30 ms
    /// (checked when the limit is built, whatever the order of the settings).
    pub fn lease_ttl(mut self, ttl: Duration) -> Self {
        self.lease_ttl = Some(ttl);
        self
    }

    /// How long any one call to Redis may take, connecting included, before the limit gives
    /// the configured answer. Defaults to 500 ms.
    ///
    /// # Panics
    ///
    /// If `timeout` is shorter than 1 ms, naming it.
    #[track_caller]
    pub fn call_timeout(mut self, timeout: Duration) -> Self {
        self.call_timeout = at_least_a_millisecond("a call timeout", timeout);
        self
    }

    /// How often, at most, a waiter learns what became of its ticket while no wake-up reaches
    /// it (the fallback for a lost wake-up; one call per process, whatever the number of
    /// waiters), and how often Redis is asked again while it is down. Defaults to 1 s; never
    /// less often than every third of the TTL.
    ///
    /// # Panics
    ///
    /// If `every` is shorter than 1 ms, naming it.
    #[track_caller]
    pub fn fallback_poll(mut self, every: Duration) -> Self {
        self.fallback_poll = at_least_a_millisecond("a fallback poll", every);
        self
    }

    /// How long a place handed over to a waiter is kept for it before it returns to the fleet
    /// (see [members that die](crate#members-that-die)). Its process takes it up at once when
    /// it hears of it (one round trip); one that is gone never does, and then every ticket of
    /// that process leaves the queue with the place. Defaults to 250 ms (a third of the lease
    /// TTL if that is shorter): far below the lease TTL, and far above a round trip to Redis.
    /// At most a third of the TTL (checked when the limit is built). A waiter whose process is slower than this to
    /// take its place up (a pause, a Redis slower than the claim timeout) joins the queue
    /// again at its end.
    ///
    /// # Panics
    ///
    /// If `timeout` is shorter than 1 ms, naming it.
    #[track_caller]
    pub fn claim_timeout(mut self, timeout: Duration) -> Self {
        self.claim_timeout = Some(at_least_a_millisecond("a claim timeout", timeout));
        self
    }

    /// At most `max_queued` operations wait, across the whole fleet: one more is turned away
    /// at once with `Rejection::QueueFull`. `0` turns away every operation that finds no free
    /// place. While Redis is out of reach, each replica queues at most its share of it. Defaults
    /// to no bound.
    pub fn max_queued(mut self, max_queued: usize) -> Self {
        self.max_queued = Some(max_queued);
        self
    }

    /// What the limit answers while Redis cannot be reached: run on this replica's share of
    /// the fleet's last capacity ([`Unreachable::Share`], the default), turn operations away
    /// ([`Unreachable::Closed`]), or admit them without the fleet limit
    /// ([`Unreachable::Open`]).
    pub fn when_unreachable(mut self, answer: Unreachable) -> Self {
        self.unreachable = answer;
        self
    }

    /// The same as `when_unreachable(Unreachable::Open)`: admits the operation without the
    /// fleet limit, and counts it in `gym.resources.limit.failed_open`.
    pub fn fail_open(self) -> Self {
        self.when_unreachable(Unreachable::Open)
    }

    /// The same as `when_unreachable(Unreachable::Closed)`: turns the operation away with
    /// `Rejection::Unavailable`.
    pub fn fail_closed(self) -> Self {
        self.when_unreachable(Unreachable::Closed)
    }

    /// Makes the builder's capacity the whole fleet's at this process's first call (as
    /// [`RedisLimit::set_capacity`] would), whatever Redis stores.
    ///
    /// By default the fleet's stored capacity wins: the builder's is stored only if the fleet
    /// has none yet, and a process built with another one keeps the fleet's, with one warning
    /// that names both. Give this to the one process (a deploy step, an operator's job) whose
    /// configuration is the fleet's; every replica that has it resets the fleet's capacity
    /// when it starts, undoing a `set_capacity` made meanwhile.
    pub fn overwrite_capacity(mut self) -> Self {
        self.overwrite_capacity = true;
        self
    }

    /// Prefixes the limit's Redis keys and channel with `prefix` (`{prefix:name}:...`, one hash
    /// slot). Defaults to `tro`.
    pub fn key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.key_prefix = prefix.into();
        self
    }

    /// Reports the limit's own instruments (`gym.resources.limit.failed_open` and
    /// `gym.resources.limit.leases_lost`, see [`metrics`](crate::metrics)) through `meter`,
    /// as [`RedisLimit::register_metrics`] does. Without it, they are not registered: the
    /// per-limit instruments of `tower-resources-operation` (capacity, active, queued) come
    /// through the layer's metrics either way.
    pub fn meter(mut self, meter: &Meter) -> Self {
        self.meters.push(meter.clone());
        self
    }

    /// Makes the fleet's capacity adaptive, as `LimitBuilder::adaptive` of
    /// `tower-resources-operation` makes one process's: the same [`Adaptive`] (its algorithm,
    /// bounds and tolerance; its interval is the longest window), run by the same controller
    /// pieces, once per window of the fleet, in whichever replica leads (see [an adaptive fleet
    /// limit](crate#an-adaptive-fleet-limit)). A fleet's windows are always of a round trip:
    /// the operation count of `Adaptive::window` is not read.
    ///
    /// Start at the bottom of the bounds (the builder's capacity is the fleet's only if the
    /// fleet has none yet): the algorithms take their baseline at low load. Give every replica
    /// the same settings: the leader's are the fleet's.
    ///
    /// ```
    /// use tower_resources_operation::adaptive::{Adaptive, Vegas};
    /// use tower_resources_operation_redis::RedisLimit;
    ///
    /// let (judges, background) = RedisLimit::builder("judges", 1)
    ///     .adaptive(Adaptive::new(Vegas::default(), 1..=64).tolerance(0.05))
    ///     .build_pair("redis://127.0.0.1:6379/")
    ///     .unwrap();
    /// assert!(judges.is_adaptive());
    /// assert_eq!(judges.adaptive_bounds(), Some(1..=64));
    /// # drop((judges, background));
    /// ```
    pub fn adaptive(mut self, adaptive: Adaptive) -> Self {
        self.adaptive = Some(AdaptiveSettings {
            adaptive,
            tick: self.adaptive_tick,
        });
        self
    }

    /// How often an [adaptive](Self::adaptive) limit's process sends its counts to the
    /// fleet's window, and its leader looks whether the window is due: one call per process
    /// per tick, whatever the load. A window lasts at least two ticks (and at least 100 ms).
    /// Defaults to 50 ms. Give it before or after `adaptive`.
    ///
    /// # Panics
    ///
    /// If `tick` is shorter than 1 ms.
    #[track_caller]
    pub fn adaptive_tick(mut self, tick: Duration) -> Self {
        self.adaptive_tick = at_least_a_millisecond("an adaptive tick", tick);
        self
    }

    /// The limit, on the Redis at `address` (a `redis://host:port/db` URL, `redis+unix:///path`,
    /// or with the `cluster` feature an [`Address::cluster`]), with its background task
    /// spawned on the current tokio runtime.
    ///
    /// Call it within the runtime that serves for as long as the limit does (with its time and
    /// IO drivers enabled); the task ends once every handle and permit is gone. The connection
    /// is made by the background task's first refresh, or the first call, not here, so a
    /// process can start while Redis is away (see [`RedisLimit::ready`]); its own tasks (the
    /// `redis` crate's connection driver) are spawned on the runtime of the call that makes it.
    ///
    /// # Errors
    ///
    /// What only the environment can say: [`ErrorKind::InvalidAddress`](crate::ErrorKind::InvalidAddress)
    /// if `address` is not a Redis URL, and [`NoRuntime`](crate::ErrorKind::NoRuntime) outside
    /// a tokio runtime (see [`build_pair`](Self::build_pair)).
    ///
    /// # Panics
    ///
    /// If the lease TTL is shorter than three call timeouts, or than 30 ms, or the claim
    /// timeout longer than a third of the TTL, naming them: a bad value is refused when the
    /// limit is built, as every other one of this builder and of `tower-resources-operation`
    /// is.
    #[track_caller]
    pub fn build(self, address: impl Into<Address>) -> Result<RedisLimit, Error> {
        let name = Arc::clone(&self.name);
        let (limit, background) = self.build_pair(address)?;
        let runtime = tokio::runtime::Handle::try_current()
            .map_err(|cause| Error::no_runtime(&name, limit.address(), cause))?;
        runtime.spawn(background);
        Ok(limit)
    }

    /// The limit, on the Redis at `address`, and its background work for the caller to run
    /// (as tower's `Buffer::pair` does): spawn it on the runtime of your choice, or poll it
    /// alongside your server. Needs no runtime to be called.
    ///
    /// The limit works only while [`Background`] runs: see there. Every call of the limit,
    /// and the future, need a tokio runtime with its time and IO drivers enabled.
    ///
    /// # Errors
    ///
    /// As [`build`](Self::build), but never `NoRuntime`.
    ///
    /// # Panics
    ///
    /// As [`build`](Self::build).
    #[track_caller]
    pub fn build_pair(
        self,
        address: impl Into<Address>,
    ) -> Result<(RedisLimit, Background), Error> {
        let name = Arc::clone(&self.name);
        let shortest = (self.call_timeout * 3).max(Duration::from_millis(30));
        let lease_ttl = self
            .lease_ttl
            .unwrap_or_else(|| Duration::from_secs(2).max(self.call_timeout * 3));
        assert!(
            lease_ttl >= shortest,
            "tower-resources-operation-redis: the fleet limit {name:?}'s lease TTL ({:?}) must \
             be at least {shortest:?}: three call timeouts of {:?}, and at least 30 ms",
            lease_ttl,
            self.call_timeout
        );
        let claim_timeout = self
            .claim_timeout
            .unwrap_or_else(|| Duration::from_millis(250).min(lease_ttl / 3));
        assert!(
            claim_timeout * 3 <= lease_ttl,
            "tower-resources-operation-redis: the fleet limit {name:?}'s claim timeout ({:?}) \
             must be at most a third of its lease TTL ({:?})",
            claim_timeout,
            lease_ttl
        );
        let keys = Keys::new(&self.key_prefix, &name);
        let (events, heard) = unbounded_channel();
        let transport = Transport::open(
            Arc::clone(&name),
            &address.into(),
            keys.channel.clone(),
            self.call_timeout,
            events,
        )?;
        let store = RedisStore::new(
            Arc::clone(&name),
            keys,
            transport,
            redis_store::Settings {
                capacity: self.capacity,
                lease_ttl,
                claim_timeout,
                max_queued: self.max_queued,
            },
        );
        let token = new_token();
        let settings = Settings {
            name: Arc::clone(&name),
            capacity: self.capacity,
            overwrite: self.overwrite_capacity,
            max_queued: self.max_queued,
            unreachable: self.unreachable,
            lease_ttl,
            call_timeout: self.call_timeout,
            fallback_poll: self.fallback_poll.min(lease_ttl / 3),
            claim_timeout,
        };
        let control = self.adaptive.map(|mut adaptive| {
            adaptive.tick = self.adaptive_tick;
            FleetControl::new(adaptive, &token, self.call_timeout, lease_ttl)
        });
        let (handle, background) = assemble(store, settings, token, control, heard);
        let limit = RedisLimit::from_handle(handle);
        for meter in &self.meters {
            limit.register_metrics(meter);
        }
        Ok((limit, background))
    }
}

/// `duration`, if it is 1 ms or more; otherwise a panic that names `what` and the value.
#[track_caller]
fn at_least_a_millisecond(what: &str, duration: Duration) -> Duration {
    assert!(
        duration >= Duration::from_millis(1),
        "tower-resources-operation-redis: {what} must be at least 1 ms; got {duration:?}"
    );
    duration
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[should_panic(expected = "judges of 2026")]
    fn a_name_that_cannot_name_a_limit_is_refused() {
        let _ = RedisLimit::builder(String::from("judges of 2026"), 1);
    }

    #[test]
    #[should_panic(expected = "claim timeout (4s) must be at most a third of its lease TTL")]
    fn a_claim_timeout_longer_than_a_third_of_the_ttl_is_refused() {
        let _ = RedisLimit::builder("judges", 1)
            .claim_timeout(Duration::from_secs(4))
            .build_pair("redis://127.0.0.1:6379/");
    }
}
