//! Lock names → znode paths, and the Curator node naming.
//!
//! A lock name becomes exactly one path segment under the lock root, so no name can
//! reach another name's node, the root's parent or `/zookeeper`:
//!
//! - `%` and `/` are percent-encoded (UTF-8 bytes as `%XX`), as is every character
//!   ZooKeeper's `PathUtils` rejects: controls, `U+D800`–`U+F8FF`, `U+FFF0`–`U+FFFF`, and
//!   every character outside the Basic Multilingual Plane (the Java server sees those as
//!   surrogates, which it rejects);
//! - the segments `.` and `..` become `%2E` and `%2E%2E`;
//! - directly under `/`, the reserved `zookeeper` becomes `%7Aookeeper`.
//!
//! Every other character is kept, so simple names such as `orders` map to themselves and a
//! Curator `InterProcessMutex` on `{root}/orders` contends with fencelock's lock `orders`.
//! The mapping is injective: `%` is always escaped, so decoding is unambiguous.

use std::fmt::Write as _;

/// The lock name Curator's `InterProcessMutex` uses between the protection prefix and
/// the sequence number.
pub(crate) const LOCK_NAME: &str = "lock-";

/// The name Curator's `LeaderLatch` uses between the protection prefix and the sequence
/// number.
pub(crate) const LATCH_NAME: &str = "latch-";

/// The lock name of Curator's `InterProcessReadWriteLock` read side.
pub(crate) const READ_NAME: &str = "__READ__";

/// The lock name of Curator's `InterProcessReadWriteLock` write side.
pub(crate) const WRITE_NAME: &str = "__WRIT__";

/// Which Curator recipe a node of a lock directory belongs to, told by its name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Recipe {
    /// `InterProcessMutex`: `_c_<uuid>-lock-<seq>`, fencelock's locks.
    Lock,
    /// `LeaderLatch`: `_c_<uuid>-latch-<seq>`, fencelock's elections.
    Latch,
    /// `InterProcessReadWriteLock` read side: `_c_<uuid>-__READ__<seq>`.
    Read,
    /// `InterProcessReadWriteLock` write side: `_c_<uuid>-__WRIT__<seq>`.
    Write,
}

impl Recipe {
    /// The name between the protection prefix and the sequence number.
    pub(crate) fn node_name(self) -> &'static str {
        match self {
            Recipe::Lock => LOCK_NAME,
            Recipe::Latch => LATCH_NAME,
            Recipe::Read => READ_NAME,
            Recipe::Write => WRITE_NAME,
        }
    }

    /// What a directory used this way is, for error messages.
    pub(crate) fn describe(self) -> &'static str {
        match self {
            Recipe::Lock => "a lock (Curator InterProcessMutex nodes)",
            Recipe::Latch => "an election (Curator LeaderLatch nodes)",
            Recipe::Read | Recipe::Write => {
                "a read-write lock (Curator InterProcessReadWriteLock nodes)"
            }
        }
    }

    /// Whether nodes of `self` and `other` may queue in one directory: the same recipe,
    /// or the two sides of a read-write lock.
    pub(crate) fn shares_dir(self, other: Recipe) -> bool {
        self == other
            || matches!(
                (self, other),
                (Recipe::Read, Recipe::Write) | (Recipe::Write, Recipe::Read)
            )
    }

    /// The recipe whose name `child` contains, wherever in it: `None` for a node with
    /// no recipe's name. The protection prefix is `_c_` and a hex uuid, so no name can
    /// appear in it. Loose (`mylatch-0000000001` is a latch node here): only for sorting
    /// and for [`recipe_node`], which tells whether a child is a recipe's node at all.
    pub(crate) fn of(child: &str) -> Option<Recipe> {
        if child.contains(READ_NAME) {
            Some(Recipe::Read)
        } else if child.contains(WRITE_NAME) {
            Some(Recipe::Write)
        } else if child.contains(LATCH_NAME) {
            Some(Recipe::Latch)
        } else if child.contains(LOCK_NAME) {
            Some(Recipe::Lock)
        } else {
            None
        }
    }
}

