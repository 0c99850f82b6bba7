//! The shared state of a client and one acquisition attempt over one or more nodes
//! (one for single, Sentinel and Cluster; N for Redlock, which needs a majority).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use fencelock_core::{Error, FencingToken, LossCause};
use futures_util::future::join_all;
use redis::{FromRedisValue, Value};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::call::{Call, millis};
use crate::config::RedisConfig;
use crate::error::{BACKEND, invalid_name};
use crate::keys::LockKeys;
use crate::node::Node;
use crate::quorum::{drift, on_every_node, pending, until_settled};
use crate::schedule::Renewals;
use crate::scripts;
use crate::subscriber::Subscriber;

/// A client: its nodes, identity, renewals and subscriptions.
pub(crate) struct Engine {
    pub(crate) config: RedisConfig,
    pub(crate) nodes: Vec<Node>,
    pub(crate) subscribers: Vec<Subscriber>,
    /// Nodes that must agree: 1, or a majority for Redlock.
    pub(crate) quorum: usize,
    /// Random per client; owner values are `client_id:attempt`.
    pub(crate) client_id: String,
    pub(crate) next_id: AtomicU64,
    pub(crate) renewals: Renewals,
    /// The waiting lines of this client's tasks, by lock key.
    pub(crate) lines: Arc<fencelock_core::line::Lines>,
    /// Every lock granted through this client and not yet released, for `close`.
    pub(crate) held: Mutex<HashMap<u64, Granted>>,
    /// Cancelled by `close`: waiting acquires end, the renewal and subscription tasks stop.
    pub(crate) closed: CancellationToken,
    pub(crate) runtime: tokio::runtime::Handle,
}

/// What `close` needs of a granted lock to release it.
pub(crate) struct Granted {
    pub(crate) keys: LockKeys,
    pub(crate) owner: String,
    pub(crate) token: u64,
    pub(crate) liveness: fencelock_core::Liveness,
    /// Whether it is a campaign's term (its release is published to observers).
    pub(crate) election: bool,
}

/// What one attempt found.
pub(crate) enum Attempt {
    /// Granted with this token; the attempt's owner value and id.
    Granted {
        token: FencingToken,
        owner: String,
        id: u64,
        sent: Instant,
    },
    /// Held by someone else; try again after at most this long (or on a message).
    Held(Duration),
}

/// One node's answer to the acquire script.
enum Reply {
    Granted(u64),
    /// The holder's PTTL, and (Redlock) the instance's token counter.
    Held(i64, Option<u64>),
}

/// Releases an attempt's key in the background if the attempt is dropped before it has
/// been turned into a guard or found not to have taken the lock.
pub(crate) struct InFlight<'a> {
    pub(crate) engine: &'a Arc<Engine>,
    pub(crate) keys: &'a LockKeys,
    pub(crate) owner: String,
    pub(crate) election: bool,
    pub(crate) armed: bool,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.engine.release_in_background(
                self.keys.clone(),
                std::mem::take(&mut self.owner),
                None,
                self.election,
            );
        }
    }
}

impl Engine {
    pub(crate) fn new(config: RedisConfig, nodes: Vec<Node>) -> Self {
        let closed = CancellationToken::new();
        // A cluster gets one subscriber per master (waiters subscribe where their lock's
        // slot is served, see `Node::for_shard`); other topologies one per node.
        let mut subscribers = Vec::new();
        for node in &nodes {
            if node.shards().is_empty() {
                subscribers.push(Subscriber::new(
                    node.clone(),
                    config.timeout,
                    closed.clone(),
                ));
            }
            for shard in node.shards() {
                subscribers.push(Subscriber::new(
                    node.for_shard(shard),
                    config.timeout,
                    closed.clone(),
                ));
            }
        }
        Engine {
            quorum: nodes.len() / 2 + 1,
            client_id: format!("{:016x}{:016x}", fastrand::u64(..), fastrand::u64(..)),
            next_id: AtomicU64::new(1),
            renewals: Renewals::default(),
            lines: Arc::default(),
            held: Mutex::new(HashMap::new()),
            closed,
            runtime: tokio::runtime::Handle::current(),
            config,
            nodes,
            subscribers,
        }
    }

