//! An adaptive limit's window in the in-memory store: the tick and the decision scripts.

use std::collections::HashMap;

use super::step::Step;
use crate::fleet::store::{Decision, Event, Known, TakenWindow, Tick, Ticked};

/// The tick script: the member's counts into the window, the window's load sampled, the
/// leader's lease, and the window taken if it is due and this member leads.
pub(super) fn tick(step: &mut Step<'_>, tick: &Tick<'_>) -> Ticked {
    let now = step.now;
    let capacity = step.capacity() as i64;
    let adaptive = &mut step.data.adaptive;
    let epoch = *adaptive.epoch.get_or_insert_with(|| {
        adaptive.opened = Some(now);
        1
    });
    adaptive.ticked = Some(now);
    let own = tick.seen == epoch;
    let fields = tick.counts.fields();
    let field = |name: &str| {
        fields
            .iter()
            .find(|(n, _)| n == name)
            .map_or(0, |(_, value)| *value as i64)
    };
    let decreased = adaptive.decreased;
    let window = &mut step.data.window;
    let add = |window: &mut HashMap<String, i64>, name: &str, value: i64| {
        *window.entry(name.to_owned()).or_default() += value
    };
    if own {
        add(window, "ended", field("ended"));
    }
    let (mut news, mut stale) = (field("congested"), field("stale"));
    if (tick.judged as i64) < decreased as i64 - 1 {
        // Judged before the member heard of the last decrease: admitted before it.
        (news, stale) = (0, stale + news);
    }
    add(window, "congested", news);
    add(window, "stale", stale);
    add(window, "rejected", field("rejected"));
    for (name, value) in &fields {
        let Some((_, suffix)) = name.rsplit_once('/') else {
            continue;
        };
        let value = *value as i64;
        match suffix {
            "e" | "o" | "v" => add(window, name, value),
            "t" | "s" | "q" if own => add(window, name, value),
            "m" if own => {
                let old = window.get(name.as_str()).copied();
                if old.is_none_or(|old| value < old) {
                    window.insert(name.clone(), value);
                }
            }
            _ => {}
        }
    }
    let active = step.data.holders.len() as i64;
    let window = &mut step.data.window;
    *window.entry("samples".into()).or_default() += 1;
    *window.entry("active_sum".into()).or_default() += active;
    let peak = window.entry("peak".into()).or_default();
    *peak = (*peak).max(active);
    let leads = match &step.data.leader {
        Some((leader, ends)) if *ends > now => leader == tick.candidate,
        _ => true,
    };
    if leads {
        step.data.leader = Some((tick.candidate.to_owned(), now + tick.leader_ttl));
    }
    let window = &step.data.window;
    let get = |name: &str| window.get(name).copied().unwrap_or(0);
    let (ended, congested) = (get("ended"), get("congested"));
    let adaptive = &step.data.adaptive;
    let age = adaptive.opened.map_or(0, |opened| {
        now.saturating_duration_since(opened).as_millis() as i64
    });
    let rtt_ms = adaptive.rtt_us.unwrap_or(0).max(0) as f64 / 1000.0;
    let (floor, interval) = (
        tick.shortest.as_millis() as i64,
        tick.longest.as_millis() as i64,
    );
    let due = congested > (tick.tolerance * capacity as f64).floor() as i64
        || (age >= floor && ended >= capacity)
        || (rtt_ms > 0.0
            && age as f64 >= (floor as f64).max(2.0 * rtt_ms)
            && ended * 2 >= capacity)
        || (age >= interval
            && ended >= 1
            && (ended * 2 >= capacity || age as f64 >= interval as f64 * 1.5));
    let mut taken = None;
    let mut epoch = epoch;
    if due && leads {
        let fields: Vec<(String, String)> = step
            .data
            .window
            .drain()
            .map(|(name, value)| (name, value.to_string()))
            .collect();
        taken = Some(TakenWindow::from_fields(&fields));
        epoch += 1;
        step.data.adaptive.epoch = Some(epoch);
        step.data.adaptive.opened = Some(now);
    } else if due && !step.data.window.contains_key("announced") {
        step.data.window.insert("announced".into(), 1);
        step.published.push(Event::Due);
    }
    let adaptive = &step.data.adaptive;
    let positive = |value: Option<i64>| value.and_then(|value| u64::try_from(value).ok());
    Ticked {
        capacity: step.capacity(),
        leads,
        age_ms: age as u64,
        known: Known {
            epoch,
            decreased: adaptive.decreased,
            rtt_us: positive(adaptive.rtt_us),
            baseline_us: positive(adaptive.baseline_us),
            estimate_us: positive(adaptive.estimate_us),
        },
        taken,
        handed: match leads && tick.starting {
            true => adaptive.baselines.clone(),
            false => String::new(),
        },
    }
}

/// The decision script: the leader's capacity for the window it took, dropped unless it
/// still leads and the window is still open; a decrease opens a window of its own.
pub(super) fn decide(step: &mut Step<'_>, decision: &Decision<'_>) -> Option<usize> {
    let now = step.now;
    let leads = matches!(&step.data.leader,
        Some((leader, ends)) if *ends > now && leader == decision.leader);
    if !leads || step.data.adaptive.epoch != Some(decision.window) {
        return None;
    }
    let mut epoch = decision.window;
    if decision.capacity < step.capacity() {
        epoch += 1;
        step.data.adaptive.epoch = Some(epoch);
        step.data.adaptive.decreased = epoch;
        let window = &mut step.data.window;
        if let Some(congested) = window.remove("congested") {
            *window.entry("stale".into()).or_default() += congested;
        }
        window.retain(|name, _| {
            name != "ended"
                && !name
                    .rsplit_once('/')
                    .is_some_and(|(_, suffix)| matches!(suffix, "t" | "s" | "q" | "m"))
        });
    }
    if decision.capacity != step.capacity() {
        step.data.capacity = Some(decision.capacity);
        step.promote();
        step.published.push(Event::Capacity(decision.capacity));
    }
    let us = |us: Option<u64>| us.map_or(-1, |us| us as i64);
    let known = &decision.known;
    let adaptive = &mut step.data.adaptive;
    adaptive.rtt_us = Some(us(known.rtt_us));
    adaptive.baseline_us = Some(us(known.baseline_us));
    adaptive.estimate_us = Some(us(known.estimate_us));
    adaptive.baselines = decision.handover.to_owned();
    let positive = |value: Option<i64>| value.and_then(|value| u64::try_from(value).ok());
    step.published.push(Event::Decided(Known {
        epoch,
        decreased: adaptive.decreased,
        rtt_us: positive(adaptive.rtt_us),
        baseline_us: positive(adaptive.baseline_us),
        estimate_us: positive(adaptive.estimate_us),
    }));
    Some(step.capacity())
}
