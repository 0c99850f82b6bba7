//! Redlock: telling the instances apart by the server behind them.
//!
//! A majority of N instances is a majority of servers only if no server is behind two
//! of them. [`RedisConfig::check_instances`](crate::RedisConfig::check_instances) refuses
//! an instance named twice, but cannot tell two names of one server apart (`localhost`
//! and `127.0.0.1`, a DNS alias, a second address of the host). So each instance's
//! connection is checked before it is trusted: `INFO server` names the server's
//! `run_id`, unique per server process, and an instance whose `run_id` another instance
//! already has is refused ([`Error::InvalidConfig`] naming both endpoints).
//!
//! When: at `connect`, on every instance that answers (a pair found there fails
//! `connect`); an instance down at `connect` is checked at its first answer. An error
//! after which the connection manager re-makes an instance's connection (a dropped or
//! reset connection, perhaps re-made to another address of the name; not a response
//! timeout, which keeps the connection) forgets its `run_id`: the next
//! request checks the new connection first. A reply that comes after such an error on
//! the same instance (it may have come over the new, unchecked connection) is not
//! trusted: the request fails retryably, as a Sentinel request whose connection was
//! replaced does. A refused instance counts as one that failed, and is checked again at
//! each request (its server may have changed since).

use std::sync::{Arc, Mutex, PoisonError};

use fencelock_core::Error;
use redis::RedisError;
use redis::aio::ConnectionManager;

use crate::error::{BACKEND, map_err};
use crate::topology::Endpoint;

/// What is known of every instance of one client.
struct Instances {
    endpoints: Vec<Endpoint>,
    slots: Mutex<Vec<Slot>>,
}

#[derive(Default)]
struct Slot {
    /// The `run_id` of the server behind the instance's connection, once checked.
    run_id: Option<String>,
    /// Raised at every error after which the connection is re-made (see
    /// [`replaces_connection`]): a reply is trusted only if none came between the check
    /// and the reply.
    generation: u64,
}

/// One Redlock instance: where its connection's identity is checked.
#[derive(Clone)]
pub(crate) struct Instance {
    index: usize,
    instances: Arc<Instances>,
}

impl Instance {
    /// The instances of `endpoints`, one [`Instance`] each, in order.
    pub(crate) fn all(endpoints: &[Endpoint]) -> Vec<Instance> {
        let shared = Arc::new(Instances {
            endpoints: endpoints.to_vec(),
            slots: Mutex::new(endpoints.iter().map(|_| Slot::default()).collect()),
        });
        (0..endpoints.len())
            .map(|index| Instance {
                index,
                instances: shared.clone(),
            })
            .collect()
    }

    fn slots(&self) -> std::sync::MutexGuard<'_, Vec<Slot>> {
        self.instances
            .slots
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn endpoint(&self) -> &Endpoint {
        &self.instances.endpoints[self.index]
    }