    /// Whether this client talks to a Redis Cluster.
    pub(crate) fn is_cluster(&self) -> bool {
        self.nodes.first().is_some_and(Node::is_cluster)
    }

    /// Whether this client is a Redlock over several instances.
    pub(crate) fn is_redlock(&self) -> bool {
        self.nodes.len() > 1
    }

    /// Fails with [`Error::Closed`] once the client is closed.
    pub(crate) fn check_open(&self) -> Result<(), Error> {
        if self.closed.is_cancelled() {
            Err(Error::Closed { backend: BACKEND })
        } else {
            Ok(())
        }
    }

    /// The keys of lock (or election) `name`. In the raw layout, a name whose key would
    /// be another name's auxiliary key is [`Error::InvalidName`] (see
    /// `KeyLayout::refusal`). On a Redis Cluster, a name whose
    /// keys cannot share one slot (the raw layout's `}` without a tag: see
    /// [`KeyLayout::raw`](crate::KeyLayout::raw)) is [`Error::InvalidName`], before any
    /// I/O: its scripts would fail with `CROSSSLOT`.
    pub(crate) fn lock_keys(&self, name: &str) -> Result<LockKeys, Error> {
        let layout = &self.config.layout;
        if let Some(reason) = layout.refusal(name, false) {
            return Err(invalid_name(name, reason));
        }
        let keys = layout.keys(name);
        if self.is_cluster() && !keys.share_a_slot() {
            return Err(invalid_name(
                name,
                "in the raw layout on a Redis Cluster, a lock key with `}` and no \
                 non-empty {tag} cannot keep its token key in its slot: put a {tag} \
                 in the name",
            ));
        }
        Ok(keys)
    }

    /// The subscribers a waiter for a key in `slot` subscribes with: on a cluster, the
    /// one of the master serving the slot (the first if none was found); otherwise one
    /// per node.
    pub(crate) fn subscribers_for(&self, slot: u16) -> &[Subscriber] {
        // A cluster is one node, whose subscribers are its shards', in order.
        let shards = self.nodes.first().map_or(&[][..], Node::shards);
        if shards.is_empty() {
            return &self.subscribers;
        }
        let index = shards
            .iter()
            .position(|shard| shard.slots.iter().any(|(a, b)| (*a..=*b).contains(&slot)))
            .unwrap_or(0);
        &self.subscribers[index..=index]
    }

    /// The TTL, in ms, a grant for `lease` gives the name's counter: `token_ttl`, but
    /// never less than the lease. The counter must live as long as the lock key set with
    /// it: a re-sent acquire that finds its own key is granted with the token the
    /// counter recorded (and would be refused by itself without it, the key left for a
    /// lease), a release that finds the key expired reads the counter to tell an expiry
    /// nobody followed from a loss, and Redlock's counters keep tokens increasing
    /// whatever the clients' clocks say.
    pub(crate) fn counter_ttl(&self, lease: Duration) -> u64 {
        millis(self.config.token_ttl.max(lease))
    }

    pub(crate) fn lease_timeout(&self, lease: Duration) -> Duration {
        if self.nodes.len() > 1 {
            // Redlock: a node that does not answer quickly is skipped, not waited for.
            self.config.timeout.min(lease / 2)
        } else {
            self.config.timeout
        }
    }

    /// Runs `call` on `node`, giving up after `limit`. A single server's connection
    /// already bounds every command by the configured timeout, so for it (when `limit`
    /// is no shorter) no timer of its own is set: that timer was a measurable part of an
    /// uncontended acquire.
    pub(crate) async fn bounded<T>(
        &self,
        node: &Node,
        limit: Duration,
        call: impl std::future::Future<Output = Result<T, Error>>,
    ) -> Result<T, Error> {
        if self.nodes.len() == 1 && node.is_single() && limit >= self.config.timeout {
            return call.await;
        }
        tokio::time::timeout(limit, call)
            .await
            .unwrap_or_else(|_| Err(Error::unavailable(BACKEND, "timed out")))
    }

