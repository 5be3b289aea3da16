//! A real Redis Cluster for a test: three masters and a replica of each, `redis-server`s on free
//! loopback ports made one cluster by `redis-cli --cluster create`, with a short node timeout
//! so that a master killed is failed over within a few seconds. Killed when dropped.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// One node of the cluster.
struct Node {
    port: u16,
    child: Option<Child>,
}

/// The cluster.
pub struct RedisCluster {
    nodes: Vec<Node>,
    dir: PathBuf,
}

impl RedisCluster {
    /// Three masters and three replicas, with a node timeout of `node_timeout`: made, and
    /// answering with every slot served.
    pub fn start(node_timeout: Duration) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "tro-redis-cluster-{}-{}",
            std::process::id(),
            super::replicas::now_ms()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        // Each node on a port of its own, answered by it and no other process (a port free a
        // moment ago may be another test's server's by now: see `RedisServer::start_on`).
        let nodes: Vec<Node> = (0..6).map(|_| Node::start(&dir, node_timeout)).collect();
        let ports: Vec<u16> = nodes.iter().map(|node| node.port).collect();
        let cluster = Self { nodes, dir };
        let mut create = vec!["--cluster".to_owned(), "create".to_owned()];
        create.extend(ports.iter().map(|port| format!("127.0.0.1:{port}")));
        create.extend(["--cluster-replicas", "1", "--cluster-yes"].map(String::from));
        let status = Command::new("redis-cli")
            .args(&create)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .status()
            .expect("redis-cli on PATH (it comes with redis-server)");
        assert!(status.success(), "redis-cli --cluster create failed");
        for node in &cluster.nodes {
            cluster.wait(|| {
                cluster
                    .cli(node.port, &["CLUSTER", "INFO"])
                    .is_some_and(|info| info.contains("cluster_state:ok"))
            });
            // Every replica in sync with its master.
            cluster.wait(|| {
                cluster
                    .cli(node.port, &["INFO", "replication"])
                    .is_some_and(|info| {
                        info.contains("role:master") || info.contains("master_link_status:up")
                    })
            });
        }
        cluster
    }

    /// The nodes' URLs.
    pub fn urls(&self) -> Vec<String> {
        self.nodes
            .iter()
            .map(|node| format!("redis://127.0.0.1:{}/", node.port))
            .collect()
    }

    /// The port of the master that serves `key`'s slot now.
    pub fn master_of(&self, key: &str) -> u16 {
        self.serving(key)
            .unwrap_or_else(|| panic!("no master serves the slot of {key}"))
    }

    /// The port of the master that serves `key`'s slot now, if one does (none while it fails
    /// over).
    fn serving(&self, key: &str) -> Option<u16> {
        let port = self.alive_port();
        let slot: u16 = self
            .cli(port, &["CLUSTER", "KEYSLOT", key])
            .expect("CLUSTER KEYSLOT")
            .trim()
            .parse()
            .expect("a slot");
        let nodes = self
            .cli(port, &["CLUSTER", "NODES"])
            .expect("CLUSTER NODES");
        for line in nodes.lines() {
            let fields: Vec<&str> = line.split(' ').collect();
            if !fields[2].contains("master") || fields[2].contains("fail") {
                continue;
            }
            for range in &fields[8..] {
                let (from, to) = match range.split_once('-') {
                    Some((from, to)) => (from.parse::<u16>(), to.parse::<u16>()),
                    None => (range.parse::<u16>(), range.parse::<u16>()),
                };
                if let (Ok(from), Ok(to)) = (from, to) {
                    if (from..=to).contains(&slot) {
                        let address = fields[1].split('@').next().unwrap();
                        return address.rsplit(':').next().unwrap().parse().ok();
                    }
                }
            }
        }
        None
    }

    /// Kills the node on `port` (SIGKILL).
    pub fn kill(&mut self, port: u16) {
        let node = self
            .nodes
            .iter_mut()
            .find(|node| node.port == port)
            .expect("a node of the cluster");
        if let Some(mut child) = node.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Waits until another master serves `key`'s slot than `old`, and the cluster says it is
    /// ok; returns the new master's port.
    pub fn failed_over(&self, key: &str, old: u16) -> u16 {
        let mut port = old;
        self.wait(|| {
            port = self.serving(key).unwrap_or(old);
            port != old
                && self
                    .cli(port, &["CLUSTER", "INFO"])
                    .is_some_and(|info| info.contains("cluster_state:ok"))
        });
        port
    }

    fn alive_port(&self) -> u16 {
        self.nodes
            .iter()
            .find(|node| node.child.is_some())
            .expect("a node alive")
            .port
    }

    /// `redis-cli -p port args...`'s answer, if it answered.
    fn cli(&self, port: u16, args: &[&str]) -> Option<String> {
        cli(port, args)
    }

    fn wait(&self, mut ready: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !ready() {
            if Instant::now() > deadline {
                let nodes = self.cli(self.alive_port(), &["CLUSTER", "NODES"]);
                panic!(
                    "the cluster did not get ready:\n{}",
                    nodes.unwrap_or_default()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Node {
    /// A cluster node on a free port (and its cluster bus port, + 10000), answering `PING`
    /// itself; on another port if a process other than it answers there.
    fn start(dir: &std::path::Path, node_timeout: Duration) -> Self {
        let mut last = String::new();
        for _ in 0..10 {
            let port = free_port();
            let mut child = Command::new("redis-server")
                .args([
                    "--port",
                    &port.to_string(),
                    "--bind",
                    "127.0.0.1",
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    &format!("nodes-{port}.conf"),
                    "--cluster-node-timeout",
                    &node_timeout.as_millis().to_string(),
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    // A replica syncs at once (by default a diskless sync waits 5 s), so that it
                    // can be failed over to.
                    "--repl-diskless-sync-delay",
                    "0",
                    // A replica may be promoted however long ago it last heard its master (the
                    // test kills the master at a moment of its choosing).
                    "--cluster-replica-validity-factor",
                    "0",
                    "--dir",
                    &dir.display().to_string(),
                    "--logfile",
                    "",
                    "--loglevel",
                    "warning",
                ])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::inherit())
                .spawn()
                .expect("redis-server on PATH (apt-get install redis-server)");
            let answered = super::redis_server::answers(&mut child, port, Duration::from_secs(30));
            match answered {
                Ok(()) => {
                    return Self {
                        port,
                        child: Some(child),
                    }
                }
                Err(why) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    last = why;
                }
            }
        }
        panic!("no cluster node started on any of 10 free ports; the last: {last}");
    }
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            if let Some(mut child) = node.child.take() {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn free_port() -> u16 {
    // A cluster node also listens on its port + 10000 (the cluster bus): keep both free.
    loop {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|listener| listener.local_addr())
            .expect("a free port")
            .port();
        if port < 55_000 && std::net::TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
            return port;
        }
    }
}

/// `redis-cli -p port args...`'s answer, if it answered.
fn cli(port: u16, args: &[&str]) -> Option<String> {
    let output = Command::new("redis-cli")
        .args(["-p", &port.to_string()])
        .args(args)
        .stderr(Stdio::null())
        .output()
        .ok()?;
    output
        .status
        .success()
        .then(|| String::from_utf8_lossy(&output.stdout).trim().to_owned())
}
