//! Unlock notifications: one pub/sub connection per node, shared by all waiters of a
//! client, with a task that (un)subscribes in order and wakes waiters on messages.
//!
//! The task keeps the connection subscribed to every *live* channel (one with a waiter,
//! a key of `Shared::waiters`). When the connection is lost, or a SUBSCRIBE or
//! UNSUBSCRIBE on it fails, it drops the connection and schedules one reconnection, with
//! a bounded backoff while reconnecting fails. The reconnection subscribes the live
//! channels *as they are then*: whatever waiters subscribed or gave up in between, none
//! is forgotten and none is subscribed for nothing. Every (re)connection is the same
//! code path, also the first one and one caused by a waiter subscribing while there is
//! no connection.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use futures_util::StreamExt;
use futures_util::future::join_all;
use redis::aio::{PubSubSink, PubSubStream};
use tokio::sync::{Notify, mpsc, oneshot};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::node::Node;

/// How long a waiter waits for its SUBSCRIBE to be confirmed before it goes on anyway.
/// A confirmation that comes later wakes the channel's waiters (an unlock published
/// before the server saw the SUBSCRIBE reached nobody); one that never comes leads to a
/// reconnection, which wakes them too. Any other missed message costs at most the
/// waiter's sleep bound, the lock's remaining TTL.
const ACK_WAIT: Duration = Duration::from_millis(250);

/// The delay before reconnecting after the connection was lost or a command on it
/// failed, and the backoff's first step.
const RETRY_MIN: Duration = Duration::from_millis(100);

/// The longest delay between two reconnection attempts (the backoff doubles up to it).
const RETRY_MAX: Duration = Duration::from_secs(2);

/// How often a connection with live channels is checked with a `PING`. A server that
/// vanished without closing the connection (a crashed host, a partition, a failed-over
/// master's address) would otherwise leave it open and silent for ever: waiters would
/// sleep out every lock's TTL, and election observers with no leader to time out on
/// would never hear of a new one.
const PING_EVERY: Duration = Duration::from_secs(5);

/// The pub/sub side of one node.
pub(crate) struct Subscriber {
    shared: Arc<Shared>,
    commands: mpsc::UnboundedSender<Command>,
}

/// What the subscriber, its subscriptions and its task share.
#[derive(Default)]
struct Shared {
    /// The id of the next subscription.
    next_id: AtomicU64,
    /// The live channels: per channel, the wake-up of each subscription to it.
    waiters: Mutex<HashMap<String, HashMap<u64, Arc<Notify>>>>,
}

/// A request to the subscription task.
enum Command {
    /// A waiter registered for the channel; confirm once it is subscribed.
    Subscribe(String, oneshot::Sender<()>),
    /// The last waiter on the channel is gone.
    Unsubscribe(String),
}

/// A waiter's interest in a channel; dropping it unsubscribes when it was the last one.
pub(crate) struct Subscription {
    shared: Arc<Shared>,
    commands: mpsc::UnboundedSender<Command>,
    channel: String,
    id: u64,
}

impl Shared {
    /// The live channels, locked.
    fn waiters(&self) -> MutexGuard<'_, HashMap<String, HashMap<u64, Arc<Notify>>>> {
        self.waiters.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether `channel` is live.
    fn has_waiters(&self, channel: &str) -> bool {
        self.waiters().contains_key(channel)
    }

    /// Wakes every waiter on `channel`.
    fn wake(&self, channel: &str) {
        if let Some(waiters) = self.waiters().get(channel) {
            for notify in waiters.values() {
                notify.notify_one();
            }
        }
    }
}

impl Subscriber {
    /// Starts the subscription task of `node`. It connects on first use and ends when
    /// the subscriber and all its subscriptions are dropped.
    ///
    /// It also ends when `closed` is cancelled (the client was closed).
    pub(crate) fn new(node: Node, timeout: Duration, closed: CancellationToken) -> Self {
        let shared = Arc::new(Shared::default());
        let (commands, receiver) = mpsc::unbounded_channel();
        tokio::spawn(run(node, timeout, shared.clone(), receiver, closed));
        Subscriber { shared, commands }
    }

    /// Registers `wake` for messages on `channel` and subscribes, waiting (briefly) for
    /// the server to confirm. Failures are not errors: the waiter's sleep is bounded by
    /// the lock's remaining TTL anyway.
    pub(crate) async fn subscribe(&self, channel: &str, wake: Arc<Notify>) -> Subscription {
        let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
        self.shared
            .waiters()
            .entry(channel.to_owned())
            .or_default()
            .insert(id, wake);
        let subscription = Subscription {
            shared: self.shared.clone(),
            commands: self.commands.clone(),
            channel: channel.to_owned(),
            id,
        };
        let (ack, acked) = oneshot::channel();
        if self
            .commands
            .send(Command::Subscribe(channel.to_owned(), ack))
            .is_ok()
        {
            let _ = tokio::time::timeout(ACK_WAIT, acked).await;
        }
        subscription
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        let mut waiters = self.shared.waiters();
        if let Some(set) = waiters.get_mut(&self.channel) {
            set.remove(&self.id);
            if set.is_empty() {
                waiters.remove(&self.channel);
                let _ = self
                    .commands
                    .send(Command::Unsubscribe(std::mem::take(&mut self.channel)));
            }
        }
    }
}

