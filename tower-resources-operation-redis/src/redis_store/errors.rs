//! The `redis` crate's errors, and addresses, as this crate's [`Error`] says them.

use std::sync::Arc;
use std::time::Duration;

use redis::RedisError;

use crate::error::{Error, ErrorKind};

/// `address` cannot be used: `cause`.
pub(crate) fn invalid_address(limit: &Arc<str>, address: &str, cause: RedisError) -> Error {
    Error::new(
        ErrorKind::InvalidAddress,
        limit,
        address,
        format!("not a Redis address the limit can use ({cause})"),
        Some(Box::new(cause)),
    )
}

/// A call, bounded by `timeout`, that failed with `cause`.
pub(crate) fn from_redis(
    limit: &Arc<str>,
    address: &str,
    timeout: Duration,
    cause: RedisError,
) -> Error {
    use redis::ErrorKind as Redis;
    let (kind, what) = if cause.is_timeout() {
        (
            ErrorKind::Timeout,
            format!("Redis did not answer within the call timeout ({timeout:?})"),
        )
    } else if cause.is_io_error()
        || cause.is_connection_dropped()
        || cause.is_connection_refusal()
        || matches!(
            cause.kind(),
            Redis::IoError
                | Redis::BusyLoadingError
                | Redis::TryAgain
                | Redis::ClusterDown
                | Redis::MasterDown
        )
    {
        (ErrorKind::Unreachable, "Redis cannot be reached".to_owned())
    } else {
        (ErrorKind::Redis, "Redis answered with an error".to_owned())
    };
    Error::new(
        kind,
        limit,
        address,
        format!("{what}: {cause}"),
        Some(Box::new(cause)),
    )
}

/// `address` as messages say it: the host, port and database of a URL, never its user or
/// password; an address that does not parse, with whatever is between `://` and `@` hidden.
pub(crate) fn redact(address: &str, parsed: Option<&redis::ConnectionInfo>) -> String {
    use redis::ConnectionAddr;
    if let Some(info) = parsed {
        let db = info.redis.db;
        return match &info.addr {
            ConnectionAddr::Tcp(host, port) => format!("redis://{host}:{port}/{db}"),
            ConnectionAddr::TcpTls { host, port, .. } => format!("rediss://{host}:{port}/{db}"),
            ConnectionAddr::Unix(path) => format!("redis+unix://{}?db={db}", path.display()),
        };
    }
    let mut shown = match (address.find("://"), address.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            format!("{}://***{}", &address[..scheme], &address[at..])
        }
        _ => address.to_owned(),
    };
    if shown.len() > 200 {
        let mut end = 200;
        while !shown.is_char_boundary(end) {
            end -= 1;
        }
        shown.truncate(end);
        shown.push('…');
    }
    shown
}
