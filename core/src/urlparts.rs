//! The parts of a backend URL every backend parses the same way: the host list, the
//! user info and the query string.
//!
//! Every backend's URL is `SCHEME://[USER[:PASSWORD]@]HOST[:PORT][,HOST[:PORT]...][/PATH][?QUERY]`.
//! A list of hosts is not a URL authority the `url` crate accepts, so the list is split
//! here, and each host is checked with [`url::Host::parse`] (a domain name, an IPv4
//! address, or an IPv6 address in brackets): a typo such as `127.0.0.1:6379:1`,
//! `[::1` or `host name` is an error at parse time, before any DNS lookup or
//! connection. User info and query values are percent-decoded only: `+` is a plus sign,
//! `&` or `=` inside a value must be written `%26` and `%3D`, as in any URL.

use std::fmt;

/// Refuses a URL whose user info has a raw `/`, `?` or `#` (they end the host list
/// early, and the host parser's complaint would quote part of the password):
/// `rest` is the URL after `SCHEME://`. An `@` after the first `/` or `?` but before the
/// query (the first `?` followed by an option name and `=`) can only be such a
/// password, or an unencoded `@` in a path.
///
/// # Errors
///
/// A message that quotes nothing of the URL.
pub fn check_userinfo_encoded(rest: &str) -> Result<(), String> {
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let limit = query_start(rest);
    if authority_end < limit && rest[authority_end..limit].contains('@') {
        return Err(
            "an `@` after the host list: percent-encode `/`, `?` and `#` in a password \
             (%2F, %3F, %23), and `@` in a path (%40)"
                .into(),
        );
    }
    Ok(())
}

/// Whether `s` is a URL scheme as RFC 3986 spells one (`redis`, `redis+sentinel`,
/// `etcds`): a letter, then letters, digits, `+`, `-` and `.`. Text before a `://` that
/// is not (`admin:pw@h/x?legacy=redis`) is never to be quoted as a scheme.
pub fn is_scheme(s: &str) -> bool {
    s.starts_with(|c: char| c.is_ascii_alphabetic())
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'))
}

/// Where the query of `rest` (a URL after `SCHEME://`) begins: the first `?` followed by
/// an option name and `=`; the length of `rest` without one. A `?` in a malformed
/// password is not followed by a name and `=` (unless the password has that very shape),
/// and the query values after it may hold URLs, with `@`, of their own.
pub(crate) fn query_start(rest: &str) -> usize {
    let bytes = rest.as_bytes();
    for (i, &b) in bytes.iter().enumerate() {
        if b != b'?' {
            continue;
        }
        let name = bytes[i + 1..]
            .iter()
            .take_while(|c| c.is_ascii_alphanumeric() || **c == b'_' || **c == b'-')
            .count();
        if name > 0 && bytes.get(i + 1 + name) == Some(&b'=') {
            return i;
        }
    }
    rest.len()
}

/// One `host:port` of a host list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostPort {
    /// The host: a domain name (lowercase ASCII), an IPv4 address, or an IPv6 address in
    /// brackets (`[::1]`).
    pub host: String,
    /// The port: as written, or the backend's default.
    pub port: u16,
}

impl HostPort {
    /// The host without the brackets of an IPv6 address (for socket APIs).
    pub fn bare_host(&self) -> &str {
        self.host
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(&self.host)
    }
}

impl fmt::Display for HostPort {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.host, self.port)
    }
}

/// Parses a comma-separated host list; a host without a port gets `default_port`.
///
/// # Errors
///
/// A message naming the first bad entry: an empty list or entry, a host that is not a
/// domain name, IPv4 address or bracketed IPv6 address, or a port that is not a number
/// from 1 to 65535.
pub fn parse_hosts(hosts: &str, default_port: u16) -> Result<Vec<HostPort>, String> {
    if hosts.is_empty() {
        return Err("no host given".into());
    }
    hosts
        .split(',')
        .map(|entry| parse_host(entry, default_port))
        .collect()
}

fn parse_host(entry: &str, default_port: u16) -> Result<HostPort, String> {
    if entry.is_empty() {
        return Err("an empty host in the host list".into());
    }
    // The port follows the last `:`, unless that colon is inside an IPv6 address.
    let (host, port) = match entry.rfind(':') {
        Some(colon) if !entry[colon..].contains(']') => {
            (&entry[..colon], Some(&entry[colon + 1..]))
        }
        _ => (entry, None),
    };
    if host.is_empty() {
        return Err(format!("`{entry}`: the host is empty"));
    }
    // Stored as parsed: an IPv4 address in its usual form, a domain in lowercase ASCII.
    let parsed = url::Host::parse(host)
        .map_err(|e| format!("`{entry}`: `{host}` is not a host name or address ({e})"))?;
    let port = match port {
        None => default_port,
        Some(port) => port
            .parse::<u16>()
            .ok()
            .filter(|&p| p != 0)
            .ok_or_else(|| format!("`{entry}`: `{port}` is not a port number (1-65535)"))?,
    };
    Ok(HostPort {
        host: parsed.to_string(),
        port,
    })
}

