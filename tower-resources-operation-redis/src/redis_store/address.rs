//! [`Address`]: where a fleet limit's Redis is; [`Keys`]: the Redis names of one limit.

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
    pub(super) all: [String; 10],
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
