//! Lock name → Redis keys, and Redis Cluster slots.

use std::fmt;
use std::sync::Arc;

/// How lock names become Redis keys.
///
/// Every layout puts a lock's auxiliary keys (token counter, waiter marker) and its unlock
/// and election channels in the lock key's cluster slot, so one script can touch them all
/// on Redis Cluster. A leader's value has no key of its own: it is stored in the lock key,
/// after the owner (see the README's Elections section).
#[derive(Clone, PartialEq, Eq)]
pub struct KeyLayout {
    prefix: String,
    raw: bool,
}

impl KeyLayout {
    /// The prefix of the default (tagged) layout.
    pub const DEFAULT_PREFIX: &'static str = "fencelock:";

    /// The default layout: `PREFIX{NAME}`, where `%` and `}` in the name are
    /// percent-encoded so the whole name is the hash tag. Names map injectively; the
    /// prefix must not contain `{` or `}`.
    ///
    /// # Errors
    ///
    /// A message when the prefix contains a brace.
    pub fn tagged(prefix: impl Into<String>) -> Result<Self, &'static str> {
        let prefix = prefix.into();
        if prefix.contains(['{', '}']) {
            return Err("the prefix of the tagged layout must not contain { or }");
        }
        Ok(KeyLayout { prefix, raw: false })
    }

    /// The migration layout: the lock key is exactly `PREFIX` + name (the prefix may be
    /// empty), as a hand-written `SET key value NX PX ms` lock would use, so both exclude
    /// each other. On Redis Cluster, a key containing `}` without a non-empty `{tag}`
    /// cannot have its auxiliary keys in its slot: a lock or election of such a name is
    /// refused there with [`Error::InvalidName`](fencelock_core::Error::InvalidName)
    /// before anything is sent (and `list` skips it); use a tag in such keys. Its
    /// semaphore and read-write lock, whose keys share a slot of their own, work.
    ///
    /// Keys are not encoded here, so names that would land on another name's auxiliary
    /// keys are refused with `InvalidName` on every deployment: a key containing
    /// `}:fencelock-`, and a semaphore or read-write lock key with a `{tag}` that ends
    /// with `:token`, `:waiters` or `:intent` or contains `:h:`.
    pub fn raw(prefix: impl Into<String>) -> Self {
        KeyLayout {
            prefix: prefix.into(),
            raw: true,
        }
    }

    /// The prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// Whether this is the raw (migration) layout.
    pub fn is_raw(&self) -> bool {
        self.raw
    }

    /// The keys of lock `name`.
    pub(crate) fn keys(&self, name: &str) -> LockKeys {
        if self.raw {
            let lock = format!("{}{name}", self.prefix);
            let tag = hash_tag(&lock).unwrap_or(&lock).to_owned();
            KeySet {
                token: format!("{{{tag}}}:fencelock-token:{lock}"),
                waiters: format!("{{{tag}}}:fencelock-waiters:{lock}"),
                channel: format!("{{{tag}}}:fencelock-unlock:{lock}"),
                election: format!("{{{tag}}}:fencelock-election:{lock}"),
                index: None,
                slot: slot(&lock),
                lock,
            }
            .into()
        } else {
            let mut lock = String::with_capacity(self.prefix.len() + name.len() + 2);
            lock.push_str(&self.prefix);
            lock.push('{');
            lock.push_str(&encode_tagged(name));
            lock.push('}');
            KeySet {
                token: joined(&lock, ":token"),
                waiters: joined(&lock, ":waiters"),
                channel: joined(&lock, ":unlock"),
                election: joined(&lock, ":election"),
                index: None,
                slot: slot(&lock),
                lock,
            }
            .into()
        }
    }
}

/// The part every auxiliary key of the raw layout has after its `{tag}`.
const RAW_AUXILIARY: &str = "}:fencelock-";

/// The ends of a raw semaphore's or read-write lock's auxiliary keys after its index
/// key (see [`KeyLayout::primitive_keys`]); `:h:` is followed by a holder's owner.
const RAW_MEMBER_SUFFIXES: [&str; 3] = [":token", ":waiters", ":intent"];

