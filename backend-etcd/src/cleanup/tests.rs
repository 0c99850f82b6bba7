//! The clean-up of creates etcd answered with an error but may still apply.

use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Client, GetOptions, PutOptions};
use fencelock_core::line::{Front, Lines};
use tokio::runtime::Handle;
use tokio::time::Instant;

use super::{Cleanup, InFlightCreate, KeyState};
use crate::batch::Batcher;
use crate::session::{Keepalives, Session};

/// A client, its session, and a key of ours on the session lease.
struct Setup {
    client: Arc<Client>,
    session: Arc<Session>,
    /// Keeps the session alive while the test runs.
    _keepalives: Arc<Keepalives>,
    lines: Arc<Lines>,
    key: Arc<str>,
}

impl Setup {
    async fn new(test: &str) -> Self {
        let server = fencelock_testkit::EtcdServer::shared();
        let client = Arc::new(Client::connect([server.endpoint()], None).await.unwrap());
        let ttl = Duration::from_secs(10);
        let keepalives = Keepalives::new((*client).clone(), Handle::current());
        let session = Session::grant(&client, ttl, &Handle::current(), Some(&keepalives))
            .await
            .unwrap();
        let names = format!("held-unit-{test}-{:x}/x/", std::process::id());
        let key = crate::keys::own_key(&names, session.lease_id()).into();
        Setup {
            client,
            session,
            _keepalives: keepalives,
            lines: Arc::default(),
            key,
        }
    }

    fn turn(&self) -> Option<Front> {
        self.lines.try_front(&self.key)
    }

    /// The clean-up of an acquire whose create etcd answered with an error.
    fn cleanup(&self, permit: Front, create: Option<InFlightCreate>) -> Cleanup {
        Cleanup {
            client: self.client.clone(),
            batcher: Arc::new(Batcher::new(self.client.clone(), Handle::current())),
            runtime: Handle::current(),
            timeout: Duration::from_secs(1),
            key: self.key.clone(),
            state: KeyState::Unknown,
            session: Some(self.session.clone()),
            fixed_lease: None,
            moved_maybe: Vec::new(),
            permit: Some(permit),
            create,
        }
    }

    /// What a create etcd applies late does: our key, on our session lease.
    async fn put_key(&self) {
        let options = PutOptions::new().with_lease(self.session.lease_id());
        self.client
            .kv_client()
            .put(&*self.key, "", Some(options))
            .await
            .unwrap();
    }

    async fn exists(&self) -> bool {
        let options = GetOptions::new().with_count_only();
        let read = self.client.kv_client().get(&*self.key, Some(options)).await;
        read.unwrap().count() > 0
    }

    async fn gone_within(&self, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        while self.exists().await {
            if Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        true
    }
}

/// A create answered with an error after 300 ms (a timeout: etcd may still apply
/// it) and applied at 500 ms, after its clean-up deleted the key by name: the key
/// is deleted too. It used to stay on the session lease, first under the name, for
/// as long as the client lived.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_applied_after_its_error_leaves_no_key() {
    let setup = Setup::new("late").await;
    let create = tokio::spawn(async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        Err(())
    });
    setup.cleanup(setup.turn().unwrap(), Some(create)).spawn();
    tokio::time::sleep(Duration::from_millis(500)).await;
    setup.put_key().await;
    assert!(
        setup.gone_within(Duration::from_secs(3)).await,
        "the late create's key was left"
    );
}

/// The same when the caller had the error (no create running any more); and a key
/// found while one of this client's acquires of the name has the line's front is that
/// acquire's, left alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_key_is_left_to_an_acquire_that_has_the_name() {
    let setup = Setup::new("turn").await;
    setup.cleanup(setup.turn().unwrap(), None).spawn();
    // The clean-up deletes by name, then gives the turn back: an acquire takes it.
    let deadline = Instant::now() + Duration::from_secs(2);
    let turn = loop {
        if let Some(turn) = setup.turn() {
            break turn;
        }
        assert!(Instant::now() < deadline, "the turn was never given back");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    setup.put_key().await;
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    assert!(
        setup.exists().await,
        "the key of an acquire that had the turn was deleted"
    );
    drop(turn);
    assert!(
        setup.gone_within(Duration::from_secs(3)).await,
        "the late create's key was left"
    );
}

/// Two late creates of the key (two clean-ups of it, each with a create whose outcome
/// is unknown) landing at different times within the window: both keys are deleted.
/// The sweep used to stop after its first deletion, leaving the second key on the
/// session lease for as long as the client lived.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn late_creates_landing_one_after_another_leave_no_key() {
    let setup = Setup::new("twice").await;
    setup.cleanup(setup.turn().unwrap(), None).spawn();
    tokio::time::sleep(Duration::from_millis(400)).await;
    setup.put_key().await;
    assert!(
        setup.gone_within(Duration::from_secs(2)).await,
        "the first late create's key was left"
    );
    setup.put_key().await;
    assert!(
        setup.gone_within(Duration::from_secs(3)).await,
        "the second late create's key was left"
    );
}
