//! Leader election: one leader at a time, tokens per term, observers, hand-over on
//! resignation and on loss. Backends without elections must refuse them with a typed
//! error, which these cases check instead.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use futures_util::future::join_all;

use super::support::{SLACK, short_lease, unique_name, until_waiters};
use crate::{AcquireOptions, DistributedLock, Error, FencedRegister, Leader, LeaderChanges};

/// Whether `lock` has elections; if not, checks that it says so with
/// [`Error::Unsupported`] on every election call.
async fn has_elections(lock: &dyn DistributedLock) -> bool {
    if lock.capabilities().election {
        return true;
    }
    let name = unique_name("no-election");
    assert!(matches!(
        lock.campaign(&name, "x", AcquireOptions::new()).await,
        Err(Error::Unsupported { .. })
    ));
    assert!(matches!(
        lock.leader(&name).await,
        Err(Error::Unsupported { .. })
    ));
    assert!(matches!(
        lock.observe(&name).await,
        Err(Error::Unsupported { .. })
    ));
    false
}

/// The next leader an observer reports, skipping "nobody leads" in between, within
/// `within`.
async fn next_leader(changes: &mut LeaderChanges, within: Duration) -> Leader {
    tokio::time::timeout(within, async {
        loop {
            match changes.next().await {
                Some(Ok(Some(leader))) => return leader,
                Some(Ok(None)) => {}
                Some(Err(error)) => panic!("observing failed: {error}"),
                None => panic!("the observation ended"),
            }
        }
    })
    .await
    .expect("the observer reports the next leader")
}

/// Eight candidates on two clients campaign for one election, five terms each: never two
/// leaders at once (checked by a counter of sitting leaders and by a fenced register that
/// accepts every leader's write), terms' tokens strictly increasing, and `leader()`
/// names the sitting leader's value and token.
///
/// # Errors
///
/// None: a violation of the contract panics with a message saying what went wrong.
///
/// # Cancel safety
///
/// Dropping it drops the case's terms and pending campaigns, which the backend cleans up
/// as its own cancellation safety promises.
pub async fn one_leader_at_a_time(a: &dyn DistributedLock, b: &dyn DistributedLock) {
    if !has_elections(a).await {
        return;
    }
    let election = unique_name("election-one-leader");
    let sitting = AtomicUsize::new(0);
    let register = FencedRegister::new(0u64);
    let tokens = std::sync::Mutex::new(Vec::new());
    let candidates = (0..8).map(|i| {
        let client = if i % 2 == 0 { a } else { b };
        let (election, sitting, register, tokens) = (&election, &sitting, &register, &tokens);
        async move {
            let value = format!("candidate-{i}");
            for _ in 0..5 {
                let term = client
                    .campaign(
                        election,
                        &value,
                        AcquireOptions::new().wait_timeout(Duration::from_secs(60)),
                    )
                    .await
                    .expect("campaign");
                assert_eq!(
                    sitting.fetch_add(1, Ordering::SeqCst),
                    0,
                    "two leaders at once"
                );
                let seen = client
                    .leader(election)
                    .await
                    .expect("leader")
                    .expect("a leader while one sits");
                assert_eq!(seen, Leader::new(value.clone(), term.token()));
                let count = register.read();
                register
                    .write(term.token(), count + 1)
                    .expect("a sitting leader's write is accepted");
                tokens.lock().unwrap().push(term.token());
                tokio::time::sleep(Duration::from_millis(5)).await;
                sitting.fetch_sub(1, Ordering::SeqCst);
                term.release().await.expect("resign");
            }
        }
    });
    join_all(candidates).await;
    assert_eq!(register.read(), 40);
    let tokens = tokens.into_inner().unwrap();
    assert!(
        tokens.windows(2).all(|w| w[0] < w[1]),
        "terms' tokens increase: {tokens:?}"
    );
    assert_eq!(a.leader(&election).await.expect("leader"), None);
}

