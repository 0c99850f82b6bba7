//! The Lua scripts: each lock operation is one `EVALSHA`. A server that does not know
//! the script (`NOSCRIPT`: it restarted, or it is a replica promoted by a failover) gets
//! the same call as `EVAL` with the script's text, which also caches it there. The
//! fallback is sent to the server that refused, routed by the call's keys like the
//! `EVALSHA` was: a `SCRIPT LOAD` would go wherever the client's (possibly outdated)
//! view of a cluster sends it.
//!
//! # Token scheme
//!
//! The acquire script issues `max(counter + 1, server clock in µs)` and records it in
//! the lock's counter key (TTL `token_ttl`, or the lease if longer, refreshed at every
//! grant), in the same script that sets the lock key. The counter alone is not enough:
//! a failover to a lagging replica, or a restart from an older snapshot, leaves a
//! counter that is present but stale, and `counter + 1` would then re-issue a token
//! already handed out. The clock, which has moved on, lies above every token issued
//! before the data loss (each was at most the clock at its grant, or one more than a
//! token that was). The counter keeps tokens increasing when grants come faster than
//! the clock ticks, or when a clock steps back a little. The assumption: the wall clock
//! of the server (and of any replica promoted in its place) does not step back by more
//! than the time between the last grant before the data loss and the first grant after
//! it. Tokens are below 2^53, so Lua's doubles represent them exactly.
//!
//! Redlock: the token of a guard is the highest token among the granting majority, or
//! one more than the highest counter among the refusing instances if that is higher,
//! and it must be recorded on a majority before the guard is handed out, so that any
//! later majority (which overlaps this one) issues a larger one. The overlap may be an
//! instance that refuses the later grant (it still holds an earlier holder's key): its
//! counter counts as much as a granting one's. The client proposes one value
//! to all instances ([`ACQUIRE_PROPOSED`]); when the granting majority all answer the
//! same token it is already recorded there and the attempt costs one round trip, and
//! only when they disagree (an instance lagging behind or ahead, or a refusing instance
//! ahead of them all) does the client write the highest back ([`RAISE_TOKEN`]) before
//! returning. Tokens never go backwards while
//! a majority keeps its counters; an instance that lost its counter (restarted without
//! persistence) answers the proposal, the client's clock, which lies above earlier
//! tokens unless that client's clock is behind the clocks of earlier clients by more
//! than the time since their grants.

use std::sync::LazyLock;

use crate::call::Lua;

/// KEYS: lock, token, waiter marker. ARGV: owner, lease ms, token ttl ms, mark (`1`
/// when the caller will wait if the lock is taken).
/// Returns `{1, token}` when granted, `{0, pttl}` when held by someone else.
///
/// `token = max(counter + 1, server clock in µs)` (the module docs say why both). The
/// usual grant (the clock above the counter) is `SET NX PX`, `TIME` and one
/// `SET ... PX ... GET` that records the clock and returns the old counter (Redis 6.2 or
/// later); the clock's digits are joined as strings, so no number is formatted. Only a
/// counter at or above the clock needs a fourth command.
///
/// A refused try of a caller that will wait sets the waiter marker (see [`RELEASE`]).
pub(crate) static ACQUIRE: LazyLock<Lua> =
    LazyLock::new(|| Lua::new(&acquire(Granted::Lock, RESENT)));

/// [`ACQUIRE`] for a campaign: KEYS and ARGV as there, then ARGV\[5\] unused, the
/// election channel, the leader's value. The grant stores the term in the lock key (see
/// [`campaign_grant`]) and publishes on the election channel.
pub(crate) static CAMPAIGN: LazyLock<Lua> =
    LazyLock::new(|| Lua::new(&acquire(Granted::Campaign, RESENT_TERM)));

/// What a granting script does with the token `tok` (a Lua expression).
#[derive(Clone, Copy)]
enum Granted {
    /// Returns it.
    Lock,
    /// Stores the term in the lock key and publishes it, then returns it.
    Campaign,
    /// Redlock: stores the term in the lock key marked provisional (this instance's own
    /// answer, not yet the guard's token), publishes nothing, and returns it. See
    /// [`provisional_grant`].
    Provisional,
}

impl Granted {
    fn lua(self, tok: &str) -> String {
        match self {
            Granted::Lock => format!("return {{1, {tok}}}"),
            Granted::Campaign => campaign_grant(tok),
            Granted::Provisional => provisional_grant(tok),
        }
    }
}

