//! Key layouts: patterns, slots, injectivity, the raw layout's refusals.

use std::collections::HashMap;

use super::*;

#[test]
fn lock_keys_are_found_by_their_pattern_and_named_back() {
    let names = ["a", "a}b", "100%", "{x}", "odd *?[]\\^ ü", "a%7D"];
    for layout in [KeyLayout::default(), KeyLayout::raw("lock:")] {
        for name in names {
            let keys = layout.keys(name);
            assert_eq!(
                layout.name_of(&keys.lock).as_deref(),
                Some(name),
                "{layout:?}"
            );
            for auxiliary in [&keys.token, &keys.waiters] {
                assert_eq!(layout.name_of(auxiliary), None, "{auxiliary}");
            }
            assert!(glob(&layout.match_pattern(""), &keys.lock), "{}", keys.lock);
            assert!(
                glob(&layout.match_pattern(name), &keys.lock),
                "{}",
                keys.lock
            );
            assert!(!glob(
                &layout.match_pattern(&format!("{name}x")),
                &keys.lock
            ));
            if !layout.is_raw() {
                assert!(!glob(&layout.match_pattern(""), &keys.token));
            }
        }
    }
    assert_eq!(KeyLayout::default().name_of("fencelock:{a}b}"), None);
    assert_eq!(KeyLayout::default().name_of("fencelock:{a%41}"), None);
    assert_eq!(KeyLayout::default().name_of("other:{a}"), None);
}

/// Redis's glob, for the patterns made here: `*`, and `\` escaping one character.
fn glob(pattern: &str, text: &str) -> bool {
    fn matches(p: &[char], t: &[char]) -> bool {
        match p.first() {
            None => t.is_empty(),
            Some('*') => (0..=t.len()).any(|i| matches(&p[1..], &t[i..])),
            Some('\\') => t.first() == p.get(1) && !t.is_empty() && matches(&p[2..], &t[1..]),
            Some(c) => t.first() == Some(c) && matches(&p[1..], &t[1..]),
        }
    }
    let (p, t): (Vec<char>, Vec<char>) = (pattern.chars().collect(), text.chars().collect());
    matches(&p, &t)
}

#[test]
fn slots_match_redis() {
    // Values from `CLUSTER KEYSLOT`.
    assert_eq!(slot("foo"), 12182);
    assert_eq!(slot("123456789"), 12739);
    assert_eq!(slot("{user1000}.following"), slot("{user1000}.followers"));
    assert_eq!(slot("foo{}{bar}"), slot("foo{}{bar}"));
    assert_ne!(slot("foo{}{bar}"), slot("bar"));
}

#[test]
fn tagged_keys_share_a_slot_and_are_injective() {
    let layout = KeyLayout::default();
    let names = ["a", "a}", "a%7D", "}x", "{tag}", "a/b", "%", "锁"];
    let mut seen = std::collections::HashSet::new();
    for name in names {
        let k = layout.keys(name);
        assert!(seen.insert(k.lock.clone()), "{name}");
        assert_eq!(slot(&k.token), k.slot, "{name}");
        assert_eq!(slot(&k.channel), k.slot, "{name}");
        assert_eq!(slot(&k.election), k.slot, "{name}");
        assert_eq!(slot(&k.waiters), k.slot, "{name}");
        assert!(k.lock.starts_with("fencelock:{"));
    }
    assert_eq!(layout.keys("x").lock, "fencelock:{x}");
}

#[test]
fn raw_keys_are_prefix_plus_name() {
    let layout = KeyLayout::raw("lock:");
    let k = layout.keys("order:SKU-8842");
    assert_eq!(k.lock, "lock:order:SKU-8842");
    assert_eq!(slot(&k.token), slot(&k.lock));
    let k = KeyLayout::raw("").keys("{order}:1");
    assert_eq!(k.lock, "{order}:1");
    assert_eq!(slot(&k.token), slot(&k.lock));
    assert_eq!(slot(&k.channel), slot(&k.lock));
    assert_eq!(slot(&k.election), slot(&k.lock));
    assert_eq!(slot(&k.waiters), slot(&k.lock));
}

/// The keys of a name share its lock key's slot, except a raw lock key with `}` and
/// no non-empty tag, which a Cluster then refuses (see `RedisLock::lock_keys`).
#[test]
fn raw_keys_with_a_brace_and_no_tag_do_not_share_a_slot() {
    for name in ["a", "a}b", "x{}y}", "{t}x}y", "锁"] {
        assert!(KeyLayout::default().keys(name).share_a_slot(), "{name}");
    }
    for prefix in ["", "lock:"] {
        let raw = KeyLayout::raw(prefix);
        for name in ["a", "order:SKU-8842", "{order}:1", "{t}x}y", "锁"] {
            assert!(raw.keys(name).share_a_slot(), "{prefix}{name}");
        }
        for name in ["a}b", "x{}y}", "}"] {
            let keys = raw.keys(name);
            assert!(!keys.share_a_slot(), "{prefix}{name}");
            assert_ne!(slot(&keys.token), keys.slot, "{prefix}{name}");
        }
        // A semaphore's or read-write lock's keys all carry the tag `{lock}` (or the
        // lock's own tag), which hashes on the lock up to its first `}`: one slot,
        // unless that leaves it empty (a name starting with `}` and no prefix).
        for name in [
            "a",
            "order:SKU-8842",
            "{order}:1",
            "{t}x}y",
            "锁",
            "a}b",
            "x{}y}",
        ] {
            for kind in ["sem", "rw"] {
                assert!(
                    raw.primitive_keys(name, kind).share_a_slot(),
                    "{prefix}{name} {kind}"
                );
            }
        }
    }
}