impl KeyLayout {
    /// Why `name` cannot be used in this layout (a semaphore's or read-write lock's name
    /// when `member`), if so: in the raw layout, where keys are the names themselves,
    /// a name whose key would be another name's auxiliary key. Such a name would take
    /// over the other's token counter, waiter marker or index (the other holder losing
    /// its lock, or its scripts failing with `WRONGTYPE`). The tagged layout encodes
    /// names, so every name maps to keys of its own there.
    ///
    /// Refused, in the raw layout only: a key (prefix and name) containing
    /// `}:fencelock-`; for a semaphore or read-write lock whose key has a `{tag}`, a key
    /// ending with `:token`, `:waiters` or `:intent` or containing `:h:` (another such
    /// name's keys are its own followed by those: without a tag, each name's keys hash
    /// on the whole name and stay apart).
    pub(crate) fn refusal(&self, name: &str, member: bool) -> Option<&'static str> {
        if !self.raw {
            return None;
        }
        let key = format!("{}{name}", self.prefix);
        if key.contains(RAW_AUXILIARY) {
            return Some(
                "in the raw layout, a key containing `}:fencelock-` would be another \
                 name's token counter, waiter marker or index",
            );
        }
        let sibling =
            RAW_MEMBER_SUFFIXES.iter().any(|end| key.ends_with(end)) || key.contains(":h:");
        if member && sibling && hash_tag(&key).is_some() {
            return Some(
                "in the raw layout, a semaphore or read-write lock key with a {tag} that \
                 ends with `:token`, `:waiters` or `:intent`, or contains `:h:`, would be \
                 another one's counter, waiter marker or holder key: use another name or \
                 the tagged layout",
            );
        }
        None
    }
}

impl KeyLayout {
    /// The keys of semaphore (`kind` = `sem`) or read-write lock (`kind` = `rw`) `name`,
    /// all in the slot of the lock key of `name` (see the README's key layout). The
    /// returned [`LockKeys`]' `lock` is the index hash; each holder's key is
    /// [`PrimitiveKeys::holder`].
    pub(crate) fn primitive_keys(&self, name: &str, kind: &str) -> PrimitiveKeys {
        let base = if self.raw {
            let lock = format!("{}{name}", self.prefix);
            let tag = hash_tag(&lock).unwrap_or(&lock).to_owned();
            format!("{{{tag}}}:fencelock-{kind}:{lock}")
        } else {
            format!("{}{{{}}}:{kind}", self.prefix, encode_tagged(name))
        };
        PrimitiveKeys {
            slot: slot(&base),
            holders: format!("{base}:h:"),
            token: format!("{base}:token"),
            waiters: format!("{base}:waiters"),
            channel: format!("{base}:unlock"),
            intent: format!("{base}:intent"),
            index: base,
        }
    }
}

/// The keys of one semaphore or read-write lock (see [`KeyLayout::primitive_keys`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PrimitiveKeys {
    /// The index hash: holder owner → permits (`w` for a writer), and `#limit`.
    pub index: String,
    /// The prefix of the holders' keys (`holders` + owner; value `owner \r index \r token`).
    pub holders: String,
    /// The token counter.
    pub token: String,
    /// The waiter marker (as the lock's).
    pub waiters: String,
    /// The release channel.
    pub channel: String,
    /// A waiting writer's intent (read-write locks).
    pub intent: String,
    /// The Redis Cluster slot of all of them.
    pub slot: u16,
}

impl PrimitiveKeys {
    /// Whether every key and channel of the semaphore or read-write lock (its holders'
    /// keys too) is in one cluster slot, as one script on a Redis Cluster needs. Not so
    /// in the raw layout for a name with `}` and no non-empty `{tag}`, as for a lock (see
    /// [`KeySet::share_a_slot`]).
    pub(crate) fn share_a_slot(&self) -> bool {
        let holder = joined(&self.holders, "owner");
        [
            &self.index,
            &holder,
            &self.token,
            &self.waiters,
            &self.channel,
            &self.intent,
        ]
        .into_iter()
        .all(|key| slot(key) == self.slot)
    }

    /// The [`LockKeys`] of the holder `owner`: its own key, with the shared counter,
    /// marker and channel, which the lock's release and renewal scripts handle.
    pub(crate) fn holder(&self, owner: &str) -> LockKeys {
        KeySet {
            lock: format!("{}{owner}", self.holders),
            token: self.token.clone(),
            waiters: self.waiters.clone(),
            channel: self.channel.clone(),
            election: self.channel.clone(),
            index: Some(self.index.clone()),
            slot: self.slot,
        }
        .into()
    }
}

impl KeyLayout {
    /// A `SCAN MATCH` glob for the lock keys of names starting with `prefix`. In the raw
    /// layout it matches every key under the layout's prefix that starts so.
    pub(crate) fn match_pattern(&self, prefix: &str) -> String {
        let mut pattern = glob_escape(&self.prefix);
        if self.raw {
            pattern.push_str(&glob_escape(prefix));
            pattern.push('*');
        } else {
            pattern.push('{');
            pattern.push_str(&glob_escape(&encode_tagged(prefix)));
            pattern.push_str("*}");
        }
        pattern
    }

