//! Keeping passwords out of errors and logs.

/// Query parameters whose values are secrets.
const SECRET_PARAMS: &[&str] = &["password", "pass", "pwd", "token", "secret"];

/// Returns `url` with the password of its user info and the values of secret query
/// parameters replaced by `***`. Works on strings that are not valid URLs too, so it can
/// be used in the error for a malformed URL.
///
/// # Examples
///
/// ```
/// assert_eq!(
///     fencelock_core::redact_url("redis://app:hunter2@cache:6379/0?password=x"),
///     "redis://app:***@cache:6379/0?password=***"
/// );
/// ```
pub fn redact_url(url: &str) -> String {
    redact_at(url, 0)
}

/// How deep URLs nested in query values are redacted: the legs of `migrate://` are one
/// level, and nothing real goes much deeper. A value nested deeper is hidden whole, so
/// a crafted URL cannot make this recurse once per level (a stack overflow aborts the
/// process) or rescan the rest of the URL at every level.
const MAX_NESTING: usize = 4;

fn redact_at(url: &str, depth: usize) -> String {
    let (mut out, rest) = split_userinfo(url);
    let (head, query) = match rest.split_once('?') {
        Some((head, query)) => (head, Some(query)),
        None => (rest, None),
    };
    out.push_str(head);
    if let Some(query) = query {
        out.push('?');
        let pairs: Vec<String> = query
            .split('&')
            .map(|pair| match pair.split_once('=') {
                Some((key, _)) if is_secret(key) => format!("{key}=***"),
                Some((key, value)) => format!("{key}={}", redact_nested(value, depth)),
                None => pair.to_owned(),
            })
            .collect();
        out.push_str(&pairs.join("&"));
    }
    out
}

/// Whether the query parameter `key` holds a secret: one of [`SECRET_PARAMS`], or a
/// name ending in `_` and one of them (`sentinel_password`), also percent-encoded
/// (`sentinel%5Fpassword`), as the backends decode keys before reading them.
fn is_secret(key: &str) -> bool {
    let key = percent_encoding::percent_decode_str(key)
        .decode_utf8_lossy()
        .to_ascii_lowercase();
    SECRET_PARAMS
        .iter()
        .any(|secret| key == *secret || key.ends_with(&format!("_{secret}")))
}

/// A query value that is itself a URL (the legs of `migrate://`), redacted whether it is
/// percent-encoded or not.
fn redact_nested(value: &str, depth: usize) -> String {
    let nested = depth + 1;
    if value.contains("://") {
        if nested > MAX_NESTING {
            return "***".to_owned();
        }
        return redact_at(value, nested);
    }
    match percent_encoding::percent_decode_str(value).decode_utf8() {
        Ok(decoded) if decoded.contains("://") => {
            if nested > MAX_NESTING {
                return "***".to_owned();
            }
            let redacted = redact_at(&decoded, nested);
            if redacted == decoded {
                value.to_owned()
            } else {
                percent_encoding::utf8_percent_encode(&redacted, COMPONENT).to_string()
            }
        }
        _ => value.to_owned(),
    }
}

/// What is percent-encoded in a URL query value or user info: everything but the
/// unreserved characters.
pub const COMPONENT: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

