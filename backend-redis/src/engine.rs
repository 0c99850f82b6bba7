//! The shared state of a client (its nodes, identity, renewals, subscriptions and
//! granted locks) and what it does on every node: bounded calls, release, revoke,
//! extend and close. One acquisition attempt is [`crate::attempt`].

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize};
use std::time::Duration;

use fencelock_core::kit::CLOCK_DRIFT;
use fencelock_core::kit::{Grants, Renewals};
use fencelock_core::{Error, LossCause};
use futures_util::future::join_all;
use redis::{FromRedisValue, RedisWrite, ToRedisArgs};
use tokio_util::sync::CancellationToken;

use crate::call::{Call, millis};
use crate::config::RedisConfig;
use crate::error::{BACKEND, invalid_name};
use crate::keys::LockKeys;
use crate::node::Node;
use crate::quorum::{on_every_node, pending, until_settled};
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
    /// The renewing leases, on the kit's scheduler (see [`crate::renewal`]).
    pub(crate) renewals: Renewals<Engine>,
    /// Renewal calls in flight at once in the next round, less one (see
    /// [`MAX_IN_FLIGHT`](crate::renewal::MAX_IN_FLIGHT)).
    pub(crate) widen: AtomicUsize,
    /// The waiting lines of this client's tasks, by lock key.
    pub(crate) lines: Arc<fencelock_core::line::Lines>,
    /// Every lock granted through this client and not yet released, by attempt id, for
    /// `close` (which closes it: a grant after that is refused).
    pub(crate) held: Grants<Granted>,
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
    /// A renewing lease's key in [`Engine::renewals`].
    pub(crate) renewal: Option<u64>,
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
            renewals: Renewals::new(tokio::runtime::Handle::current()),
            widen: AtomicUsize::new(0),
            lines: Arc::default(),
            held: Grants::new(),
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
    /// only raises a counter. (An acquire waits for every instance: see `attempt::try_once`.)
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
        let expected = match token.filter(|_| !self.config.layout.is_raw()) {
            Some(token) => Expected::Token(token),
            None => Expected::Unchecked,
        };
        self.compare_and_delete(keys, owner, expected, election)
            .await
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
        self.compare_and_delete(keys, owner, Expected::Revoke, election)
            .await
    }

    /// The release script on every node; `expected` is its third argument (see
    /// [`RELEASE`](scripts::RELEASE)).
    async fn compare_and_delete(
        &self,
        keys: &LockKeys,
        owner: &str,
        expected: Expected,
        election: bool,
    ) -> Result<bool, Error> {
        let mut invocation = scripts::RELEASE.prepare_invoke();
        invocation
            .key(&keys.lock)
            .key(&keys.waiters)
            .key(&keys.token)
            .arg(owner)
            .arg(&keys.channel)
            .arg(expected);
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
            Ok(sent + lease - CLOCK_DRIFT.of(lease))
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

    /// Closes the client: nothing is granted any more, every lock granted through it is
    /// marked lost and released, and its tasks stop. Returns the first release that
    /// failed (that key expires with its lease).
    pub(crate) async fn close(&self) -> Result<(), Error> {
        // Drained under the registry's lock, which a new grant takes to register: a grant
        // is either drained here or refused there. Then waiting acquires end and the
        // tasks stop.
        let granted = self.held.close(());
        self.closed.cancel();
        let releases = granted.iter().map(|g| {
            if let Some(key) = g.renewal {
                self.renewals.remove(key);
            }
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
        self.renewals.wake();
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
        self.runtime
            .spawn(self.release_later(keys, owner, token, election));
    }

    /// The release [`release_in_background`](Self::release_in_background) runs, bounded
    /// by twice the command timeout, for a task of its own.
    pub(crate) fn release_later(
        self: &Arc<Self>,
        keys: LockKeys,
        owner: String,
        token: Option<u64>,
        election: bool,
    ) -> impl Future<Output = ()> + Send + 'static {
        let engine = self.clone();
        let timeout = self.config.timeout;
        async move {
            let _ =
                tokio::time::timeout(timeout * 2, engine.release(&keys, &owner, token, election))
                    .await;
        }
    }
}

/// The third argument of the [`RELEASE`](scripts::RELEASE) script: what the release
/// expects of the name's counter. Written straight into the call, as the decimal token,
/// `""` or `!` (no string per release).
#[derive(Debug, Clone, Copy)]
enum Expected {
    /// The guard's token: a key found gone with the counter still at it was deleted by
    /// nobody else since.
    Token(u64),
    /// No check of the counter (the raw layout, whose counter hand-written lockers do not
    /// move).
    Unchecked,
    /// A revoke: also moves the counter on.
    Revoke,
}

impl ToRedisArgs for Expected {
    fn write_redis_args<W: ?Sized + RedisWrite>(&self, out: &mut W) {
        match self {
            Expected::Token(token) => token.write_redis_args(out),
            Expected::Unchecked => out.write_arg(b""),
            Expected::Revoke => out.write_arg(b"!"),
        }
    }
}
