//! Leader election over Redis: a campaign is the lock of the same name, taken with the
//! leader's value, and observers follow the election channel.
//!
//! # Layout
//!
//! A campaign's grant stores its term in the lock key itself: the acquire script sets the
//! key to the owner (`SET NX PX`, as for a lock), issues the token, and rewrites the key
//! to `owner \n token \n value` keeping its expiry. The value therefore has no key of its
//! own to keep consistent: it is renewed, expires and is deleted with the lock key, and
//! one read of that key (with its `PTTL`) gives holder, value, token and remaining lease
//! together. Release and renewal compare the owner line (the value up to the first
//! newline), so a term is released and renewed exactly like a lock.
//!
//! # Observing
//!
//! The grant of a term, and its release or revocation, publish on the election channel
//! (in the lock key's slot). An observer subscribes to it through the client's shared
//! pub/sub connection before its first read, and reads the holder again on every message.
//! A lease that runs out publishes nothing in Redis, so the observer also reads again when
//! the holder's key expires: it sleeps until the remaining lease (`PTTL`) of the read,
//! which is a deadline, not polling (a renewed leader costs one read per lease). When the pub/sub connection was lost, its
//! reconnection wakes the observer too, since messages may have been missed.
//!
//! Plain locks publish nothing on the election channel (their scripts stay as cheap as a
//! hand-written lock's): an observer reports a plain lock's holder only when it reads for
//! another reason (first read, a campaign's message, its `PTTL` deadline, a
//! reconnection), and is not told when a plain lock takes a free name.
//!
//! Redis keeps no history of the key: a term that begins and ends between two reads of an
//! observer (shorter than one round trip) is not reported; every term an observer reports
//! is reported once, in the order of the terms, with its value and the leader's own token,
//! and "nobody leads" is reported when a read finds the name free.
//!
//! # Confirmed terms (Redlock)
//!
//! A Redlock term's token is decided by the client from every instance's answer (the
//! highest granted, or one more than a refusing instance's counter), after the instances
//! wrote their term lines: a majority of instances can agree on an answer lower than the
//! guard's token. So a Redlock grant writes its lines provisional (`owner \n ?token \n
//! value`), and the client, before handing the guard out, rewrites them confirmed with the
//! guard's token (`RAISE_TOKEN`) and publishes. A term is reported (by `leader` and by
//! observers) only when a quorum holds the same confirmed line ([`decide`]): never with a
//! token the leader did not have. A read that cannot decide (too few answers) reports
//! nothing, and an observer reports a leader only with a token larger than the last it
//! reported, so no term is reported twice.

use std::time::Duration;

use fencelock_core::{Error, FencingToken, Leader};
use futures_util::future::join_all;
use redis::Value;

use crate::engine::Engine;
use crate::error::BACKEND;
use crate::keys::LockKeys;
use crate::scripts;

/// A campaign's term, as one instance's lock key holds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Term<'a> {
    /// The token in the term line.
    pub(crate) token: u64,
    /// The leader's value.
    pub(crate) value: &'a str,
    /// `false` for a Redlock grant's provisional line (`?` before the token: that
    /// instance's own answer, which need not be the guard's token), `true` for a line
    /// that carries the guard's token.
    pub(crate) confirmed: bool,
}

/// What a lock key holds, split: the owner (the whole value of a plain lock, the owner
/// line of a campaign's term) and, for a term, its token, value and whether it is
/// confirmed.
pub(crate) fn parse(stored: &str) -> (&str, Option<Term<'_>>) {
    let term = stored.split_once('\n').and_then(|(owner, rest)| {
        if !is_owner(owner) {
            return None;
        }
        let (token, value) = rest.split_once('\n')?;
        let (token, confirmed) = match token.strip_prefix('?') {
            Some(provisional) => (provisional, false),
            None => (token, true),
        };
        if !token.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        let token = token.parse::<u64>().ok()?;
        Some((
            owner,
            Term {
                token,
                value,
                confirmed,
            },
        ))
    });
    match term {
        Some((owner, term)) => (owner, Some(term)),
        None => (stored, None),
    }
}

/// Whether `line` is one of fencelock's owner values: 32 hex digits (the client id), a
/// colon and a decimal attempt number. A hand-written lock's value in the raw layout is
/// taken for a term only if it looks like one.
fn is_owner(line: &str) -> bool {
    let Some((client, attempt)) = line.split_once(':') else {
        return false;
    };
    client.len() == 32
        && client.bytes().all(|b| b.is_ascii_hexdigit())
        && !attempt.is_empty()
        && attempt.bytes().all(|b| b.is_ascii_digit())
}