/// The scheme and the user info of `url` with its password redacted, and the rest.
///
/// The user info ends at the last `@` before the query (whose values may hold URLs of
/// their own, see `urlparts::query_start`): a password with a raw `/`, `?`, `#` or `=`
/// is still found and hidden, though a URL with the first three is refused as malformed.
///
/// Without `://` (a typo such as `redis:/:pw@h`), or with no scheme before it,
/// everything before the last `@` but a leading scheme is hidden.
fn split_userinfo(url: &str) -> (String, &str) {
    // Text before the first `://` that is no scheme (`admin:pw@h/x?legacy=redis://y`)
    // is read as a URL without one.
    let Some((scheme, rest)) = url.split_once("://").filter(|(s, _)| is_scheme(s)) else {
        let Some(at) = url.rfind('@') else {
            return (String::new(), url);
        };
        let scheme = url
            .split_once(':')
            .map(|(scheme, _)| scheme)
            .filter(|s| is_scheme(s) && s.len() < at);
        return match scheme {
            Some(scheme) => (format!("{scheme}:***@"), &url[at + 1..]),
            None => ("***@".to_owned(), &url[at + 1..]),
        };
    };
    let limit = crate::urlparts::query_start(rest);
    // A `?name=` after something that is no host list (`:pa?ss=x@h`) may be a raw `?` in
    // a password rather than the query: where the user info ends cannot be told, so
    // nothing after the scheme is shown.
    let before = &rest[..limit];
    let hosts = before.rsplit_once('@').map_or(before, |(_, hosts)| hosts);
    if limit < rest.len() && !before.is_empty() && !plausible_hosts(hosts) {
        return (format!("{scheme}://***"), "");
    }
    // No user info and no path before the query, but a raw `@` in it outside any
    // nested URL (`u:123?a=b@h`): the `?` may be in a password, before which the user
    // info looks like `host:port`. (An IPv6 host in brackets cannot be user info.)
    if !before.contains(['@', '/']) && !before.starts_with('[') && raw_at_in_query(&rest[limit..]) {
        return (format!("{scheme}://***"), "");
    }
    let Some(at) = rest[..limit].rfind('@') else {
        return (format!("{scheme}://"), rest);
    };
    let userinfo = &rest[..at];
    let user = userinfo.split_once(':').map_or(userinfo, |(user, _)| user);
    let secret = if userinfo.contains(':') { ":***" } else { "" };
    (format!("{scheme}://{user}{secret}@"), &rest[at + 1..])
}

/// Whether a query (from its `?`) has an `@` outside the values that are URLs of
/// their own (the legs of `migrate://`, which may hold user info).
fn raw_at_in_query(query: &str) -> bool {
    query
        .split('&')
        .any(|pair| pair.contains('@') && !pair.contains("://"))
}

use crate::urlparts::is_scheme;

/// Whether `s` (a URL after `SCHEME://`, up to its query) starts with a host list:
/// `host[:port]` (an IPv6 host in brackets), comma separated, then nothing or a `/` path.
fn plausible_hosts(s: &str) -> bool {
    let port_ok = |port: &str| !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit());
    let hosts = s.split_once('/').map_or(s, |(hosts, _)| hosts);
    !hosts.is_empty()
        && hosts.split(',').all(|item| {
            if let Some(bracketed) = item.strip_prefix('[') {
                return bracketed.split_once(']').is_some_and(|(_, after)| {
                    after.is_empty() || after.strip_prefix(':').is_some_and(port_ok)
                });
            }
            let (host, port) = match item.split_once(':') {
                Some((host, port)) => (host, Some(port)),
                None => (item, None),
            };
            !host.is_empty()
                && host
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_'))
                && port.is_none_or(port_ok)
        })
}

#[cfg(test)]
mod tests {
    use super::redact_url;

