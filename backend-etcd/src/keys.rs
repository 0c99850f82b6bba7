//! Where a lock lives in etcd's key space.

/// Escapes `%` (so the encoding is injective) and `/` (so no name's key range contains
/// another name's keys: `a` never sees `a/b`); everything else, including non-ASCII text,
/// stays as it is, so keys remain readable in `etcdctl get --prefix`.
pub(crate) fn encode(name: &str) -> String {
    let mut encoded = String::with_capacity(name.len());
    for c in name.chars() {
        match c {
            '%' => encoded.push_str("%25"),
            '/' => encoded.push_str("%2F"),
            c => encoded.push(c),
        }
    }
    encoded
}

/// The name [`encode`] made `encoded` from; `None` for anything `encode` cannot make.
pub(crate) fn decode(encoded: &str) -> Option<String> {
    let mut name = String::with_capacity(encoded.len());
    let mut rest = encoded;
    while let Some(at) = rest.find('%') {
        name.push_str(&rest[..at]);
        rest = &rest[at..];
        if let Some(after) = rest.strip_prefix("%25") {
            name.push('%');
            rest = after;
        } else if let Some(after) = rest.strip_prefix("%2F") {
            name.push('/');
            rest = after;
        } else {
            return None;
        }
    }
    name.push_str(rest);
    Some(name)
}

/// The key range of one lock name: `{prefix}/{encoded name}/`.
///
/// Every contender puts one key under it; the one with the lowest create revision holds
/// the lock. This is the layout of etcd's Go `concurrency.NewMutex(session,
/// "{prefix}/{encoded name}")` and of `etcdctl lock {prefix}/{encoded name}`, so they and
/// fencelock exclude each other.
pub(crate) fn name_prefix(prefix: &str, name: &str) -> String {
    format!("{prefix}/{}/", encode(name))
}

/// The key a client puts for `name` under its lease: `{name prefix}{lease id in lowercase
/// hex}`, as the Go client does.
pub(crate) fn own_key(name_prefix: &str, lease_id: i64) -> String {
    format!("{name_prefix}{lease_id:x}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_never_share_a_range() {
        let names = [
            "a", "a/b", "a%2Fb", "a%252Fb", "..", "../x", "/", "", "ab", "a/",
        ];
        let ranges: Vec<String> = names.iter().map(|n| name_prefix("locks", n)).collect();
        for (i, a) in ranges.iter().enumerate() {
            for (j, b) in ranges.iter().enumerate() {
                if i != j {
                    assert!(
                        !b.starts_with(a.as_str()),
                        "{:?} contains {:?}",
                        names[i],
                        names[j]
                    );
                }
            }
        }
    }

    #[test]
    fn decoding_undoes_encoding() {
        for name in ["a", "a/b", "a%2Fb", "%", "%%25/", "锁 {x}", "/"] {
            assert_eq!(decode(&encode(name)).as_deref(), Some(name));
        }
        assert_eq!(decode("a%2"), None);
        assert_eq!(decode("a%41"), None);
    }

    #[test]
    fn layout_matches_the_go_client() {
        let prefix = name_prefix("locks", "orders");
        assert_eq!(prefix, "locks/orders/");
        assert_eq!(
            own_key(&prefix, 0x694d_8b4c_1f2a_0b07),
            "locks/orders/694d8b4c1f2a0b07"
        );
        assert_eq!(name_prefix("p", "锁 {x}"), "p/锁 {x}/");
    }
}