    /// Sends `call` to every node at once, each call bounded by `limit`, and turns each
    /// node's reply into an answer with `answer`. Returns as soon as `settled` says that
    /// the answers in so far decide the outcome (a quorum agreed, or none can any more),
    /// or when every node has answered: the answers in node order, `None` for a node
    /// that has not answered yet.
    ///
    /// Redlock: an instance that has not answered by then (silent, partitioned, slow)
    /// does not hold the caller up: waiting for it could only use up the lease the
    /// quorum's answers are counted from. Its call goes on in a task of its own until it
    /// is answered or `limit` runs out, as if it had been waited for (so a slow instance
    /// still gets every request, and the script loaded after a `NOSCRIPT`), and its
    /// answer is dropped. That is harmless for the calls that use it (renewal, extend,
    /// the raise of a token): a renewal it applies late moves that instance's expiry no
    /// further than a lease from when it applied it, as waiting for it would have, and
    /// the caller's deadline stays anchored at the instant the call was sent; a raise
    /// only raises a counter. (An acquire waits for every instance: see `try_once`.)
    ///
    /// With one node the call is awaited in place (no task, no allocation).
    ///
    /// # Cancel safety
    ///
    /// Dropping the returned future before it is ready drops every node's call, as
    /// `join_all` would: nothing goes on in the background.
    pub(crate) async fn on_nodes_until<R, T>(
        self: &Arc<Self>,
        call: Call,
        limit: Duration,
        answer: impl Fn(Result<R, Error>) -> T + Clone + Send + Sync + 'static,
        settled: impl FnMut(&[Option<T>]) -> bool,
    ) -> Vec<Option<T>>
    where
        R: FromRedisValue + Send + 'static,
        T: Send + 'static,
    {
        if let [node] = &self.nodes[..] {
            return vec![Some(answer(
                self.bounded(node, limit, node.invoke::<R>(&call)).await,
            ))];
        }
        let call = Arc::new(call);
        let calls = (0..self.nodes.len()).map(|i| {
            let (engine, call, answer) = (self.clone(), call.clone(), answer.clone());
            async move {
                let node = &engine.nodes[i];
                answer(engine.bounded(node, limit, node.invoke::<R>(&call)).await)
            }
        });
        until_settled(&self.runtime, calls, settled).await
    }

