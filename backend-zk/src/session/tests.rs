use fencelock_core::Liveness;
use fencelock_testkit::ZkServer;

use super::*;
use crate::held::ZkGrant;
use crate::node::Node;

/// The deadline's margin covers clock rates (2 %) and late leader pings (50 ms): at
/// the minimum session timeout (two ticks, 1 s here) 70 ms, where it was 20 ms.
#[test]
fn the_deadline_margin_covers_late_pings_at_the_minimum_session_timeout() {
    let late_pings = Duration::from_millis(50);
    assert_eq!(
        DEADLINE_MARGIN.of(Duration::from_secs(1)),
        Duration::from_millis(70)
    );
    assert_eq!(
        DEADLINE_MARGIN.of(Duration::from_secs(2)),
        Duration::from_millis(90)
    );
    assert!(
        DEADLINE_MARGIN.of(Duration::from_secs(1)) > Duration::from_secs(1) / 50 + late_pings / 2
    );
    // The rule of every backend, and ZooKeeper's extra on top of it.
    assert_eq!(
        DEADLINE_MARGIN.of(Duration::from_secs(1)),
        CLOCK_DRIFT.of(Duration::from_secs(1)) + Duration::from_millis(10 + 48)
    );
}

/// A grant that registers after `close` gave up its session (it passed the
/// acquire's `closed` check just before) is given up too: its guard reports
/// [`LossCause::ClientClosed`], the session keeps no trace of it, and its node is
/// deleted, as for the grants `close` drained.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_registered_after_give_up_is_given_up_too() {
    let server = ZkServer::shared();
    let config = ZkConfig::new(server.connect_string());
    let transport = Transport::prepare(&config).unwrap();
    let session = ZkSession::connect(&config, &transport, config.session_timeout())
        .await
        .unwrap();
    let path = format!("/fencelock-late-grant-{:x}", std::process::id());
    let options = zk::CreateMode::Ephemeral.with_acls(session.acls());
    let (stat, _) = session.client.create(&path, b"", &options).await.unwrap();

    // `close` went through: nothing was registered yet.
    assert!(session.give_up().is_empty());

    // The late grant, as `acquire::grant` builds it.
    let liveness = Liveness::new(session.deadline(session.anchor()));
    let node = Node::new(session.clone(), path.clone(), stat.version);
    let held = ZkGrant::start("late".into(), node, liveness.clone(), None);

    assert_eq!(
        liveness.lost_cause(),
        Some(LossCause::ClientClosed),
        "a grant registered after give_up must be lost (reason: {:?})",
        liveness.lost_reason()
    );
    assert_eq!(liveness.lost_reason(), Some("the client was closed"));
    assert!(
        session.held.is_empty(),
        "a grant registered after give_up must not be kept"
    );
    let gone = async {
        while session.client.check_stat(&path).await.unwrap().is_some() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(5), gone)
        .await
        .expect("the node of a grant given up at registration is deleted");
    drop(held);
}

/// An acquire whose grant finds its session's deadline passed while the session lives on
/// (right after a cut that outlived the deadline: the anchor is the older of the last two
/// answered probes, from before the cut, until the second probe after it is answered)
/// waits for the session to be confirmed again, within its wait, and is granted. It
/// failed at once with "the lease ran out before the grant was confirmed", so a
/// semaphore asked again right after a cut failed (seen in `faults.rs`). One that does
/// not wait still fails at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_on_a_session_behind_its_deadline_waits_for_the_next_probes() {
    use fencelock_core::{Lease, Wait, WaitDeadline};

    use crate::acquire::{self, Ask};
    use crate::names::Recipe;

    let timeout = Duration::from_secs(4);
    let server = ZkServer::shared();
    let config = ZkConfig::new(server.connect_string()).with_session_timeout(timeout);
    let transport = Transport::prepare(&config).unwrap();
    let session = ZkSession::connect(&config, &transport, timeout)
        .await
        .unwrap();
    let name = format!("behind-{:016x}", fastrand::u64(..));
    let ask = |wait| Ask {
        recipe: Recipe::Lock,
        data: b"",
        lease: Lease::Renewing(timeout),
        no_wait: wait == Wait::NoWait,
        wait: WaitDeadline::new(wait),
    };
    // As after a cut: both answered probes older than the timeout.
    let behind = |session: &ZkSession| {
        let old = Instant::now() - timeout - Duration::from_secs(1);
        *session.confirmed.lock().unwrap() = (old, old);
        assert!(session.deadline(session.anchor()) <= Instant::now());
    };

    behind(&session);
    let refused = acquire::acquire(session.clone(), &name, ask(Wait::NoWait)).await;
    assert!(
        matches!(&refused, Err(Error::Unavailable { .. })),
        "a try that does not wait fails at once: {:?}",
        refused.map(|guard| guard.token())
    );

    behind(&session);
    let granted = acquire::acquire(
        session.clone(),
        &name,
        ask(Wait::Timeout(Duration::from_secs(10))),
    )
    .await
    .expect("granted once the session is confirmed again");
    assert!(
        granted.valid_until() > Instant::now(),
        "the guard's deadline is the confirmed one"
    );
    assert!(!granted.is_lost());
    granted.release().await.unwrap();
}
