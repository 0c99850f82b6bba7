//! The replica check (`wait_replicas`): a grant's script sent with `CLIENT ID` in one
//! pipeline, then `WAIT` on that same connection before the guard is handed out.

use fencelock_core::Error;
use fencelock_core::kit::CLOCK_DRIFT;
use redis::Value;
use std::time::Duration;
use tokio::time::Instant;

use crate::call::{Call, millis};
use crate::engine::Engine;
use crate::error::BACKEND;
use crate::node::Node;

/// Runs a grant's script on `node`. With the replica check (`wait_replicas`) the
/// id of the connection it went on (`CLIENT ID`, in one pipeline with it) comes
/// back too, for [`replicas_acknowledged`]: the
/// `WAIT` must run on that connection (on another it would check nothing), and
/// only after a grant (a refused try must not wait up to `wait_timeout` for
/// replicas, holding up the shared connection).
pub(crate) async fn invoke_grant(
    engine: &Engine,
    node: &Node,
    call: &Call,
) -> Result<(Value, Option<Value>), Error> {
    if engine.config.wait_replicas == 0 {
        return Ok((node.invoke::<Value>(call).await?, None));
    }
    let mut id = redis::cmd("CLIENT");
    id.arg("ID");
    let (reply, connection) = node.invoke_then(call, &id).await?;
    Ok((reply, Some(connection)))
}

/// The replica check of a grant made on `node` over the connection `connection`
/// ([`invoke_grant`]'s id): `WAIT n timeout` on that same
/// connection (a pipeline with `CLIENT ID`, which must name it still) must see `n`
/// acknowledgements, and must answer before the lease of the grant (sent at `sent`,
/// for `lease`) ran out on the local clock: a guard whose deadline has passed
/// before it is handed out would be lost from its first instant. Checked for every
/// grant (a lock's, a term's, a semaphore's or read-write lock's) when
/// `wait_replicas` is set; the caller undoes the grant when it fails.
///
/// # Cancel safety
///
/// Sends a `WAIT`, which changes nothing; the caller's in-flight guard undoes the
/// grant when this is dropped.
pub(crate) async fn replicas_acknowledged(
    engine: &Engine,
    node: &Node,
    connection: Option<&Value>,
    sent: Instant,
    lease: Duration,
) -> Result<(), Error> {
    let wanted = engine.config.wait_replicas;
    if wanted == 0 {
        return Ok(());
    }
    let Some(connection) = connection else {
        return Err(Error::backend(
            BACKEND,
            false,
            "the grant came without the id of its connection",
        ));
    };
    let mut id = redis::cmd("CLIENT");
    id.arg("ID");
    let mut wait = redis::cmd("WAIT");
    wait.arg(wanted).arg(millis(engine.config.wait_timeout));
    let (now, acks) = engine
        .bounded(node, engine.config.timeout, node.query_pair(&id, &wait))
        .await?;
    if &now != connection {
        // A reconnection since the grant: this connection never wrote it.
        return Err(Error::unavailable(
            BACKEND,
            "the connection changed between the grant and its replica check; it was released",
        ));
    }
    let acks = match acks {
        Value::Int(n) => u32::try_from(n).unwrap_or(0),
        _ => {
            return Err(Error::backend(
                BACKEND,
                false,
                "unexpected reply from the replica check's WAIT",
            ));
        }
    };
    if sent.elapsed() + CLOCK_DRIFT.of(lease) >= lease {
        Err(Error::unavailable(
            BACKEND,
            "the lease ran out before the grant was confirmed (the replicas acknowledged \
             it too slowly)",
        ))
    } else if acks >= wanted {
        Ok(())
    } else {
        Err(Error::backend(
            BACKEND,
            true,
            format!(
                "only {acks} of {wanted} replicas acknowledged the grant within {:?}; it was released",
                engine.config.wait_timeout
            ),
        ))
    }
}