    /// One try to take `keys` for `lease`; with a `value`, a campaign whose grant
    /// stores the value with the lock and is published on the election channel. A
    /// refused try marks the lock as awaited when `will_wait` (the release then publishes
    /// an unlock message).
    pub(crate) async fn try_once(
        self: &Arc<Self>,
        keys: &LockKeys,
        lease: Duration,
        will_wait: bool,
        value: Option<&str>,
    ) -> Result<Attempt, Error> {
        // Before anything is sent: a clock Redlock cannot propose from is refused.
        let proposal = if self.nodes.len() > 1 {
            Some(proposal(std::time::SystemTime::now())?)
        } else {
            None
        };
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let owner = format!("{}:{id}", self.client_id);
        let election = value.is_some();
        let mut in_flight = InFlight {
            engine: self,
            keys,
            owner: owner.clone(),
            election,
            armed: true,
        };
        let redlock = self.nodes.len() > 1;
        let script = match (redlock, election) {
            (false, false) => &scripts::ACQUIRE,
            (true, false) => &scripts::ACQUIRE_PROPOSED,
            (false, true) => &scripts::CAMPAIGN,
            (true, true) => &scripts::CAMPAIGN_PROPOSED,
        };
        let mut invocation = script.prepare_invoke();
        invocation
            .key(&keys.lock)
            .key(&keys.token)
            .key(&keys.waiters)
            .arg(&owner)
            .arg(millis(lease))
            .arg(self.counter_ttl(lease))
            .arg(u8::from(will_wait));
        if let Some(proposal) = proposal {
            invocation.arg(proposal);
        }
        if let Some(value) = value {
            if !redlock {
                // ARGV[5], the proposal, is Redlock's only.
                invocation.arg(0);
            }
            invocation.arg(&keys.election).arg(value);
        }
        let per_node = self.lease_timeout(lease);
        let sent = Instant::now();
        // Every instance's answer (each bounded by `per_node`), unlike a renewal's: the
        // token is the highest of them all, not only of the first majority to grant. An
        // instance ahead of the others may be the only one left remembering an issued
        // token (its majority partner restarted without persistence), and a refused try
        // not waited for to the end might still grant and need undoing. A silent
        // instance costs the grant `per_node` (at most half the lease); its deadline
        // still counts from `sent`, and its first renewal, due a third of the lease
        // after `sent`, goes out at once and needs a majority only.
        let replies = on_every_node(&self.nodes, |node| {
            let invocation = &invocation;
            async move {
                // With the replica check, its `WAIT` goes with the script (one node).
                let (reply, acks) = self
                    .bounded(node, per_node, self.invoke_grant(node, invocation))
                    .await?;
                Ok::<_, Error>((parse_acquire(reply)?, acks))
            }
        })
        .await;
        let mut acks = None;
        let mut granted = Vec::new();
        let mut held = Vec::new();
        // The highest counter a refusing instance answered (Redlock).
        let mut refused_counter = 0;
        let mut errors = Vec::new();
        for reply in replies {
            match reply {
                Ok((Reply::Granted(token), wait)) => {
                    granted.push(token);
                    acks = wait;
                }
                Ok((Reply::Held(pttl, counter), _)) => {
                    held.push(pttl);
                    refused_counter = refused_counter.max(counter.unwrap_or(0));
                }
                Err(e) => errors.push(e),
            }
        }
        let validity = lease
            .checked_sub(sent.elapsed() + drift(lease))
            .unwrap_or_default();
        if granted.len() >= self.quorum && !validity.is_zero() {
            // A refusing instance may be the only one of an earlier granting majority
            // that still remembers its token (see the scripts' module docs).
            let token = granted
                .iter()
                .copied()
                .max()
                .unwrap_or(0)
                .max(refused_counter.saturating_add(1));
            let recorded = granted.iter().filter(|t| **t == token).count();
            let checked = async {
                // A Redlock campaign's term lines are provisional (each instance's own
                // answer, see `scripts::provisional_grant`): it always confirms them
                // with the guard's token, so observers never report another token.
                if recorded < self.quorum || (redlock && election) {
                    // The granting majority disagreed, or a refusing instance was ahead
                    // of it: make a majority remember the token before anyone relies on
                    // it.
                    let term = value.map(|value| (owner.as_str(), value));
                    self.raise_token(keys, token, term, lease, per_node).await?;
                    if sent.elapsed() + drift(lease) >= lease {
                        return Err(Error::unavailable(
                            BACKEND,
                            "the lease ran out while the token was being recorded",
                        ));
                    }
                }
                self.replicas_acknowledged(&self.nodes[0], acks.as_ref(), sent, lease)
                    .await?;
                Ok::<_, Error>(())
            };
            if let Err(e) = checked.await {
                self.undo(&mut in_flight, per_node).await;
                return Err(e);
            }
            in_flight.armed = false;
            return Ok(Attempt::Granted {
                token: FencingToken::new(token),
                owner,
                id,
                sent,
            });
        }
        if !granted.is_empty() {
            // Redlock without a majority (or too slow): undo the partial grant now.
            self.undo(&mut in_flight, per_node).await;
            if granted.len() >= self.quorum {
                // Granted, but the answer came after the lease had run out: the lock was
                // free, so this is the servers' slowness, not contention.
                return Err(Error::unavailable(
                    BACKEND,
                    "the lease ran out before the grant was confirmed (Redis answered too slowly)",
                ));
            }
        } else if errors.is_empty() {
            in_flight.armed = false;
        }
        if errors.len() > self.nodes.len() - self.quorum {
            return Err(errors.swap_remove(0));
        }
        Ok(Attempt::Held(retry_after(
            &held,
            granted.len(),
            self.quorum,
        )))
    }

    /// Undoes an attempt that did not become a guard: its release on every node, waited
    /// for no longer than `bound` (an instance's answer to the acquire: the slow ones are
    /// why it failed, and the caller must not wait on them again). Unless the release
    /// was answered (the key deleted, or found not ours) within the bound, `in_flight`
    /// stays armed and its drop sends the release again in the background (a
    /// compare-and-delete: sent twice, it deletes nothing of anyone else's). A release
    /// that failed (a connection reset, a reconnect that did not get through) is not
    /// done: the key it left would otherwise stay, owned by nobody, for its lease.
    pub(crate) async fn undo(&self, in_flight: &mut InFlight<'_>, bound: Duration) {
        let release = self.release(in_flight.keys, &in_flight.owner, None, in_flight.election);
        if let Ok(Ok(_)) = tokio::time::timeout(bound, release).await {
            in_flight.armed = false;
        }
    }