/// The recipe of `child` if it is a node one of the recipes makes, named as Curator and
/// fencelock name them: `[_c_<uuid>-]<recipe name><sequence number>` (the protection
/// prefix is optional, as for Curator nodes made without protection). `None` for any
/// other node, such as another application's node in a lock directory (under the root
/// `/`, Kafka's `/admin/delete_topics/<topic>` lies in the directory of lock `admin`),
/// even one with a recipe's name inside its own (`padlock-0000000001`): such a node is
/// never a holder or a waiter, and never deleted.
pub(crate) fn recipe_node(child: &str) -> Option<Recipe> {
    let recipe = Recipe::of(child)?;
    let protection = &child[..child.rfind(recipe.node_name())?];
    let protected = protection.is_empty()
        || protection
            .strip_prefix("_c_")
            .and_then(|rest| rest.strip_suffix('-'))
            .is_some_and(|uuid| {
                uuid.len() == 36 && uuid.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-')
            });
    (protected && matches!(rank(child), Rank::Sequence(_))).then_some(recipe)
}

/// Whether `c` must be percent-encoded in a path segment.
pub(crate) fn needs_escape(c: char) -> bool {
    let u = u32::from(c);
    c == '%'
        || c == '/'
        || u <= 0x1f
        || (0x7f..=0x9f).contains(&u)
        || (0xd800..=0xf8ff).contains(&u)
        || u >= 0xfff0
}

