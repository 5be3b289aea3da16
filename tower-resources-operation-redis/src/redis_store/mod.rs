//! [`RedisStore`]: the fleet's [`Store`] in Redis (one server, or a Redis Cluster): each step
//! one Lua script ([`scripts`]), on one connection per limit that also hears the limit's
//! channel ([`transport`]).

mod codec;
mod errors;
mod scripts;
mod transport;
#[cfg(test)]
mod windows_tests;

use std::sync::Arc;
use std::time::Duration;

use redis::{Script, ScriptInvocation};
use tower_resources_operation::adaptive::Window;

use crate::error::Error;
use crate::fleet::control::{Known, Taken as TakenWindow, Ticked};
use crate::fleet::store::{
    Answer, Decision, Event, Refresh, Refreshed, State, Status, Store, Taken, Tick,
};
use codec::{Decoder, Encoder, Field, Malformed};
use scripts::SCRIPTS;
pub(crate) use transport::Transport;

/// Where a fleet limit's Redis is: one server, or (with the `cluster` feature) a Redis Cluster.
///
/// A `&str` or a `String` is one server's URL: `redis://host:port/db` (`rediss://` is not
/// built in), or `redis+unix:///path`.
///
/// ```
/// use tower_resources_operation_redis::Address;
///
/// let one: Address = "redis://redis.internal:6379/".into();
/// # drop(one);
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Address {
    /// One Redis server, by its URL.
    One(String),
    /// The nodes of a Redis Cluster (any of them: the rest are found from these), by their
    /// URLs. Every key of a limit shares one hash slot, so one shard serves the limit, and a
    /// failover of that shard's master is followed (see the crate docs, "Redis Cluster").
    #[cfg(feature = "cluster")]
    Cluster(Vec<String>),
}

impl Address {
    /// The nodes of a Redis Cluster.
    ///
    /// ```
    /// use tower_resources_operation_redis::Address;
    ///
    /// let cluster = Address::cluster(["redis://10.0.0.1:7000/", "redis://10.0.0.2:7000/"]);
    /// # drop(cluster);
    /// ```
    #[cfg(feature = "cluster")]
    pub fn cluster<I: IntoIterator<Item = S>, S: Into<String>>(nodes: I) -> Self {
        Address::Cluster(nodes.into_iter().map(Into::into).collect())
    }
}

impl From<&str> for Address {
    fn from(url: &str) -> Self {
        Address::One(url.to_owned())
    }
}

impl From<String> for Address {
    fn from(url: String) -> Self {
        Address::One(url)
    }
}

impl From<&String> for Address {
    fn from(url: &String) -> Self {
        Address::One(url.clone())
    }
}

/// The Redis names of one limit: one hash slot, `{prefix:name}:...`.
#[derive(Debug)]
pub(crate) struct Keys {
    all: [String; 10],
    pub(crate) channel: String,
}

impl Keys {
    pub(crate) fn new(prefix: &str, name: &str) -> Self {
        let slot = format!("{{{prefix}:{name}}}");
        let key = |what: &str| format!("{slot}:{what}");
        Self {
            all: [
                key("capacity"),
                key("holders"),
                key("queue"),
                key("waiting"),
                key("arrivals"),
                key("claims"),
                key("processes"),
                key("adaptive"),
                key("window"),
                key("leader"),
            ],
            channel: key("wake"),
        }
    }
}

/// A limit's settings, as every script needs them.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Settings {
    pub(crate) capacity: usize,
    pub(crate) lease_ttl: Duration,
    pub(crate) claim_timeout: Duration,
    pub(crate) max_queued: Option<usize>,
}

/// A fleet limit's store in Redis.
pub(crate) struct RedisStore {
    name: Arc<str>,
    keys: Keys,
    transport: Transport,
    settings: Settings,
}

impl RedisStore {
    pub(crate) fn new(
        name: Arc<str>,
        keys: Keys,
        transport: Transport,
        settings: Settings,
    ) -> Self {
        Self {
            name,
            keys,
            transport,
            settings,
        }
    }

