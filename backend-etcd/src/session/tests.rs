//! A session's guards and its keepalive on the client's scheduler, on a real server.

use super::*;

/// A guard registered after its session was ended reports the cause the session
/// ended with: a lock granted while `close` ran is lost because the client was
/// closed, not because of some session failure (the conformance case
/// `acquires_racing_close_are_given_up` met this race on a loaded machine).
#[test]
fn a_guard_registered_after_the_end_reports_the_cause_it_ended_with() {
    let session = Session::new(7, Duration::from_secs(10), Instant::now());
    let before = session.liveness();
    session.register(before.clone());
    session.mark_lost(LossCause::ClientClosed, "the client was closed");
    let after = session.liveness();
    session.register(after.clone());
    for liveness in [before, after] {
        assert_eq!(liveness.lost_cause(), Some(LossCause::ClientClosed));
        assert_eq!(liveness.lost_reason(), Some("the client was closed"));
    }
    assert_eq!(session.registered(), 0);
}

/// Every session of a client is kept alive by the client's one renewal scheduler:
/// two sessions of different TTLs outlive several of their TTLs, each renewed a
/// third of its TTL after the last credited request; one that ends, and one that is
/// dropped, leave the scheduler, and its task then ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_are_kept_alive_by_the_clients_one_scheduler() {
    let server = fencelock_testkit::EtcdServer::shared();
    let client = Client::connect([server.endpoint()], None).await.unwrap();
    let runtime = Handle::current();
    let keepalives = Keepalives::new(client.clone(), runtime.clone());
    let (two, three) = (Duration::from_secs(2), Duration::from_secs(3));
    let short = Session::grant(&client, two, &runtime, Some(&keepalives))
        .await
        .unwrap();
    let long = Session::grant(&client, three, &runtime, Some(&keepalives))
        .await
        .unwrap();
    assert_eq!(keepalives.renewals.len(), 2);
    let guards = [short.liveness(), long.liveness()];
    tokio::time::sleep(Duration::from_secs(7)).await;
    for (session, guard) in [(&short, &guards[0]), (&long, &guards[1])] {
        assert!(!session.is_lost(), "{session:?}");
        assert!(!guard.is_lost());
        // Renewed within the last third of its TTL (and some slack for a busy
        // machine): the deadline is ahead by more than a third of the TTL.
        let ahead = session.valid_until() - Instant::now();
        assert!(ahead > session.ttl() / 3, "{ahead:?} ahead for {session:?}");
        let left = client
            .clone()
            .lease_client()
            .time_to_live(session.lease_id(), None)
            .await
            .unwrap()
            .ttl();
        assert!(left > 0, "etcd still has the lease");
    }
    short.mark_lost(LossCause::ClientClosed, "the test ended it");
    assert_eq!(keepalives.renewals.len(), 1);
    // Dropped: gone at once, or when a round in flight lets go of it.
    drop(long);
    let ended = Instant::now() + Duration::from_secs(5);
    while !keepalives.renewals.is_idle() && Instant::now() < ended {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(keepalives.renewals.is_empty());
    assert!(keepalives.renewals.is_idle(), "the task ended");
}
