//! Unlock notifications: one pub/sub connection per node, shared by all waiters of a
//! client, with a task that (un)subscribes in order and wakes waiters on messages.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use futures_util::StreamExt;
use redis::aio::{PubSubSink, PubSubStream};
use tokio::sync::{Notify, mpsc, oneshot};

use crate::node::Node;

/// How long a waiter waits for its SUBSCRIBE to be confirmed before it goes on anyway
/// (a missed message then costs at most one lease, the sleep bound).
const ACK_WAIT: Duration = Duration::from_millis(250);

/// The pub/sub side of one node.
pub(crate) struct Subscriber {
    shared: Arc<Shared>,
    commands: mpsc::UnboundedSender<Command>,
}

#[derive(Default)]
struct Shared {
    next_id: AtomicU64,
    waiters: Mutex<HashMap<String, HashMap<u64, Arc<Notify>>>>,
}

enum Command {
    Subscribe(String, oneshot::Sender<()>),
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
    fn waiters(&self) -> MutexGuard<'_, HashMap<String, HashMap<u64, Arc<Notify>>>> {
        self.waiters.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn has_waiters(&self, channel: &str) -> bool {
        self.waiters().contains_key(channel)
    }

    fn wake(&self, channel: &str) {
        if let Some(waiters) = self.waiters().get(channel) {
            for notify in waiters.values() {
                notify.notify_one();
            }
        }
    }

    fn wake_all(&self) {
        for waiters in self.waiters().values() {
            for notify in waiters.values() {
                notify.notify_one();
            }
        }
    }
}

impl Subscriber {
    /// Starts the subscription task of `node`. It connects on first use and ends when
    /// the subscriber and all its subscriptions are dropped.
    pub(crate) fn new(node: Node, timeout: Duration) -> Self {
        let shared = Arc::new(Shared::default());
        let (commands, receiver) = mpsc::unbounded_channel();
        tokio::spawn(run(node, timeout, shared.clone(), receiver));
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

async fn next_message(stream: &mut Option<PubSubStream>) -> Option<redis::Msg> {
    match stream {
        Some(stream) => stream.next().await,
        None => std::future::pending().await,
    }
}

async fn sleep_until(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// A connection subscribed to `channels`.
type Connected = (PubSubSink, PubSubStream, HashSet<String>);

async fn connect(node: &Node, timeout: Duration, channels: Vec<String>) -> Option<Connected> {
    let pubsub = match tokio::time::timeout(timeout, node.pubsub()).await {
        Ok(Ok(pubsub)) => pubsub,
        _ => {
            tracing::debug!("redis pub/sub connection failed");
            return None;
        }
    };
    let (mut sink, stream) = pubsub.split();
    if !channels.is_empty() {
        match tokio::time::timeout(timeout, sink.subscribe(&channels)).await {
            Ok(Ok(())) => {}
            _ => return None,
        }
    }
    Some((sink, stream, channels.into_iter().collect()))
}

async fn run(
    node: Node,
    timeout: Duration,
    shared: Arc<Shared>,
    mut commands: mpsc::UnboundedReceiver<Command>,
) {
    let mut sink: Option<PubSubSink> = None;
    let mut stream: Option<PubSubStream> = None;
    let mut subscribed = HashSet::<String>::new();
    let mut reconnect_at = None;
    loop {
        tokio::select! {
            command = commands.recv() => match command {
                None => return,
                Some(Command::Subscribe(channel, ack)) => {
                    if !shared.has_waiters(&channel) || subscribed.contains(&channel) {
                        let _ = ack.send(());
                        continue;
                    }
                    let result = match sink.as_mut() {
                        Some(s) => matches!(
                            tokio::time::timeout(timeout, s.subscribe(&channel)).await,
                            Ok(Ok(()))
                        ),
                        None => match connect(&node, timeout, vec![channel.clone()]).await {
                            Some((s, r, _)) => {
                                sink = Some(s);
                                stream = Some(r);
                                subscribed.clear();
                                reconnect_at = None;
                                true
                            }
                            None => false,
                        },
                    };
                    if result {
                        subscribed.insert(channel);
                        let _ = ack.send(());
                    } else {
                        sink = None;
                        stream = None;
                        subscribed.clear();
                    }
                }
                Some(Command::Unsubscribe(channel)) => {
                    if !shared.has_waiters(&channel) && subscribed.remove(&channel) {
                        if let Some(s) = sink.as_mut() {
                            if !matches!(
                                tokio::time::timeout(timeout, s.unsubscribe(&channel)).await,
                                Ok(Ok(()))
                            ) {
                                sink = None;
                                stream = None;
                                subscribed.clear();
                            }
                        }
                    }
                }
            },
            message = next_message(&mut stream) => match message {
                Some(message) => shared.wake(message.get_channel_name()),
                None => {
                    // Connection lost: reconnect and resubscribe soon; meanwhile waiters
                    // sleep at most the remaining TTL.
                    sink = None;
                    stream = None;
                    subscribed.clear();
                    reconnect_at = Some(tokio::time::Instant::now() + Duration::from_millis(100));
                }
            },
            () = sleep_until(reconnect_at) => {
                reconnect_at = None;
                let channels: Vec<String> = shared.waiters().keys().cloned().collect();
                if channels.is_empty() {
                    continue;
                }
                match connect(&node, timeout, channels).await {
                    Some((s, r, set)) => {
                        sink = Some(s);
                        stream = Some(r);
                        subscribed = set;
                        // Unlocks may have been missed while disconnected.
                        shared.wake_all();
                    }
                    None => {
                        reconnect_at = Some(tokio::time::Instant::now() + Duration::from_millis(500));
                    }
                }
            },
        }
    }
}