/// An observer on the other client sees every leader in order with its value and
/// token (the first item is the state when it started), and "nobody leads" once the last
/// leader resigned; leadership passes to a waiting candidate when the leader resigns.
///
/// # Errors
///
/// None: a violation of the contract panics with a message saying what went wrong.
///
/// # Cancel safety
///
/// Dropping it drops the case's terms, campaigns and observers, which the backend cleans
/// up as its own cancellation safety promises.
pub async fn observers_see_every_leader_in_order(a: &dyn DistributedLock, b: &dyn DistributedLock) {
    if !has_elections(a).await {
        return;
    }
    let election = unique_name("election-observed");
    let within = Duration::from_secs(10);
    let mut changes = b.observe(&election).await.expect("observe");
    let first = tokio::time::timeout(within, changes.next())
        .await
        .expect("the first item comes at once")
        .expect("an item")
        .expect("observing");
    assert_eq!(first, None, "nobody leads a new election");

    let one = a
        .campaign(&election, "10.0.0.1:8080", AcquireOptions::new())
        .await
        .expect("campaign");
    let seen = next_leader(&mut changes, within).await;
    assert_eq!(seen, Leader::new("10.0.0.1:8080", one.token()));

    // A second candidate waits; the first resigns; the second leads.
    let waiting = b.campaign(
        &election,
        "10.0.0.2:8080",
        AcquireOptions::new().wait_timeout(Duration::from_secs(30)),
    );
    let resign = async {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let token = one.token();
        one.release().await.expect("resign");
        token
    };
    let (two, first_token) = tokio::join!(waiting, resign);
    let two = two.expect("the waiting candidate is elected");
    assert!(two.token() > first_token);
    let seen = next_leader(&mut changes, within).await;
    assert_eq!(seen, Leader::new("10.0.0.2:8080", two.token()));

    two.release().await.expect("resign");
    let nobody = tokio::time::timeout(within, changes.next())
        .await
        .expect("the observer learns that nobody leads");
    assert!(
        matches!(nobody, Some(Ok(None))),
        "nobody leads after the last resignation: {nobody:?}"
    );
}

/// A leader whose fixed lease runs out (a paused or cut-off process) is deposed: it is
/// told, a waiting candidate on the other client is elected with a larger token, an
/// observer sees the new leader, and the old term's token is refused by a fenced
/// register that saw the new one.
///
/// # Errors
///
/// None: a violation of the contract panics with a message saying what went wrong.
///
/// # Cancel safety
///
/// Dropping it drops the case's terms, campaigns and observers, which the backend cleans
/// up as its own cancellation safety promises.
pub async fn leadership_passes_when_the_leader_is_lost(
    a: &dyn DistributedLock,
    b: &dyn DistributedLock,
) {
    if !has_elections(a).await {
        return;
    }
    let election = unique_name("election-lost");
    let lease = short_lease(a);
    let old = a
        .campaign(&election, "old", AcquireOptions::new().fixed_lease(lease))
        .await
        .expect("campaign");
    let mut changes = b.observe(&election).await.expect("observe");
    let seen = next_leader(&mut changes, Duration::from_secs(10)).await;
    assert_eq!(seen.token, old.token());
    let register = FencedRegister::new("");
    register.write(old.token(), "old").expect("write");

    let new = b
        .campaign(
            &election,
            "new",
            AcquireOptions::new().wait_timeout(lease * 4 + Duration::from_secs(10)),
        )
        .await
        .expect("elected once the old leader's lease ran out");
    assert!(new.token() > old.token());
    tokio::time::timeout(SLACK * 4, old.lost())
        .await
        .expect("the deposed leader is told");
    let seen = next_leader(&mut changes, Duration::from_secs(10)).await;
    assert_eq!(seen, Leader::new("new", new.token()));
    register.write(new.token(), "new").expect("write");
    assert!(
        register.write(old.token(), "stale").is_err(),
        "the deposed leader's write is refused"
    );
    new.release().await.expect("resign");
}

