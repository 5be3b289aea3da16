//! A model of the one protocol that must never give a place twice, checked over every
//! interleaving: three operations of two members ask, wait, take up places handed over, give
//! up, end, and are killed with their member, while claims lapse, against the store's own steps
//! (the in-memory store's scripts, which agree with Redis's). Every state reachable is visited
//! once; in each, the operations that believe they hold a place are at most the capacity, and
//! each holds a lease the store counts.
//!
//! What a member does is the fleet's rule for each answer: granted, it holds the place; queued,
//! it waits and asks again on any news; a refresh that finds its ticket gone makes it ask again.

use std::collections::HashSet;
use std::time::Duration;

use tokio::time::Instant;

use super::scripts;
use super::step::{Data, Step};
use crate::fleet::store::{Answer, Refresh, Status};

const CAPACITY: usize = 1;
const TTL: Duration = Duration::from_secs(10);
const CLAIM: Duration = Duration::from_millis(250);
/// How many times a claim timeout may pass: each lapses every claim then open.
const LAPSES: u32 = 2;

/// Where an operation stands, as its member believes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Op {
    /// Has not asked, or must ask again.
    Asking,
    /// Waits in the fleet's queue, as the store last said.
    Queued,
    /// Holds a place.
    Holds,
    /// Ended (its place given back), gave up (its ticket given back), or died with its member.
    Gone,
}

/// The operations' ids, and their members.
const IDS: [&str; 3] = ["m:1", "m:2", "n:1"];
const MEMBERS: [&str; 2] = ["m", "n"];

#[derive(Clone)]
struct World {
    data: Data,
    ops: [Op; 3],
    lapses: u32,
    /// Whether member `n` was killed.
    killed: bool,
}

impl World {
    fn now(&self) -> Instant {
        origin() + (CLAIM + Duration::from_millis(1)) * self.lapses
    }

    /// Runs `script` as one step of the store.
    fn step<T>(&mut self, script: impl FnOnce(&mut Step<'_>) -> T) -> T {
        let now = self.now();
        let mut step = Step {
            data: &mut self.data,
            now,
            ttl: TTL,
            claim: CLAIM,
            published: Vec::new(),
        };
        step.prelude(CAPACITY);
        script(&mut step)
    }

    /// A canonical form: what the store keeps, and where each operation stands.
    fn key(&self) -> String {
        format!(
            "{:?} {} {} {}",
            self.ops,
            self.lapses,
            self.killed,
            self.data.canonical(self.now())
        )
    }

    /// Every next world, one per action enabled here.
    fn next(&self) -> Vec<(String, World)> {
        let mut next = Vec::new();
        for (op, id) in IDS.iter().enumerate() {
            let mut world = self.clone();
            match self.ops[op] {
                Op::Asking | Op::Queued => {
                    world.ops[op] = match world.step(|step| scripts::take(step, id, None)).answer {
                        Answer::Granted => Op::Holds,
                        Answer::Queued => Op::Queued,
                        Answer::Full => Op::Gone,
                    };
                    next.push((format!("{id} asks"), world));
                    let mut gives_up = self.clone();
                    gives_up.step(|step| scripts::release(step, &[(*id).to_owned()]));
                    gives_up.ops[op] = Op::Gone;
                    next.push((format!("{id} gives up"), gives_up));
                }
                Op::Holds => {
                    world.step(|step| scripts::release(step, &[(*id).to_owned()]));
                    world.ops[op] = Op::Gone;
                    next.push((format!("{id} ends"), world));
                }
                Op::Gone => {}
            }
        }
        for member in MEMBERS {
            if member == "n" && self.killed {
                continue;
            }
            let mut world = self.clone();
            let mine: Vec<usize> = (0..IDS.len())
                .filter(|op| IDS[*op].starts_with(member))
                .collect();
            let ids = |state: Op| -> Vec<String> {
                mine.iter()
                    .filter(|op| world.ops[**op] == state)
                    .map(|op| IDS[*op].to_owned())
                    .collect()
            };
            let (held, waiting) = (ids(Op::Holds), ids(Op::Queued));
            let books = Refresh {
                process: member,
                held: &held,
                unheard: &[],
                waiting: &waiting,
            };
            let refreshed = world.step(|step| scripts::refresh(step, &books));
            for (id, status) in waiting.iter().zip(&refreshed.waiting) {
                let op = IDS.iter().position(|i| i == id).unwrap();
                world.ops[op] = match status {
                    Status::Holds => Op::Holds,
                    Status::Waits => Op::Queued,
                    Status::TakenBack | Status::Gone => Op::Asking,
                };
            }
            next.push((format!("{member} refreshes"), world));
        }
        if !self.killed {
            let mut world = self.clone();
            world.killed = true;
            for (op, id) in IDS.iter().enumerate() {
                if id.starts_with('n') {
                    world.ops[op] = Op::Gone;
                }
            }
            next.push(("n is killed".to_owned(), world));
        }
        if self.lapses < LAPSES {
            let mut world = self.clone();
            world.lapses += 1;
            next.push(("a claim timeout passes".to_owned(), world));
        }
        next
    }

    /// What must hold in every world: at most the capacity hold places, and each of those
    /// holds a lease the store counts.
    fn check(&self, path: &[String]) {
        let now = self.now();
        let holding: Vec<&str> = (0..IDS.len())
            .filter(|op| self.ops[*op] == Op::Holds)
            .map(|op| IDS[op])
            .collect();
        assert!(
            holding.len() <= CAPACITY,
            "{holding:?} hold places of {CAPACITY} after {path:?}"
        );
        for id in holding {
            assert!(
                self.data.holds_lease(id, now),
                "{id} believes it holds a place the store does not count, after {path:?}"
            );
        }
    }
}

/// One instant every world's clock counts from.
fn origin() -> Instant {
    static ORIGIN: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    *ORIGIN.get_or_init(Instant::now)
}

#[test]
fn no_interleaving_gives_one_place_to_two_operations() {
    let start = World {
        data: Data::default(),
        ops: [Op::Asking; 3],
        lapses: 0,
        killed: false,
    };
    let mut seen = HashSet::new();
    let mut stack = vec![(start, Vec::<String>::new())];
    while let Some((world, path)) = stack.pop() {
        world.check(&path);
        if !seen.insert(world.key()) {
            continue;
        }
        for (action, next) in world.next() {
            let mut path = path.clone();
            path.push(action);
            stack.push((next, path));
        }
    }
    // Every action was reachable: the model explored more than its first steps.
    assert!(seen.len() > 1_000, "{} worlds", seen.len());
    println!("{} worlds, none gives a place twice", seen.len());
}