/// The path segment of lock `name`; `at_root` when the lock root is `/`.
pub(crate) fn encode_name(name: &str, at_root: bool) -> String {
    match name {
        "." => return "%2E".into(),
        ".." => return "%2E%2E".into(),
        "zookeeper" if at_root => return "%7Aookeeper".into(),
        _ => {}
    }
    let mut out = String::with_capacity(name.len());
    for c in name.chars() {
        if needs_escape(c) {
            let mut buf = [0u8; 4];
            for byte in c.encode_utf8(&mut buf).bytes() {
                let _ = write!(out, "%{byte:02X}");
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// The lock name whose path segment is `segment`: `None` for a child of the lock root
/// that [`encode_name`] cannot have made (`/zookeeper`, an application's own node).
pub(crate) fn decode_name(segment: &str, at_root: bool) -> Option<String> {
    let bytes = segment.as_bytes();
    let mut decoded = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = segment.get(i + 1..i + 3)?;
            decoded.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            decoded.push(bytes[i]);
            i += 1;
        }
    }
    let name = String::from_utf8(decoded).ok()?;
    // Only the one spelling encode_name produces: the mapping stays injective.
    (encode_name(&name, at_root) == segment).then_some(name)
}

/// The directory (a container node) holding the lock nodes of `name`.
pub(crate) fn lock_dir(root: &str, name: &str) -> String {
    format!("{root}/{}", encode_name(name, root.is_empty()))
}

/// The directory of semaphore `name`: `{root}/%sem/{encoded name}`. `%sem` is no
/// encoded lock name (an encoded `%` is `%25`), so a lock and a semaphore of one name
/// never meet, and [`decode_name`] skips it when listing locks.
pub(crate) fn semaphore_dir(root: &str, name: &str) -> String {
    format!("{root}/%sem/{}", encode_name(name, false))
}

/// The directory of read-write lock `name`: `{root}/%rw/{encoded name}` (see
/// [`semaphore_dir`]).
pub(crate) fn rw_dir(root: &str, name: &str) -> String {
    format!("{root}/%rw/{}", encode_name(name, false))
}

/// The child-name prefix of one acquisition or campaign: `_c_<uuid>-lock-` or
/// `_c_<uuid>-latch-`, as Curator's protected mode names it. The uuid lets a client find
/// its node after a lost create reply.
pub(crate) fn protected_prefix(recipe: Recipe) -> String {
    format!("_c_{}-{}", uuid::Uuid::new_v4(), recipe.node_name())
}

/// Curator's sort key of a child: what follows the last `lock-` (`latch-` for a latch
/// node), or the whole name for a node of neither recipe.
///
/// In a directory of one recipe this is exactly Curator's order (Curator's
/// `InterProcessMutex` sorts by what follows `lock-`, its `LeaderLatch` by what follows
/// `latch-`). In a directory where both meet (which fencelock refuses to use, see
/// [`crate::ZkLock`]) both kinds sort by their sequence numbers, which the parent
/// assigns from one counter: the order in which they were created.
pub(crate) fn sort_key(child: &str) -> &str {
    let name = match Recipe::of(child) {
        Some(recipe) => recipe.node_name(),
        None => return child,
    };
    match child.rfind(name) {
        Some(i) => &child[i + name.len()..],
        None => child,
    }
}

/// A child's place in its directory, before the wrap of the sequence counter is taken
/// into account (see [`sort_children`]): sequence numbers first, as unsigned 32-bit
/// values, then any other name by its text.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Rank {
    /// A sequence suffix (`0000000042`, or `-2147483648` after the counter wrapped).
    Sequence(u32),
    /// A node of neither recipe, or one whose suffix is no number.
    Other(String),
}

/// The [`Rank`] of `child`.
pub(crate) fn rank(child: &str) -> Rank {
    let key = sort_key(child);
    match key.parse::<i32>() {
        // `as`: the wrapping reinterpretation is the point (i32::MAX + 1 follows i32::MAX).
        #[allow(clippy::cast_sign_loss)]
        Ok(sequence) if key.len() >= 10 => Rank::Sequence(sequence as u32),
        _ => Rank::Other(key.to_owned()),
    }
}

/// Where the order starts among ascending sequence numbers: after the largest gap on
/// the ring of 2³² numbers.
///
/// The server numbers children from the parent's `cversion`, a signed 32-bit counter
/// that every create and delete moves on: a directory in use for 2³⁰ acquisitions
/// counts past `2147483647` to `-2147483648` (which sorts first as text, so it would
/// be granted while the holder still holds), and later past `-1` to `0`. The nodes
/// alive at once span a short arc of the ring, so the largest gap is the unused part
/// and the first node after it is the oldest. Curator compares the text, and its
/// order breaks at the wrap.
pub(crate) fn ring_start(ascending: &[u32]) -> usize {
    let Some((&first, &last)) = ascending.first().zip(ascending.last()) else {
        return 0;
    };
    // The gap from the last back round to the first; no rotation wins a tie.
    let mut widest = u64::from(first) + (1u64 << 32) - u64::from(last);
    let mut start = 0;
    for (i, pair) in ascending.windows(2).enumerate() {
        let gap = u64::from(pair[1]) - u64::from(pair[0]);
        if gap > widest {
            widest = gap;
            start = i + 1;
        }
    }
    start
}

/// Among `ranks` in ascending order: how many are sequence numbers (they come first),
/// and the index of the oldest of them across the wrap (see [`ring_start`]).
pub(crate) fn order_start<'a>(ranks: impl Iterator<Item = &'a Rank>) -> (usize, usize) {
    let sequences: Vec<u32> = ranks
        .map_while(|rank| match rank {
            Rank::Sequence(sequence) => Some(*sequence),
            Rank::Other(_) => None,
        })
        .collect();
    (sequences.len(), ring_start(&sequences))
}

