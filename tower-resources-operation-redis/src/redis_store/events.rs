//! What is published on a limit's channel, heard as the fleet's [`Event`]s.

use crate::fleet::store::{Event, Known};

/// What was published on the limit's channel, as an event: `g <window> <ids>` places handed
/// over in the fleet's window `window` (0 for a fixed limit),
/// `c <capacity>`, `a <epoch> <decreased> <rtt> <baseline> <estimate>` a decision, `d` a
/// window due.
pub(crate) fn parse_message(message: &str) -> Option<Event> {
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

#[cfg(test)]
mod tests {
    use super::*;

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