/// The holder of a name as a quorum sees it.
#[derive(Debug, Clone)]
pub(crate) struct Holder {
    /// The owner value (a term's owner line).
    pub(crate) owner: String,
    /// The grant's token: a term's own, the counter for a plain lock. For an
    /// unconfirmed term, the highest token an instance answered (not necessarily the
    /// leader's).
    pub(crate) token: u64,
    /// The remaining lease (`None`: a key without expiry).
    pub(crate) remaining: Option<Duration>,
    /// A term's value; `None` for a plain lock.
    pub(crate) value: Option<String>,
    /// Whether a leader may be reported: a plain lock, or a term whose confirmed line
    /// (the guard's token) a quorum holds. `false` while a Redlock grant is being made
    /// (its lines are provisional) or confirmed on too few instances yet.
    pub(crate) confirmed: bool,
}

impl Holder {
    /// The leader this holder is: a plain lock's holder leads with an empty value (as
    /// on every backend: campaigning and locking one name exclude each other). `None`
    /// for an unconfirmed term: it is not reported.
    pub(crate) fn leader(&self) -> Option<Leader> {
        self.confirmed.then(|| {
            Leader::new(
                self.value.clone().unwrap_or_default(),
                FencingToken::new(self.token),
            )
        })
    }
}

/// One read of a name on a quorum.
#[derive(Debug, Clone)]
pub(crate) enum Reading {
    /// Held: a quorum agrees on the owner.
    Held(Holder),
    /// Nobody holds it on a quorum, and the instances that did not answer could not
    /// make one (Redlock).
    Free,
    /// Nobody holds it on a quorum of the instances that answered, but with the ones
    /// that did not, someone might (Redlock): the read decides nothing.
    Undecided,
}

impl Reading {
    /// The holder, if a quorum agrees on one.
    pub(crate) fn holder(self) -> Option<Holder> {
        match self {
            Reading::Held(holder) => Some(holder),
            Reading::Free | Reading::Undecided => None,
        }
    }

    /// The leader to report: a confirmed holder's; `None` otherwise.
    pub(crate) fn leader(&self) -> Option<Leader> {
        match self {
            Reading::Held(holder) => holder.leader(),
            Reading::Free | Reading::Undecided => None,
        }
    }
}

/// What one instance answered to the read of a name.
#[derive(Debug, Clone)]
pub(crate) struct Seen {
    /// The owner line (a plain lock's whole value).
    pub(crate) owner: String,
    /// The term in the key, for a campaign: token, value, confirmed.
    pub(crate) term: Option<(u64, String, bool)>,
    /// The name's counter on that instance (0 if none).
    pub(crate) counter: u64,
    /// The key's `PTTL` (`None`: no expiry).
    pub(crate) remaining: Option<Duration>,
}