/// Sorts the children of a lock directory in Curator's order: by the sequence suffix,
/// oldest first across a wrap of the sequence counter (see [`ring_start`]). The first
/// one holds the lock (or leads the election).
pub(crate) fn sort_children(children: &mut [String]) {
    let mut ranked: Vec<(Rank, String)> = children
        .iter_mut()
        .map(|child| (rank(child), std::mem::take(child)))
        .collect();
    ranked.sort_unstable();
    let (sequences, first) = order_start(ranked.iter().map(|(rank, _)| rank));
    ranked[..sequences].rotate_left(first);
    for (slot, (_, child)) in children.iter_mut().zip(ranked) {
        *slot = child;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    /// A ZooKeeper PathUtils check of one segment, as the Java server does it (UTF-16).
    fn java_accepts(segment: &str) -> bool {
        !segment.is_empty()
            && segment != "."
            && segment != ".."
            && !segment.contains('/')
            && segment.encode_utf16().all(|u| {
                !(u <= 0x1f
                    || (0x7f..=0x9f).contains(&u)
                    || (0xd800..=0xf8ff).contains(&u)
                    || u >= 0xfff0)
            })
    }

    #[test]
    fn names_map_to_one_safe_segment_injectively() {
        let names = [
            "orders",
            "a/b",
            "a%2Fb",
            "a%b",
            "/",
            "//",
            ".",
            "..",
            "...",
            "./x",
            "../..",
            "zookeeper",
            "Zookeeper",
            "%7Aookeeper",
            "%2E",
            "é",
            "锁/订单",
            "🔒",
            "\u{e000}",
            "\u{fff0}",
            "{tag}",
            "with space",
            "*?[",
            "\\",
            "a.",
            ".a",
        ];
        let mut seen = HashSet::new();
        for name in names {
            for at_root in [false, true] {
                let segment = encode_name(name, at_root);
                assert!(java_accepts(&segment), "{name:?} → {segment:?}");
                if at_root {
                    assert_ne!(segment, "zookeeper");
                }
            }
            assert!(seen.insert(encode_name(name, true)), "{name:?} collides");
        }
        assert_eq!(encode_name("orders", false), "orders");
        assert_eq!(encode_name("a/b", false), "a%2Fb");
        assert_eq!(encode_name("zookeeper", false), "zookeeper");
        assert_eq!(lock_dir("", "zookeeper"), "/%7Aookeeper");
        assert_eq!(lock_dir("/r", ".."), "/r/%2E%2E");
    }

    #[test]
    fn decoding_undoes_encoding_and_refuses_other_nodes() {
        for name in [
            "a",
            "a/b",
            "%",
            ".",
            "..",
            "zookeeper",
            "锁 {x}",
            "\u{1F512}",
            "a\u{7f}",
        ] {
            for at_root in [false, true] {
                let segment = encode_name(name, at_root);
                assert_eq!(decode_name(&segment, at_root).as_deref(), Some(name));
            }
        }
        assert_eq!(decode_name("zookeeper", true), None);
        assert_eq!(decode_name("%61", false), None, "not how `a` is spelled");
        assert_eq!(decode_name("%2", false), None);
        assert_eq!(decode_name("%FF", false), None);
    }

    #[test]
    fn children_sort_by_sequence_like_curator() {
        let mut children = vec![
            "_c_b-lock-0000000003".to_owned(),
            "_c_a-lock-0000000010".to_owned(),
            "_c_c-lock-0000000001".to_owned(),
        ];
        sort_children(&mut children);
        assert_eq!(
            children,
            [
                "_c_c-lock-0000000001",
                "_c_b-lock-0000000003",
                "_c_a-lock-0000000010"
            ]
        );
        let prefix = protected_prefix(Recipe::Lock);
        assert!(prefix.starts_with("_c_") && prefix.ends_with("-lock-"));
        assert_eq!(prefix.len(), "_c_".len() + 36 + "-lock-".len());
        let prefix = protected_prefix(Recipe::Latch);
        assert!(prefix.starts_with("_c_") && prefix.ends_with("-latch-"));
        assert_eq!(
            Recipe::of(&format!("{prefix}0000000001")),
            Some(Recipe::Latch)
        );
    }

    #[test]
    fn latch_nodes_sort_like_curator_and_mixed_ones_by_creation() {
        let mut latches = vec![
            "_c_b-latch-0000000007".to_owned(),
            "latch-0000000002".to_owned(),
            "_c_a-latch-0000000004".to_owned(),
        ];
        sort_children(&mut latches);
        assert_eq!(
            latches,
            [
                "latch-0000000002",
                "_c_a-latch-0000000004",
                "_c_b-latch-0000000007"
            ]
        );
        let mut mixed = vec![
            "_c_b-latch-0000000007".to_owned(),
            "_c_a-lock-0000000005".to_owned(),
            "stray".to_owned(),
            "_c_c-latch-0000000003".to_owned(),
        ];
        sort_children(&mut mixed);
        assert_eq!(
            mixed,
            [
                "_c_c-latch-0000000003",
                "_c_a-lock-0000000005",
                "_c_b-latch-0000000007",
                "stray"
            ]
        );
        assert_eq!(Recipe::of("_c_a-lock-0000000005"), Some(Recipe::Lock));
        assert_eq!(Recipe::of("stray"), None);
    }

    #[test]
    fn only_nodes_named_as_the_recipes_name_them_are_recipe_nodes() {
        let uuid = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0";
        for (child, recipe) in [
            (format!("_c_{uuid}-lock-0000000001"), Recipe::Lock),
            (format!("_c_{uuid}-latch-0000000007"), Recipe::Latch),
            (format!("_c_{uuid}-__READ__0000000002"), Recipe::Read),
            (format!("_c_{uuid}-__WRIT__-2147483648"), Recipe::Write),
            ("lock-0000000003".to_owned(), Recipe::Lock),
            ("latch-0000000002".to_owned(), Recipe::Latch),
        ] {
            assert_eq!(recipe_node(&child), Some(recipe), "{child}");
        }
        let prefix = protected_prefix(Recipe::Lock);
        assert_eq!(
            recipe_node(&format!("{prefix}0000000042")),
            Some(Recipe::Lock)
        );
        for child in [
            "child",
            "delete_topics",
            "0000000001",
            "padlock-0000000001",
            "x-lock-0000000001",
            "_c_a-lock-0000000001",
            "lock-",
            "lock-12",
            "lock-abcdefghij",
            "_c_0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0-lease-0000000001",
            "_c_0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1fz-lock-0000000001",
        ] {
            assert_eq!(recipe_node(child), None, "{child}");
        }
    }

    /// After 2³⁰ acquisitions in one directory the server's counter runs past
    /// `2147483647` to `-2147483648`, and later past `-1` to `0`: the oldest node still
    /// comes first, and a newcomer never jumps the queue.
    #[test]
    fn children_sort_oldest_first_across_the_wrap_of_the_counter() {
        for (given, expected) in [
            (
                vec![
                    "_c_c-lock--2147483646",
                    "_c_b-lock--2147483648",
                    "_c_a-lock-2147483647",
                ],
                vec![
                    "_c_a-lock-2147483647",
                    "_c_b-lock--2147483648",
                    "_c_c-lock--2147483646",
                ],
            ),
            (
                vec![
                    "_c_c-lock-0000000001",
                    "_c_a-lock--000000002",
                    "_c_b-lock--000000001",
                ],
                vec![
                    "_c_a-lock--000000002",
                    "_c_b-lock--000000001",
                    "_c_c-lock-0000000001",
                ],
            ),
            (
                vec!["stray", "_c_b-lock-0000000001", "_c_a-lock--000000003"],
                vec!["_c_a-lock--000000003", "_c_b-lock-0000000001", "stray"],
            ),
        ] {
            let mut children: Vec<String> = given.iter().map(|c| (*c).to_owned()).collect();
            sort_children(&mut children);
            assert_eq!(children, expected);
        }
        assert_eq!(ring_start(&[]), 0);
        assert_eq!(ring_start(&[7]), 0);
        assert_eq!(ring_start(&[3, 5, 10]), 0);
        assert_eq!(ring_start(&[0, 2, u32::MAX - 1]), 2);
    }
}