    /// Redlock: makes a majority remember `token` (granted for `lease`) before the guard
    /// is handed out, and for a campaign's `term` (owner, value) writes it into the term
    /// line observers read.
    async fn raise_token(
        self: &Arc<Self>,
        keys: &LockKeys,
        token: u64,
        term: Option<(&str, &str)>,
        lease: Duration,
        per_node: Duration,
    ) -> Result<(), Error> {
        let mut invocation = scripts::RAISE_TOKEN.prepare_invoke();
        invocation.key(&keys.token);
        if term.is_some() {
            invocation.key(&keys.lock);
        }
        invocation.arg(token).arg(self.counter_ttl(lease));
        if let Some((owner, value)) = term {
            invocation.arg(owner).arg(value).arg(&keys.election);
        }
        let quorum = self.quorum;
        let acked = |acks: &[Option<bool>]| acks.iter().filter(|a| **a == Some(true)).count();
        let acks = self
            .on_nodes_until(
                invocation,
                per_node,
                |reply: Result<i64, Error>| matches!(reply, Ok(1)),
                |acks| acked(acks) >= quorum || acked(acks) + pending(acks) < quorum,
            )
            .await;
        if acked(&acks) >= quorum {
            Ok(())
        } else {
            Err(Error::unavailable(
                BACKEND,
                "the token could not be recorded on a majority of the instances",
            ))
        }
    }

    /// Runs a grant's script on `node`. With the replica check (`wait_replicas`) the
    /// id of the connection it went on (`CLIENT ID`, in one pipeline with it) comes
    /// back too, for [`replicas_acknowledged`](Self::replicas_acknowledged): the
    /// `WAIT` must run on that connection (on another it would check nothing), and
    /// only after a grant (a refused try must not wait up to `wait_timeout` for
    /// replicas, holding up the shared connection).
    pub(crate) async fn invoke_grant(
        &self,
        node: &Node,
        call: &Call,
    ) -> Result<(Value, Option<Value>), Error> {
        if self.config.wait_replicas == 0 {
            return Ok((node.invoke::<Value>(call).await?, None));
        }
        let mut id = redis::cmd("CLIENT");
        id.arg("ID");
        let (reply, connection) = node.invoke_then(call, &id).await?;
        Ok((reply, Some(connection)))
    }

    /// The replica check of a grant made on `node` over the connection `connection`
    /// ([`invoke_grant`](Self::invoke_grant)'s id): `WAIT n timeout` on that same
    /// connection (a pipeline with `CLIENT ID`, which must name it still) must see `n`
    /// acknowledgements, and must answer before the lease of the grant (sent at `sent`,
    /// for `lease`) ran out on the local clock: a guard whose deadline has passed
    /// before it is handed out would be lost from its first instant. Checked for every
    /// grant (a lock's, a term's, a semaphore's or read-write lock's) when
    /// `wait_replicas` is set; the caller undoes the grant when it fails.
    ///
    /// # Cancel safety
    ///
    /// Sends a `WAIT`, which changes nothing; the caller's in-flight guard undoes the
    /// grant when this is dropped.
    pub(crate) async fn replicas_acknowledged(
        &self,
        node: &Node,
        connection: Option<&Value>,
        sent: Instant,
        lease: Duration,
    ) -> Result<(), Error> {
        let wanted = self.config.wait_replicas;
        if wanted == 0 {
            return Ok(());
        }
        let Some(connection) = connection else {
            return Err(Error::backend(
                BACKEND,
                false,
                "the grant came without the id of its connection",
            ));
        };
        let mut id = redis::cmd("CLIENT");
        id.arg("ID");
        let mut wait = redis::cmd("WAIT");
        wait.arg(wanted).arg(millis(self.config.wait_timeout));
        let (now, acks) = self
            .bounded(node, self.config.timeout, node.query_pair(&id, &wait))
            .await?;
        if &now != connection {
            // A reconnection since the grant: this connection never wrote it.
            return Err(Error::unavailable(
                BACKEND,
                "the connection changed between the grant and its replica check; it was released",
            ));
        }
        let acks = match acks {
            Value::Int(n) => u32::try_from(n).unwrap_or(0),
            _ => {
                return Err(Error::backend(
                    BACKEND,
                    false,
                    "unexpected reply from the replica check's WAIT",
                ));
            }
        };
        if sent.elapsed() + drift(lease) >= lease {
            Err(Error::unavailable(
                BACKEND,
                "the lease ran out before the grant was confirmed (the replicas acknowledged \
                 it too slowly)",
            ))
        } else if acks >= wanted {
            Ok(())
        } else {
            Err(Error::backend(
                BACKEND,
                true,
                format!(
                    "only {acks} of {wanted} replicas acknowledged the grant within {:?}; it was released",
                    self.config.wait_timeout
                ),
            ))
        }
    }