/// Bad election names are refused before any I/O, a campaign that cannot wait is
/// refused with `Contended` while someone leads, and a cancelled campaign leaves nothing
/// that would block the next one.
///
/// # Errors
///
/// None: a violation of the contract panics with a message saying what went wrong.
///
/// # Cancel safety
///
/// Dropping it drops the case's terms and campaigns, which the backend cleans up as its
/// own cancellation safety promises.
pub async fn campaigns_are_checked_and_cancellable(
    a: &dyn DistributedLock,
    b: &dyn DistributedLock,
) {
    if !has_elections(a).await {
        return;
    }
    for bad in ["", "bad\0name"] {
        assert!(matches!(
            a.campaign(bad, "v", AcquireOptions::new()).await,
            Err(Error::InvalidName { .. })
        ));
        assert!(matches!(
            a.leader(bad).await,
            Err(Error::InvalidName { .. })
        ));
        assert!(matches!(
            a.observe(bad).await,
            Err(Error::InvalidName { .. })
        ));
    }
    let election = unique_name("election-cancel");
    // The longest value is the same on every backend; one byte more is refused before
    // any I/O, with nothing left behind.
    let longest = "v".repeat(crate::MAX_LEADER_VALUE);
    let term = a
        .campaign(&election, &longest, AcquireOptions::new().no_wait())
        .await
        .expect("a campaign with the longest value");
    assert_eq!(
        b.leader(&election)
            .await
            .expect("leader")
            .map(|l| l.value.len()),
        Some(crate::MAX_LEADER_VALUE)
    );
    term.release().await.expect("resign");
    let too_long = longest + "v";
    assert!(matches!(
        a.campaign(&election, &too_long, AcquireOptions::new().no_wait())
            .await,
        Err(Error::InvalidConfig(_))
    ));
    assert_eq!(b.leader(&election).await.expect("leader"), None);
    let leader = a
        .campaign(&election, "first", AcquireOptions::new())
        .await
        .expect("campaign");
    // On the other client, so that the refusal and the queued campaign reach the server
    // (a client may refuse its own second campaign locally).
    assert!(matches!(
        b.campaign(&election, "second", AcquireOptions::new().no_wait())
            .await,
        Err(Error::Contended { .. })
    ));
    // A campaign dropped while it waits, after it had time to queue on the server.
    let waiting = b.campaign(&election, "dropped", AcquireOptions::new());
    let granted = tokio::time::timeout(Duration::from_millis(300), waiting).await;
    assert!(
        granted.is_err(),
        "a second campaign won while a leader sat: {granted:?}"
    );
    // Its clean-up runs in the background on remote backends: wait for it, as the
    // cancellation cases do, so that what follows checks what the clean-up left behind,
    // not whether it beat the resign's round trip from the other client (on etcd it
    // once did not, in a full test run: the dropped campaign's key still led for a
    // moment after the resign).
    until_waiters(b, &election, 0).await;
    leader.release().await.expect("resign");
    // Nothing of the dropped campaign leads once the leader resigned.
    let watched = tokio::time::Instant::now();
    while watched.elapsed() < Duration::from_millis(300) {
        let now = a.leader(&election).await.expect("leader");
        assert!(
            now.as_ref().is_none_or(|l| l.value != "dropped"),
            "a dropped campaign was elected: {now:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let next = a
        .campaign(
            &election,
            "third",
            AcquireOptions::new().wait_timeout(Duration::from_secs(5)),
        )
        .await
        .expect("the dropped campaign does not block the next one");
    assert_eq!(
        b.leader(&election).await.expect("leader"),
        Some(Leader::new("third", next.token()))
    );
    next.release().await.expect("resign");
}

/// How long a close and its effect on observers may take.
const CLOSE_WITHIN: Duration = Duration::from_secs(5);

/// Closing a client ends its observations: the last item is [`Error::Closed`], then the
/// stream ends, while another client's observation goes on.
///
/// # Errors
///
/// None: a violation of the contract panics with a message saying what went wrong.
///
/// # Cancel safety
///
/// Dropping it drops the case's term and observations.
pub async fn observations_end_when_the_client_closes(
    a: &dyn DistributedLock,
    b: &dyn DistributedLock,
) {
    if !has_elections(a).await {
        return;
    }
    let election = unique_name("election-close");
    let term = b
        .campaign(&election, "sitting", AcquireOptions::new())
        .await
        .expect("campaign");
    let mut closing = a.observe(&election).await.expect("observe");
    let mut staying = b.observe(&election).await.expect("observe");
    assert_eq!(
        next_leader(&mut closing, CLOSE_WITHIN).await.value,
        "sitting"
    );
    assert_eq!(
        next_leader(&mut staying, CLOSE_WITHIN).await.value,
        "sitting"
    );
    a.close().await.expect("close");
    let last = tokio::time::timeout(CLOSE_WITHIN, async {
        loop {
            match closing.next().await {
                Some(Ok(_)) => {}
                other => return other,
            }
        }
    })
    .await
    .expect("the closed client's observation ends");
    assert!(
        matches!(last, Some(Err(Error::Closed { .. }))),
        "the last item of a closed client's observation: {last:?}"
    );
    let after = tokio::time::timeout(CLOSE_WITHIN, closing.next())
        .await
        .expect("nothing comes after Closed");
    assert!(after.is_none(), "an item after Closed: {after:?}");
    term.release().await.expect("resign");
    assert_eq!(
        tokio::time::timeout(CLOSE_WITHIN, staying.next())
            .await
            .expect("the other client's observation goes on")
            .expect("not ended")
            .expect("no error"),
        None
    );
}

/// How many candidates campaign on each client in [`observers_report_each_grant_once`].
const CANDIDATES_PER_CLIENT: usize = 2;

/// How many terms each candidate of [`observers_report_each_grant_once`] serves: enough
/// terms, with candidates racing for each, that an observer reading while a grant is
/// being made (a Redlock grant whose instances answered different tokens, say) is caught.
const TERMS_PER_CANDIDATE: usize = 10;

/// Candidates on several clients (`campaigners`, separate connections or sessions)
/// campaign for one election many times, each term short, while `observer` (another
/// client) observes it. Every leader the observer reports is a grant a candidate was
/// actually given, with that term's own value and token (never a token the leader did not
/// have), each term at most once, in the order of the terms: the reported tokens strictly
/// increase. An observer may skip a term (one that begins and ends between two of its
/// reads); it may not report one with another token, or twice. A last term, held until it
/// is reported, shows the observer is still following.
///
/// # Errors
///
/// None: a violation of the contract panics with a message saying what went wrong.
///
/// # Cancel safety
///
/// Dropping it drops the case's terms, campaigns and observation, which the backend cleans
/// up as its own cancellation safety promises.
pub async fn observers_report_each_grant_once(
    campaigners: &[&dyn DistributedLock],
    observer: &dyn DistributedLock,
) {
    if !has_elections(observer).await {
        return;
    }
    let election = unique_name("election-each-grant-once");
    let within = Duration::from_secs(10);
    let mut changes = observer.observe(&election).await.expect("observe");
    let first = tokio::time::timeout(within, changes.next())
        .await
        .expect("the first item comes at once")
        .expect("an item")
        .expect("observing");
    assert_eq!(first, None, "nobody leads a new election");

    let sitting = AtomicUsize::new(0);
    let register = FencedRegister::new(0u64);
    // Every grant: (token, value), in the order the terms were served.
    let grants = std::sync::Mutex::new(Vec::new());
    let candidates = campaigners
        .iter()
        .enumerate()
        .flat_map(|(c, &client)| (0..CANDIDATES_PER_CLIENT).map(move |k| (c, k, client)));
    let candidates = candidates.map(|(c, k, client)| {
        let (election, sitting, register, grants) = (&election, &sitting, &register, &grants);
        async move {
            for n in 0..TERMS_PER_CANDIDATE {
                let value = format!("client{c}-candidate{k}-term{n}");
                let term = client
                    .campaign(
                        election,
                        &value,
                        AcquireOptions::new().wait_timeout(Duration::from_secs(60)),
                    )
                    .await
                    .expect("campaign");
                assert_eq!(
                    sitting.fetch_add(1, Ordering::SeqCst),
                    0,
                    "two leaders at once"
                );
                let count = register.read();
                register
                    .write(term.token(), count + 1)
                    .expect("a sitting leader's write is accepted");
                grants.lock().unwrap().push((term.token(), value));
                tokio::time::sleep(Duration::from_millis(2)).await;
                sitting.fetch_sub(1, Ordering::SeqCst);
                term.release().await.expect("resign");
            }
        }
    });
    join_all(candidates).await;

    // The last term is held until the observer reports it.
    let last = campaigners[0]
        .campaign(&election, "last", AcquireOptions::new())
        .await
        .expect("campaign");
    let mut grants = grants.into_inner().unwrap();
    grants.push((last.token(), "last".to_owned()));
    let mut observed = Vec::new();
    tokio::time::timeout(within, async {
        loop {
            match changes.next().await {
                Some(Ok(Some(leader))) => {
                    let done = leader.value == "last";
                    observed.push((leader.token, leader.value));
                    if done {
                        return;
                    }
                }
                Some(Ok(None)) => {}
                Some(Err(error)) => panic!("observing failed: {error}"),
                None => panic!("the observation ended"),
            }
        }
    })
    .await
    .unwrap_or_else(|_| {
        panic!(
            "the observer did not report the last term ({}) within {within:?}; it reported {observed:?}",
            last.token()
        )
    });
    last.release().await.expect("resign");

    assert_eq!(register.read() as usize, grants.len() - 1);
    assert!(
        grants.windows(2).all(|w| w[0].0 < w[1].0),
        "terms' tokens increase: {grants:?}"
    );
    let granted: std::collections::HashMap<_, _> = grants.iter().cloned().collect();
    for (token, value) in &observed {
        let leader_had = grants.iter().find(|(_, v)| v == value).map(|(t, _)| *t);
        assert!(
            granted.get(token) == Some(value),
            "the observer reported ({token}, {value:?}), which no candidate was granted \
             ({value:?} had token {leader_had:?}); {} reports for {} terms: {observed:?}",
            observed.len(),
            grants.len(),
        );
    }
    for pair in observed.windows(2) {
        assert!(
            pair[0].0 < pair[1].0,
            "the observer reported {:?} after {:?}: a term twice or out of order; {} \
             reports for {} terms: {observed:?}",
            pair[1],
            pair[0],
            observed.len(),
            grants.len(),
        );
    }
}
