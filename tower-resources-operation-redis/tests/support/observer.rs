//! An observer of the fleet outside the limit under test: a `redis-server` of its own, where
//! each operation records its entry and its exit as it runs, with the time (one clock for every
//! process on the machine). From it, a test reads how many ran at once at any moment, and when
//! each success came, whatever the limit believes.

use redis::aio::MultiplexedConnection;

use super::redis_server::RedisServer;
use super::replicas::now_ms;

/// Records an operation's entry: the count running goes up, at the time now.
pub async fn enter(observer: &mut MultiplexedConnection) {
    let _: i64 = redis::Script::new(
        "local n = redis.call('INCR', KEYS[1]) \
         redis.call('RPUSH', KEYS[2], ARGV[1] .. ' ' .. n) \
         return n",
    )
    .key("running")
    .key("events")
    .arg(now_ms())
    .invoke_async(observer)
    .await
    .expect("the observer");
}

/// Records an operation's exit, after it ran to its end (a success of `replica`).
pub async fn leave(observer: &mut MultiplexedConnection, replica: &str) {
    let _: i64 = redis::Script::new(
        "local n = redis.call('DECR', KEYS[1]) \
         redis.call('RPUSH', KEYS[2], ARGV[1] .. ' ' .. n) \
         redis.call('RPUSH', KEYS[3], ARGV[1] .. ' ' .. ARGV[2]) \
         return n",
    )
    .key("running")
    .key("events")
    .key("successes")
    .arg(now_ms())
    .arg(replica)
    .invoke_async(observer)
    .await
    .expect("the observer");
}

/// A connection to the observer, for a replica.
pub async fn connect(url: &str) -> MultiplexedConnection {
    redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .expect("the observer")
}

/// What the observer saw.
pub struct Seen {
    /// `(ms, running)` after each entry and exit, in order.
    pub events: Vec<(u64, i64)>,
    /// `(ms, replica)` of each success, in order.
    pub successes: Vec<(u64, String)>,
}

impl Seen {
    /// Reads it all.
    pub fn read(observer: &RedisServer) -> Self {
        let mut connection = observer.connection();
        let list = |key: &str, connection: &mut redis::Connection| -> Vec<String> {
            redis::cmd("LRANGE")
                .arg(key)
                .arg(0)
                .arg(-1)
                .query(connection)
                .expect("the observer")
        };
        let events = list("events", &mut connection)
            .iter()
            .map(|event| {
                let (at, running) = event.split_once(' ').unwrap();
                (at.parse().unwrap(), running.parse().unwrap())
            })
            .collect();
        // Each process pushes its own in order; several may push out of order by a millisecond.
        let mut successes: Vec<(u64, String)> = list("successes", &mut connection)
            .iter()
            .map(|success| {
                let (at, replica) = success.split_once(' ').unwrap();
                (at.parse().unwrap(), replica.to_owned())
            })
            .collect();
        successes.sort();
        Self { events, successes }
    }

    /// The most operations running at once between `from` and `to` (ms), counting those
    /// already running at `from`.
    pub fn most_between(&self, from: u64, to: u64) -> i64 {
        let mut most = self
            .events
            .iter()
            .take_while(|(at, _)| *at < from)
            .last()
            .map_or(0, |(_, running)| *running);
        for (_, running) in self.events.iter().filter(|(at, _)| (from..to).contains(at)) {
            most = most.max(*running);
        }
        most
    }

    /// The longest time (ms) between `from` and `to` with no success of any replica that is
    /// not `except`, counting from `from` to the first and from the last to `to`.
    pub fn longest_gap(&self, from: u64, to: u64, except: &str) -> u64 {
        let mut last = from;
        let mut longest = 0;
        for (at, _) in self
            .successes
            .iter()
            .filter(|(at, replica)| replica != except && (from..to).contains(at))
        {
            longest = longest.max(at - last);
            last = *at;
        }
        longest.max(to - last)
    }

    /// The first success at or after `from` (ms), of any replica.
    pub fn first_success_after(&self, from: u64) -> Option<u64> {
        self.successes
            .iter()
            .map(|(at, _)| *at)
            .find(|at| *at >= from)
    }

    /// Successes between `from` and `to` (ms).
    pub fn successes_between(&self, from: u64, to: u64) -> usize {
        self.successes
            .iter()
            .filter(|(at, _)| (from..to).contains(at))
            .count()
    }
}