    /// Compare-and-delete on every node; whether a quorum still held it (or, with the
    /// grant's `token`, had it gone with nobody granted since).
    ///
    /// In the raw layout the counter does not see hand-written lockers, so a gone key is
    /// always "not held" there.
    ///
    /// `election`: the grant is a campaign's (its lock key holds the term after the
    /// owner line), so the release compares the owner line and is published on the
    /// election channel.
    pub(crate) async fn release(
        &self,
        keys: &LockKeys,
        owner: &str,
        token: Option<u64>,
        election: bool,
    ) -> Result<bool, Error> {
        let token = token
            .filter(|_| !self.config.layout.is_raw())
            .map_or_else(String::new, |t| t.to_string());
        self.compare_and_delete(keys, owner, token, election).await
    }

    /// Takes the grant of `owner` from it (see [`release`](Self::release)): also moves the
    /// name's counter on, so that the holder's own release finds the grant gone *and*
    /// the counter moved, and answers `Lost` rather than "released already".
    pub(crate) async fn revoke(
        &self,
        keys: &LockKeys,
        owner: &str,
        election: bool,
    ) -> Result<bool, Error> {
        self.compare_and_delete(keys, owner, "!".to_owned(), election)
            .await
    }

    /// The release script on every node; `token` is its third argument (see
    /// [`RELEASE`](scripts::RELEASE)).
    async fn compare_and_delete(
        &self,
        keys: &LockKeys,
        owner: &str,
        token: String,
        election: bool,
    ) -> Result<bool, Error> {
        let mut invocation = scripts::RELEASE.prepare_invoke();
        invocation
            .key(&keys.lock)
            .key(&keys.waiters)
            .key(&keys.token)
            .arg(owner)
            .arg(&keys.channel)
            .arg(token);
        if let Some(index) = &keys.index {
            invocation.key(index);
        }
        if election {
            invocation.arg(&keys.election);
        }
        let replies = on_every_node(&self.nodes, |node| {
            let invocation = &invocation;
            async move {
                self.bounded(node, self.config.timeout, node.invoke::<i64>(invocation))
                    .await
            }
        })
        .await;
        let deleted = replies.iter().filter(|r| matches!(r, Ok(1))).count();
        let mut errors: Vec<Error> = replies.into_iter().filter_map(Result::err).collect();
        if deleted >= self.quorum {
            Ok(true)
        } else if !errors.is_empty() && deleted + errors.len() >= self.quorum {
            Err(errors.swap_remove(0))
        } else {
            Ok(false)
        }
    }