    /// Checks the server behind `conn` unless it has been since the last connection
    /// error; returns the generation to pass to [`after`](Self::after).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] when another instance has the same `run_id`; a
    /// non-retryable [`Error::Backend`] when the server refuses `INFO` (an ACL without
    /// `+info`, a renamed command) or names no `run_id`; a retryable error when the
    /// server cannot be reached or the connection failed during the check.
    pub(crate) async fn checked(&self, conn: &ConnectionManager) -> Result<u64, Error> {
        let generation = {
            let slots = self.slots();
            let slot = &slots[self.index];
            if slot.run_id.is_some() {
                return Ok(slot.generation);
            }
            slot.generation
        };
        let mut info = redis::cmd("INFO");
        info.arg("server");
        let reply: Result<String, RedisError> = info.query_async(&mut conn.clone()).await;
        let reply = match reply {
            Ok(reply) => reply,
            Err(e) => {
                self.after(Some(&e), generation)?;
                let error = map_err(e);
                if error.is_retryable() {
                    return Err(error);
                }
                return Err(Error::backend(
                    BACKEND,
                    false,
                    format!(
                        "Redlock instance {} refused `INFO server` ({error}): Redlock reads \
                         each instance's run_id to make sure no server is behind two \
                         instances (it would count twice toward the majority); allow the \
                         user `+info`",
                        self.endpoint()
                    ),
                ));
            }
        };
        let Some(run_id) = run_id(&reply) else {
            return Err(Error::backend(
                BACKEND,
                false,
                format!(
                    "Redlock instance {}: `INFO server` names no run_id, so it cannot be \
                     told apart from the other instances",
                    self.endpoint()
                ),
            ));
        };
        let mut slots = self.slots();
        if slots[self.index].generation != generation {
            return Err(reconnected(self.endpoint()));
        }
        let twin = slots
            .iter()
            .enumerate()
            .position(|(i, slot)| i != self.index && slot.run_id.as_deref() == Some(run_id));
        if let Some(twin) = twin {
            let (first, second) = (self.index.min(twin), self.index.max(twin));
            let endpoints = &self.instances.endpoints;
            let error = format!(
                "redis: Redlock instances {} and {} are one server (run_id {run_id}): it \
                 would count twice toward the majority; name each server once",
                endpoints[first], endpoints[second]
            );
            tracing::error!(instance = %self.endpoint(), "{error}");
            return Err(Error::InvalidConfig(error));
        }
        slots[self.index].run_id = Some(run_id.to_owned());
        Ok(generation)
    }

    /// After a request sent on the connection checked at `generation` ended with
    /// `failure` (`None`: a reply): an error after which the connection is re-made
    /// ([`replaces_connection`]) forgets the server's `run_id`
    /// (the next request checks the connection again); a reply is trusted only if no
    /// such error came since the check.
    ///
    /// # Errors
    ///
    /// A retryable [`Error::Unavailable`] for a reply that may have come over an
    /// unchecked connection.
    pub(crate) fn after(&self, failure: Option<&RedisError>, generation: u64) -> Result<(), Error> {
        let mut slots = self.slots();
        let slot = &mut slots[self.index];
        if failure.is_some_and(replaces_connection) {
            slot.generation += 1;
            slot.run_id = None;
            Ok(())
        } else if slot.generation != generation {
            Err(reconnected(self.endpoint()))
        } else {
            Ok(())
        }
    }
}

/// Whether the connection manager makes a new connection after `err`: redis-rs 1.x
/// reconnects after an error of a request that `is_unrecoverable_error` (a dropped
/// connection, a reset, a parse error) and after an I/O error of the connection itself
/// (refused, unreachable). Some of these (a refused connection) follow an earlier
/// replacement and change nothing, which is harmless. A response timeout keeps the
/// connection, and so the check: a slow instance's next request (the release that
/// undoes a timed-out acquire) is not held up by one more round trip.
fn replaces_connection(err: &RedisError) -> bool {
    err.is_unrecoverable_error() || (err.is_io_error() && !err.is_timeout())
}

fn reconnected(endpoint: &Endpoint) -> Error {
    Error::unavailable(
        BACKEND,
        format!(
            "the connection to Redlock instance {endpoint} failed while the request was in \
             flight: its reply is not trusted until the server behind it is checked again"
        ),
    )
}

/// The `run_id` line of an `INFO server` reply.
fn run_id(info: &str) -> Option<&str> {
    info.lines()
        .find_map(|line| line.trim_end().strip_prefix("run_id:"))
        .filter(|id| !id.is_empty())
}

#[cfg(test)]
mod tests {
    #[test]
    fn run_id_is_read_from_info_server() {
        let info = "# Server\r\nredis_version:7.0.15\r\nrun_id:0123abcd\r\ntcp_port:6379\r\n";
        assert_eq!(super::run_id(info), Some("0123abcd"));
        assert_eq!(super::run_id("# Server\r\nrun_id:\r\n"), None);
        assert_eq!(super::run_id("# Server\r\n"), None);
    }
}
