//! fencelock and Apache Curator's `InterProcessMutex` (Debian's `libcurator-recipes-java`,
//! compiled here with `javac`) contend for the same lock path on a real ZooKeeper; a
//! register in ZooKeeper, written with a version check under the lock, shows no overlap,
//! no lost update and tokens (czxids) that only grow across both implementations.

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use fencelock_core::{DistributedLock, DistributedLockExt};
use fencelock_testkit::ZkServer;
use fencelock_zk::zookeeper_client as zk;
use fencelock_zk::{ZkConfig, ZkLock};

const JAVA_ROUNDS: usize = 40;
const RUST_TASKS: usize = 2;

mod curator;

fn parse_register(data: &[u8]) -> (u64, u64) {
    let text = std::str::from_utf8(data).expect("utf-8 register");
    let (max, count) = text.split_once(':').expect("max:count");
    (max.parse().unwrap(), count.parse().unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curator_and_fencelock_exclude_each_other() {
    let server = ZkServer::shared();
    let run = format!("{:016x}", fastrand::u64(..));
    let root = format!("/interop-{run}");
    let register = format!("/interop-{run}-register");
    let config = ZkConfig::new(server.connect_string())
        .with_chroot(&root)
        .unwrap()
        .with_session_timeout(Duration::from_secs(10));
    let locks = ZkLock::connect(config).await.expect("connect");
    let client = locks.client().await.unwrap();
    client
        .create(
            &register,
            b"0:0",
            &zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all()),
        )
        .await
        .expect("create the register");

    let classes = tempfile::tempdir().unwrap();
    let classpath = curator::compile(classes.path(), "CuratorContender");
    let java = Command::new("java")
        .args(["-Xmx128m", "-XX:TieredStopAtLevel=1", "-cp", &classpath])
        .arg("CuratorContender")
        .args([
            &server.connect_string(),
            &format!("{root}/job"),
            &register,
            &JAVA_ROUNDS.to_string(),
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("java");
    let java = tokio::task::spawn_blocking(move || java.wait_with_output());
    let java_done = Arc::new(AtomicBool::new(false));

    let contender = |_: usize| {
        let (locks, client, register, java_done) = (
            locks.clone(),
            client.clone(),
            register.clone(),
            java_done.clone(),
        );
        async move {
            let mut tokens = Vec::new();
            while !java_done.load(Ordering::SeqCst) || tokens.len() < 10 {
                let guard = locks.lock("job").await.expect("acquire");
                let fence = locks.fence(&guard).await.expect("fence");
                let (data, stat) = client.get_data(&register).await.unwrap();
                let (max, count) = parse_register(&data);
                let token = guard.token().get();
                assert!(token >= max, "stale token {token} < {max}");
                tokio::time::sleep(Duration::from_millis(2)).await;
                fence
                    .set_data(
                        &register,
                        format!("{token}:{}", count + 1).as_bytes(),
                        Some(stat.version),
                    )
                    .await
                    .expect("overlap: the register changed under the lock");
                tokens.push(token);
                guard.release().await.expect("release");
                if tokens.len() > 2_000 {
                    panic!("the Java contender never finished");
                }
            }
            tokens
        }
    };
    let rust = futures_util::future::join_all((0..RUST_TASKS).map(contender));
    let watch_java = async {
        let output = java.await.unwrap().expect("java ran");
        java_done.store(true, Ordering::SeqCst);
        output
    };
    let (rust_tokens, output) = tokio::join!(rust, watch_java);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "Curator contender failed: {}\n{stdout}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    let java_tokens: Vec<u64> = stdout
        .lines()
        .filter_map(|l| l.strip_prefix("OK "))
        .map(|t| t.parse().unwrap())
        .collect();
    assert_eq!(java_tokens.len(), JAVA_ROUNDS, "{stdout}");

    let rust_total: usize = rust_tokens.iter().map(Vec::len).sum();
    let (_, count) = parse_register(&client.get_data(&register).await.unwrap().0);
    assert_eq!(count as usize, rust_total + JAVA_ROUNDS, "lost updates");

    // The two implementations really interleaved: some Curator grant lies between
    // fencelock grants.
    let all_rust: Vec<u64> = rust_tokens.into_iter().flatten().collect();
    let (lo, hi) = (
        all_rust.iter().min().unwrap(),
        all_rust.iter().max().unwrap(),
    );
    assert!(
        java_tokens.iter().any(|t| lo < t && t < hi),
        "no interleaving: rust {lo}..{hi}, java {java_tokens:?}"
    );
    let info = locks.inspect("job").await.unwrap();
    assert!(!info.is_held(), "{info:?}");
}