    /// The lock name whose lock key is `key`, if it is one of this layout's lock keys.
    pub(crate) fn name_of(&self, key: &str) -> Option<String> {
        let rest = key.strip_prefix(self.prefix.as_str())?;
        if self.raw {
            // The auxiliary keys of raw lock keys: `{tag}:fencelock-token:...`.
            let auxiliary = rest.starts_with('{') && rest.contains("}:fencelock-")
                || key.starts_with('{') && key.contains("}:fencelock-");
            return (!auxiliary).then(|| rest.to_owned());
        }
        let encoded = rest.strip_prefix('{')?.strip_suffix('}')?;
        let mut name = String::with_capacity(encoded.len());
        let mut chars = encoded.char_indices();
        while let Some((at, c)) = chars.next() {
            match c {
                '%' if encoded[at..].starts_with("%25") => name.push('%'),
                '%' if encoded[at..].starts_with("%7D") => name.push('}'),
                '%' | '}' => return None,
                c => {
                    name.push(c);
                    continue;
                }
            }
            chars.nth(1);
        }
        Some(name)
    }
}

/// The tagged layout's spelling of a name inside its braces.
fn encode_tagged(name: &str) -> String {
    let mut encoded = String::with_capacity(name.len());
    for c in name.chars() {
        match c {
            '%' => encoded.push_str("%25"),
            '}' => encoded.push_str("%7D"),
            c => encoded.push(c),
        }
    }
    encoded
}

/// `text` with Redis glob's special characters escaped, to match literally.
fn glob_escape(text: &str) -> String {
    let mut escaped = String::with_capacity(text.len());
    for c in text.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\' | '^') {
            escaped.push('\\');
        }
        escaped.push(c);
    }
    escaped
}

impl Default for KeyLayout {
    fn default() -> Self {
        KeyLayout {
            prefix: Self::DEFAULT_PREFIX.into(),
            raw: false,
        }
    }
}

impl fmt::Debug for KeyLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = if self.raw { "Raw" } else { "Tagged" };
        f.debug_tuple(kind).field(&self.prefix).finish()
    }
}

/// The keys and channel of one lock, shared: a grant's guard, its entry for `close`, its
/// renewal and its background release all refer to the same strings, so a clone is a
/// reference count, not five allocations (they showed in the client's CPU per lock).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LockKeys(Arc<KeySet>);

impl std::ops::Deref for LockKeys {
    type Target = KeySet;

    fn deref(&self) -> &KeySet {
        &self.0
    }
}

impl From<KeySet> for LockKeys {
    fn from(keys: KeySet) -> LockKeys {
        LockKeys(Arc::new(keys))
    }
}

/// What a [`LockKeys`] holds.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct KeySet {
    /// The lock key (string, value = owner, PX = lease).
    pub lock: String,
    /// The token counter.
    pub token: String,
    /// The waiter marker: set (with a TTL) by a failed try of a client that will wait,
    /// deleted by the release, which publishes an unlock message only when it was there.
    pub waiters: String,
    /// The unlock channel.
    pub channel: String,
    /// The election channel: a campaign's grant and its release (or revocation) publish
    /// on it, for observers (see [`crate::election`]).
    pub election: String,
    /// A semaphore's or read-write lock's holder: the index hash listing it (which the
    /// release cleans also when the holder's key has expired); `None` for a lock.
    pub index: Option<String>,
    /// The Redis Cluster slot of all of them.
    pub slot: u16,
}

impl KeySet {
    /// Whether every key and channel of the lock is in the lock key's cluster slot, as one
    /// script on a Redis Cluster needs. Always so in the tagged layout; in the raw layout
    /// not for a lock key with `}` and no non-empty `{tag}` (`a}b`: its auxiliary keys'
    /// tag `{a}b}` hashes on `a`), which a Cluster cannot serve (see
    /// [`KeyLayout::raw`]).
    pub(crate) fn share_a_slot(&self) -> bool {
        [&self.token, &self.waiters, &self.channel, &self.election]
            .into_iter()
            .all(|key| slot(key) == self.slot)
    }
}

/// `key` followed by `suffix`, in one allocation (`format!` showed in the client's CPU
/// per lock).
fn joined(key: &str, suffix: &str) -> String {
    let mut joined = String::with_capacity(key.len() + suffix.len());
    joined.push_str(key);
    joined.push_str(suffix);
    joined
}

/// The content of `key`'s hash tag: between the first `{` and the next `}`, if non-empty.
fn hash_tag(key: &str) -> Option<&str> {
    let open = key.find('{')?;
    let close = key[open + 1..].find('}')?;
    (close > 0).then(|| &key[open + 1..open + 1 + close])
}

/// The Redis Cluster slot of `key`: CRC16 (XMODEM) of its hash tag or whole key, mod 16384.
pub(crate) fn slot(key: &str) -> u16 {
    let data = hash_tag(key).unwrap_or(key).as_bytes();
    let mut crc: u16 = 0;
    for &byte in data {
        crc ^= u16::from(byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc % 16384
}

#[cfg(test)]
mod tests;
