//! Fenced data in Redis: a value that refuses a fencing token lower than the highest it
//! has seen, checked and written by one Lua script.

use std::fmt;
use std::sync::LazyLock;

use fencelock_core::{Error, FencingToken, StaleToken};
use redis::aio::ConnectionLike;
use redis::{Script, Value};

use crate::error::{BACKEND, map_err};

/// One script for the three fenced operations (ARGV\[2\]: `w` write, `r` read, `c`
/// clear). Tokens travel as decimal strings and are compared as such (length, then
/// digits), not as Lua numbers: those are doubles, and tokens of the migration layer go
/// up to 2^64, where neighbouring tokens round to the same double.
const FENCED: &str = r"
local seen = redis.call('HGET', KEYS[1], 'fence')
local t = ARGV[1]
if seen then
  if not string.match(seen, '^%d+$') or (#seen > 1 and string.sub(seen, 1, 1) == '0') then
    return redis.error_reply('ERR fencelock: the fence field of this key is not a token')
  end
  if #seen > #t or (#seen == #t and seen > t) then
    return {0, seen}
  end
end
if ARGV[2] == 'w' then
  redis.call('HSET', KEYS[1], 'fence', t, 'value', ARGV[3])
  return {1}
end
redis.call('HSET', KEYS[1], 'fence', t)
if ARGV[2] == 'c' then
  redis.call('HDEL', KEYS[1], 'value')
  return {1}
end
local v = redis.call('HGET', KEYS[1], 'value')
if v then return {1, v} end
return {1}
";

/// The script's SHA1, for `EVALSHA`.
static HASH: LazyLock<String> = LazyLock::new(|| Script::new(FENCED).get_hash().to_owned());

/// A value in Redis that only accepts reads and writes carrying a fencing token at least
/// as large as every token it has seen: the resource-side check that makes a lock safe
/// against a holder that paused past its lease (the Redis counterpart of a SQL
/// `WHERE fence <= $token`, of [`FencedRegister`](fencelock_core::FencedRegister) in
/// memory, and of `ZkFence` and `owner_compare` on ZooKeeper and etcd).
///
/// The value lives in a hash at [`key`](Self::key) with two fields: `value` (the bytes)
/// and `fence` (the highest token seen, in decimal). Each operation is one script, so the
/// check and the write are atomic on the server. The check compares tokens, not lock
/// keys: it works with the tokens of any fencelock backend, on any Redis deployment
/// reached through the `redis` crate (re-exported as `fencelock_redis::redis`), and on a
/// Cluster (one key, one slot). Tokens are compared exactly over the whole `u64` range.
///
/// Equal tokens pass: every grant's token is new, so an equal token is the same holder
/// again. A holder that reads, computes and writes back reads with its token
/// ([`read`](Self::read)): the read records the token, so a holder with an older token
/// can no longer write a value computed from what it read before.
///
/// The key persists until you delete it. Delete it only when no holder of an older token
/// can still write: a deleted key has forgotten its highest token. To drop only the
/// value, use [`clear`](Self::clear), which keeps the fence.
///
/// # Examples
///
/// ```no_run
/// use fencelock_core::DistributedLockExt;
/// use fencelock_redis::{FencedValue, RedisConfig, RedisLock};
///
/// # #[tokio::main] async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let locks = RedisLock::connect(RedisConfig::from_url("redis://127.0.0.1:6379")?).await?;
/// let mut data = fencelock_redis::redis::Client::open("redis://127.0.0.1:6379")?
///     .get_multiplexed_async_connection()
///     .await?;
/// let stock = FencedValue::new("stock/SKU-8842");
///
/// let guard = locks.lock("stock/SKU-8842").await?;
/// // Refused with `FenceError::Stale` if a newer holder has read or written since.
/// let left: u32 = match stock.read(&mut data, guard.token()).await? {
///     Some(bytes) => String::from_utf8(bytes)?.parse()?,
///     None => 100,
/// };
/// stock
///     .write(&mut data, guard.token(), (left - 1).to_string().as_bytes())
///     .await?;
/// guard.release().await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct FencedValue {
    key: String,
}

/// Why a fenced operation did not apply.
#[derive(Debug)]
#[non_exhaustive]
pub enum FenceError {
    /// A larger token has been seen: the caller's lock has passed to a newer holder.
    /// Nothing was read or written.
    Stale(StaleToken),
    /// The call failed (connection, timeout, a key of another type, a `fence` field that
    /// is not a token). A call that failed in flight may or may not have been applied;
    /// repeating it with the same token and value is safe.
    Backend(Error),
}

impl fmt::Display for FenceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FenceError::Stale(stale) => stale.fmt(f),
            FenceError::Backend(err) => err.fmt(f),
        }
    }
}

/// Transparent: the display and source are those of the error inside.
impl std::error::Error for FenceError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            FenceError::Stale(stale) => stale.source(),
            FenceError::Backend(err) => err.source(),
        }
    }
}

impl From<StaleToken> for FenceError {
    fn from(stale: StaleToken) -> Self {
        FenceError::Stale(stale)
    }
}

