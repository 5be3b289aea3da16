//! A real `redis-server` for a test: started on a free loopback port with no persistence,
//! stopped, restarted on the same port, paused, and killed when dropped.

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The server, on `PATH` (Debian's package puts it in /usr/bin).
const SERVER: &str = "redis-server";

/// One `redis-server` of the test's own.
pub struct RedisServer {
    child: Option<Child>,
    port: u16,
}

impl RedisServer {
    /// Starts one on a free port of 127.0.0.1 and waits until it answers `PING`; a failure
    /// that says how to install `redis-server` if it is not on `PATH`. Every test that calls
    /// this is `#[ignore]`d with that reason, and `cargo test -- --include-ignored` (the
    /// README's command) runs it: a test that cannot run shows as ignored in the summary, never
    /// as passed.
    pub fn start_required() -> Self {
        assert!(
            find_on_path(SERVER).is_some(),
            "`{SERVER}` is not on PATH, so this test cannot run. Install it (Debian/Ubuntu: \
             `apt-get install redis-server`), or run the tests without --include-ignored to \
             leave it out (it then shows as ignored)."
        );
        // A port free a moment ago may be taken before the server binds it (by another
        // test's server, started at the same moment): then this one exits, and another answers
        // on the port. That other must never stand in for it: two tests that shared an
        // observer once each saw the other's operations as their own. So the server that
        // answers must be this one (its process id), or it starts again on another port.
        let mut last = String::new();
        for _ in 0..10 {
            let port = TcpListener::bind("127.0.0.1:0")
                .and_then(|listener| listener.local_addr())
                .expect("a free port")
                .port();
            match Self::start_on(port) {
                Ok(server) => return server,
                Err(why) => last = why,
            }
        }
        panic!("redis-server did not start on any of 10 free ports; the last: {last}");
    }

    /// Starts one on `port`, or says why it is not the one answering there.
    pub fn start_on(port: u16) -> Result<Self, String> {
        let mut server = Self { child: None, port };
        server.try_start().map(|()| server)
    }

    /// `redis://127.0.0.1:PORT/`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Starts it (again) on its port, empty, and waits until it answers `PING`.
    pub fn restart(&mut self) {
        if let Err(why) = self.try_start() {
            panic!("redis-server did not start again: {why}");
        }
    }

    /// Starts it on its port and waits until it, and no other process, answers there.
    fn try_start(&mut self) -> Result<(), String> {
        assert!(self.child.is_none(), "the server is running");
        let mut child = Command::new(SERVER)
            .args([
                "--port",
                &self.port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                &std::env::temp_dir().display().to_string(),
                "--logfile",
                "",
                "--loglevel",
                "warning",
                // For `slow_down`: DEBUG SLEEP, from this machine only.
                "--enable-debug-command",
                "local",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|error| {
                panic!(
                    "cannot start {SERVER} ({error}): install it, e.g. \
                     `apt-get install redis-server` (.ci/run does)"
                )
            });
        let answered = answers(&mut child, self.port, Duration::from_secs(20));
        match answered {
            Ok(()) => self.child = Some(child),
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
        answered
    }

    /// Stops it (as a crash would: SIGKILL), and waits until it is gone.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Makes it slow until the returned guard is dropped: a thread of the test keeps it busy
    /// with `DEBUG SLEEP` for `step` at a time, back to back, so that every other command waits
    /// up to `step` (it answers, late).
    pub fn slow_down(&self, step: Duration) -> SlowDown {
        let running = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
        let mut connection = self.connection();
        let thread = std::thread::spawn({
            let running = std::sync::Arc::clone(&running);
            move || {
                while running.load(std::sync::atomic::Ordering::Relaxed) {
                    let _: ::redis::RedisResult<()> = ::redis::cmd("DEBUG")
                        .arg("SLEEP")
                        .arg(step.as_secs_f64())
                        .query(&mut connection);
                }
            }
        });
        SlowDown {
            running,
            thread: Some(thread),
        }
    }

    /// Freezes it (SIGSTOP): connections stay open, nothing answers.
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// Thaws it (SIGCONT).
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, signal: &str) {
        let child = self.child.as_ref().expect("a running server");
        let status = Command::new("kill")
            .args([signal, &child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success());
    }

    /// A plain connection to it, for the test's own commands.
    pub fn connection(&self) -> ::redis::Connection {
        ::redis::Client::open(self.url())
            .and_then(|client| client.get_connection())
            .expect("a connection to the test's redis-server")
    }

    /// How many times `command` (lower case, e.g. `evalsha`) ran since the server started or
    /// its stats were reset, from `INFO commandstats`.
    pub fn calls(&self, command: &str) -> u64 {
        let info: String = ::redis::cmd("INFO")
            .arg("commandstats")
            .query(&mut self.connection())
            .expect("INFO commandstats");
        let prefix = format!("cmdstat_{command}:calls=");
        info.lines()
            .find_map(|line| line.strip_prefix(&prefix))
            .and_then(|rest| rest.split(',').next())
            .map_or(0, |calls| calls.parse().expect("a count"))
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Waits until `child`, a `redis-server` just started on `port`, answers there: an error if it
/// exits first (its port was taken), if another process answers there, or after `patience`.
/// Its process id tells it from another (the pid in `INFO server`).
pub fn answers(child: &mut Child, port: u16, patience: Duration) -> Result<(), String> {
    let deadline = Instant::now() + patience;
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Err(format!(
                "it exited ({status}) on port {port}: taken by another process?"
            ));
        }
        match answering_pid(port) {
            Some(pid) if pid == child.id() => return Ok(()),
            Some(pid) => {
                return Err(format!(
                    "another redis-server (pid {pid}) answers on port {port}"
                ))
            }
            None if Instant::now() >= deadline => {
                return Err(format!("it did not come up on port {port} in {patience:?}"))
            }
            None => std::thread::sleep(Duration::from_millis(10)),
        }
    }
}

/// The process id of the `redis-server` that answers on `port`, from `INFO server`.
fn answering_pid(port: u16) -> Option<u32> {
    let mut connection = ::redis::Client::open(format!("redis://127.0.0.1:{port}/"))
        .and_then(|client| client.get_connection_with_timeout(Duration::from_millis(500)))
        .ok()?;
    let info: String = ::redis::cmd("INFO")
        .arg("server")
        .query(&mut connection)
        .ok()?;
    info.lines()
        .find_map(|line| line.strip_prefix("process_id:"))
        .and_then(|pid| pid.trim().parse().ok())
}

/// The first `program` on `PATH`, if there is one.
pub fn find_on_path(program: &str) -> Option<std::path::PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(program))
        .find(|candidate| candidate.is_file())
}

/// A `redis-server` made slow ([`RedisServer::slow_down`]), until dropped.
pub struct SlowDown {
    running: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for SlowDown {
    fn drop(&mut self) {
        self.running
            .store(false, std::sync::atomic::Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