/// Decides what `seen` (the keys the answering instances hold; `answered` instances
/// answered, of `nodes`) says with `quorum` needed.
///
/// A holder is an owner a quorum of instances holds. A plain lock's token is the highest
/// counter among them. A term is reported (confirmed) only when a quorum holds the same
/// *confirmed* term line (owner, token, value): a Redlock grant writes provisional lines
/// (each instance's own answer), and a line is confirmed only by the client's
/// [`RAISE_TOKEN`](crate::scripts::RAISE_TOKEN) with the guard's token, sent after the
/// client decided that token from every instance's answer and before it hands the guard
/// out. A quorum of agreeing provisional lines is therefore not enough: they may carry a
/// token lower than the guard's (a refusing instance's counter was ahead, or another
/// granting instance answered higher), which is what an observer reading mid-grant
/// reported before, followed by the same term again with the right token. On a single
/// server (quorum 1) the campaign script writes the confirmed line itself.
pub(crate) fn decide(seen: &[Seen], answered: usize, nodes: usize, quorum: usize) -> Reading {
    let silent = nodes.saturating_sub(answered);
    let mut undecided = false;
    for first in seen {
        let same: Vec<&Seen> = seen.iter().filter(|s| s.owner == first.owner).collect();
        if same.len() < quorum {
            undecided |= same.len() + silent >= quorum;
            continue;
        }
        let remaining = |of: &[&Seen]| of.iter().filter_map(|s| s.remaining).min();
        if same.iter().all(|s| s.term.is_none()) {
            return Reading::Held(Holder {
                owner: first.owner.clone(),
                token: same.iter().map(|s| s.counter).max().unwrap_or(0),
                // The earliest expiry of the agreeing nodes (`None` only if none expires).
                remaining: remaining(&same),
                value: None,
                confirmed: true,
            });
        }
        for line in &same {
            let Some(term @ (_, _, true)) = &line.term else {
                continue;
            };
            let agreeing: Vec<&Seen> = same
                .iter()
                .copied()
                .filter(|s| s.term.as_ref() == Some(term))
                .collect();
            if agreeing.len() >= quorum {
                return Reading::Held(Holder {
                    owner: first.owner.clone(),
                    token: term.0,
                    remaining: remaining(&agreeing),
                    value: Some(term.1.clone()),
                    confirmed: true,
                });
            }
        }
        // Held, but not (yet) confirmed on a quorum.
        return Reading::Held(Holder {
            owner: first.owner.clone(),
            token: same
                .iter()
                .map(|s| s.term.as_ref().map_or(s.counter, |t| t.0))
                .max()
                .unwrap_or(0),
            remaining: remaining(&same),
            value: same
                .iter()
                .find_map(|s| s.term.as_ref().map(|t| t.1.clone())),
            confirmed: false,
        });
    }
    if undecided {
        Reading::Undecided
    } else {
        Reading::Free
    }
}

/// The holder a quorum of nodes agrees on, if any (see [`reading`]); a term
/// being granted (not yet confirmed) is a holder here, as it holds the name.
pub(crate) async fn holder_of(engine: &Engine, keys: &LockKeys) -> Result<Option<Holder>, Error> {
    Ok(reading(engine, keys).await?.holder())
}

/// One read of the lock key and its `PTTL` (and the counter, a plain lock's token) per
/// node, decided by [`decide`]: a holder is an owner a quorum agrees on,
/// and a campaign's term (read from the lock key itself, value and token with the
/// owner) is confirmed only when a quorum holds its confirmed line.
pub(crate) async fn reading(engine: &Engine, keys: &LockKeys) -> Result<Reading, Error> {
    let mut invocation = scripts::INSPECT.prepare_invoke();
    invocation.key(&keys.lock).key(&keys.token);
    let replies = join_all(engine.nodes.iter().map(|n| n.invoke::<Value>(&invocation))).await;
    let mut seen: Vec<Seen> = Vec::new();
    let mut answered = 0;
    let mut first_error = None;
    for reply in replies {
        match reply {
            Ok(Value::Array(items)) => {
                answered += 1;
                if let [stored, Value::Int(pttl), counter] = items.as_slice() {
                    if let Some(stored) = text(stored) {
                        let (owner, term) = parse(&stored);
                        seen.push(Seen {
                            owner: owner.to_owned(),
                            term: term.map(|t| (t.token, t.value.to_owned(), t.confirmed)),
                            counter: text(counter).and_then(|c| c.parse().ok()).unwrap_or(0),
                            remaining: u64::try_from(*pttl).ok().map(Duration::from_millis),
                        });
                    }
                }
            }
            Ok(_) => answered += 1,
            Err(e) => first_error = first_error.or(Some(e)),
        }
    }
    if answered < engine.quorum {
        return Err(
            first_error.unwrap_or_else(|| Error::unavailable(BACKEND, "no quorum answered"))
        );
    }
    Ok(decide(&seen, answered, engine.nodes.len(), engine.quorum))
}