impl From<Error> for FenceError {
    fn from(err: Error) -> Self {
        FenceError::Backend(err)
    }
}

impl FencedValue {
    /// The fenced value stored at `key` (any Redis key name; nothing is added to it).
    pub fn new(key: impl Into<String>) -> Self {
        FencedValue { key: key.into() }
    }

    /// The Redis key of the hash holding the value and its fence.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// Stores `value` as the holder of `token`, if `token` is at least the highest token
    /// seen, and records `token`.
    ///
    /// # Errors
    ///
    /// [`FenceError::Stale`] if a larger token has been seen (nothing is written);
    /// [`FenceError::Backend`] if the call failed.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future after the script was sent may leave the write applied or not;
    /// repeating it with the same token and value is safe.
    pub async fn write<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        token: FencingToken,
        value: &[u8],
    ) -> Result<(), FenceError> {
        self.call(conn, token, "w", Some(value)).await.map(drop)
    }

    /// The value, read as the holder of `token` (`None` if none was written or it was
    /// cleared): refused if a larger token has been seen; otherwise `token` is recorded,
    /// so a holder with an older token can no longer write.
    ///
    /// # Errors
    ///
    /// [`FenceError::Stale`] if a larger token has been seen (nothing is recorded);
    /// [`FenceError::Backend`] if the call failed.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future after the script was sent may leave the token recorded or
    /// not; reading again is safe.
    pub async fn read<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        token: FencingToken,
    ) -> Result<Option<Vec<u8>>, FenceError> {
        self.call(conn, token, "r", None).await
    }

    /// Removes the value as the holder of `token`, keeping the fence (so a holder with an
    /// older token still cannot write).
    ///
    /// # Errors
    ///
    /// [`FenceError::Stale`] if a larger token has been seen (nothing is removed);
    /// [`FenceError::Backend`] if the call failed.
    ///
    /// # Cancel safety
    ///
    /// As [`write`](Self::write): repeating it is safe.
    pub async fn clear<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        token: FencingToken,
    ) -> Result<(), FenceError> {
        self.call(conn, token, "c", None).await.map(drop)
    }

    /// The value and the highest token seen, without a token check and without recording
    /// anything: for observers, not for a holder that writes back what it read.
    ///
    /// # Errors
    ///
    /// A backend error if the call failed, the key is not a hash, or its `fence` field
    /// is not a token.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it writes nothing.
    pub async fn peek<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
    ) -> Result<(Option<Vec<u8>>, Option<FencingToken>), Error> {
        let (value, fence): (Option<Vec<u8>>, Option<String>) = redis::cmd("HMGET")
            .arg(&self.key)
            .arg("value")
            .arg("fence")
            .query_async(conn)
            .await
            .map_err(map_err)?;
        let fence = fence.map(|f| parse_token(&f)).transpose()?;
        Ok((value, fence))
    }

    async fn call<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        token: FencingToken,
        op: &str,
        value: Option<&[u8]>,
    ) -> Result<Option<Vec<u8>>, FenceError> {
        // `EVALSHA`, and on `NOSCRIPT` (a new, restarted or promoted server) the same
        // call as `EVAL` with the text, as the lock scripts do: the least-privilege ACL
        // has `evalsha` and `eval`, not `script load`, and both are routed by the key.
        let call = |command: &str, script: &str| {
            let mut cmd = redis::cmd(command);
            cmd.arg(script)
                .arg(1)
                .arg(&self.key)
                .arg(token.get().to_string())
                .arg(op);
            if let Some(value) = value {
                cmd.arg(value);
            }
            cmd
        };
        let answer: Vec<Value> = match call("EVALSHA", &HASH).query_async(conn).await {
            Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
                call("EVAL", FENCED).query_async(conn).await
            }
            other => other,
        }
        .map_err(|e| FenceError::Backend(map_err(e)))?;
        match answer.as_slice() {
            [Value::Int(1)] => Ok(None),
            [Value::Int(1), Value::BulkString(bytes)] => Ok(Some(bytes.clone())),
            [Value::Int(0), Value::BulkString(seen)] => {
                let highest = parse_token(&String::from_utf8_lossy(seen))?;
                Err(FenceError::Stale(StaleToken { token, highest }))
            }
            other => Err(FenceError::Backend(Error::backend(
                BACKEND,
                false,
                format!("unexpected answer from the fenced-value script: {other:?}"),
            ))),
        }
    }
}

fn parse_token(text: &str) -> Result<FencingToken, Error> {
    text.parse::<u64>().map(FencingToken::new).map_err(|_| {
        Error::backend(
            BACKEND,
            false,
            format!("the fence field is not a fencing token: {text:?}"),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stale_and_backend_errors_display_their_cause() {
        let stale = FenceError::from(StaleToken {
            token: FencingToken::new(7),
            highest: FencingToken::new(8),
        });
        assert!(
            stale.to_string().contains("stale fencing token 7"),
            "{stale}"
        );
        assert!(parse_token("18446744073709551615").is_ok());
        assert!(parse_token("18446744073709551616").is_err());
        assert!(parse_token("x").is_err());
    }
}