    /// Runs `script`, with the limit's keys and common arguments, then its own (`arguments`,
    /// laid out as `layout`), and decodes its reply (laid out as `reply`) with `decode`.
    async fn call<T>(
        &self,
        script: &Script,
        name: &str,
        layout: &'static [Field],
        arguments: impl FnOnce(&mut Encoder<'_, '_>),
        reply: &'static [Field],
        decode: impl FnOnce(&mut Decoder<'_>) -> Result<T, Malformed>,
    ) -> Result<T, Error> {
        let mut invocation = script.prepare_invoke();
        for key in &self.keys.all {
            invocation.key(key);
        }
        self.common(&mut invocation);
        let mut encoder = Encoder::new(&mut invocation, layout);
        arguments(&mut encoder);
        encoder.finish();
        let values: Vec<String> = self.transport.invoke(&invocation).await?;
        let mut decoder = Decoder::new(&values, reply);
        decode(&mut decoder)
            .and_then(|decoded| decoder.finish().map(|()| decoded))
            .map_err(|malformed| malformed.into_error(&self.name, self.transport.address(), name))
    }

    fn malformed(&self, what: &str) -> Error {
        Error::unexpected(&self.name, self.transport.address(), what)
    }

    /// The arguments every script starts with ([`codec::COMMON`]).
    fn common(&self, invocation: &mut ScriptInvocation<'_>) {
        let mut common = Encoder::new(invocation, codec::COMMON);
        common
            .text("channel", &self.keys.channel)
            .number("ttl", ms(self.settings.lease_ttl) as f64)
            .text("default_cap", &self.settings.capacity.to_string())
            .number("claim_ms", ms(self.settings.claim_timeout) as f64)
            .text("publish", self.transport.publish_command());
        common.finish();
    }
}

/// A status of a refreshed id, as the refresh script says it.
fn status(value: &i64) -> Status {
    match value {
        1 => Status::Holds,
        2 => Status::Waits,
        3 => Status::TakenBack,
        _ => Status::Gone,
    }
}

impl Store for RedisStore {
    fn address(&self) -> &str {
        self.transport.address()
    }

    async fn connect(&self) -> Result<(), Error> {
        self.transport.connect().await
    }

    async fn take(&self, id: &str) -> Result<Taken, Error> {
        let max_queued = self.settings.max_queued.map_or(-1.0, |bound| bound as f64);
        let arguments = |args: &mut Encoder<'_, '_>| {
            args.text("id", id).number("max_queued", max_queued);
        };
        self.call(
            &SCRIPTS.take,
            "take",
            scripts::TAKE_ARGS,
            arguments,
            scripts::TAKE_REPLY,
            |reply| {
                let answer = match reply.number("status")? {
                    Some(1) => Answer::Granted,
                    Some(2) => Answer::Full,
                    _ => Answer::Queued,
                };
                Ok(Taken {
                    answer,
                    capacity: reply.count("capacity")?,
                    replicas: reply.count("replicas")?,
                })
            },
        )
        .await
    }

    async fn release(&self, ids: &[String]) -> Result<usize, Error> {
        self.call(
            &SCRIPTS.release,
            "release",
            scripts::RELEASE_ARGS,
            |args| {
                args.texts("ids", ids);
            },
            scripts::RELEASE_REPLY,
            |reply| reply.count("capacity"),
        )
        .await
    }

    async fn refresh(&self, books: &Refresh<'_>) -> Result<Refreshed, Error> {
        let arguments = |args: &mut Encoder<'_, '_>| {
            args.text("member", books.process)
                .texts("held", books.held)
                .texts("unheard", books.unheard)
                .texts("waiting", books.waiting);
        };
        let refreshed = self
            .call(
                &SCRIPTS.refresh,
                "refresh",
                scripts::REFRESH_ARGS,
                arguments,
                scripts::REFRESH_REPLY,
                |reply| {
                    Ok(Refreshed {
                        capacity: reply.count("capacity")?,
                        replicas: reply.count("replicas")?,
                        fleet_held: reply.count("fleet_held")?,
                        fleet_unheard: reply.count("fleet_unheard")?,
                        held: reply.numbers("held")?.iter().map(status).collect(),
                        unheard: reply.numbers("unheard")?.iter().map(status).collect(),
                        waiting: reply.numbers("waiting")?.iter().map(status).collect(),
                    })
                },
            )
            .await?;
        let lengths = (
            refreshed.held.len(),
            refreshed.unheard.len(),
            refreshed.waiting.len(),
        );
        if lengths != (books.held.len(), books.unheard.len(), books.waiting.len()) {
            return Err(self.malformed("a refresh of another length"));
        }
        Ok(refreshed)
    }