/// The next message of `stream`; never, while there is no connection.
async fn next_message(stream: &mut Option<PubSubStream>) -> Option<redis::Msg> {
    match stream {
        Some(stream) => stream.next().await,
        None => std::future::pending().await,
    }
}

/// Sleeps until `at`; forever when nothing is scheduled.
async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Subscribes `sink` to `channels`, bounded by `timeout`; whether the server confirmed
/// every one.
///
/// One SUBSCRIBE per channel, all sent before the first confirmation is awaited: the
/// `redis` crate hands each confirmation to the oldest request still waiting, so a
/// SUBSCRIBE of several channels (one confirmation each) would confirm the requests
/// sent after it before the server has seen them.
///
/// A failure (no answer in time, connection closed) means the connection cannot be
/// trusted any more. An error reply of the server (such as an ACL `NOPERM`) is not
/// seen here: the `redis` crate reports it as a confirmation.
async fn subscribe_all(sink: &PubSubSink, timeout: Duration, channels: &[String]) -> bool {
    let confirmations = join_all(channels.iter().map(|channel| {
        let mut sink = sink.clone();
        async move { sink.subscribe(channel).await }
    }));
    matches!(
        tokio::time::timeout(timeout, confirmations).await,
        Ok(results) if results.iter().all(Result::is_ok)
    )
}

/// The state of the subscription task of one node.
struct Task {
    /// Where pub/sub connections go.
    node: Node,
    /// The bound of connecting and of every (un)subscription.
    timeout: Duration,
    /// The live channels and their waiters.
    shared: Arc<Shared>,
    /// The command side of the connection, while the connection is trusted.
    sink: Option<PubSubSink>,
    /// The message side of the connection, while the connection is trusted.
    stream: Option<PubSubStream>,
    /// The channels the connection is confirmed to be subscribed to.
    subscribed: HashSet<String>,
    /// When to (re)connect and subscribe every live channel; `None`: not scheduled.
    reconnect_at: Option<Instant>,
    /// The delay before the next attempt if the scheduled one fails.
    backoff: Duration,
    /// Confirmations owed to waiters that subscribed while there was no connection:
    /// sent when the reconnection subscribes their channels, dropped (the waiters then
    /// go on at once) when it fails.
    pending: Vec<oneshot::Sender<()>>,
    /// When to check the connection next ([`PING_EVERY`]), while there is one.
    ping_at: Option<Instant>,
}

impl Task {
    /// A task with no connection yet (the first subscription opens it).
    fn new(node: Node, timeout: Duration, shared: Arc<Shared>) -> Self {
        Task {
            node,
            timeout,
            shared,
            sink: None,
            stream: None,
            subscribed: HashSet::new(),
            reconnect_at: None,
            backoff: RETRY_MIN,
            pending: Vec::new(),
            ping_at: None,
        }
    }

    /// Checks that the connection still answers, while any channel is subscribed on it
    /// (with none, nobody waits on it); drops it if it does not answer in time.
    async fn ping(&mut self) {
        self.ping_at = self.sink.as_ref().map(|_| Instant::now() + PING_EVERY);
        if self.subscribed.is_empty() {
            return;
        }
        let Some(sink) = self.sink.as_mut() else {
            return;
        };
        if !matches!(
            tokio::time::timeout(self.timeout, sink.ping::<redis::Value>()).await,
            Ok(Ok(_))
        ) {
            tracing::debug!("redis pub/sub connection did not answer a PING; reconnecting");
            self.disconnected();
        }
    }

