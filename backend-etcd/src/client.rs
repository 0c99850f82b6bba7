//! `DistributedLock` for [`EtcdLock`]: every method's checks, then the path that does
//! the work (a lock: [`crate::acquire`]; read-write locks and semaphores:
//! [`crate::queue`]), and what is read without taking anything: inspect, list, leader.

use std::collections::BTreeMap;
use std::time::Duration;

use async_trait::async_trait;
use etcd_client::{GetOptions, SortOrder, SortTarget};
use fencelock_core::{
    AcquireOptions, Capabilities, DistributedLock, Error, FencingStrength, FencingToken,
    HolderInfo, Leader, LeaderChanges, ListedLock, LockGuard, LockInfo, LossDetection, Permits,
    WaitDeadline, validate_name, validate_prefix,
};
use tracing::Instrument;

use crate::config::{MIN_LEASE, lease_seconds};
use crate::error::{BACKEND, map};
use crate::keys::{decode, encode, name_prefix};
use crate::leases::revoke;
use crate::lock::EtcdLock;
use crate::queue::Ask;
use crate::txn::{delete_incarnation, first_created};

impl EtcdLock {
    /// A read lock, write lock or permits (see [`crate::queue`]), after the checks every
    /// acquire makes, ended by `close`.
    async fn queued(
        &self,
        name: &str,
        ask: Ask,
        options: AcquireOptions,
    ) -> Result<LockGuard, Error> {
        validate_name(name)?;
        options.validate(MIN_LEASE)?;
        lease_seconds(options.lease_or(self.inner().config.lease).duration())?;
        self.check_open()?;
        let span = tracing::debug_span!("fencelock.etcd.queue", lock = name, ask = ?ask);
        // Once more on a new session if the session turned out to be gone (revoked or
        // expired before its keepalive noticed), as for a lock (`take_fresh`).
        // One deadline for both tries: the retry does not restart the caller's wait.
        let wait = WaitDeadline::new(options.wait_kind());
        let taken = async {
            match self.queue(name, ask, options, wait).await {
                Err(error) if crate::error::is_stale_session(&error) => {
                    self.queue(name, ask, options, wait).await
                }
                other => other,
            }
        };
        tokio::select! {
            biased;
            () = self.inner().closed.cancelled() => Err(Error::Closed { backend: BACKEND }),
            taken = taken.instrument(span) => taken,
        }
    }

    /// Every key under `range` (keys only), in create order.
    async fn keys_in_create_order(&self, range: &str) -> Result<etcd_client::GetResponse, Error> {
        let options = GetOptions::new()
            .with_prefix()
            .with_sort(SortTarget::Create, SortOrder::Ascend)
            .with_keys_only();
        self.inner()
            .client
            .kv_client()
            .get(range, Some(options))
            .await
            .map_err(map)
    }

    /// What [`DistributedLock::inspect`] reports of the name whose key range is `names`,
    /// given its keys (key, create revision, lease) in create order.
    async fn describe(&self, names: &str, keys: &[(&[u8], i64, i64)]) -> LockInfo {
        let local = self.inner().lines.waiting_under(names);
        let Some(&(key, revision, lease)) = keys.first() else {
            return LockInfo::free(Some(local));
        };
        let remaining = match self
            .inner()
            .client
            .lease_client()
            .time_to_live(lease, None)
            .await
        {
            Ok(ttl) if ttl.ttl() >= 0 => Some(Duration::from_secs(ttl.ttl().unsigned_abs())),
            _ => None,
        };
        let owner = String::from_utf8_lossy(key)
            .rsplit('/')
            .next()
            .unwrap_or_default()
            .to_owned();
        let token = FencingToken::new(u64::try_from(revision).unwrap_or_default());
        let waiters = keys.len() - 1 + local;
        LockInfo::held(HolderInfo::new(owner, token, remaining), Some(waiters))
    }
}

#[async_trait]
impl DistributedLock for EtcdLock {
    async fn acquire(&self, name: &str, options: AcquireOptions) -> Result<LockGuard, Error> {
        validate_name(name)?;
        options.validate(MIN_LEASE)?;
        lease_seconds(options.lease_or(self.inner().config.lease).duration())?;
        self.check_open()?;
        let span = tracing::debug_span!("fencelock.etcd.acquire", lock = name);
        tokio::select! {
            biased;
            // Dropping the acquire undoes whatever it did, as for any cancellation.
            () = self.inner().closed.cancelled() => Err(Error::Closed { backend: BACKEND }),
            taken = self.take_fresh(name, options, "").instrument(span) => taken,
        }
    }

    async fn inspect(&self, name: &str) -> Result<LockInfo, Error> {
        validate_name(name)?;
        self.check_open()?;
        let names = name_prefix(&self.inner().config.prefix, name);
        let response = self.keys_in_create_order(&names).await?;
        let keys: Vec<(&[u8], i64, i64)> = response
            .kvs()
            .iter()
            .map(|kv| (kv.key(), kv.create_revision(), kv.lease()))
            .collect();
        Ok(self.describe(&names, &keys).await)
    }

    async fn acquire_read(&self, name: &str, options: AcquireOptions) -> Result<LockGuard, Error> {
        self.queued(name, Ask::Read, options).await
    }

    async fn acquire_write(&self, name: &str, options: AcquireOptions) -> Result<LockGuard, Error> {
        self.queued(name, Ask::Write, options).await
    }

    async fn acquire_permits(
        &self,
        name: &str,
        permits: Permits,
        options: AcquireOptions,
    ) -> Result<LockGuard, Error> {
        let ask = Ask::Permits {
            count: permits.count(),
            limit: permits.limit(),
        };
        self.queued(name, ask, options).await
    }

