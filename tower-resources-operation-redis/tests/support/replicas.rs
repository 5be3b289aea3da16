//! Replicas as processes of their own: a test starts this test binary again, running the same
//! test, with [`REPLICA`] set to the replica's settings; there the test's first line
//! ([`replica_or`]) runs the replica instead of the test. So a test binary has no entry point
//! of its own that passes without testing anything, and a replica is killed with `kill -9`
//! like a real one.
//!
//! A replica talks to its test over its standard output (lines it [`say`]s) and input (lines
//! it reads with [`commands`]).

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::Duration;

/// The environment variable that makes a test run as a replica, with its settings.
pub const REPLICA: &str = "TRO_TEST_REPLICA";

/// A replica's settings: `key=value` pairs, separated by spaces.
pub type Settings = BTreeMap<String, String>;

/// Runs `replica` with its settings if this process is a replica, else `test`.
pub fn replica_or(replica: impl FnOnce(Settings), test: impl FnOnce()) {
    match std::env::var(REPLICA) {
        Ok(encoded) => replica(decode(&encoded)),
        Err(_) => test(),
    }
}

/// This process's settings as a replica, if it is one: for an `async` test, whose first line
/// runs the replica on the test's own runtime and returns.
pub fn replica_settings() -> Option<Settings> {
    std::env::var(REPLICA).ok().map(|encoded| decode(&encoded))
}

/// `settings` as one line.
pub fn encode(settings: &Settings) -> String {
    settings
        .iter()
        .map(|(key, value)| format!("{key}={value}"))
        .collect::<Vec<_>>()
        .join(" ")
}

fn decode(encoded: &str) -> Settings {
    encoded
        .split(' ')
        .filter_map(|pair| pair.split_once('='))
        .map(|(key, value)| (key.to_owned(), value.to_owned()))
        .collect()
}

/// The name of the test running on this thread (libtest names each test's thread after it):
/// what a replica of it runs.
pub fn this_test() -> String {
    std::thread::current()
        .name()
        .expect("a test's own thread, named after it")
        .to_owned()
}

/// A setting, parsed.
pub fn get<T: std::str::FromStr>(settings: &Settings, key: &str) -> T
where
    T::Err: std::fmt::Debug,
{
    settings
        .get(key)
        .unwrap_or_else(|| panic!("the setting {key}"))
        .parse()
        .unwrap_or_else(|error| panic!("the setting {key}: {error:?}"))
}

/// Prints a line for the test that started this replica.
pub fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// The lines the test sends this replica, as they come.
pub fn commands() -> tokio::sync::mpsc::UnboundedReceiver<String> {
    let (sender, receiver) = tokio::sync::mpsc::unbounded_channel();
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines() {
            let Ok(line) = line else { break };
            if sender.send(line.trim().to_owned()).is_err() {
                break;
            }
        }
    });
    receiver
}

/// Starts this test binary again, running the test `test` alone as a replica with the encoded
/// `settings`, its standard input and output piped (its standard error is the test's).
pub fn spawn(test: &str, settings: String) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args([
            test,
            "--exact",
            "--include-ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(REPLICA, settings)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start a replica")
}

/// A replica process, its output read line by line.
pub struct Replica {
    child: Child,
    input: Option<ChildStdin>,
    lines: std::io::Lines<BufReader<ChildStdout>>,
}

impl Replica {
    /// Starts this test binary again as a replica of the test `settings["test"]` (see
    /// [`this_test`]), with `settings`.
    pub fn start(settings: &Settings) -> Self {
        let test = settings
            .get("test")
            .expect("the test the replica runs, as a setting")
            .clone();
        let mut child = spawn(&test, encode(settings));
        let input = child.stdin.take();
        let lines = BufReader::new(child.stdout.take().unwrap()).lines();
        Self {
            child,
            input,
            lines,
        }
    }

    /// Sends the replica a line.
    pub fn tell(&mut self, command: &str) {
        let input = self.input.as_mut().expect("the replica's input");
        writeln!(input, "{command}").expect("the replica hears");
        input.flush().expect("the replica hears");
    }

    /// Reads until a line with `prefix` (libtest may print its own words before it on the same
    /// line); returns the line from `prefix` on. Fails if the replica ends first (the deadline
    /// is the caller's: see [`within_thread`]).
    pub fn until(&mut self, prefix: &str) -> String {
        for line in self.lines.by_ref() {
            let line = line.expect("a replica's output");
            if let Some(at) = line.find(prefix) {
                return line[at..].to_owned();
            }
        }
        panic!("the replica ended before it said {prefix:?}");
    }

    /// The replica's result, once it is done: the `key=value` pairs of its `RESULT` line.
    pub fn result(mut self) -> Settings {
        let line = self.until("RESULT");
        let status = self.child.wait().unwrap();
        assert!(status.success(), "the replica failed: {status}");
        decode(line.trim_start_matches("RESULT").trim())
    }

    /// Kills it with SIGKILL, as `kill -9` does: nothing of it runs after this.
    pub fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs `work` on a thread of its own, failing the test if it takes longer than `deadline` (a
/// hung caller in a replica hangs its process, and a read of its output blocks a thread).
pub fn within_thread<T: Send + 'static>(
    what: &str,
    deadline: Duration,
    work: impl FnOnce() -> T + Send + 'static,
) -> T {
    let (sender, receiver) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = sender.send(work());
    });
    match receiver.recv_timeout(deadline) {
        Ok(done) => done,
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => panic!("{what} hung"),
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => panic!("{what} failed"),
    }
}

/// Milliseconds since the Unix epoch: one clock for every process of a test on this machine.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| since.as_millis() as u64)
}