/// A campaign's grant: the lock key, set to the owner by `SET NX PX`, becomes
/// `owner \n token \n value` with the same expiry (`KEEPTTL`), so the leader's value and
/// token live and die with the lock key: renewed by its `PEXPIRE`, expired by its `PX`,
/// deleted by its release. The grant is published on the election channel (ARGV\[6\]).
/// The owner line is what release and renewal compare (see [`RELEASE`], [`RENEW`]).
fn campaign_grant(tok: &str) -> String {
    format!(
        r"redis.call('SET', KEYS[1], ARGV[1] .. '\n' .. {tok} .. '\n' .. ARGV[7], 'KEEPTTL')
  redis.call('PUBLISH', ARGV[6], '1')
  return {{1, {tok}}}"
    )
}

/// A Redlock campaign's grant on one instance: the lock key becomes
/// `owner \n ? token \n value` (keeping its expiry), where `token` is this instance's
/// own answer, marked provisional by the `?`. The guard's token is decided by the client
/// from every instance's answer (the highest granted, or one more than a refusing
/// instance's counter), so an instance cannot know it: a majority of instances may agree
/// on an answer lower than the guard's token. The client then writes the confirmed term
/// line (`owner \n token \n value`, the guard's token) with [`RAISE_TOKEN`] on every
/// instance still holding the owner, and publishes it, before the guard is handed out;
/// observers report a term only when a majority holds the same confirmed line (see the
/// crate's `election` module). Nothing is published here: an observer woken now could
/// only find the term unconfirmed.
fn provisional_grant(tok: &str) -> String {
    format!(
        r"redis.call('SET', KEYS[1], ARGV[1] .. '\n?' .. {tok} .. '\n' .. ARGV[7], 'KEEPTTL')
  return {{1, {tok}}}"
    )
}

