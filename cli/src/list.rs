//! `fencelock list` and `fencelock revoke`: what an operator needs beside `inspect`.

use fencelock::{HolderInfo, ListedLock};
use serde_json::json;

use crate::args::{ListArgs, RevokeArgs};
use crate::exit::{Failure, code};
use crate::inspect::to_json;

/// Prints the locks under the prefix that are held or waited for.
///
/// # Errors
///
/// A [`Failure`] when the URL or prefix is bad or the backend cannot be reached.
///
/// # Cancel safety
///
/// Cancel safe: it only reads.
pub async fn list(args: ListArgs) -> Result<u8, Failure> {
    let locks = crate::backend::connect(&args.url, false).await?;
    let found = locks.list(&args.prefix).await?;
    if args.json {
        crate::exit::println_out(&list_json(locks.backend(), &found).to_string())?;
    } else {
        crate::exit::print_out(&list_text(&found))?;
    }
    Ok(code::OK)
}

fn list_json(backend: &str, found: &[ListedLock]) -> serde_json::Value {
    serde_json::Value::Array(
        found
            .iter()
            .map(|l| to_json(&l.name, backend, &l.info))
            .collect(),
    )
}

/// One line per lock: name, token, owner, remaining lease, waiters.
fn list_text(found: &[ListedLock]) -> String {
    let mut out = String::new();
    for listed in found {
        let (token, owner, lease) = match &listed.info.holder {
            Some(h) => (
                h.token.to_string(),
                h.owner.clone(),
                h.remaining_lease
                    .map_or_else(|| "-".to_owned(), |d| format!("{:.1}s", d.as_secs_f64())),
            ),
            None => ("-".to_owned(), "-".to_owned(), "-".to_owned()),
        };
        let waiters = listed
            .info
            .waiters
            .map_or_else(|| "-".to_owned(), |n| n.to_string());
        out.push_str(&format!(
            "{}\ttoken={token}\tlease={lease}\twaiters={waiters}\towner={owner}\n",
            listed.name
        ));
    }
    out
}

/// Shows who holds the lock, and with `--yes` takes it away from them.
///
/// # Errors
///
/// A [`Failure`]: usage (64) when `--yes` is missing and the lock is held, or the URL
/// or name is bad; unavailable (69) when the backend cannot be reached.
///
/// # Cancel safety
///
/// Cancel safe: the revoke either reached the backend or not.
pub async fn revoke(args: RevokeArgs) -> Result<u8, Failure> {
    let locks = crate::backend::connect(&args.url, false).await?;
    if !args.yes {
        let info = locks.inspect(&args.name).await?;
        let Some(holder) = info.holder else {
            crate::exit::println_out(&outcome(&args, None, false).to_string())?;
            return Ok(code::OK);
        };
        crate::exit::say!("{}", outcome(&args, Some(&holder), false));
        return Err(Failure::usage(format!(
            "not revoked: {} is held (token {}); add --yes to take it away",
            args.name, holder.token
        )));
    }
    let revoked = locks.revoke(&args.name).await?;
    crate::exit::println_out(&outcome(&args, revoked.as_ref(), revoked.is_some()).to_string())?;
    Ok(code::OK)
}

fn outcome(args: &RevokeArgs, holder: Option<&HolderInfo>, revoked: bool) -> String {
    if args.json {
        return json!({
            "name": args.name,
            "revoked": revoked,
            "held": holder.is_some(),
            "owner": holder.map(|h| h.owner.clone()),
            "token": holder.map(|h| h.token.get()),
        })
        .to_string();
    }
    match (holder, revoked) {
        (None, _) => format!("{}: not held; nothing to revoke", args.name),
        (Some(h), true) => format!(
            "{}: revoked from {} (token {})",
            args.name, h.owner, h.token
        ),
        (Some(h), false) => format!("{}: held by {} (token {})", args.name, h.owner, h.token),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fencelock::{FencingToken, LockInfo};

    #[test]
    fn text_has_one_line_per_lock_and_json_one_array() {
        let held = LockInfo::held(
            HolderInfo::new("lease-1f", FencingToken::new(7), None),
            Some(1),
        );
        let found = vec![
            ListedLock::new("a/b", held),
            ListedLock::new("c", LockInfo::free(None)),
        ];
        let text = list_text(&found);
        assert_eq!(text.lines().count(), 2);
        assert!(
            text.starts_with("a/b\ttoken=7\tlease=-\twaiters=1\towner=lease-1f\n"),
            "{text}"
        );
        let json = list_json("etcd", &found);
        assert_eq!(json[0]["name"], "a/b");
        assert_eq!(json[0]["token"], 7);
        assert_eq!(json[1]["held"], false);
    }
}
