//! The way to Redis: one connection per limit (made at the first call that succeeds in making
//! it, subscribed to the limit's channel on the same connection, in RESP3), to one server or,
//! with the `cluster` feature, to a Redis Cluster; every call bounded by the call timeout; what
//! is published on the channel turned into the fleet's [`Event`]s.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::{
    Client, Cmd, FromRedisValue, IntoConnectionInfo, Pipeline, ProtocolVersion, PushInfo, PushKind,
    RedisFuture, RedisResult, ScriptInvocation, Value,
};
use tokio::sync::mpsc::UnboundedSender;
use tokio::sync::OnceCell;

use super::errors::{from_redis, invalid_address, redact};
use super::Address;
use crate::error::Error;
use crate::fleet::store::Event;

/// The connection of one limit, and how to call on it.
pub(crate) struct Transport {
    limit: Arc<str>,
    /// The address, as messages say it.
    address: String,
    target: Target,
    /// The connection, made at the first call that succeeds in making it.
    connection: OnceCell<Connection>,
    /// Where what is pushed goes.
    events: UnboundedSender<Event>,
    channel: String,
    call_timeout: Duration,
}

/// What the limit connects to.
enum Target {
    One(Client),
    #[cfg(feature = "cluster")]
    Cluster(Vec<redis::ConnectionInfo>),
}

/// A connection, to one server or to a cluster.
#[derive(Clone)]
enum Connection {
    One(ConnectionManager),
    #[cfg(feature = "cluster")]
    Cluster(redis::cluster_async::ClusterConnection),
}

impl ConnectionLike for Connection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Connection::One(connection) => connection.req_packed_command(cmd),
            #[cfg(feature = "cluster")]
            Connection::Cluster(connection) => connection.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Connection::One(connection) => connection.req_packed_commands(cmd, offset, count),
            #[cfg(feature = "cluster")]
            Connection::Cluster(connection) => connection.req_packed_commands(cmd, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Connection::One(connection) => connection.get_db(),
            #[cfg(feature = "cluster")]
            Connection::Cluster(connection) => connection.get_db(),
        }
    }
}

impl Transport {
    /// The way to the Redis at `address`; connects at the first call.
    pub(crate) fn open(
        limit: Arc<str>,
        address: &Address,
        channel: String,
        call_timeout: Duration,
        events: UnboundedSender<Event>,
    ) -> Result<Self, Error> {
        let info = |address: &str| {
            let mut info = address
                .into_connection_info()
                .map_err(|cause| invalid_address(&limit, &redact(address, None), cause))?;
            let shown = redact(address, Some(&info));
            // The subscription shares the commands' connection, which RESP3 allows.
            info.redis.protocol = ProtocolVersion::RESP3;
            Ok::<_, Error>((info, shown))
        };
        let (target, shown) = match address {
            Address::One(address) => {
                let (info, shown) = info(address)?;
                let client =
                    Client::open(info).map_err(|cause| invalid_address(&limit, &shown, cause))?;
                (Target::One(client), shown)
            }
            #[cfg(feature = "cluster")]
            Address::Cluster(nodes) => {
                let mut infos = Vec::with_capacity(nodes.len());
                let mut shown = Vec::with_capacity(nodes.len());
                for node in nodes {
                    let (info, node) = info(node)?;
                    infos.push(info);
                    shown.push(node);
                }
                (
                    Target::Cluster(infos),
                    format!("the cluster of {}", shown.join(", ")),
                )
            }
        };
        Ok(Self {
            limit,
            address: shown,
            target,
            connection: OnceCell::new(),
            events,
            channel,
            call_timeout,
        })
    }

    /// The address, as messages say it (without its password).
    pub(crate) fn address(&self) -> &str {
        &self.address
    }

