//! [`RedisStore`]: the fleet's [`Store`] in Redis (one server, or a Redis Cluster): each step
//! one Lua script ([`scripts`]), on one connection per limit that also hears the limit's
//! channel ([`transport`]).

mod address;
mod codec;
mod errors;
mod events;
mod scripts;
#[cfg(test)]
mod tick_tests;
mod transport;
#[cfg(test)]
mod windows_tests;

use std::sync::Arc;
use std::time::Duration;

use redis::{Script, ScriptInvocation};

use crate::error::Error;
use crate::fleet::store::{
    Answer, Decision, Known, Refresh, Refreshed, State, Status, Store, Taken, TakenWindow, Tick,
    Ticked,
};
pub use address::Address;
pub(crate) use address::Keys;
use codec::{Decoder, Encoder, Field, Malformed};
pub(crate) use events::parse_message;
use scripts::SCRIPTS;
pub(crate) use transport::Transport;

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

    async fn state(&self, member: &str) -> Result<State, Error> {
        self.call(
            &SCRIPTS.state,
            "state",
            scripts::STATE_ARGS,
            |args| {
                args.text("member", member);
            },
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
        taken: taken.then(|| TakenWindow::from_fields(&window)),
        handed,
    })
}
