//! The way to Redis: one connection per limit (made at the first call that succeeds in making
//! it, subscribed to the limit's channel on the same connection, in RESP3), and every call
//! bounded by the call timeout. Whether Redis answered is [`Health`]'s business, a level up.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{
    Client, FromRedisValue, IntoConnectionInfo, ProtocolVersion, PushInfo, RedisResult,
    ScriptInvocation,
};
use tokio::sync::mpsc::UnboundedSender;
use tokio::sync::OnceCell;

use crate::error::{redact, Error};

/// The connection of one limit, and how to call on it.
pub(crate) struct Transport {
    limit: &'static str,
    /// The address, as messages say it.
    address: String,
    client: Client,
    /// The connection, made at the first call that succeeds in making it.
    connection: OnceCell<ConnectionManager>,
    /// Where the connection sends what is published on the channel.
    pushes: UnboundedSender<PushInfo>,
    channel: String,
    call_timeout: Duration,
}

impl Transport {
    /// The way to the Redis at `address` (a `redis://` URL); connects at the first call.
    pub(crate) fn open(
        limit: &'static str,
        address: &str,
        channel: String,
        call_timeout: Duration,
        pushes: UnboundedSender<PushInfo>,
    ) -> Result<Self, Error> {
        let mut info = address
            .into_connection_info()
            .map_err(|cause| Error::invalid_address(limit, &redact(address, None), cause))?;
        let shown = redact(address, Some(&info));
        // The subscription shares the commands' connection, which RESP3 allows.
        info.redis.protocol = ProtocolVersion::RESP3;
        let client =
            Client::open(info).map_err(|cause| Error::invalid_address(limit, &shown, cause))?;
        Ok(Self {
            limit,
            address: shown,
            client,
            connection: OnceCell::new(),
            pushes,
            channel,
            call_timeout,
        })
    }

    /// The address, as messages say it (without its password).
    pub(crate) fn address(&self) -> &str {
        &self.address
    }

    /// The connection, made (and subscribed) if it is not yet.
    async fn connection(&self) -> RedisResult<ConnectionManager> {
        let connection = self
            .connection
            .get_or_try_init(|| async {
                let timeout = self.call_timeout;
                // No retry within a connection attempt: its backoff starts at a second, longer
                // than a call may take, so a retry would only hide the cause behind a timeout.
                // The next call tries again, and while Redis is down the background task's
                // probe is that call, every fallback poll.
                let config = ConnectionManagerConfig::new()
                    .set_connection_timeout(timeout)
                    .set_response_timeout(timeout)
                    .set_number_of_retries(0)
                    .set_push_sender(self.pushes.clone())
                    .set_automatic_resubscription();
                let mut connection =
                    ConnectionManager::new_with_config(self.client.clone(), config).await?;
                connection.subscribe(&self.channel).await?;
                Ok::<_, redis::RedisError>(connection)
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
                return redis::cmd("PING").query_async::<()>(&mut connection).await;
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
            invocation.invoke_async(&mut connection).await
        })
        .await
    }

    /// `call`, or a timeout error after the call timeout.
    ///
    /// The call is boxed (see `Core::call`).
    async fn timed<'a, T: Send>(
        &self,
        call: impl Future<Output = RedisResult<T>> + Send + 'a,
    ) -> Result<T, Error> {
        let call: Pin<Box<dyn Future<Output = RedisResult<T>> + Send + 'a>> = Box::pin(call);
        match tokio::time::timeout(self.call_timeout, call).await {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(cause)) => Err(Error::from_redis(
                self.limit,
                &self.address,
                self.call_timeout,
                cause,
            )),
            Err(_) => Err(Error::timeout(self.limit, &self.address, self.call_timeout)),
        }
    }
}