    /// A waiter subscribed to `channel`: subscribe now if connected, otherwise let the
    /// (scheduled, or immediate) reconnection do it. `ack` is sent once the server has
    /// confirmed; if nobody waits for it any more, the channel's waiters are woken
    /// instead (they went on unconfirmed, and may have missed an unlock).
    async fn subscribe(&mut self, channel: String, ack: oneshot::Sender<()>) {
        if !self.shared.has_waiters(&channel) || self.subscribed.contains(&channel) {
            let _ = ack.send(());
            return;
        }
        let Some(sink) = self.sink.as_ref() else {
            // The channel is live, so the reconnection includes it.
            self.pending.push(ack);
            if self.reconnect_at.is_none() {
                self.reconnect_at = Some(Instant::now());
            }
            return;
        };
        if subscribe_all(sink, self.timeout, std::slice::from_ref(&channel)).await {
            if ack.send(()).is_err() {
                // The waiter stopped waiting for this confirmation (after `ACK_WAIT`) and
                // made its confirming try before the server knew of the subscription: an
                // unlock published since reached nobody. Wake it, as a reconnection does.
                self.shared.wake(&channel);
            }
            self.subscribed.insert(channel);
        } else {
            tracing::debug!("redis SUBSCRIBE failed; reconnecting");
            self.pending.push(ack);
            self.disconnected();
        }
    }

    /// The last waiter on `channel` is gone: unsubscribe, unless a new waiter came
    /// meanwhile.
    async fn unsubscribe(&mut self, channel: &str) {
        if self.shared.has_waiters(channel) || !self.subscribed.remove(channel) {
            return;
        }
        if let Some(sink) = self.sink.as_mut() {
            if !matches!(
                tokio::time::timeout(self.timeout, sink.unsubscribe(channel)).await,
                Ok(Ok(()))
            ) {
                // The remaining channels are subscribed again on a new connection.
                tracing::debug!("redis UNSUBSCRIBE failed; reconnecting");
                self.disconnected();
            }
        }
    }

    /// The connection is lost or cannot be trusted: drop it and schedule a reconnection
    /// (unless one is scheduled already). Meanwhile waiters sleep at most the remaining
    /// TTL.
    fn disconnected(&mut self) {
        self.sink = None;
        self.stream = None;
        self.ping_at = None;
        self.subscribed.clear();
        if self.reconnect_at.is_none() {
            self.reconnect_at = Some(Instant::now() + jittered(self.backoff));
        }
    }

    /// The scheduled reconnection: a new connection subscribed to every channel live
    /// now (a connection still trusted is kept, and only the live channels it lacks are
    /// subscribed). On failure the next attempt is scheduled after a longer delay.
    async fn reconnect(&mut self) {
        self.reconnect_at = None;
        let live: Vec<String> = self.shared.waiters().keys().cloned().collect();
        if self.sink.is_none() {
            if live.is_empty() {
                // Nobody waits: connect again on the next subscription.
                self.backoff = RETRY_MIN;
                self.acknowledge();
                return;
            }
            match self.node.pubsub(self.timeout).await {
                Ok(pubsub) => {
                    let (sink, stream) = pubsub.split();
                    self.sink = Some(sink);
                    self.stream = Some(stream);
                    self.subscribed.clear();
                    self.ping_at = Some(Instant::now() + PING_EVERY);
                }
                _ => {
                    tracing::debug!("redis pub/sub connection failed");
                    self.retry_later();
                    return;
                }
            }
        }
        let missing: Vec<String> = live
            .into_iter()
            .filter(|channel| !self.subscribed.contains(channel))
            .collect();
        let Some(sink) = self.sink.as_ref() else {
            return;
        };
        if subscribe_all(sink, self.timeout, &missing).await {
            self.backoff = RETRY_MIN;
            self.acknowledge();
            for channel in missing {
                // Unlocks may have been published while it was not subscribed.
                self.shared.wake(&channel);
                self.subscribed.insert(channel);
            }
        } else {
            tracing::debug!("redis SUBSCRIBE after reconnecting failed");
            self.retry_later();
        }
    }

    /// A reconnection failed: drop what it opened, tell the waiting subscribers to go
    /// on, and try again after the next (longer, bounded) delay.
    fn retry_later(&mut self) {
        self.pending.clear();
        self.backoff = self.backoff.saturating_mul(2).min(RETRY_MAX);
        self.disconnected();
    }

    /// Confirms every pending subscription.
    fn acknowledge(&mut self) {
        for ack in self.pending.drain(..) {
            let _ = ack.send(());
        }
    }
}

/// `delay` plus up to a quarter more, so that clients cut off together do not all
/// reconnect in the same instant.
fn jittered(delay: Duration) -> Duration {
    delay.saturating_add((delay / 100).saturating_mul(fastrand::u32(0..=25)))
}