/// In the raw layout no accepted name's key is another accepted name's key: the
/// names built to land on the auxiliary keys of others are refused (see
/// `KeyLayout::refusal`), and the tagged layout refuses nothing.
#[test]
fn raw_names_that_would_land_on_other_names_keys_are_refused() {
    let owner = "0123456789abcdef0123456789abcdef:7";
    for prefix in ["", "lock:", "{app}:"] {
        let raw = KeyLayout::raw(prefix);
        let mut names: Vec<String> = ["a", "{t}x", "x}y", "{t}", "}"]
            .iter()
            .map(|n| (*n).to_owned())
            .collect();
        // Each of their keys without the prefix, and their siblings.
        for base in names.clone() {
            let keys = raw.keys(&base);
            let mut theirs = vec![keys.token.clone(), keys.waiters.clone()];
            for kind in ["sem", "rw"] {
                let member = raw.primitive_keys(&base, kind);
                theirs.extend([member.index.clone(), member.token.clone()]);
                theirs.push(format!("{}{owner}", member.holders));
            }
            for key in theirs {
                names.push(key.strip_prefix(prefix).unwrap_or(&key).to_owned());
            }
            for end in [":token", ":waiters", ":intent", ":h:"] {
                names.push(format!(
                    "{base}{end}{}",
                    if end == ":h:" { owner } else { "" }
                ));
            }
        }
        // Key → the accepted name (and its kind) that has it.
        let mut taken: HashMap<String, String> = HashMap::new();
        let mut claim = |name: &str, what: &str, key: String| {
            if let Some(other) = taken.insert(key.clone(), format!("{what} {name}")) {
                assert_eq!(other, format!("{what} {name}"), "{prefix}: {key} twice");
            }
        };
        for name in &names {
            if raw.refusal(name, false).is_none() {
                let keys = raw.keys(name);
                claim(name, "lock", keys.lock.clone());
                claim(name, "lock", keys.token.clone());
                claim(name, "lock", keys.waiters.clone());
            }
            for kind in ["sem", "rw"] {
                if raw.refusal(name, true).is_none() {
                    let member = raw.primitive_keys(name, kind);
                    for key in [
                        member.index.clone(),
                        member.token.clone(),
                        member.waiters.clone(),
                        member.intent.clone(),
                        format!("{}{owner}", member.holders),
                    ] {
                        claim(name, kind, key);
                    }
                }
            }
        }
        assert!(names.iter().any(|n| raw.refusal(n, false).is_some()));
        assert!(raw.refusal("order:SKU-8842", false).is_none());
        assert!(raw.refusal("{order}:1", true).is_none());
    }
    for name in ["{a}:fencelock-token:a", "{t}x:token", "{t}x:h:y"] {
        assert_eq!(KeyLayout::default().refusal(name, true), None);
    }
}

/// The raw layout without a prefix: a semaphore or read-write lock named with a
/// leading `}` gets the empty tag `{}`, and its keys hash whole, apart: a Cluster
/// refuses it (see `RedisLock::take_member`).
#[test]
fn raw_primitive_keys_with_an_empty_tag_do_not_share_a_slot() {
    let raw = KeyLayout::raw("");
    for name in ["}", "}x", "}:a"] {
        for kind in ["sem", "rw"] {
            assert!(
                !raw.primitive_keys(name, kind).share_a_slot(),
                "{name} {kind}"
            );
        }
    }
}

#[test]
fn primitive_keys_share_the_lock_slot_and_are_not_listed() {
    for layout in [KeyLayout::default(), KeyLayout::raw("lock:")] {
        for name in ["a", "a}b", "{x}", "锁"] {
            if layout.is_raw() && name == "a}b" {
                // A raw key with `}` and no tag: documented as unsupported on Cluster.
                continue;
            }
            let lock = layout.keys(name);
            for kind in ["sem", "rw"] {
                let k = layout.primitive_keys(name, kind);
                let holder = k.holder("owner:1");
                for key in [
                    &k.index,
                    &k.token,
                    &k.waiters,
                    &k.channel,
                    &k.intent,
                    &holder.lock,
                ] {
                    assert_eq!(slot(key), lock.slot, "{key}");
                    assert_eq!(layout.name_of(key), None, "{key}");
                    if !layout.is_raw() {
                        assert!(!glob(&layout.match_pattern(""), key), "{key}");
                    }
                }
            }
        }
    }
    assert_eq!(
        KeyLayout::default().primitive_keys("x", "sem").index,
        "fencelock:{x}:sem"
    );
}

#[test]
fn braces_in_tagged_prefix_are_refused() {
    assert!(KeyLayout::tagged("a{").is_err());
    assert!(KeyLayout::tagged("ok:").is_ok());
}