/// Percent-decodes `text` (`+` stays a plus sign).
///
/// # Errors
///
/// When the decoded bytes are not UTF-8; the message names `what`, never the text (it
/// may be a password).
pub fn percent_decode(text: &str, what: &str) -> Result<String, String> {
    percent_encoding::percent_decode_str(text)
        .decode_utf8()
        .map(|s| s.into_owned())
        .map_err(|_| format!("{what} is not valid percent-encoded UTF-8"))
}

/// Splits `USER[:PASSWORD]` and percent-decodes both parts. An empty user is `None`
/// (`redis://:password@host`).
///
/// # Errors
///
/// When a part is not valid percent-encoded UTF-8.
pub fn parse_userinfo(userinfo: &str) -> Result<(Option<String>, Option<String>), String> {
    let (user, password) = match userinfo.split_once(':') {
        Some((user, password)) => (user, Some(password)),
        None => (userinfo, None),
    };
    let user = percent_decode(user, "the user name")?;
    let password = password
        .map(|p| percent_decode(p, "the password"))
        .transpose()?;
    Ok(((!user.is_empty()).then_some(user), password))
}

/// The `key=value` pairs of a query string, percent-decoded, in order. An empty pair
/// (`a=1&&b=2`) is skipped; a key without `=` has an empty value.
///
/// # Errors
///
/// When a key or value is not valid percent-encoded UTF-8 (the message names the key
/// only), or a key is given twice (`lease=10s&lease=5s`: which one was meant cannot
/// be told, and taking either silently could give two services that look configured
/// alike different settings).
pub fn parse_query(query: &str) -> Result<Vec<(String, String)>, String> {
    let mut pairs: Vec<(String, String)> = Vec::new();
    for pair in query.split('&').filter(|pair| !pair.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        let key = percent_decode(key, "an option name")?;
        if pairs.iter().any(|(earlier, _)| *earlier == key) {
            return Err(format!("`{key}` is given twice; give it once"));
        }
        let value = percent_decode(value, &format!("the value of `{key}`"))?;
        pairs.push((key, value));
    }
    Ok(pairs)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hp(host: &str, port: u16) -> HostPort {
        HostPort {
            host: host.into(),
            port,
        }
    }

    #[test]
    fn a_query_key_given_twice_is_refused() {
        let err = parse_query("lease=10s&prefix=a&lease=5s").unwrap_err();
        assert!(err.contains("`lease`") && err.contains("twice"), "{err}");
        // Also when one spelling is percent-encoded.
        let err = parse_query("lease=10s&l%65ase=5s").unwrap_err();
        assert!(err.contains("`lease`"), "{err}");
        assert_eq!(parse_query("a=1&&b=2").unwrap().len(), 2);
    }

    #[test]
    fn host_lists() {
        assert_eq!(parse_hosts("a", 1).unwrap(), [hp("a", 1)]);
        assert_eq!(
            parse_hosts("a:2,10.0.0.1,[::1]:3,[fe80::1]", 1).unwrap(),
            [
                hp("a", 2),
                hp("10.0.0.1", 1),
                hp("[::1]", 3),
                hp("[fe80::1]", 1)
            ]
        );
        assert_eq!(parse_hosts("[::1]:3", 1).unwrap()[0].bare_host(), "::1");
        assert_eq!(
            parse_hosts("my_host.local:9", 1).unwrap(),
            [hp("my_host.local", 9)]
        );
    }

    #[test]
    fn malformed_hosts_are_refused() {
        for bad in [
            "",
            ",",
            "a,",
            ":6379",
            "127.0.0.1:6379:1",
            "[::1",
            "::1",
            "[::1]:x",
            "host name:6379",
            "a:0",
            "a:65536",
            "a:-1",
            "a/b",
            "a@b",
            "a?b",
            "[::1]]:1",
        ] {
            assert!(parse_hosts(bad, 1).is_err(), "{bad:?} was accepted");
        }
    }

    #[test]
    fn user_info_and_query_are_percent_decoded_only() {
        assert_eq!(
            parse_userinfo("u%40x:p%26+%3D%3A%2F%3F%23%40%25").unwrap(),
            (Some("u@x".into()), Some("p&+=:/?#@%".into()))
        );
        assert_eq!(parse_userinfo(":pw").unwrap(), (None, Some("pw".into())));
        assert_eq!(parse_userinfo("user").unwrap(), (Some("user".into()), None));
        assert!(parse_userinfo("u:%FF").is_err());
        assert_eq!(
            parse_query("a=1+2&&b=%26x%3D&c").unwrap(),
            [
                ("a".to_string(), "1+2".to_string()),
                ("b".into(), "&x=".into()),
                ("c".into(), String::new())
            ]
        );
        let err = parse_query("password=%FF").unwrap_err();
        assert!(!err.contains("FF"), "{err}");
        for raw in [
            "u:s3cr/et@h:1/0",
            "u:s3cr?et@h:1",
            "u:s3cr#et@h/x",
            "h/s3cr@x",
        ] {
            let err = check_userinfo_encoded(raw).unwrap_err();
            assert!(!err.contains("s3cr"), "{err}");
        }
        for fine in [
            "u:p%2Fw@h:1/0",
            "h:1/0?prefix=a@b",
            "h:1",
            "u:p@ss@h",
            ":p=w@h",
        ] {
            assert!(check_userinfo_encoded(fine).is_ok(), "{fine}");
        }
    }
}