    async fn set_capacity(&self, capacity: usize) -> Result<usize, Error> {
        self.call(
            &SCRIPTS.set_capacity,
            "set_capacity",
            scripts::SET_CAPACITY_ARGS,
            |args| {
                args.number("capacity", capacity as f64);
            },
            scripts::SET_CAPACITY_REPLY,
            |reply| reply.count("capacity"),
        )
        .await
    }

    async fn state(&self) -> Result<State, Error> {
        self.call(
            &SCRIPTS.state,
            "state",
            scripts::STATE_ARGS,
            |_| {},
            scripts::STATE_REPLY,
            |reply| {
                Ok(State {
                    capacity: reply.count("capacity")?,
                    active: reply.count("active")?,
                    unheard: reply.count("unheard")?,
                    queued: reply.count("queued")?,
                    replicas: reply.count("replicas")?,
                    adaptive: reply.number("adaptive")? == Some(1),
                })
            },
        )
        .await
    }

    async fn tick(&self, tick: &Tick<'_>) -> Result<Ticked, Error> {
        let counts = tick.counts.fields();
        let total = |name: &str| {
            counts
                .iter()
                .find(|(n, _)| n == name)
                .map_or(0.0, |(_, value)| *value as f64)
        };
        // Each series' fields, in the order the script reads them.
        let mut prefixes: Vec<&str> = Vec::new();
        for (name, _) in &counts {
            if let Some((prefix, _)) = name.rsplit_once('/') {
                if !prefixes.contains(&prefix) {
                    prefixes.push(prefix);
                }
            }
        }
        let of = |prefix: &str, suffix: &str| {
            let name = format!("{prefix}/{suffix}");
            counts.iter().find(|(n, _)| *n == name).map(|(_, v)| *v)
        };
        let number = |value: u64| i64::try_from(value).unwrap_or(i64::MAX);
        let arguments = |args: &mut Encoder<'_, '_>| {
            args.text("candidate", tick.candidate)
                .number("leader_ttl", ms(tick.leader_ttl) as f64)
                .number("seen", tick.seen as f64)
                .number("ended", total("ended"))
                .number("congested", total("congested"))
                .number("stale", total("stale"))
                .number("rejected", total("rejected"))
                .number("shortest", ms(tick.shortest) as f64)
                .number("longest", ms(tick.longest) as f64)
                .number("tolerance", tick.tolerance)
                .records("series", &prefixes, |prefix, series| {
                    series.text("prefix", &format!("{prefix}/"));
                    for suffix in ["e", "o", "v", "t", "s", "q"] {
                        series.number(suffix, number(of(prefix, suffix).unwrap_or(0)));
                    }
                    series.number("m", of(prefix, "m").map_or(-1, number));
                })
                .number("starting", u8::from(tick.starting))
                .number("judged", tick.judged as f64);
        };
        self.call(
            &SCRIPTS.tick,
            "tick",
            scripts::TICK_ARGS,
            arguments,
            scripts::TICK_REPLY,
            decode_ticked,
        )
        .await
    }