    async fn campaign(
        &self,
        election: &str,
        value: &str,
        options: AcquireOptions,
    ) -> Result<LockGuard, Error> {
        validate_name(election)?;
        fencelock_core::validate_leader_value(value)?;
        options.validate(MIN_LEASE)?;
        lease_seconds(options.lease_or(self.inner().config.lease).duration())?;
        self.check_open()?;
        let span = tracing::debug_span!("fencelock.etcd.campaign", election);
        tokio::select! {
            biased;
            () = self.inner().closed.cancelled() => Err(Error::Closed { backend: BACKEND }),
            taken = self.take_fresh(election, options, value).instrument(span) => taken,
        }
    }

    async fn leader(&self, election: &str) -> Result<Option<Leader>, Error> {
        validate_name(election)?;
        self.check_open()?;
        let names = name_prefix(&self.inner().config.prefix, election);
        let options = GetOptions::new()
            .with_prefix()
            .with_sort(SortTarget::Create, SortOrder::Ascend)
            .with_limit(1);
        let response = self
            .inner()
            .client
            .kv_client()
            .get(names.as_str(), Some(options))
            .await
            .map_err(map)?;
        Ok(crate::election::Candidates::from_kvs(response.kvs()).leader())
    }

    async fn observe(&self, election: &str) -> Result<LeaderChanges, Error> {
        validate_name(election)?;
        self.check_open()?;
        let names = name_prefix(&self.inner().config.prefix, election);
        let (candidates, revision) = crate::election::read(&self.inner().client, &names).await?;
        let (changes, receiver) = tokio::sync::mpsc::unbounded_channel();
        // The first item: the state the watch starts from.
        let _ = changes.send(Ok(candidates.leader()));
        let stop = self.inner().closed.child_token();
        self.inner().runtime.spawn(crate::election::follow(
            self.inner().client.clone(),
            names,
            candidates,
            revision,
            changes,
            stop.clone(),
        ));
        Ok(LeaderChanges::new(receiver, stop))
    }

    async fn list(&self, prefix: &str) -> Result<Vec<ListedLock>, Error> {
        validate_prefix(prefix)?;
        self.check_open()?;
        let root = format!("{}/", self.inner().config.prefix);
        let range = format!("{root}{}", encode(prefix));
        let response = self.keys_in_create_order(&range).await?;
        // Every key is `{root}{encoded name}/{lease}`; group them by name, keeping the
        // create order within each.
        let mut by_name: BTreeMap<String, Vec<(&[u8], i64, i64)>> = BTreeMap::new();
        for kv in response.kvs() {
            let Some(rest) = kv.key().strip_prefix(root.as_bytes()) else {
                continue;
            };
            let Some(slash) = rest.iter().position(|&b| b == b'/') else {
                continue;
            };
            let Some(name) = std::str::from_utf8(&rest[..slash]).ok().and_then(decode) else {
                continue;
            };
            by_name
                .entry(name)
                .or_default()
                .push((kv.key(), kv.create_revision(), kv.lease()));
        }
        let mut found = Vec::with_capacity(by_name.len());
        for (name, keys) in by_name {
            let info = self
                .describe(&name_prefix(&self.inner().config.prefix, &name), &keys)
                .await;
            found.push(ListedLock::new(name, info));
        }
        Ok(found)
    }

    async fn revoke(&self, name: &str) -> Result<Option<HolderInfo>, Error> {
        validate_name(name)?;
        self.check_open()?;
        let names = name_prefix(&self.inner().config.prefix, name);
        let response = self
            .inner()
            .client
            .kv_client()
            .get(names.as_str(), Some(first_created()))
            .await
            .map_err(map)?;
        let Some(first) = response.kvs().first() else {
            return Ok(None);
        };
        let key = first.key_str().map_err(map)?.to_owned();
        let info = self
            .describe(
                &names,
                &[(first.key(), first.create_revision(), first.lease())],
            )
            .await;
        // Only the incarnation seen: a holder that took the name since keeps it.
        let deleted =
            delete_incarnation(&self.inner().client, &key, first.create_revision()).await?;
        if deleted {
            tracing::warn!(lock = name, key, "etcd: lock revoked");
        }
        Ok(info.holder.filter(|_| deleted))
    }

    async fn close(&self) -> Result<(), Error> {
        self.inner().closed.cancel();
        // Every guard is told before anything is awaited, and the revokes run in a task
        // of their own: a dropped `close` leaves no session renewed, no guard valid, and
        // no lease unrevoked.
        let sessions = self.inner().sessions.close();
        let fixed = self.inner().fixed.close();
        let client = self.inner().client.clone();
        let revoking = self.inner().runtime.spawn(async move {
            let mut outcome = Ok(());
            for lease in sessions {
                if let Err(error) = revoke(&client, lease).await {
                    tracing::warn!(lease, %error, "etcd: a session lease could not be revoked at close; it expires on its own");
                    outcome = outcome.and(Err(error));
                }
            }
            for lease in fixed {
                if let Err(error) = revoke(&client, lease).await {
                    tracing::warn!(lease, %error, "etcd: a fixed lease could not be revoked at close; it expires on its own");
                    outcome = outcome.and(Err(error));
                }
            }
            outcome
        });
        revoking
            .await
            .unwrap_or_else(|_| Err(Error::unavailable(BACKEND, "the close task failed")))
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::new(true, FencingStrength::Strong, true, LossDetection::Notified)
            .with_min_lease(MIN_LEASE)
            .with_counts_waiters(true)
            .with_election(true)
            .with_semaphore(true)
            .with_rw_lock(true)
    }

    fn backend(&self) -> &'static str {
        BACKEND
    }

    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }
}
