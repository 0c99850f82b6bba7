//! One watch stream per client for the keys of held locks.
//!
//! A held lock must learn when its key is deleted by anyone but its own release (an
//! operator, lease expiry). A gRPC watch stream per held lock cost about 28 KB each, and
//! releasing tens of thousands of them at once reset as many HTTP/2 streams, which made
//! the client's own HTTP/2 library drop the whole connection (`GOAWAY
//! ENHANCE_YOUR_CALM`, its rapid-reset guard). Instead every key watch of a client is
//! multiplexed onto one stream, under a watch ID the client assigns, and is ended with a
//! cancel request on that stream.
//!
//! The stream runs in one task while any key is watched and ends (half-closed, so no
//! reset is sent) after [`LINGER`] without any. A broken stream is reopened with backoff,
//! and every watch is created again from its original start revision: etcd replays the
//! history in between, so no deletion is missed. If that history was compacted, the
//! watch ends with [`Ended::Compacted`] and its owner checks the key instead.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use etcd_client::{Client, EventType, WatchFilterType, WatchOptions, WatchResponse};
use tokio::runtime::Handle;
use tokio::sync::{mpsc, oneshot};

/// How long the stream stays open after its last watch ended.
const LINGER: Duration = Duration::from_secs(1);

/// How long a drained stream may take to end after it was half-closed.
const DRAIN: Duration = Duration::from_secs(1);

/// Why a key watch ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Ended {
    /// The key was deleted.
    Deleted,
    /// etcd compacted the history the watch needed (at this revision): whether the key
    /// still exists is unknown and must be read.
    Compacted(i64),
    /// etcd refused the watch (for example RBAC), with its reason.
    Refused(String),
}

/// The key watches of one client.
pub(crate) struct KeyWatches {
    client: Arc<Client>,
    runtime: Handle,
    state: Mutex<State>,
}

impl std::fmt::Debug for KeyWatches {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyWatches")
            .field("watched", &self.lock().entries.len())
            .finish_non_exhaustive()
    }
}

#[derive(Default)]
struct State {
    /// The last watch ID handed out; IDs are never reused by one client.
    last_id: i64,
    entries: HashMap<i64, Entry>,
    /// The requests of the running stream task, if one runs.
    requests: Option<mpsc::UnboundedSender<Request>>,
}

struct Entry {
    /// Shared with the guard that watches it.
    key: Arc<str>,
    /// The first revision the watch must see.
    from: i64,
    ended: oneshot::Sender<Ended>,
}

#[derive(Debug)]
enum Request {
    Create(i64),
    Cancel(i64),
}

/// One watched key; dropping it ends the watch.
pub(crate) struct KeyWatch {
    watches: Arc<KeyWatches>,
    id: i64,
    ended: oneshot::Receiver<Ended>,
}

impl std::fmt::Debug for KeyWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyWatch").field("id", &self.id).finish()
    }
}

impl KeyWatch {
    /// Completes when the watch ends. Pending forever if the client's watches end without
    /// an answer (the process is shutting down its runtime).
    ///
    /// Cancel safe: dropping the future keeps the watch; dropping the `KeyWatch` ends it.
    pub(crate) async fn ended(&mut self) -> Ended {
        match (&mut self.ended).await {
            Ok(ended) => ended,
            Err(_) => std::future::pending().await,
        }
    }
}

impl Drop for KeyWatch {
    fn drop(&mut self) {
        self.watches.forget(self.id);
    }
}