/// The subscription task: (un)subscribes as waiters come and go, wakes the waiters of a
/// channel on its messages, and reconnects. Ends when the subscriber and all its
/// subscriptions are gone.
async fn run(
    node: Node,
    timeout: Duration,
    shared: Arc<Shared>,
    mut commands: mpsc::UnboundedReceiver<Command>,
    closed: CancellationToken,
) {
    let mut task = Task::new(node, timeout, shared);
    loop {
        tokio::select! {
            () = closed.cancelled() => return,
            command = commands.recv() => match command {
                None => return,
                Some(Command::Subscribe(channel, ack)) => task.subscribe(channel, ack).await,
                Some(Command::Unsubscribe(channel)) => task.unsubscribe(&channel).await,
            },
            message = next_message(&mut task.stream) => match message {
                Some(message) => task.shared.wake(message.get_channel_name()),
                None => {
                    tracing::debug!("redis pub/sub connection lost; reconnecting");
                    task.disconnected();
                }
            },
            () = sleep_until(task.reconnect_at) => task.reconnect().await,
            () = sleep_until(task.ping_at) => task.ping().await,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use fencelock_testkit::{Fault, FaultProxy, RedisServer};
    use tokio::sync::Notify;
    use tokio_util::sync::CancellationToken;

    use super::{ACK_WAIT, PING_EVERY, Subscriber};
    use crate::RedisConfig;

    /// A pub/sub connection whose server stopped answering without closing it (a
    /// partition; a crashed host) is found by its PING and replaced: the old code kept
    /// it for ever, subscribed to nothing that arrives.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_silent_connection_is_found_by_ping_and_replaced() {
        let server = RedisServer::start();
        let proxy = FaultProxy::start(&server.addr());
        let config = RedisConfig::from_url(&format!("redis://{}", proxy.addr())).unwrap();
        let node = crate::connect::open(&config).await.unwrap().remove(0);
        let subscriber = Subscriber::new(node, Duration::from_secs(1), CancellationToken::new());
        let wake = Arc::new(Notify::new());
        let _subscription = subscriber.subscribe("unlocks", wake.clone()).await;
        let before = proxy.accepted();
        proxy.set(Fault::Blackhole);
        tokio::time::sleep(PING_EVERY + Duration::from_secs(2)).await;
        proxy.set(Fault::Pass);
        // The reconnection (held in the listen backlog until now) gets through and
        // subscribes again; a message published then reaches the waiter.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while proxy.accepted() <= before && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(
            proxy.accepted() > before,
            "no new connection: the silent one was kept"
        );
        let client = redis::Client::open(server.url()).unwrap();
        let mut conn = client.get_multiplexed_async_connection().await.unwrap();
        let notified = wake.notified();
        tokio::pin!(notified);
        loop {
            let _: i64 = redis::cmd("PUBLISH")
                .arg("unlocks")
                .arg("0")
                .query_async(&mut conn)
                .await
                .unwrap();
            if tokio::time::timeout(Duration::from_millis(200), notified.as_mut())
                .await
                .is_ok()
            {
                break;
            }
            assert!(tokio::time::Instant::now() < deadline, "never woken");
        }
    }

    /// A SUBSCRIBE confirmed after the waiter stopped waiting for it (here: a link that
    /// holds everything for 1 s each way, against the 250 ms a waiter waits) wakes the
    /// channel's waiters: the waiter's confirming try came before the server knew of the
    /// subscription, so an unlock published in between reached nobody, and without the
    /// wake-up the waiter would sleep until the lock's TTL ran out.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_subscription_confirmed_late_wakes_its_waiters() {
        let server = RedisServer::shared();
        let proxy = FaultProxy::start(&server.addr());
        let config = RedisConfig::from_url(&format!("redis://{}", proxy.addr())).unwrap();
        let node = crate::connect::open(&config).await.unwrap().remove(0);
        let subscriber = Subscriber::new(node, Duration::from_secs(5), CancellationToken::new());
        let channel = format!("late-ack-{:x}", std::process::id());
        // Connected and subscribed while the link is quick.
        let _warm = subscriber
            .subscribe(&format!("{channel}-warm"), Arc::new(Notify::new()))
            .await;
        let slow = Duration::from_secs(1);
        proxy.set(Fault::Delay {
            min: slow,
            max: slow,
        });
        let wake = Arc::new(Notify::new());
        let started = tokio::time::Instant::now();
        let _subscription = subscriber.subscribe(&channel, wake.clone()).await;
        assert!(
            started.elapsed() < slow,
            "the waiter waited {:?} for the confirmation",
            started.elapsed()
        );
        assert!(started.elapsed() >= ACK_WAIT);
        // The unlock, published before the server has seen the SUBSCRIBE: nobody hears it.
        let client = redis::Client::open(server.url()).unwrap();
        let mut conn = client.get_multiplexed_async_connection().await.unwrap();
        let heard: i64 = redis::cmd("PUBLISH")
            .arg(&channel)
            .arg("0")
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(heard, 0, "the SUBSCRIBE was not held back");
        let woken = tokio::time::timeout(Duration::from_secs(3), wake.notified()).await;
        proxy.set(Fault::Pass);
        assert!(
            woken.is_ok(),
            "the waiter was not woken when its subscription was confirmed"
        );
    }
}
