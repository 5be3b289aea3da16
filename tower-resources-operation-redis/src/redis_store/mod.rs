//! [`RedisStore`]: the fleet's [`Store`] in Redis (one server, or a Redis Cluster): each step
//! one Lua script ([`scripts`]), on one connection per limit that also hears the limit's
//! channel ([`transport`]).

mod errors;
mod scripts;
mod transport;
#[cfg(test)]
mod windows_tests;

use std::sync::Arc;
use std::time::Duration;

use redis::{FromRedisValue, Script, ScriptInvocation};
use tower_resources_operation::adaptive::Window;

use crate::error::Error;
use crate::fleet::control::{Known, Taken as TakenWindow, Ticked};
use crate::fleet::store::{
    Answer, Decision, Event, Refresh, Refreshed, State, Status, Store, Taken, Tick,
};
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

    /// `script` with the limit's keys and common arguments; the caller adds its own.
    fn invocation<'a>(&self, script: &'a Script) -> ScriptInvocation<'a> {
        let mut invocation = script.prepare_invoke();
        for key in &self.keys.all {
            invocation.key(key);
        }
        invocation
            .arg(&self.keys.channel)
            .arg(ms(self.settings.lease_ttl))
            .arg(self.settings.capacity)
            .arg(ms(self.settings.claim_timeout))
            .arg(self.transport.publish_command());
        invocation
    }

    async fn run<T: FromRedisValue + Send>(
        &self,
        invocation: &ScriptInvocation<'_>,
    ) -> Result<T, Error> {
        self.transport.invoke(invocation).await
    }

    fn malformed(&self, what: &str) -> Error {
        Error::unexpected(&self.name, self.transport.address(), what)
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
        let mut invocation = self.invocation(&SCRIPTS.acquire);
        let max_queued = self
            .settings
            .max_queued
            .map_or(-1, |bound| i64::try_from(bound).unwrap_or(i64::MAX));
        invocation.arg(id).arg(max_queued);
        let (status, capacity, replicas): (i64, usize, usize) = self.run(&invocation).await?;
        let answer = match status {
            1 => Answer::Granted,
            2 => Answer::Full,
            _ => Answer::Queued,
        };
        Ok(Taken {
            answer,
            capacity,
            replicas,
        })
    }

    async fn release(&self, ids: &[String]) -> Result<usize, Error> {
        let mut invocation = self.invocation(&SCRIPTS.release);
        invocation.arg(ids);
        self.run(&invocation).await
    }

    async fn refresh(&self, books: &Refresh<'_>) -> Result<Refreshed, Error> {
        let mut invocation = self.invocation(&SCRIPTS.refresh);
        invocation
            .arg(books.process)
            .arg(books.held.len())
            .arg(books.unheard.len())
            .arg(books.held)
            .arg(books.unheard)
            .arg(books.waiting);
        let answer: Vec<i64> = self.run(&invocation).await?;
        let expected = 2 + books.held.len() + books.unheard.len() + books.waiting.len();
        if answer.len() != expected {
            return Err(self.malformed("a refresh of another length"));
        }
        let count = |value: i64| usize::try_from(value).unwrap_or(0);
        let status = |value: &i64| match value {
            1 => Status::Holds,
            2 => Status::Waits,
            3 => Status::TakenBack,
            _ => Status::Gone,
        };
        let (held, rest) = answer[2..].split_at(books.held.len());
        let (unheard, waiting) = rest.split_at(books.unheard.len());
        Ok(Refreshed {
            capacity: count(answer[0]),
            replicas: count(answer[1]),
            held: held.iter().map(status).collect(),
            unheard: unheard.iter().map(status).collect(),
            waiting: waiting.iter().map(status).collect(),
        })
    }

    async fn set_capacity(&self, capacity: usize) -> Result<usize, Error> {
        let mut invocation = self.invocation(&SCRIPTS.set_capacity);
        invocation.arg(capacity);
        self.run(&invocation).await
    }

    async fn state(&self) -> Result<State, Error> {
        let invocation = self.invocation(&SCRIPTS.state);
        let (capacity, active, queued, replicas, adaptive): (usize, usize, usize, usize, i64) =
            self.run(&invocation).await?;
        Ok(State {
            capacity,
            active,
            queued,
            replicas,
            adaptive: adaptive == 1,
        })
    }

    async fn tick(&self, tick: &Tick<'_>) -> Result<Ticked, Error> {
        let mut invocation = self.invocation(&SCRIPTS.fleet_tick);
        let fields = tick.counts.fields();
        let field = |name: &str| {
            fields
                .iter()
                .find(|(n, _)| n == name)
                .map_or(0, |(_, v)| *v)
        };
        invocation
            .arg(tick.candidate)
            .arg(ms(tick.leader_ttl))
            .arg(tick.seen)
            .arg(field("ended"))
            .arg(field("congested"))
            .arg(field("stale"))
            .arg(field("rejected"))
            .arg(ms(tick.shortest))
            .arg(ms(tick.longest))
            .arg(tick.tolerance);
        // Each series' fields, in the order the script reads them.
        let mut series: Vec<&str> = Vec::new();
        for (name, _) in &fields {
            if let Some((prefix, _)) = name.rsplit_once('/') {
                if !series.contains(&prefix) {
                    series.push(prefix);
                }
            }
        }
        invocation.arg(series.len());
        for prefix in series {
            let of = |suffix: &str| {
                let name = format!("{prefix}/{suffix}");
                fields.iter().find(|(n, _)| *n == name).map(|(_, v)| *v)
            };
            invocation.arg(format!("{prefix}/"));
            for suffix in ["e", "o", "v", "t", "s", "q"] {
                invocation.arg(of(suffix).unwrap_or(0));
            }
            invocation.arg(of("m").map_or(-1, |us| i64::try_from(us).unwrap_or(i64::MAX)));
        }
        invocation.arg(u8::from(tick.starting)).arg(tick.judged);
        let fields: Vec<String> = self.run(&invocation).await?;
        parse_ticked(&fields).ok_or_else(|| self.malformed("a malformed tick"))
    }

    async fn decide(&self, decision: &Decision<'_>) -> Result<Option<usize>, Error> {
        let mut invocation = self.invocation(&SCRIPTS.fleet_decide);
        let us = |us: Option<u64>| us.map_or(-1, |us| i64::try_from(us).unwrap_or(i64::MAX));
        let known = &decision.known;
        invocation
            .arg(decision.leader)
            .arg(decision.window)
            .arg(decision.capacity)
            .arg(us(known.rtt_us))
            .arg(us(known.baseline_us))
            .arg(us(known.estimate_us))
            .arg(decision.handover);
        let capacity: i64 = self.run(&invocation).await?;
        // A negative answer: another process leads now, or took the window.
        Ok(usize::try_from(capacity).ok())
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

/// The tick script's strings: the known state, then, if the window was taken, the window's
/// hash as field, value pairs (each series' counts under its [`series_field`] prefix).
fn parse_ticked(fields: &[String]) -> Option<Ticked> {
    let number = |index: usize| -> Option<u64> {
        fields
            .get(index)
            .and_then(|field| field.parse::<i64>().ok())
            .and_then(|value| u64::try_from(value).ok())
    };
    let taken = number(0)? == 1;
    let known = Known {
        epoch: number(2)?,
        decreased: number(5).unwrap_or(0),
        rtt_us: number(6),
        baseline_us: number(7),
        estimate_us: number(8),
    };
    let taken = taken.then(|| parse_window(fields.get(10..).unwrap_or_default()));
    Some(Ticked {
        capacity: usize::try_from(number(1)?).unwrap_or(usize::MAX),
        leads: number(3)? == 1,
        age_ms: number(4).unwrap_or(0),
        known,
        taken,
        handed: fields.get(9).cloned().unwrap_or_default(),
    })
}

/// A window's hash, as `HGETALL` lists it: the fleet's counts ([`Window::from_fields`]) and
/// the load the store sampled. A field this crate did not write is skipped.
fn parse_window(pairs: &[String]) -> TakenWindow {
    let mut window = TakenWindow::default();
    let mut counts = Vec::new();
    for pair in pairs.chunks_exact(2) {
        let Ok(value) = pair[1].parse::<i64>() else {
            continue;
        };
        let value = u64::try_from(value).unwrap_or(0);
        match pair[0].as_str() {
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