    /// The command scripts publish with: `SPUBLISH` on a cluster, so that a message goes to
    /// the shard that holds the limit's slot only, `PUBLISH` on one server.
    pub(crate) fn publish_command(&self) -> &'static str {
        match self.target {
            Target::One(_) => "PUBLISH",
            #[cfg(feature = "cluster")]
            Target::Cluster(_) => "SPUBLISH",
        }
    }

    /// What the connection hears, as the fleet's events.
    fn pushes(&self) -> impl Fn(PushInfo) -> Result<(), ()> + Send + Sync + 'static {
        let events = self.events.clone();
        move |push: PushInfo| {
            let event = match push.kind {
                PushKind::Message | PushKind::SMessage => push
                    .data
                    .get(1)
                    .and_then(|data| String::from_redis_value(data).ok())
                    .and_then(|message| super::parse_message(&message)),
                PushKind::Disconnection | PushKind::Subscribe | PushKind::SSubscribe => {
                    Some(Event::Reconnected)
                }
                _ => None,
            };
            match event {
                Some(event) => events.send(event).map_err(drop),
                None => Ok(()),
            }
        }
    }

    /// The connection, made (and subscribed) if it is not yet.
    async fn connection(&self) -> RedisResult<Connection> {
        let connection = self
            .connection
            .get_or_try_init(|| async {
                let timeout = self.call_timeout;
                match &self.target {
                    Target::One(client) => {
                        // No retry within a connection attempt: its backoff starts at a
                        // second, longer than a call may take, so a retry would only hide the
                        // cause behind a timeout. The next call tries again, and while Redis
                        // is down the background task's probe is that call, every fallback
                        // poll.
                        let config = ConnectionManagerConfig::new()
                            .set_connection_timeout(timeout)
                            .set_response_timeout(timeout)
                            .set_number_of_retries(0)
                            .set_push_sender(self.pushes())
                            .set_automatic_resubscription();
                        let mut connection =
                            ConnectionManager::new_with_config(client.clone(), config).await?;
                        connection.subscribe(&self.channel).await?;
                        Ok::<_, redis::RedisError>(Connection::One(connection))
                    }
                    #[cfg(feature = "cluster")]
                    Target::Cluster(nodes) => {
                        let client = redis::cluster::ClusterClientBuilder::new(nodes.clone())
                            .use_protocol(ProtocolVersion::RESP3)
                            .connection_timeout(timeout)
                            .response_timeout(timeout)
                            .retries(1)
                            .push_sender(self.pushes())
                            .build()?;
                        let mut connection = client.get_async_connection().await?;
                        connection.ssubscribe(&self.channel).await?;
                        Ok(Connection::Cluster(connection))
                    }
                }
            })
            .await?;
        Ok(connection.clone())
    }

    /// Connects and subscribes if that is not done yet, or else sends a `PING`: either way,
    /// whether Redis answers now, within the call timeout.
    pub(crate) async fn connect(&self) -> Result<(), Error> {
        self.timed(async {
            if let Some(connection) = self.connection.get() {
                let mut connection = connection.clone();
                let ping = redis::cmd("PING");
                return match ping.query_async::<()>(&mut connection).await {
                    Err(error) if is_lost_connection(&error) => {
                        ping.query_async::<()>(&mut connection).await
                    }
                    answer => answer,
                };
            }
            self.connection().await.map(drop)
        })
        .await
    }

    /// Runs `invocation` (by its SHA; loaded first if Redis does not know it), within the call
    /// timeout.
    pub(crate) async fn invoke<T: FromRedisValue + Send>(
        &self,
        invocation: &ScriptInvocation<'_>,
    ) -> Result<T, Error> {
        self.timed(async {
            let mut connection = self.connection().await?;
            match invocation.invoke_async(&mut connection).await {
                // The connection was lost (Redis restarted, say): the connection manager has
                // started a new one, and the call goes once more, on it, within the same call
                // timeout. Each script is safe to run twice: it takes the ids as they are.
                Err(error) if is_lost_connection(&error) => {
                    invocation.invoke_async(&mut connection).await
                }
                answer => answer,
            }
        })
        .await
    }

    /// `call`, or a timeout error after the call timeout.
    ///
    /// Boxed, as every future that holds the `redis` crate's is here at some level: held
    /// inline, they nest deep enough to pass the compiler's layout depth limit in a caller's
    /// `async` block (one allocation per round trip to Redis costs nothing next to it).
    async fn timed<'a, T: Send>(
        &self,
        call: impl Future<Output = RedisResult<T>> + Send + 'a,
    ) -> Result<T, Error> {
        let call: Pin<Box<dyn Future<Output = RedisResult<T>> + Send + 'a>> = Box::pin(call);
        match tokio::time::timeout(self.call_timeout, call).await {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(cause)) => Err(from_redis(
                &self.limit,
                &self.address,
                self.call_timeout,
                cause,
            )),
            Err(_) => Err(Error::timeout(
                &self.limit,
                &self.address,
                self.call_timeout,
            )),
        }
    }
}

/// Whether `error` says the connection was lost or could not be made again: the connection
/// manager then starts a new one, which the next call waits for.
fn is_lost_connection(error: &redis::RedisError) -> bool {
    error.is_io_error() || error.is_connection_dropped() || error.is_connection_refusal()
}