impl KeyWatches {
    pub(crate) fn new(client: Arc<Client>, runtime: Handle) -> Self {
        KeyWatches {
            client,
            runtime,
            state: Mutex::default(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Watches `key` for deletion from revision `from` on (puts are not reported).
    pub(crate) fn watch(self: &Arc<Self>, key: Arc<str>, from: i64) -> KeyWatch {
        let (tx, rx) = oneshot::channel();
        let mut state = self.lock();
        state.last_id += 1;
        let id = state.last_id;
        state.entries.insert(
            id,
            Entry {
                key,
                from,
                ended: tx,
            },
        );
        let sent = state
            .requests
            .as_ref()
            .is_some_and(|requests| requests.send(Request::Create(id)).is_ok());
        if !sent {
            // No stream runs: start one. It reads the entries itself when it opens.
            let (requests, receiver) = mpsc::unbounded_channel();
            state.requests = Some(requests);
            let this = self.clone();
            self.runtime.spawn(this.run(receiver));
        }
        drop(state);
        KeyWatch {
            watches: self.clone(),
            id,
            ended: rx,
        }
    }

    fn forget(&self, id: i64) {
        let mut state = self.lock();
        if state.entries.remove(&id).is_some() {
            if let Some(requests) = &state.requests {
                let _ = requests.send(Request::Cancel(id));
            }
        }
    }

    /// Ends watch `id` with `ended` and asks etcd to cancel it.
    fn finish(&self, id: i64, ended: Ended) {
        let mut state = self.lock();
        if let Some(entry) = state.entries.remove(&id) {
            let _ = entry.ended.send(ended);
            if let Some(requests) = &state.requests {
                let _ = requests.send(Request::Cancel(id));
            }
        }
    }

    fn options(id: i64, from: i64) -> WatchOptions {
        WatchOptions::new()
            .with_watch_id(id)
            .with_start_revision(from)
            .with_filters([WatchFilterType::NoPut])
    }

    /// The stream task: opens the stream, forwards requests, dispatches answers, reopens
    /// a broken stream and ends once nothing has been watched for [`LINGER`].
    async fn run(self: Arc<Self>, mut requests: mpsc::UnboundedReceiver<Request>) {
        let mut backoff = Duration::from_millis(100);
        loop {
            // Everything watched now is created on the new stream; requests already
            // queued for these IDs are skipped.
            let mut pending: Vec<i64> = {
                let state = self.lock();
                let mut ids: Vec<i64> = state.entries.keys().copied().collect();
                ids.sort_unstable();
                ids
            };
            if pending.is_empty() {
                if self.close_if_idle() {
                    return;
                }
                match tokio::time::timeout(LINGER, requests.recv()).await {
                    Ok(Some(_)) | Err(_) => continue,
                    Ok(None) => return,
                }
            }
            let first = pending.remove(0);
            let Some((key, from)) = self.entry(first) else {
                continue;
            };
            let opened = self
                .client
                .watch_client()
                .watch(key, Some(Self::options(first, from)))
                .await;
            let stream = match opened {
                Ok(stream) => stream,
                Err(error) => {
                    tracing::debug!(%error, "etcd key watch stream failed to open; retrying");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                    continue;
                }
            };
            let (mut sender, mut responses) = stream.split();
            let mut sent: HashSet<i64> = HashSet::from([first]);
            pending.reverse();
            // Sending and reading run side by side: etcd stops reading requests while
            // its answers are not read, so a sender that did not read could hang.
            let forward = async {
                loop {
                    let request = match pending.pop() {
                        Some(id) => Request::Create(id),
                        None => match tokio::time::timeout(LINGER, requests.recv()).await {
                            Ok(Some(request)) => request,
                            Ok(None) => return false,
                            Err(_) if self.close_if_idle() => return false,
                            Err(_) => continue,
                        },
                    };
                    let outcome = match request {
                        Request::Create(id) if !sent.contains(&id) => match self.entry(id) {
                            Some((key, from)) => {
                                sent.insert(id);
                                sender.watch(key, Some(Self::options(id, from))).await
                            }
                            None => Ok(()),
                        },
                        Request::Cancel(id) if sent.remove(&id) => sender.cancel(id).await,
                        _ => Ok(()),
                    };
                    if outcome.is_err() {
                        return true;
                    }
                }
            };
            let read = async {
                loop {
                    match responses.message().await {
                        Ok(Some(response)) => self.dispatch(&response),
                        Ok(None) => return,
                        Err(error) => {
                            tracing::debug!(%error, "etcd key watch stream broke; reopening");
                            return;
                        }
                    }
                }
            };
            let idle = tokio::select! {
                reopen = forward => !reopen,
                () = read => false,
            };
            if idle {
                drop(sender);
                // Half-closed: etcd ends the
                // stream, so no reset is sent.
                let _ = tokio::time::timeout(DRAIN, async {
                    while let Ok(Some(_)) = responses.message().await {}
                })
                .await;
                return;
            }
            backoff = Duration::from_millis(100);
            tokio::time::sleep(backoff).await;
        }
    }

    /// The key and start revision of watch `id`, if it is still wanted.
    fn entry(&self, id: i64) -> Option<(Vec<u8>, i64)> {
        self.lock()
            .entries
            .get(&id)
            .map(|entry| (entry.key.as_bytes().to_vec(), entry.from))
    }

    /// Ends the stream task if nothing is watched: returns whether it must end. New
    /// watches after this start a new task.
    fn close_if_idle(&self) -> bool {
        let mut state = self.lock();
        if state.entries.is_empty() {
            state.requests = None;
            true
        } else {
            false
        }
    }

    fn dispatch(&self, response: &WatchResponse) {
        let id = response.watch_id();
        if response
            .events()
            .iter()
            .any(|e| e.event_type() == EventType::Delete)
        {
            self.finish(id, Ended::Deleted);
        } else if response.canceled() {
            let ended = if response.compact_revision() > 0 {
                Ended::Compacted(response.compact_revision())
            } else {
                Ended::Refused(response.cancel_reason().to_owned())
            };
            self.finish(id, ended);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use etcd_client::{CompactionOptions, ConnectOptions};
    use fencelock_testkit::{EtcdServer, FaultProxy};
    use tokio::time::Instant;

    async fn connect(endpoint: &str) -> Arc<Client> {
        let options = ConnectOptions::new().with_connect_timeout(Duration::from_secs(5));
        Arc::new(Client::connect([endpoint], Some(options)).await.unwrap())
    }

    async fn put(client: &Client, key: &str) -> i64 {
        let put = client.kv_client().put(key, "", None).await.unwrap();
        put.header().unwrap().revision()
    }

    /// Polls `metric` on `server` until `ok` holds, for at most 10 s.
    async fn metric_until(server: &EtcdServer, metric: &str, ok: impl Fn(f64) -> bool) -> f64 {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let value = server.metric(metric).unwrap_or(-1.0);
            if ok(value) || Instant::now() >= deadline {
                return value;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn is_idle(watches: &KeyWatches) -> bool {
        let state = watches.lock();
        state.entries.is_empty() && state.requests.is_none()
    }

    const STREAMS: &str = "etcd_debugging_mvcc_watch_stream_total";
    const WATCHERS: &str = "etcd_debugging_mvcc_watcher_total";

    /// Many watched keys share one stream; a deletion ends exactly its own watch; the
    /// stream ends, without a reset, once nothing is watched.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn one_stream_carries_every_watch_and_ends_when_idle() {
        let server = EtcdServer::start();
        let client = connect(&server.endpoint()).await;
        let watches = Arc::new(KeyWatches::new(client.clone(), Handle::current()));
        let mut watched = Vec::new();
        for i in 0..300 {
            let key = format!("w/{i}");
            let revision = put(&client, &key).await;
            watched.push((
                key.clone(),
                watches.watch(key.as_str().into(), revision + 1),
            ));
        }
        assert_eq!(metric_until(&server, WATCHERS, |v| v == 300.0).await, 300.0);
        assert_eq!(
            server.metric(STREAMS),
            Some(1.0),
            "one stream for 300 watches"
        );
        // Puts are not reported; deletions are, each to its own watch only.
        put(&client, "w/5").await;
        for i in (0..300).step_by(30) {
            client
                .kv_client()
                .delete(format!("w/{i}"), None)
                .await
                .unwrap();
        }
        for (i, (_, watch)) in watched.iter_mut().enumerate() {
            let ended = tokio::time::timeout(
                Duration::from_millis(if i % 30 == 0 { 5_000 } else { 1 }),
                watch.ended(),
            )
            .await;
            match ended {
                Ok(ended) => {
                    assert_eq!(i % 30, 0, "watch {i} ended: {ended:?}");
                    assert_eq!(ended, Ended::Deleted);
                }
                Err(_) => assert_ne!(i % 30, 0, "the deletion of w/{i} was not reported"),
            }
        }
        assert_eq!(
            metric_until(&server, WATCHERS, |v| v == 290.0).await,
            290.0,
            "ended watches are cancelled on the server"
        );
        drop(watched);
        assert_eq!(metric_until(&server, WATCHERS, |v| v == 0.0).await, 0.0);
        assert_eq!(
            metric_until(&server, STREAMS, |v| v == 0.0).await,
            0.0,
            "the idle stream ends"
        );
        assert!(is_idle(&watches));
        // A new watch opens a new stream.
        let revision = put(&client, "again").await;
        let mut again = watches.watch("again".into(), revision + 1);
        client.kv_client().delete("again", None).await.unwrap();
        let ended = tokio::time::timeout(Duration::from_secs(5), again.ended()).await;
        assert_eq!(ended.unwrap(), Ended::Deleted);
    }

    /// A watch whose history was compacted says so, instead of ending silently.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_compacted_history_ends_the_watch_as_compacted() {
        // Its own server: a compaction would disturb other tests.
        let server = EtcdServer::start();
        let client = connect(&server.endpoint()).await;
        let watches = Arc::new(KeyWatches::new(client.clone(), Handle::current()));
        let key = format!("compacted-{:x}", std::process::id());
        let created = put(&client, &key).await;
        // Compacting at a revision keeps that revision: compact two past the creation,
        // so the watch from the one after it has lost its history.
        put(&client, &format!("{key}-other")).await;
        let now = put(&client, &format!("{key}-other")).await;
        client
            .kv_client()
            .compact(now, Some(CompactionOptions::new().with_physical()))
            .await
            .unwrap();
        let ended = tokio::time::timeout(
            Duration::from_secs(5),
            watches.watch(key.as_str().into(), created + 1).ended(),
        )
        .await
        .unwrap();
        assert!(
            matches!(ended, Ended::Compacted(r) if r >= now),
            "{ended:?}"
        );
    }

    /// A broken stream is reopened and replays what happened while it was down: a
    /// deletion during the break is reported.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_deletion_while_the_stream_was_broken_is_reported() {
        let server = EtcdServer::shared();
        let proxy = FaultProxy::start(&server.endpoint());
        let direct = connect(&server.endpoint()).await;
        let client = connect(&proxy.addr()).await;
        let watches = Arc::new(KeyWatches::new(client, Handle::current()));
        let key = format!("broken-{:x}", std::process::id());
        let kept = format!("{key}-kept");
        let revision = put(&direct, &key).await;
        put(&direct, &kept).await;
        let mut watch = watches.watch(key.as_str().into(), revision + 1);
        let mut other = watches.watch(kept.as_str().into(), revision + 1);
        tokio::time::sleep(Duration::from_millis(300)).await;
        proxy.set(fencelock_testkit::Fault::Blackhole);
        proxy.reset_connections();
        direct.kv_client().delete(key.as_str(), None).await.unwrap();
        tokio::time::sleep(Duration::from_millis(500)).await;
        proxy.set(fencelock_testkit::Fault::Pass);
        let ended = tokio::time::timeout(Duration::from_secs(15), watch.ended()).await;
        assert_eq!(ended.expect("the deletion was reported"), Ended::Deleted);
        assert!(
            tokio::time::timeout(Duration::from_millis(300), other.ended())
                .await
                .is_err(),
            "the other watch goes on"
        );
        direct
            .kv_client()
            .delete(kept.as_str(), None)
            .await
            .unwrap();
        let ended = tokio::time::timeout(Duration::from_secs(5), other.ended()).await;
        assert_eq!(ended.unwrap(), Ended::Deleted);
        assert!(
            proxy.accepted() >= 2,
            "the stream was reopened on a new connection"
        );
    }
}