    /// Moves the expiry of `keys` (held by `owner`) to `lease` from now on every node,
    /// with the renewal script. Returns the new local deadline (from when the call was
    /// sent) as soon as a quorum did: a Redlock instance still silent then is not waited
    /// for (see [`on_nodes_until`](Self::on_nodes_until)).
    pub(crate) async fn extend(
        self: &Arc<Self>,
        name: &str,
        keys: &LockKeys,
        owner: &str,
        lease: Duration,
    ) -> Result<tokio::time::Instant, Error> {
        let mut invocation = scripts::RENEW.prepare_invoke();
        // The counter's TTL is raised with it: the lease may be longer than the grant's.
        invocation
            .key(&keys.lock)
            .key(&keys.token)
            .arg(owner)
            .arg(millis(lease))
            .arg(self.counter_ttl(lease));
        let limit = self.lease_timeout(lease);
        let quorum = self.quorum;
        let renewed = |replies: &[Option<Result<Vec<i64>, Error>>]| {
            replies
                .iter()
                .filter(|r| matches!(r, Some(Ok(v)) if v.as_slice() == [1]))
                .count()
        };
        let sent = tokio::time::Instant::now();
        let replies = self
            .on_nodes_until(
                invocation,
                limit,
                |reply: Result<Vec<i64>, Error>| reply,
                |replies| {
                    renewed(replies) >= quorum || renewed(replies) + pending(replies) < quorum
                },
            )
            .await;
        let gone = replies
            .iter()
            .filter(|r| matches!(r, Some(Ok(v)) if matches!(v.as_slice(), [n] if *n != 1)))
            .count();
        if renewed(&replies) >= quorum {
            Ok(sent + lease - drift(lease))
        } else if gone > self.nodes.len() - self.quorum {
            Err(Error::lost(
                name,
                "the lock key was gone or held by another owner when extending its lease",
            ))
        } else {
            match replies.into_iter().flatten().find_map(Result::err) {
                Some(error) => Err(error),
                None => Err(Error::unavailable(
                    BACKEND,
                    "too few Redis servers confirmed the extension",
                )),
            }
        }
    }

    /// The locks granted through this client and not yet released.
    pub(crate) fn held(&self) -> MutexGuard<'_, HashMap<u64, Granted>> {
        self.held.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Closes the client: nothing is granted any more, every lock granted through it is
    /// marked lost and released, and its tasks stop. Returns the first release that
    /// failed (that key expires with its lease).
    pub(crate) async fn close(&self) -> Result<(), Error> {
        // Cancelled under the lock of `held`, which a new grant takes to register: a
        // grant is either drained here or refused there.
        let granted: Vec<(u64, Granted)> = {
            let mut held = self.held();
            self.closed.cancel();
            held.drain().collect()
        };
        let releases = granted.iter().map(|(id, g)| {
            self.renewals.remove(*id);
            g.liveness
                .mark_lost(LossCause::ClientClosed, "the client was closed");
            self.release(&g.keys, &g.owner, Some(g.token), g.election)
        });
        let mut outcome = Ok(());
        for result in join_all(releases).await {
            if let Err(error) = result {
                tracing::warn!(%error, "redis: a lock could not be released at close; it expires with its lease");
                outcome = outcome.and(Err(error));
            }
        }
        self.renewals.wake_to_stop();
        outcome
    }

    /// Releases in a background task, bounded by the command timeout.
    pub(crate) fn release_in_background(
        self: &Arc<Self>,
        keys: LockKeys,
        owner: String,
        token: Option<u64>,
        election: bool,
    ) {
        let engine = self.clone();
        let timeout = self.config.timeout;
        self.runtime.spawn(async move {
            let _ =
                tokio::time::timeout(timeout * 2, engine.release(&keys, &owner, token, election))
                    .await;
        });
    }
}

fn parse_acquire(value: Value) -> Result<Reply, Error> {
    let bad = || Error::backend(BACKEND, false, "unexpected reply from the acquire script");
    let Value::Array(items) = value else {
        return Err(bad());
    };
    match items.as_slice() {
        [Value::Int(1), Value::Int(token)] => {
            u64::try_from(*token).map(Reply::Granted).map_err(|_| bad())
        }
        [Value::Int(1), Value::BulkString(token)] => std::str::from_utf8(token)
            .ok()
            .and_then(|t| t.parse().ok())
            .map(Reply::Granted)
            .ok_or_else(bad),
        [Value::Int(0), Value::Int(pttl)] | [Value::Int(0), Value::Int(pttl), Value::Nil] => {
            Ok(Reply::Held(*pttl, None))
        }
        [Value::Int(0), Value::Int(pttl), Value::BulkString(counter)] => {
            std::str::from_utf8(counter)
                .ok()
                .and_then(|c| c.parse().ok())
                .map(|c| Reply::Held(*pttl, Some(c)))
                .ok_or_else(bad)
        }
        _ => Err(bad()),
    }
}