/// A reply's text, if it is a string.
fn text(value: &Value) -> Option<String> {
    match value {
        Value::BulkString(bytes) => Some(String::from_utf8_lossy(bytes).into_owned()),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A confirmed term (`true`) or a provisional one.
    fn term(token: u64, value: &str, confirmed: bool) -> Option<Term<'_>> {
        Some(Term {
            token,
            value,
            confirmed,
        })
    }

    #[test]
    fn terms_and_plain_owners_are_told_apart() {
        let owner = "0123456789abcdef0123456789ABCDEF:42";
        assert_eq!(parse(owner), (owner, None));
        let line = format!("{owner}\n1700000000000000\n10.0.0.1:8080");
        assert_eq!(
            parse(&line),
            (owner, term(1_700_000_000_000_000, "10.0.0.1:8080", true))
        );
        // A Redlock grant's provisional line.
        let line = format!("{owner}\n?1700000000000000\n10.0.0.1:8080");
        assert_eq!(
            parse(&line),
            (owner, term(1_700_000_000_000_000, "10.0.0.1:8080", false))
        );
        // A value may hold newlines, or be empty.
        let line = format!("{owner}\n7\na\nb");
        assert_eq!(parse(&line), (owner, term(7, "a\nb", true)));
        let line = format!("{owner}\n7\n");
        assert_eq!(parse(&line), (owner, term(7, "", true)));
        // Hand-written values are owners as a whole.
        for foreign in [
            "legacy-7f3a",
            "legacy\n7\nv",
            "0123456789abcdef0123456789abcdef:\n7\nv",
            "0123456789abcdef0123456789abcdeg:1\n7\nv",
            &format!("{owner}\nx7\nv"),
            &format!("{owner}\n7"),
            &format!("{owner}\n?\nv"),
            &format!("{owner}\n??7\nv"),
            &format!("{owner}\n+7\nv"),
            "",
        ] {
            assert_eq!(parse(foreign), (foreign, None), "{foreign:?}");
        }
    }

    const O: &str = "0123456789abcdef0123456789abcdef:1";

    /// An instance holding `O`'s term line (`confirmed` or provisional) with `token`.
    fn line(token: u64, confirmed: bool) -> Seen {
        Seen {
            owner: O.to_owned(),
            term: Some((token, "p1".to_owned(), confirmed)),
            counter: token,
            remaining: Some(Duration::from_secs(10)),
        }
    }

    /// An instance holding another owner's key (or a plain lock) with `counter`.
    fn other(owner: &str, counter: u64) -> Seen {
        Seen {
            owner: owner.to_owned(),
            term: None,
            counter,
            remaining: Some(Duration::from_secs(5)),
        }
    }

    fn leader(reading: &Reading) -> Option<(u64, String)> {
        reading.leader().map(|l| (l.token.get(), l.value))
    }

    /// Issue 35: two of three instances granted with the proposal (673) while the third
    /// refused with its counter ahead (948), so the guard's token is 949. Caught between
    /// the grant and the confirmation, the two agreeing provisional lines are held, not
    /// a leader; once a majority holds the confirmed line, the leader is reported with
    /// the guard's token; a confirmed line on one instance only is not enough.
    #[test]
    fn a_term_is_reported_only_once_confirmed_on_a_quorum() {
        let mid_grant = [line(673, false), line(673, false), other("previous", 948)];
        let reading = decide(&mid_grant, 3, 3, 2);
        assert!(
            matches!(&reading, Reading::Held(h) if !h.confirmed && h.owner == O),
            "{reading:?}"
        );
        assert_eq!(leader(&reading), None);
        let half = [line(949, true), line(673, false), other("previous", 949)];
        assert_eq!(leader(&decide(&half, 3, 3, 2)), None);
        let confirmed = [line(949, true), line(949, true), other("previous", 949)];
        assert_eq!(
            leader(&decide(&confirmed, 3, 3, 2)),
            Some((949, "p1".to_owned()))
        );
        // Two confirmed lines that disagree (written by an older version) are not a leader.
        let older = [line(673, true), line(949, true), other("previous", 948)];
        assert_eq!(leader(&decide(&older, 3, 3, 2)), None);
        // One server: its line is the leader's (the campaign script writes it confirmed).
        assert_eq!(
            leader(&decide(&[line(5, true)], 1, 1, 1)),
            Some((5, "p1".to_owned()))
        );
        // A plain lock's token is the highest counter of the agreeing instances.
        let plain = [other(O, 7), other(O, 8), other("x", 9)];
        assert_eq!(leader(&decide(&plain, 3, 3, 2)), Some((8, String::new())));
    }

    /// A read that could not tell (one instance silent, the owner on one of the two that
    /// answered) decides nothing, so an observer does not report "nobody leads" and then
    /// the same term again.
    #[test]
    fn a_read_missing_the_deciding_instance_is_undecided() {
        let reading = decide(&[line(9, true)], 2, 3, 2);
        assert!(matches!(reading, Reading::Undecided), "{reading:?}");
        assert!(matches!(decide(&[], 2, 3, 2), Reading::Free));
        assert!(matches!(decide(&[line(9, true)], 3, 3, 2), Reading::Free));
    }
}