    #[test]
    fn passwords_never_survive() {
        let cases = [
            ("mem://", "mem://"),
            (
                "etcd://root:s3cret@h1:2379,h2:2379/locks",
                "etcd://root:***@h1:2379,h2:2379/locks",
            ),
            ("redis://:s3cret@h", "redis://:***@h"),
            ("redis://user@h", "redis://user@h"),
            (
                "zk://h/chroot?digest=u&password=s3cret",
                "zk://h/chroot?digest=u&password=***",
            ),
            ("redis://u:p@ss@h", "redis://u:***@h"),
            // Raw `/`, `?`, `#` in a password (malformed, refused): still hidden.
            ("redis://u:pa/ss@h:1/0", "redis://u:***@h:1/0"),
            ("redis://:pa?ss@h:1?prefix=x", "redis://:***@h:1?prefix=x"),
            ("etcd://u:p#w@h/x?lease=2s", "etcd://u:***@h/x?lease=2s"),
            ("redis://h:1/0?prefix=a@b", "redis://h:1/0?prefix=a@b"),
            // A password of digits with a raw `?name=` in it: `u:123` looks like a host.
            ("redis://u:123?a=b@h", "redis://***"),
            ("redis://h:1?prefix=a@b", "redis://***"),
            // A secret option's name percent-encoded, as the backends decode it.
            (
                "redis+sentinel://s1:26379/m?sentinel%5Fpassword=hunter2",
                "redis+sentinel://s1:26379/m?sentinel%5Fpassword=***",
            ),
            ("x://h/?pass%77ord=hunter2", "x://h/?pass%77ord=***"),
            ("redis://:p=w@h:1", "redis://:***@h:1"),
            ("redis://:p&w=x@h:1?db=1", "redis://:***@h:1?db=1"),
            (
                "redis+sentinel://s1,s2/m?sentinel_password=s3cret&db=1",
                "redis+sentinel://s1,s2/m?sentinel_password=***&db=1",
            ),
            (
                "x://h?Sentinel_Password=s3cret",
                "x://h?Sentinel_Password=***",
            ),
            ("x://h?passwords_on=1", "x://h?passwords_on=1"),
            ("not a url:p@ss", "***@ss"),
            // No `://`: a typo in the scheme's slashes still hides the password.
            ("redis:/:hunter2@cache:6379", "redis:***@cache:6379"),
            ("etcd:root:s3cret@h:2379/locks", "etcd:***@h:2379/locks"),
            ("no-at-sign:here", "no-at-sign:here"),
            // No scheme before the first `://`.
            (
                "admin:hunter2@h/x?legacy=redis://y",
                "admin:***@h/x?legacy=redis://y",
            ),
            // A raw `?` in a password that looks like the start of a query.
            ("redis://:s3cr?et=x@h:6379", "redis://***"),
            // User info with a host list: the query is the query, its secrets hidden.
            (
                "redis://app@h/0?password=p@ss",
                "redis://app@h/0?password=***",
            ),
            (
                "redis://:pw@s1,s2/m?prefix=team@corp",
                "redis://:***@s1,s2/m?prefix=team@corp",
            ),
            // A host that is no host list and an `@` in the query: nothing shown.
            ("redis://cache host?password=p@ss", "redis://***"),
            ("redis:///0?password=a@b", "redis://***"),
            (
                "redis://h1:1,h2:2/0?prefix=a@b",
                "redis://h1:1,h2:2/0?prefix=a@b",
            ),
            (
                "redis://[::1]:6379?prefix=a@b",
                "redis://[::1]:6379?prefix=a@b",
            ),
            (
                "migrate://?legacy=redis%3A%2F%2F%3As3cret%40h%3A1&phase=legacy",
                "migrate://?legacy=redis%3A%2F%2F%3A%2A%2A%2A%40h%3A1&phase=legacy",
            ),
            (
                "migrate://?target=etcd://u:s3cret@h/p&phase=target",
                "migrate://?target=etcd://u:***@h/p&phase=target",
            ),
            (
                "migrate://?target=etcd%3A%2F%2Fh%2Fp&phase=target",
                "migrate://?target=etcd%3A%2F%2Fh%2Fp&phase=target",
            ),
        ];
        for (input, expected) in cases {
            assert_eq!(redact_url(input), expected, "{input}");
        }
    }

    /// URLs nested in query values as deep as anyone likes (`l=mem://?l=mem://?...`,
    /// raw or percent-encoded) are redacted without recursing once per level: a small
    /// stack survives a long one, and a password deep inside is still hidden.
    #[test]
    fn deeply_nested_urls_neither_overflow_nor_leak() {
        let raw = format!("mem://?{}x", "l=mem://?".repeat(100_000));
        let mut encoded = "redis://:s3cret@h".to_owned();
        for _ in 0..50 {
            encoded = format!(
                "migrate://?legacy={}",
                percent_encoding::utf8_percent_encode(&encoded, super::COMPONENT)
            );
        }
        let deep_secret = format!("{}redis://:s3cret@h", "migrate://?legacy=".repeat(50));
        let redacted = std::thread::Builder::new()
            .stack_size(256 * 1024)
            .spawn(move || {
                let raw = redact_url(&raw);
                (raw.len(), redact_url(&encoded), redact_url(&deep_secret))
            })
            .unwrap()
            .join()
            .expect("redacting a deeply nested URL overflowed the stack");
        assert!(redacted.0 > 0);
        assert!(!redacted.1.contains("s3cret"), "{}", redacted.1);
        assert!(!redacted.2.contains("s3cret"), "{}", redacted.2);
    }
}