/// Redlock's token proposal: this client's wall clock `now` in µs since the Unix epoch.
///
/// # Errors
///
/// A clock before the epoch, or so far ahead that tokens would pass 2^52 (after 2112),
/// is refused: the acquire scripts take the larger of the proposal and the counter, so
/// a proposal of 0 would let tokens restart at 1 once the counters are gone (expired,
/// or lost by a majority restarted without persistence).
fn proposal(now: std::time::SystemTime) -> Result<u64, Error> {
    now.duration_since(std::time::UNIX_EPOCH)
        .ok()
        .and_then(|d| u64::try_from(d.as_micros()).ok())
        .filter(|us| (1..1 << 52).contains(us))
        .ok_or_else(|| {
            Error::backend(
                BACKEND,
                false,
                "Redlock tokens start from this client's clock, which reads before 1970 or \
                 after 2112: set the clock",
            )
        })
}

/// How long to sleep (at most, unless woken by an unlock message) before trying again,
/// after a try that `granted` instances granted (and that was undone) and that others
/// refused with the holders' remaining leases `held`, of `quorum` needed.
///
/// When the refusals reach a quorum, someone holds the lock on a majority: the lock
/// can be had once enough of those keys are gone for the free instances to make a
/// majority, that is after the `quorum - granted`-th shortest PTTL (one server: its
/// PTTL), unless an unlock message comes first. Only a split vote (neither the grants
/// nor the refusals reach a quorum: two waiters raced, or an instance did not answer)
/// backs off a random short while. A waiter that backed off briefly whenever some
/// instance granted would poll the free minority instance for the whole hold of a
/// holder on a bare majority.
fn retry_after(held: &[i64], granted: usize, quorum: usize) -> Duration {
    if held.len() < quorum {
        return Duration::from_millis(fastrand::u64(5..50));
    }
    let mut held = held.to_vec();
    held.sort_unstable_by_key(|pttl| match *pttl {
        // A key without expiry (a foreign lock) frees last.
        pttl if pttl < 0 => i64::MAX,
        pttl => pttl,
    });
    let needed = quorum.saturating_sub(granted).max(1);
    match held[needed - 1] {
        pttl if pttl >= 0 => Duration::from_millis(u64::try_from(pttl).unwrap_or(0) + 1),
        // A key without expiry: re-check every second.
        _ => Duration::from_secs(1),
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, SystemTime, UNIX_EPOCH};

    use super::{proposal, retry_after};

    /// A majority of refusals waits for the lock to be freed on enough instances; only
    /// a split vote backs off briefly.
    #[test]
    fn only_a_split_vote_backs_off_briefly() {
        let ms = Duration::from_millis;
        // One server.
        assert_eq!(retry_after(&[700], 0, 1), ms(701));
        assert_eq!(retry_after(&[-1], 0, 1), ms(1000));
        // A holder on a bare majority of 3, the third instance free (and granted).
        assert_eq!(retry_after(&[9000, 8000], 1, 2), ms(8001));
        // All 3 held: two must be freed.
        assert_eq!(retry_after(&[9000, 300, 8000], 0, 2), ms(8001));
        // 5 instances, 3 held, 2 granted: one more must be freed.
        assert_eq!(retry_after(&[9000, 300, 8000], 2, 3), ms(301));
        // A key without expiry counts as freed last.
        assert_eq!(retry_after(&[-1, 8000], 1, 2), ms(8001));
        // Split votes.
        for (held, granted, quorum) in [(&[9000][..], 1, 2), (&[][..], 0, 1), (&[5][..], 2, 3)] {
            assert!(retry_after(held, granted, quorum) < ms(50));
        }
    }

    /// A clock Redlock cannot propose a token from is refused, not turned into a 0 that
    /// lets tokens restart at 1 once the counters are gone.
    #[test]
    fn a_clock_before_1970_or_after_2112_is_refused() {
        let now = SystemTime::now();
        let micros = now.duration_since(UNIX_EPOCH).unwrap().as_micros();
        assert_eq!(proposal(now).ok().map(u128::from), Some(micros));
        for bad in [
            UNIX_EPOCH - Duration::from_secs(1),
            UNIX_EPOCH,
            UNIX_EPOCH + Duration::from_micros(1 << 52),
        ] {
            assert!(proposal(bad).is_err(), "{bad:?}");
        }
    }
}