    async fn decide(&self, decision: &Decision<'_>) -> Result<Option<usize>, Error> {
        let us = |us: Option<u64>| us.map_or(-1.0, |us| us as f64);
        let known = &decision.known;
        let arguments = |args: &mut Encoder<'_, '_>| {
            args.text("leader", decision.leader)
                .text("window", &decision.window.to_string())
                .number("capacity", decision.capacity as f64)
                .number("rtt_us", us(known.rtt_us))
                .number("baseline_us", us(known.baseline_us))
                .number("estimate_us", us(known.estimate_us))
                .text("handover", decision.handover);
        };
        self.call(
            &SCRIPTS.decide,
            "decide",
            scripts::DECIDE_ARGS,
            arguments,
            scripts::DECIDE_REPLY,
            // A negative answer: another process leads now, or took the window.
            |reply| {
                Ok(reply
                    .number("capacity")?
                    .and_then(|c| usize::try_from(c).ok()))
            },
        )
        .await
    }
}

/// `duration` in whole milliseconds, as the scripts take it.
fn ms(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

/// What was published on the limit's channel, as an event: `g <window> <ids>` places handed
/// over in the fleet's window `window` (0 for a fixed limit),
/// `c <capacity>`, `a <epoch> <decreased> <rtt> <baseline> <estimate>` a decision, `d` a
/// window due.
fn parse_message(message: &str) -> Option<Event> {
    if let Some(handed) = message.strip_prefix("g ") {
        let mut ids = handed.split(' ').peekable();
        // An earlier build's scripts say no window (an id is `process:count`, never a number):
        // the places are handed over all the same, in a window this process cannot tell.
        let window = match ids.peek().map(|first| first.parse::<u64>()) {
            Some(Ok(window)) => {
                ids.next();
                window
            }
            _ => 0,
        };
        return Some(Event::Handed {
            window,
            ids: ids.map(str::to_owned).collect(),
        });
    }
    if let Some(capacity) = message.strip_prefix("c ") {
        return capacity.parse().ok().map(Event::Capacity);
    }
    if message == "d" {
        return Some(Event::Due);
    }
    let decision = message.strip_prefix("a ")?;
    let mut parts = decision.split(' ').map(|part| part.parse::<i64>().ok());
    let mut next = || parts.next().flatten();
    let (epoch, decreased) = (next()?, next()?);
    let us = |value: Option<i64>| value.and_then(|v| u64::try_from(v).ok());
    Some(Event::Decided(Known {
        epoch: u64::try_from(epoch).ok()?,
        decreased: u64::try_from(decreased).unwrap_or(0),
        rtt_us: us(next()),
        baseline_us: us(next()),
        estimate_us: us(next()),
    }))
}

/// The tick script's reply: what the fleet knows, and the window's hash if it was taken.
fn decode_ticked(reply: &mut Decoder<'_>) -> Result<Ticked, Malformed> {
    let positive = |value: Option<i64>| value.and_then(|value| u64::try_from(value).ok());
    let taken = reply.number("taken")? == Some(1);
    let capacity = reply.count("capacity")?;
    let epoch = positive(reply.number("epoch")?)
        .ok_or_else(|| Malformed("the epoch is not a window".to_owned()))?;
    let leads = reply.number("leads")? == Some(1);
    let age_ms = positive(reply.number("age")?).unwrap_or(0);
    let known = Known {
        epoch,
        decreased: positive(reply.number("decreased")?).unwrap_or(0),
        rtt_us: positive(reply.number("rtt_us")?),
        baseline_us: positive(reply.number("baseline_us")?),
        estimate_us: positive(reply.number("estimate_us")?),
    };
    let handed = reply.text("baselines")?;
    let window = reply.pairs("window")?;
    Ok(Ticked {
        capacity,
        leads,
        age_ms,
        known,
        taken: taken.then(|| parse_window(&window)),
        handed,
    })
}

/// A window's hash, as `HGETALL` lists it: the fleet's counts ([`Window::from_fields`]) and
/// the load the store sampled. A field this crate did not write is skipped.
fn parse_window(pairs: &[(String, String)]) -> TakenWindow {
    let mut window = TakenWindow::default();
    let mut counts = Vec::new();
    for (name, value) in pairs {
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

#[cfg(test)]
mod tests {
    use super::*;
    use tower_resources_operation::{Executor, Operation};

    fn strings(fields: &[&str]) -> Vec<String> {
        fields.iter().map(|field| (*field).to_owned()).collect()
    }

    /// The tick's reply `values`, decoded whole.
    fn parse_ticked(values: &[String]) -> Result<Ticked, Malformed> {
        let mut reply = Decoder::new(values, scripts::TICK_REPLY);
        let ticked = decode_ticked(&mut reply)?;
        reply.finish()?;
        Ok(ticked)
    }

    #[test]
    fn a_tick_that_took_no_window_says_what_the_fleet_knows() {
        let ticked =
            parse_ticked(&strings(&["0", "7", "12", "0", "40", "", "", "", "", ""])).unwrap();
        assert_eq!(
            (ticked.capacity, ticked.leads, ticked.age_ms),
            (7, false, 40)
        );
        assert_eq!((ticked.known.epoch, ticked.known.decreased), (12, 0));
        assert_eq!(ticked.known.rtt_us, None);
        assert!(ticked.taken.is_none());
    }

    #[test]
    fn a_taken_window_makes_the_fleets_sample_series_by_series() {
        let fields = strings(&[
            "1",
            "8",
            "5",
            "1",
            "150",
            "3",
            "50000",
            "51000",
            "52000", // known
            "judge/inline/1000000/4.000/-1/12.500 nobody/knows/1/1/1/1 verify/subprocess/x",
            "ended",
            "8",
            "congested",
            "1",
            "stale",
            "2",
            "rejected",
            "0", // counts
            "samples",
            "4",
            "active_sum",
            "30",
            "peak",
            "9",
            "announced",
            "1",
            "verify/subprocess/e",
            "9",
            "verify/subprocess/o",
            "6",
            "verify/subprocess/v",
            "300000",
            "verify/subprocess/t",
            "6",
            "verify/subprocess/s",
            "300000",
            "verify/subprocess/q",
            "14648437",
            "verify/subprocess/m",
            "49000",
            "judge/inline/e",
            "2",
            "judge/inline/o",
            "2",
            "judge/inline/v",
            "2000000",
            "judge/inline/t",
            "2",
            "judge/inline/s",
            "2000000",
            "judge/inline/q",
            "1953125",
            "judge/inline/m",
            "1000000",
            "nobody/knows/e",
            "5",
            "verify/subprocess/zz",
            "1", // not ours: skipped
        ]);
        let ticked = parse_ticked(&fields).unwrap();
        assert!(ticked.leads);
        assert_eq!(ticked.known.baseline_us, Some(51_000));
        assert_eq!(
            ticked.handed,
            "judge/inline/1000000/4.000/-1/12.500 nobody/knows/1/1/1/1 verify/subprocess/x",
            "handed over as the last leader wrote it"
        );
        let adaptive = tower_resources_operation::adaptive::Adaptive::new(
            tower_resources_operation::adaptive::Vegas::default(),
            1..=64,
        );
        let taken = ticked.taken.unwrap();
        assert!(!taken.is_thin(8), "11 ended of 8 places");
        assert!(taken.is_thin(23), "11 ended of 23 places");
        let sample = taken.sample(8, &adaptive, ticked.age_ms);
        assert_eq!(
            (sample.ended, sample.congested, sample.stale_congested),
            (8, 1, 2)
        );
        let verify = sample
            .series_of(Operation::Verify, Executor::Subprocess)
            .expect("the verifies, read by kind");
        assert_eq!(verify.mean_run_time, Some(Duration::from_millis(50)));
        assert_eq!(verify.min_run_time, Some(Duration::from_millis(49)));
        let judge = sample
            .series_of(Operation::Judge, Executor::Inline)
            .unwrap();
        assert_eq!(judge.mean_run_time, Some(Duration::from_secs(1)));
        assert_eq!(sample.series().count(), 2, "{sample:?}");
        assert_eq!((sample.peak_in_flight, sample.in_flight), (9, 7.5));
        assert!(!sample.round_trip, "congested");
        assert_eq!(sample.elapsed, Duration::from_millis(150));
    }

    #[test]
    fn what_is_published_is_heard_as_the_fleets_events() {
        assert_eq!(
            parse_message("g 7 a:1 b:2"),
            Some(Event::Handed {
                window: 7,
                ids: vec!["a:1".into(), "b:2".into()]
            })
        );
        assert_eq!(
            parse_message("g a:1 b:2"),
            Some(Event::Handed {
                window: 0,
                ids: vec!["a:1".into(), "b:2".into()]
            }),
            "no window: handed over all the same"
        );
        assert_eq!(parse_message("c 12"), Some(Event::Capacity(12)));
        assert_eq!(parse_message("d"), Some(Event::Due));
        let Some(Event::Decided(known)) = parse_message("a 7 5 50000 -1 52000") else {
            panic!("a decision");
        };
        assert_eq!((known.epoch, known.decreased), (7, 5));
        assert_eq!(
            (known.rtt_us, known.baseline_us, known.estimate_us),
            (Some(50_000), None, Some(52_000))
        );
        assert_eq!(parse_message("x"), None);
        assert_eq!(parse_message("c many"), None);
    }
}
