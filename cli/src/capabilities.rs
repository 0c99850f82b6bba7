//! `fencelock capabilities`: what a backend guarantees, checked against requirements.

use std::time::Duration;

use fencelock::Capabilities;
use serde_json::json;

use crate::args::CapabilitiesArgs;
use crate::exit::{Failure, code};

/// Connects, prints what the backend guarantees, and fails (64) if a `--require`d (or
/// URL- or file-required) property is missing.
///
/// # Errors
///
/// A [`Failure`]: usage, connection, or a requirement the backend does not meet.
///
/// # Cancel safety
///
/// Cancel safe: it only connects and reads.
pub async fn capabilities(args: CapabilitiesArgs) -> Result<u8, Failure> {
    // Requirements are checked by connect itself: a backend lacking one is refused with
    // RequirementNotMet, exit 64, naming what is missing and what the backend offers.
    let locks = crate::backend::connect(&args.url, false).await?;
    let caps = locks.capabilities();
    if args.json {
        crate::exit::println_out(&to_json(locks.backend(), &caps).to_string())?;
    } else {
        crate::exit::print_out(&to_text(locks.backend(), &caps))?;
    }
    Ok(code::OK)
}

fn yes(on: bool) -> &'static str {
    if on { "yes" } else { "no" }
}

fn lease(d: Duration) -> String {
    if d.is_zero() {
        "none".into()
    } else {
        fencelock_duration(d)
    }
}

/// A duration in the syntax the command line accepts.
fn fencelock_duration(d: Duration) -> String {
    humantime::format_duration(d).to_string()
}

fn to_text(backend: &str, caps: &Capabilities) -> String {
    format!(
        "backend         {backend}\nlinearizable    {}\nfencing         {}\nfifo            {}\nloss detection  {}\ncounts waiters  {}\nshortest lease  {}\nelection        {}\nsemaphore       {}\nrw-lock         {}\n",
        yes(caps.linearizable),
        caps.fencing,
        yes(caps.fifo),
        caps.loss_detection,
        yes(caps.counts_waiters),
        lease(caps.min_lease),
        yes(caps.election),
        yes(caps.semaphore),
        yes(caps.rw_lock),
    )
}

fn to_json(backend: &str, caps: &Capabilities) -> serde_json::Value {
    json!({
        "backend": backend,
        "linearizable": caps.linearizable,
        "fencing": caps.fencing.to_string(),
        "fifo": caps.fifo,
        "loss_detection": caps.loss_detection.to_string(),
        "counts_waiters": caps.counts_waiters,
        "min_lease_ms": caps.min_lease.as_millis() as u64,
        "election": caps.election,
        "semaphore": caps.semaphore,
        "rw_lock": caps.rw_lock,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use fencelock::{FencingStrength, LossDetection};

    #[test]
    fn text_and_json() {
        let caps = Capabilities::new(true, FencingStrength::Strong, true, LossDetection::Notified)
            .with_min_lease(Duration::from_secs(2))
            .with_counts_waiters(true);
        let text = to_text("etcd", &caps);
        assert!(text.contains("linearizable    yes"), "{text}");
        assert!(text.contains("shortest lease  2s"), "{text}");
        let doc = to_json("etcd", &caps);
        assert_eq!(doc["fencing"], "strong");
        assert_eq!(doc["min_lease_ms"], 2000);
        // What `--require election|semaphore|rw-lock` checks is shown too.
        for line in ["election        ", "semaphore       ", "rw-lock         "] {
            assert!(text.contains(line), "{text}");
        }
        for key in ["election", "semaphore", "rw_lock"] {
            assert!(doc[key].is_boolean(), "{doc}");
        }
    }
}