/// The text of the single-server acquire script (see [`ACQUIRE`]).
fn acquire(granted: Granted, resent: &str) -> String {
    format!(
        r"
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  local t = redis.call('TIME')
  local now = t[1] .. string.rep('0', 6 - #t[2]) .. t[2]
  local c = tonumber(redis.call('SET', KEYS[2], now, 'PX', ARGV[3], 'GET') or '0') or 0
  if c < tonumber(now) then
    {}
  end
  local tok = string.format('%.0f', c + 1)
  redis.call('SET', KEYS[2], tok, 'PX', ARGV[3])
  {}
end
{resent}{REFUSED}",
        granted.lua("now"),
        granted.lua("tok"),
    )
}

/// The middle of both acquire scripts: the lock holds our own owner value (unique per
/// attempt), so this is the same attempt sent again (redis-rs re-sends a request after a
/// dropped connection) and its first send was applied. It is granted again, with the
/// token the first send recorded (nobody else was granted since: we hold the lock), and
/// the lease restarts now, so the caller's deadline, anchored at this send, is within it.
const RESENT: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  local c = redis.call('GET', KEYS[2])
  if c then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return {1, c}
  end
end
";

/// [`RESENT`] for a campaign, whose lock key holds the owner line followed by the term
/// (see [`campaign_grant`]).
const RESENT_TERM: &str = r"
local v = redis.call('GET', KEYS[1])
if v and string.sub(v, 1, #ARGV[1] + 1) == ARGV[1] .. '\n' then
  local c = redis.call('GET', KEYS[2])
  if c then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return {1, c}
  end
end
";

/// The end of the single-server acquire scripts: the lock is held by someone else. A
/// caller that will wait marks the lock as awaited until at least a second past the
/// holder's `PTTL` (and for two seconds at least, for a key without expiry, re-checked
/// every second), so the marker outlives the waiter's sleep until its next try, which
/// marks again.
const REFUSED: &str = r"
local pttl = redis.call('PTTL', KEYS[1])
if ARGV[4] == '1' then
  local ms = pttl
  if ms < 1000 then ms = 1000 end
  redis.call('SET', KEYS[3], '1', 'PX', ms + 1000)
end
return {0, pttl}
";

/// [`REFUSED`] for Redlock: also answers the instance's counter (`false` if none). The
/// refusing instance may be the only one left that remembers the latest token (its
/// majority partner restarted empty, and the instances granting now never saw it), so
/// the client takes the next token above it too.
const REFUSED_COUNTER: &str = r"
local pttl = redis.call('PTTL', KEYS[1])
if ARGV[4] == '1' then
  local ms = pttl
  if ms < 1000 then ms = 1000 end
  redis.call('SET', KEYS[3], '1', 'PX', ms + 1000)
end
return {0, pttl, redis.call('GET', KEYS[2])}
";

/// Redlock's acquire. KEYS: lock, token, waiter marker. ARGV: owner, lease ms, token ttl
/// ms, mark (as in [`ACQUIRE`]), the client's proposal (its wall clock in µs, or 0).
/// Returns `{1, token}` when granted, `{0, pttl, counter or false}` when held by someone
/// else (see [`REFUSED_COUNTER`]).
///
/// `token = max(counter + 1, proposal)`. Every instance of one attempt gets the same
/// proposal, so in the usual case (the proposal lies above every counter) they all
/// answer the same token, which is then already recorded on the whole granting majority
/// and needs no second round trip. That usual case costs two commands: the lock's
/// `SET NX PX` and one `SET ... GET` that records the proposal and returns the old
/// counter (Redis 6.2 or later), and returns the proposal as given; only a counter at or
/// above the proposal needs a third.
pub(crate) static ACQUIRE_PROPOSED: LazyLock<Lua> =
    LazyLock::new(|| Lua::new(&acquire_proposed(Granted::Lock, RESENT)));

/// [`ACQUIRE_PROPOSED`] for a campaign: KEYS and ARGV as there, then the election
/// channel and the leader's value (as in [`CAMPAIGN`]). The term line it writes is
/// provisional (see [`provisional_grant`]); the client confirms it with [`RAISE_TOKEN`].
pub(crate) static CAMPAIGN_PROPOSED: LazyLock<Lua> =
    LazyLock::new(|| Lua::new(&acquire_proposed(Granted::Provisional, RESENT_TERM)));

/// The text of Redlock's acquire script (see [`ACQUIRE_PROPOSED`]).
fn acquire_proposed(granted: Granted, resent: &str) -> String {
    format!(
        r"
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  local c = tonumber(redis.call('SET', KEYS[2], ARGV[5], 'PX', ARGV[3], 'GET') or '0') or 0
  if c < tonumber(ARGV[5]) then
    {}
  end
  local tok = string.format('%.0f', c + 1)
  redis.call('SET', KEYS[2], tok, 'PX', ARGV[3])
  {}
end
{resent}{REFUSED_COUNTER}",
        granted.lua("ARGV[5]"),
        granted.lua("tok"),
    )
}

/// KEYS: token, and for a campaign the lock. ARGV: token, token ttl ms, and for a
/// campaign the owner, the leader's value and the election channel. Raises the counter
/// to at least `token` (Redlock: makes a majority remember the highest token granted).
///
/// A Redlock campaign's term line was written provisional, with this instance's own
/// answer (see [`provisional_grant`]): where the lock key still holds our owner line, it
/// is rewritten confirmed with the guard's token (keeping its expiry) and published, so
/// observers, who report only a term a majority holds confirmed, report the token the
/// leader's guard holds. Every Redlock campaign sends this before its guard is handed
/// out, also when the instances agreed on the token.
pub(crate) static RAISE_TOKEN: LazyLock<Lua> = LazyLock::new(|| {
    Lua::new(
        r"
local c = tonumber(redis.call('GET', KEYS[1]) or '0') or 0
if c < tonumber(ARGV[1]) then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
end
if KEYS[2] then
  local v = redis.call('GET', KEYS[2])
  local term = ARGV[3] .. '\n' .. ARGV[1] .. '\n' .. ARGV[4]
  if v and v ~= term and string.sub(v, 1, #ARGV[3] + 1) == ARGV[3] .. '\n' then
    redis.call('SET', KEYS[2], term, 'KEEPTTL')
    redis.call('PUBLISH', ARGV[5], '1')
  end
end
return 1
",
    )
});

/// KEYS: lock, waiter marker, token counter, and for a semaphore's or read-write lock's
/// holder its index. ARGV: owner, unlock channel, the grant's token (or empty), and for
/// a campaign's grant the election channel. Deletes the lock
/// only if the owner matches, together with the waiter marker, and publishes on the
/// unlock channel only when the marker was there: an uncontended release is `GET` +
/// `DEL`, like a hand-written compare-and-delete. Returns 1 if deleted (or already
/// released, below), 0 if not ours.
///
/// A campaign's lock key holds the owner line followed by the term (see
/// [`campaign_grant`]): with the election channel given, the owner line is compared, and
/// a deleted term is published on that channel for observers. A plain release passes no
/// fourth argument and compares the whole value, as before.
///
/// A waiter cannot miss the message: every refused try of a waiting client marks the
/// lock, and it subscribes before its second try. A release before that try is seen by
/// the try itself; a release after it finds the marker the try left (or, if the holder
/// changed in between, the marker of the waiter's latest try against the new holder).
///
/// A key that is gone while the counter still holds the grant's token means nobody was
/// granted the lock since (every grant moves the counter, in the same script that sets
/// the key): this is a release sent again after its first send was applied (redis-rs
/// re-sends after a dropped connection), or an expiry no other holder followed. Nothing
/// can have overlapped, so it is not a loss.
///
/// `revoke` passes `!` as the token: it deletes someone else's grant, so it moves the
/// counter on (when there is one, with `GET` and `SET ... KEEPTTL`, which the
/// least-privilege ACL allows), and that holder's own release then answers 0 (lost), not
/// 1 by the rule above. Tokens only grow: the next grant's is larger still.
///
/// A semaphore's or read-write lock's holder key (`owner \r index \r token`: see
/// [`MEMBER_ACQUIRE`]) is deleted with its entry in the index, and the index with its
/// last live holder: entries whose holder key has expired (a holder that crashed, or
/// whose lease ran out) are pruned on the way (one `PTTL` per holder: the commands
/// `MEMBER_ACQUIRE` prunes with, which the least-privilege ACL allows). The release of
/// a holder whose key has expired removes its entry too: its index is given as KEYS[4]
/// (a semaphore's or read-write lock's holder only), whose holders' keys are KEYS[1]
/// without the owner.
///
/// A lock key someone overwrote with another type is not held (0), like another
/// owner's; the `GET` is a `pcall` so that this is the lock's loss, not a script error.
pub(crate) static RELEASE: LazyLock<Lua> = LazyLock::new(|| {
    Lua::new(
        r"
local function forget(idx, holders)
  redis.call('HDEL', idx, ARGV[1])
  local left = false
  local all = redis.call('HGETALL', idx)
  for i = 1, #all, 2 do
    local f = all[i]
    if f ~= '#limit' then
      if redis.call('PTTL', holders .. f) == -2 then
        redis.call('HDEL', idx, f)
      else
        left = true
      end
    end
  end
  if not left then
    redis.call('DEL', idx)
  end
end
local v = redis.pcall('GET', KEYS[1])
if type(v) == 'table' then
  return 0
end
if v == ARGV[1] or (ARGV[4] and v and string.sub(v, 1, #ARGV[1] + 1) == ARGV[1] .. '\n') then
  if redis.call('DEL', KEYS[1], KEYS[2]) > 1 then
    redis.call('PUBLISH', ARGV[2], '0')
  end
  if ARGV[4] then
    redis.call('PUBLISH', ARGV[4], '0')
  end
  if ARGV[3] == '!' then
    local c = tonumber(redis.call('GET', KEYS[3]) or '')
    if c then
      redis.call('SET', KEYS[3], string.format('%.0f', c + 1), 'KEEPTTL')
    end
  end
  return 1
end
if v and string.sub(v, 1, #ARGV[1] + 1) == ARGV[1] .. '\r' then
  local rest = string.sub(v, #ARGV[1] + 2)
  local idx = string.match(rest, '^(.*)\r%d+$') or rest
  forget(idx, string.sub(KEYS[1], 1, #KEYS[1] - #ARGV[1]))
  if redis.call('DEL', KEYS[1], KEYS[2]) > 1 then
    redis.call('PUBLISH', ARGV[2], '0')
  end
  return 1
end
if not v and KEYS[4] then
  local holders = string.sub(KEYS[1], 1, #KEYS[1] - #ARGV[1])
  if string.sub(KEYS[1], #holders + 1) == ARGV[1] and redis.call('HEXISTS', KEYS[4], ARGV[1]) == 1 then
    forget(KEYS[4], holders)
  end
end
if not v and ARGV[3] ~= '' and redis.call('GET', KEYS[3]) == ARGV[3] then
  return 1
end
return 0
",
    )
});

/// KEYS: for each lock in turn its key, followed by its token counter when the counter
/// is to be refreshed (all in one slot). ARGV: for each lock in turn its owner, lease ms
/// and the counter's TTL in ms, or an empty string when its counter is not given.
/// A renewed lock's counter, when given, has its TTL raised to that (never lowered): a
/// lock held longer than `token_ttl` keeps the counter its tokens grow from (Redlock's
/// next token, a re-sent acquire and a late release all read it).
/// A semaphore's or read-write lock's holder key (`owner \r index \r token`: see
/// [`MEMBER_ACQUIRE`]) is renewed with its index hash, whose expiry is kept at least as
/// late as every holder's.
/// Returns one integer per lock: 1 renewed, 0 missing, another owner's or not a string
/// (someone overwrote it with another type). The `GET` is a `pcall`: a wrong-typed key
/// is its own lock's loss, not an error that fails every lock renewed in the same call.
/// A campaign's lock key (owner line, then the term: see [`campaign_grant`]) is compared
/// by its owner line, which costs a plain lock's renewal nothing (its value equals the
/// owner).
pub(crate) static RENEW: LazyLock<Lua> = LazyLock::new(|| {
    Lua::new(
        r"
local r, n = {}, 1
for i = 1, #ARGV / 3 do
  local k, o, lease, keep = KEYS[n], ARGV[3 * i - 2], ARGV[3 * i - 1], ARGV[3 * i]
  local counter = nil
  n = n + 1
  if keep ~= '' then
    counter = KEYS[n]
    n = n + 1
  end
  local v = redis.pcall('GET', k)
  if type(v) ~= 'string' then
    r[i] = 0
  elseif v == o or string.sub(v, 1, #o + 1) == o .. '\n' then
    redis.call('PEXPIRE', k, lease)
    r[i] = 1
  elseif string.sub(v, 1, #o + 1) == o .. '\r' then
    local rest, ms = string.sub(v, #o + 2), tonumber(lease)
    local idx = string.match(rest, '^(.*)\r%d+$') or rest
    redis.call('PEXPIRE', k, ms)
    if redis.call('PTTL', idx) < ms then
      redis.call('PEXPIRE', idx, ms)
    end
    r[i] = 1
  else
    r[i] = 0
  end
  if counter and r[i] == 1 then
    local p = redis.call('PTTL', counter)
    if p >= 0 and p < tonumber(keep) then
      redis.call('PEXPIRE', counter, keep)
    end
  end
end
return r
",
    )
});

/// KEYS: lock, token. Returns `{owner or false, pttl, counter or false}`: the holder, its
/// remaining lease and the name's counter in one read. For a campaign's grant, the
/// "owner" is the owner line followed by the term (see [`campaign_grant`]), which is how
/// `leader` reads a leader's value and token together with its lease.
pub(crate) static INSPECT: LazyLock<Lua> = LazyLock::new(|| {
    Lua::new(
        r"
return {redis.call('GET', KEYS[1]), redis.call('PTTL', KEYS[1]), redis.call('GET', KEYS[2])}
",
    )
});

/// A semaphore's or read-write lock's grant. KEYS: index hash, the holder's key, token
/// counter, waiter marker, writer intent. ARGV: owner, lease ms, token ttl ms, mark (`1`
/// when the caller will wait), mode (`s` semaphore, `r` reader, `w` writer), count,
/// limit, the holders' key prefix, the writer's intent id.
///
/// Returns `{1, token}` when granted, `{0, retry ms}` when refused, `{-1, limit}` when
/// the semaphore has holders, or a waiting request, with another limit.
///
/// Each holder has a key of its own (`holders` + owner, value `owner \r index \r token`,
/// PX = lease), renewed and released by [`RENEW`] and [`RELEASE`] like a lock key; the
/// token in it is what a re-sent request of the same grant answers (redis-rs re-sends a
/// request after a dropped connection or, on a cluster, a timeout): the counter has
/// moved on with other holders' grants since, and answering it would give this grant
/// another holder's token. (Values written without the token, `owner \r index`, are
/// still read.) The index
/// hash maps each holder's owner to its permits (`w` for a writer) and keeps the
/// semaphore's `#limit`. Entries whose holder key has expired are pruned here, so a
/// crashed holder's permits come back with its lease. The index expires no earlier than
/// its latest holder.
///
/// A writer or semaphore request that will wait and is refused records its intent
/// (`id \n count`, and `\n limit` for a semaphore; a key with a 3 s expiry, refreshed on
/// each try, deleted by its grant or its cancellation) unless another request's intent
/// is there. A semaphore request with another limit than a waiting request's is refused
/// like one with another limit than the holders': the limit is kept while anyone holds
/// or waits. While a writer's
/// intent is there, no reader and no other writer is granted: writer-preferring. While
/// a semaphore request's intent is there, others are granted only what leaves its
/// permits free, so smaller requests cannot starve it. Tokens are
/// `max(counter + 1, server clock in µs)` as for locks.
pub(crate) static MEMBER_ACQUIRE: LazyLock<Lua> = LazyLock::new(|| {
    Lua::new(
        r"
local idx, me = KEYS[1], ARGV[1] .. '\r' .. KEYS[1]
local held = redis.call('GET', KEYS[2])
if held and string.sub(held, 1, #me + 1) == me .. '\r' then
  redis.call('PEXPIRE', KEYS[2], ARGV[2])
  return {1, string.sub(held, #me + 2)}
end
local mode, count, limit = ARGV[5], tonumber(ARGV[6]), tonumber(ARGV[7])
local used, writer, soonest, stored = 0, false, -1, nil
local all = redis.call('HGETALL', idx)
for i = 1, #all, 2 do
  local f, v = all[i], all[i + 1]
  if f == '#limit' then
    stored = tonumber(v)
  else
    local p = redis.call('PTTL', ARGV[8] .. f)
    if p == -2 then
      redis.call('HDEL', idx, f)
    else
      if v == 'w' then
        writer = true
        used = used + 1
      else
        used = used + (tonumber(v) or 1)
      end
      if p >= 0 and (soonest < 0 or p < soonest) then soonest = p end
    end
  end
end
local intent, mine, ahead, waiting = redis.call('GET', KEYS[5]), false, 0, nil
if intent then
  local id, n, l = string.match(intent, '^(.*)\n(%d+)\n(%d+)$')
  if not id then id, n = string.match(intent, '^(.*)\n(%d+)$') end
  if id == ARGV[9] then mine = true else ahead, waiting = tonumber(n) or 1, tonumber(l) end
end
local ok
if mode == 's' then
  if used > 0 and stored and stored ~= limit then
    return {-1, stored}
  end
  if waiting and waiting ~= limit then
    return {-1, waiting}
  end
  ok = used + count + ahead <= limit
elseif mode == 'r' then
  ok = not writer and not intent
else
  ok = used == 0 and (not intent or mine)
end
if ok then
  local t = redis.call('TIME')
  local tok = t[1] .. string.rep('0', 6 - #t[2]) .. t[2]
  local c = tonumber(redis.call('SET', KEYS[3], tok, 'PX', ARGV[3], 'GET') or '0') or 0
  if c >= tonumber(tok) then
    tok = string.format('%.0f', c + 1)
    redis.call('SET', KEYS[3], tok, 'PX', ARGV[3])
  end
  redis.call('SET', KEYS[2], me .. '\r' .. tok, 'PX', ARGV[2])
  if mode == 's' then
    redis.call('HSET', idx, ARGV[1], count, '#limit', limit)
  elseif mode == 'w' then
    redis.call('HSET', idx, ARGV[1], 'w')
  else
    redis.call('HSET', idx, ARGV[1], '1')
  end
  if mine then redis.call('DEL', KEYS[5]) end
  if redis.call('PTTL', idx) < tonumber(ARGV[2]) then
    redis.call('PEXPIRE', idx, ARGV[2])
  end
  return {1, tok}
end
if mode ~= 'r' and ARGV[4] == '1' and (not intent or mine) then
  local v = ARGV[9] .. '\n' .. count
  if mode == 's' then v = v .. '\n' .. limit end
  redis.call('SET', KEYS[5], v, 'PX', 3000)
end
if soonest < 0 then
  soonest = intent and redis.call('PTTL', KEYS[5]) or 100
  if soonest < 0 then soonest = 100 end
end
if ARGV[4] == '1' then
  local ms = soonest
  if ms < 1000 then ms = 1000 end
  redis.call('SET', KEYS[4], '1', 'PX', ms + 1000)
end
return {0, soonest}
",
    )
});

/// KEYS: intent, waiter marker. ARGV: intent id, channel. Deletes a cancelled request's
/// intent (see [`MEMBER_ACQUIRE`]) if it is still its own, and wakes the waiters it
/// held back.
pub(crate) static INTENT_CLEAR: LazyLock<Lua> = LazyLock::new(|| {
    Lua::new(
        r"
local v = redis.call('GET', KEYS[1])
if v and string.sub(v, 1, #ARGV[1] + 1) == ARGV[1] .. '\n' then
  redis.call('DEL', KEYS[1])
  if redis.call('DEL', KEYS[2]) > 0 then
    redis.call('PUBLISH', ARGV[2], '0')
  end
  return 1
end
return 0
",
    )
});

#[cfg(test)]
mod tests;
