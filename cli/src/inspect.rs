//! `fencelock inspect`: who holds a lock.

use fencelock::LockInfo;
use serde_json::json;

use crate::args::InspectArgs;
use crate::exit::{Failure, code};

/// Prints what the backend knows about the lock.
///
/// # Errors
///
/// A [`Failure`] when the URL or name is bad or the backend cannot be reached.
///
/// # Cancel safety
///
/// Cancel safe: it only reads.
pub async fn inspect(args: InspectArgs) -> Result<u8, Failure> {
    let locks = crate::backend::connect(&args.url, false).await?;
    let info = locks.inspect(&args.name).await?;
    if args.json {
        crate::exit::println_out(&to_json(&args.name, locks.backend(), &info).to_string())?;
    } else {
        crate::exit::print_out(&to_text(&args.name, locks.backend(), &info))?;
    }
    Ok(code::OK)
}

pub(crate) fn to_json(name: &str, backend: &str, info: &LockInfo) -> serde_json::Value {
    let holder = info.holder.as_ref();
    json!({
        "name": name,
        "backend": backend,
        "held": info.is_held(),
        "owner": holder.map(|h| h.owner.clone()),
        "token": holder.map(|h| h.token.get()),
        "remaining_lease_ms": holder.and_then(|h| h.remaining_lease).map(|d| d.as_millis() as u64),
        "waiters": info.waiters,
    })
}

pub(crate) fn to_text(name: &str, backend: &str, info: &LockInfo) -> String {
    let unknown = || "unknown".to_owned();
    let mut out = format!("lock     {name}\nbackend  {backend}\n");
    match &info.holder {
        None => out.push_str("held     no\n"),
        Some(holder) => {
            let lease = holder
                .remaining_lease
                .map_or_else(unknown, |d| format!("{:.1}s left", d.as_secs_f64()));
            out.push_str(&format!(
                "held     yes\nowner    {}\ntoken    {}\nlease    {lease}\n",
                holder.owner, holder.token
            ));
        }
    }
    let waiters = info.waiters.map_or_else(unknown, |n| n.to_string());
    out.push_str(&format!("waiters  {waiters}\n"));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use fencelock::{FencingToken, HolderInfo};
    use std::time::Duration;

    #[test]
    fn text_and_json() {
        let holder = HolderInfo::new(
            "lease-1f",
            FencingToken::new(42),
            Some(Duration::from_secs(3)),
        );
        let info = LockInfo::held(holder, Some(2));
        let text = to_text("jobs", "etcd", &info);
        assert!(
            text.contains("token    42") && text.contains("3.0s left"),
            "{text}"
        );
        assert!(text.contains("waiters  2"));
        let json = to_json("jobs", "etcd", &info);
        assert_eq!(json["token"], 42);
        assert_eq!(json["remaining_lease_ms"], 3000);
        let free = to_text("jobs", "mem", &LockInfo::free(None));
        assert!(free.contains("held     no") && free.contains("waiters  unknown"));
    }
}
