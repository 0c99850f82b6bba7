//! No input panics (property tests with `proptest`): arbitrary and nearly valid URLs,
//! config files, durations, names, leases, waits and permit counts give a value or a
//! typed error, never a panic; a URL that parses prints as one that parses back to the
//! same `Config`; and whatever was asked of the in-memory backend, nothing is left once
//! every guard is released.
//!
//! The in-memory backend runs on a paused tokio clock, so waits of years end at once and
//! extreme instants are reached without waiting for them. Failing cases are not
//! persisted to files (`failure_persistence: None`): the shrunk case is in the failure
//! message. A panic in any thread (a task the backend spawned included) fails the case.

use std::sync::Once;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use fencelock::{
    AcquireOptions, Config, DistributedLock, Error, FOREVER, MAX_LEASE, MigrationPhase, Permits,
    migration_url,
};
use proptest::prelude::*;
use proptest::test_runner::Config as ProptestConfig;

/// Panics anywhere in the process, counted by a hook (installed once, chaining the
/// default one): a panic inside a task the backend spawned (a renewal, a relay) is
/// swallowed by Tokio and would not fail the case otherwise.
fn panics() -> usize {
    static COUNT: AtomicUsize = AtomicUsize::new(0);
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            COUNT.fetch_add(1, Ordering::SeqCst);
            default(info);
        }));
    });
    COUNT.load(Ordering::SeqCst)
}

fn config(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

/// The URL schemes of one backend, and the query options its parser reads.
const BACKENDS: &[(&[&str], &[&str])] = &[
    (&["mem", "MEM"], &[]),
    (
        &["etcd", "etcds", "Etcd"],
        &[
            "lease",
            "connect_timeout",
            "cleanup_timeout",
            "ca",
            "cert",
            "key",
            "domain",
        ],
    ),
    (
        &["zk", "zks", "zookeeper"],
        &[
            "session_timeout",
            "min_lease",
            "connect_timeout",
            "sasl",
            "ca",
            "cert",
            "key",
            "acl",
        ],
    ),
    (
        &[
            "redis",
            "rediss",
            "redis+sentinel",
            "rediss+sentinel",
            "redis+cluster",
            "rediss+cluster",
            "redlock",
            "redlocks",
        ],
        &[
            "prefix",
            "layout",
            "wait_replicas",
            "wait_timeout",
            "timeout",
            "connect_timeout",
            "token_ttl",
            "poll_min",
            "poll_max",
            "sentinel_username",
            "sentinel_password",
            "ca",
            "cert",
            "key",
            "domain",
            "db",
        ],
    ),
    (&["http", "", "redis+", "+"], &["unknown", "", "Lease"]),
];

/// The facade's own query options, read for every scheme.
const FACADE_KEYS: &[&str] = &[
    "require",
    "retry",
    "retry_min_delay",
    "retry_max_delay",
    "metrics",
    "metrics_names",
    "max_waiters",
];

/// A host: mostly valid, sometimes not.
fn host() -> impl Strategy<Value = String> {
    prop_oneof![
        8 => prop::sample::select(vec![
            "127.0.0.1", "localhost", "[::1]", "10.0.0.7", "db-1.example", "a.b.c",
        ])
        .prop_map(str::to_owned),
        1 => prop::sample::select(vec![
            "::1", "[::1", "", "x y", "%41", "999.1.1.1", "[fe80::1%25lo]", "é.example", "@", ":",
        ])
        .prop_map(str::to_owned),
        1 => "[a-z0-9.:%\\[\\]-]{0,12}",
    ]
}

/// A port: mostly valid, sometimes not.
fn port() -> impl Strategy<Value = String> {
    prop_oneof![
        2 => Just(String::new()),
        6 => any::<u16>().prop_map(|p| format!(":{p}")),
        1 => prop::sample::select(vec![
            ":", ":0", ":65535", ":65536", ":-1", ":99999999999999999999", ":2379x", "::",
        ])
        .prop_map(str::to_owned),
    ]
}

/// A duration as text, in every unit, at and beyond `Duration::MAX`.
fn duration_text() -> impl Strategy<Value = String> {
    prop_oneof![
        prop::sample::select(vec![
            "0",
            "0s",
            "0ns",
            "1ns",
            "1us",
            "1ms",
            "1s",
            "2s",
            "4s",
            "30s",
            "1m",
            "1h",
            "365d",
            "584942417355y",
            "584942417356y",
            "18446744073709551615s",
            "18446744073709551615ns",
            "18446744073709551616ms",
            "1y 1y",
            "10 years",
            "-5s",
            "5",
            "s",
            "1e400s",
            "NaN",
            "1.5s",
            "500ms",
        ])
        .prop_map(str::to_owned),
        "[0-9]{1,24}(ns|us|ms|s|m|h|d|w|y)",
    ]
}

/// An integer as text, at and beyond every integer limit.
fn integer_text() -> impl Strategy<Value = String> {
    prop_oneof![
        prop::sample::select(vec![
            "0",
            "1",
            "2",
            "3",
            "15",
            "16",
            "-1",
            "4294967295",
            "4294967296",
            "9223372036854775807",
            "9223372036854775808",
            "18446744073709551615",
            "18446744073709551616",
            "1e3",
            "",
            "+1",
            "01",
        ])
        .prop_map(str::to_owned),
        any::<u64>().prop_map(|n| n.to_string()),
    ]
}

/// A value for query option `key`: mostly of the kind it takes, sometimes anything.
fn value_for(key: &str) -> BoxedStrategy<String> {
    let typed: BoxedStrategy<String> = match key {
        "lease" | "connect_timeout" | "cleanup_timeout" | "session_timeout" | "min_lease"
        | "wait_timeout" | "timeout" | "token_ttl" | "poll_min" | "poll_max"
        | "retry_min_delay" | "retry_max_delay" | "second_leg_wait" => duration_text().boxed(),
        "retry" | "max_waiters" | "db" | "wait_replicas" | "epoch" | "legacy_epoch" => {
            integer_text().boxed()
        }
        "metrics" | "metrics_names" => prop::sample::select(vec!["true", "false", "1", "yes"])
            .prop_map(str::to_owned)
            .boxed(),
        "require" => prop::sample::select(vec![
            "linearizable",
            "fencing=strong",
            "election,semaphore,rw-lock",
            "fifo",
            "nope",
            "linearizable,linearizable",
        ])
        .prop_map(str::to_owned)
        .boxed(),
        "layout" => prop::sample::select(vec!["raw", "tagged", "x"])
            .prop_map(str::to_owned)
            .boxed(),
        "acl" => prop::sample::select(vec!["open", "creator", "x"])
            .prop_map(str::to_owned)
            .boxed(),
        "ca" | "cert" | "key" => prop::sample::select(vec!["/tmp/none.pem", "", "%00"])
            .prop_map(str::to_owned)
            .boxed(),
        _ => "[a-zA-Z0-9:/%._-]{0,10}".boxed(),
    };
    prop_oneof![
        8 => typed,
        1 => "\\PC{0,10}",
        1 => prop::sample::select(vec!["%", "%FF", "%00", "a%26b%3Dc", "&", "="]).prop_map(str::to_owned),
    ]
    .boxed()
}

/// `key=value` pairs from `keys` (and the facade's), each value fitting its key.
fn query(keys: &'static [&'static str]) -> impl Strategy<Value = String> {
    let all: Vec<&'static str> = keys.iter().chain(FACADE_KEYS).copied().collect();
    let n = all.len().min(4);
    prop::sample::subsequence(all, 0..=n)
        .prop_flat_map(|keys| {
            keys.into_iter()
                .map(|k| value_for(k).prop_map(move |v| format!("{k}={v}")))
                .collect::<Vec<_>>()
        })
        .prop_map(|pairs| {
            if pairs.is_empty() {
                String::new()
            } else {
                format!("?{}", pairs.join("&"))
            }
        })
}

/// A URL of one backend: its scheme, user information, one to four hosts, a path and
/// options it reads, each part mostly valid.
fn url() -> impl Strategy<Value = String> {
    (0..BACKENDS.len()).prop_flat_map(|backend| {
        let (schemes, keys) = BACKENDS[backend];
        let userinfo = prop_oneof![
            4 => Just(String::new()),
            1 => Just("app@".to_owned()),
            1 => Just("app:s3cret@".to_owned()),
            1 => Just(":@".to_owned()),
            1 => "[a-z%:]{0,6}@",
        ];
        let hosts = prop::collection::vec((host(), port()), 1..4).prop_map(|hosts| {
            hosts
                .into_iter()
                .map(|(h, p)| format!("{h}{p}"))
                .collect::<Vec<_>>()
                .join(",")
        });
        let path = prop_oneof![
            Just(String::new()),
            Just("/".to_owned()),
            Just("/locks".to_owned()),
            Just("/0".to_owned()),
            Just("/16".to_owned()),
            Just("/a//b".to_owned()),
            "/[a-z0-9%/.]{0,10}",
        ];
        (
            prop::sample::select(schemes.to_vec()),
            userinfo,
            hosts,
            path,
            query(keys),
        )
            .prop_map(|(s, u, h, p, q)| format!("{s}://{u}{h}{p}{q}"))
    })
}

/// A migration URL whose legs are built from the parts above.
fn migration() -> impl Strategy<Value = String> {
    const KEYS: &[&str] = &[
        "epoch",
        "legacy_epoch",
        "second_leg_wait",
        "phase",
        "legacy",
    ];
    let leg = || {
        prop_oneof![
            3 => prop::sample::select(vec![
                "mem://",
                "redis://127.0.0.1:6379?layout=raw&prefix=lock:",
                "redis://10.0.0.5:6379/2",
                "rediss://app:s3cret@10.0.0.5:6380",
                "redlock://a:1,b:2,c:3",
                "redis+sentinel://s1:26379,s2:26379/mymaster",
                "redis+cluster://c1:7000,c2:7001",
                "etcd://127.0.0.1:2379/locks",
                "etcd://a:1,b:2/p?lease=10s",
                "zk://127.0.0.1:2181/locks?session_timeout=10s",
                "zookeeper://z1,z2,z3/app",
            ])
            .prop_map(str::to_owned),
            1 => url(),
        ]
    };
    (0..4usize, leg(), leg(), query(KEYS)).prop_map(|(phase, legacy, target, query)| {
        let url = migration_url(MigrationPhase::ALL[phase], &legacy, &target);
        match query.strip_prefix('?') {
            Some(more) => format!("{url}&{more}"),
            None => url,
        }
    })
}

/// Parses `url`; a URL that parses prints (`Display`) as one that parses to an equal
/// `Config`, unless printing replaced a secret (or a part it could not read) by `***`.
fn parses_or_refuses(url: &str) -> Result<(), TestCaseError> {
    let Ok(parsed) = Config::from_url(url) else {
        return Ok(());
    };
    let printed = parsed.to_string();
    prop_assert!(
        !printed.contains("s3cret"),
        "a password is printed: {printed}"
    );
    // `***` in the URL, or percent-encoded inside a `migrate://` leg.
    if !printed.contains("***") && !printed.contains("%2A%2A%2A") {
        let again = Config::from_url(&printed);
        prop_assert!(
            again.as_ref().is_ok_and(|again| *again == parsed),
            "{url} printed as {printed}, which parses to {again:?}, not {parsed:?}"
        );
    }
    Ok(())
}

proptest! {
    #![proptest_config(config(2000))]

    #[test]
    fn any_text_is_a_config_or_an_error(text in "\\PC{0,60}") {
        parses_or_refuses(&text)?;
        let _ = Config::from_toml_str(&text);
        let _ = fencelock::redact_url(&text);
    }

    #[test]
    fn nearly_valid_urls_parse_or_are_refused(url in url()) {
        parses_or_refuses(&url)?;
    }

    #[test]
    fn nearly_valid_migration_urls_parse_or_are_refused(url in migration()) {
        parses_or_refuses(&url)?;
    }

    #[test]
    fn nearly_valid_config_files_parse_or_are_refused(text in config_file()) {
        if let Ok(parsed) = Config::from_toml_str(&text) {
            parses_or_refuses(&parsed.to_string())?;
            let printed = parsed.to_string();
            if !printed.contains("***") && !printed.contains("%2A%2A%2A") {
                let again = Config::from_url(&printed);
                prop_assert!(
                    again.as_ref().is_ok_and(|again| *again == parsed),
                    "{text} printed as {printed}, which parses to {again:?}"
                );
            }
        }
    }
}

/// A TOML value for `key`: what [`value_for`] gives, as a boolean or an integer when it
/// reads as one, else as a TOML string.
fn toml_value_for(key: &'static str) -> impl Strategy<Value = String> {
    value_for(key).prop_map(|v| match (v.as_str(), v.parse::<i64>()) {
        ("true" | "false", _) => v,
        (_, Ok(n)) if !v.starts_with('+') && !v.starts_with('0') => n.to_string(),
        _ => toml_string(&v),
    })
}

/// `text` as a TOML basic string.
fn toml_string(text: &str) -> String {
    let mut quoted = String::from('"');
    for c in text.chars() {
        match c {
            '"' => quoted.push_str("\\\""),
            '\\' => quoted.push_str("\\\\"),
            c if c.is_control() => quoted.push_str(&format!("\\u{:04X}", u32::from(c))),
            c => quoted.push(c),
        }
    }
    quoted.push('"');
    quoted
}

/// A config file: a backend, endpoints, the facade's settings and the backend's own
/// options in `[options]`, each mostly valid.
fn config_file() -> impl Strategy<Value = String> {
    (0..BACKENDS.len() - 1).prop_flat_map(|backend| {
        let (schemes, keys) = BACKENDS[backend];
        let name = prop::sample::select(schemes.to_vec());
        let endpoints = prop::collection::vec((host(), port()), 0..4);
        let facade = prop::sample::subsequence(
            vec![
                "lease",
                "max_waiters",
                "retry",
                "metrics",
                "db",
                "prefix",
                "service",
            ],
            0..4,
        )
        .prop_flat_map(|keys| {
            keys.into_iter()
                .map(|k| toml_value_for(k).prop_map(move |v| format!("{k} = {v}\n")))
                .collect::<Vec<_>>()
        });
        // mem:// reads no option of its own: any it is given is refused.
        let keys = if keys.is_empty() {
            vec!["unknown"]
        } else {
            keys.to_vec()
        };
        let n = keys.len().min(3);
        let options = prop::sample::subsequence(keys, 0..=n).prop_flat_map(|keys| {
            keys.into_iter()
                .map(|k| toml_value_for(k).prop_map(move |v| format!("{k} = {v}\n")))
                .collect::<Vec<_>>()
        });
        let require = prop::sample::subsequence(
            vec!["linearizable", "fencing=strong", "election", "x"],
            0..2,
        );
        (name, endpoints, facade, options, require).prop_map(
            |(name, endpoints, facade, options, require)| {
                let endpoints: Vec<String> = endpoints
                    .into_iter()
                    .map(|(h, p)| toml_string(&format!("{h}{p}")))
                    .collect();
                let mut text = format!("backend = {}\n", toml_string(name));
                if !endpoints.is_empty() {
                    text.push_str(&format!("endpoints = [{}]\n", endpoints.join(", ")));
                }
                if !require.is_empty() {
                    text.push_str(&format!("require = {require:?}\n"));
                }
                text.push_str(&facade.concat());
                if !options.is_empty() {
                    text.push_str("[options]\n");
                    text.push_str(&options.concat());
                }
                text
            },
        )
    })
}

/// A duration anywhere from zero to `Duration::MAX`, weighted towards the limits the
/// library checks against.
fn duration() -> impl Strategy<Value = Duration> {
    prop_oneof![
        prop::sample::select(vec![
            Duration::ZERO,
            Duration::from_nanos(1),
            Duration::from_millis(1),
            Duration::from_secs(1),
            Duration::from_secs(30),
            MAX_LEASE,
            MAX_LEASE + Duration::from_nanos(1),
            FOREVER,
            FOREVER - Duration::from_nanos(1),
            Duration::from_secs(u64::MAX / 2),
            Duration::MAX,
        ]),
        any::<u64>().prop_map(Duration::from_nanos),
        any::<u64>().prop_map(Duration::from_millis),
        any::<u64>().prop_map(Duration::from_secs),
        (any::<u64>(), 0..1_000_000_000u32).prop_map(|(s, n)| Duration::new(s, n)),
    ]
}

/// A lease or wait: mostly an ordinary one, else anything from [`duration`].
fn usual_duration() -> impl Strategy<Value = Duration> {
    prop_oneof![
        3 => (1u64..3_600_000).prop_map(Duration::from_millis),
        1 => duration(),
    ]
}

/// Acquire options from every lease kind and wait kind.
fn options() -> impl Strategy<Value = AcquireOptions> {
    (0..4usize, usual_duration(), 0..4usize, usual_duration()).prop_map(|(lease, l, wait, w)| {
        let options = match lease {
            0 => AcquireOptions::new(),
            1 => AcquireOptions::new().lease(l),
            _ => AcquireOptions::new().fixed_lease(l),
        };
        match wait {
            0 => options.no_wait(),
            1 => options.wait_forever(),
            _ => options.wait_timeout(w),
        }
    })
}

/// A lock name, valid or not.
fn name() -> impl Strategy<Value = String> {
    prop_oneof![
        prop::sample::select(vec![
            "a", "a/b", "", "..", "{tag}", "*?[", "é", "a\0b", "a\nb"
        ])
        .prop_map(str::to_owned),
        "\\PC{1,8}",
        Just("x".repeat(fencelock::MAX_NAME_LEN)),
        Just("x".repeat(fencelock::MAX_NAME_LEN + 1)),
    ]
}

/// One call on the in-memory backend.
#[derive(Debug, Clone)]
enum Call {
    Acquire(usize, AcquireOptions),
    Permits(usize, u32, u32, AcquireOptions),
    Read(usize, AcquireOptions),
    Write(usize, AcquireOptions),
    Extend(usize, Duration),
    Release(usize),
    Sleep(Duration),
    Inspect(usize),
}

fn call() -> impl Strategy<Value = Call> {
    let permits = prop_oneof![Just(0u32), Just(1), Just(2), Just(u32::MAX), any::<u32>()];
    let limit = prop_oneof![Just(0u32), Just(1), Just(3), Just(u32::MAX), any::<u32>()];
    prop_oneof![
        (0..3usize, options()).prop_map(|(n, o)| Call::Acquire(n, o)),
        (0..3usize, permits, limit, options()).prop_map(|(n, p, l, o)| Call::Permits(n, p, l, o)),
        (0..3usize, options()).prop_map(|(n, o)| Call::Read(n, o)),
        (0..3usize, options()).prop_map(|(n, o)| Call::Write(n, o)),
        (0..8usize, duration()).prop_map(|(g, d)| Call::Extend(g, d)),
        (0..8usize).prop_map(Call::Release),
        usual_duration().prop_map(Call::Sleep),
        (0..3usize).prop_map(Call::Inspect),
    ]
}

/// How long (on the paused clock) any one call may take before the case fails: a wait
/// behind a holder whose lease is renewed for ever never ends, so such a wait is cut
/// here, as a caller's own timeout would (dropping the acquire, which must leave
/// nothing behind).
const CALL_LIMIT: Duration = Duration::from_secs(3600);

proptest! {
    #![proptest_config(config(300))]

    #[test]
    fn no_call_on_the_memory_backend_panics_or_leaves_anything(
        names in prop::collection::vec(name(), 3),
        calls in prop::collection::vec(call(), 1..16),
    ) {
        let panicked = panics();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .start_paused(true)
            .build()
            .expect("a runtime");
        runtime.block_on(async move {
            let locks = fencelock::connect("mem://").await.expect("mem://");
            let mut guards = Vec::new();
            // The token of the last exclusive lock granted on each name: the next is higher.
            let mut last_token = [0u64; 3];
            for call in calls {
                let outcome = tokio::time::timeout(CALL_LIMIT, async {
                    match call {
                        Call::Acquire(n, o) => {
                            if let Ok(guard) = locks.acquire(&names[n], o).await {
                                let token = guard.token().get();
                                prop_assert!(
                                    token > last_token[n],
                                    "{:?}: token {token} after {}", names[n], last_token[n]
                                );
                                last_token[n] = token;
                                guards.push(guard);
                            }
                        }
                        Call::Permits(n, p, l, o) => match Permits::new(p, l) {
                            Ok(permits) => {
                                guards.extend(locks.acquire_permits(&names[n], permits, o).await);
                            }
                            Err(Error::InvalidConfig { .. }) => {}
                            Err(other) => {
                                return Err(TestCaseError::fail(format!(
                                    "Permits::new({p}, {l}): {other:?}"
                                )));
                            }
                        },
                        Call::Read(n, o) => guards.extend(locks.acquire_read(&names[n], o).await),
                        Call::Write(n, o) => guards.extend(locks.acquire_write(&names[n], o).await),
                        Call::Extend(g, d) => {
                            if let Some(guard) = guards.get(g) {
                                let _ = guard.extend(d).await;
                            }
                        }
                        Call::Release(g) => {
                            if g < guards.len() {
                                let _ = guards.remove(g).release().await;
                            }
                        }
                        Call::Sleep(d) => tokio::time::sleep(d.min(CALL_LIMIT)).await,
                        Call::Inspect(n) => {
                            let _ = locks.inspect(&names[n]).await;
                        }
                    }
                    Ok(())
                })
                .await;
                if let Ok(checked) = outcome {
                    checked?;
                }
            }
            for guard in guards.drain(..) {
                let _ = guard.release().await;
            }
            for name in &names {
                if let Ok(info) = locks.inspect(name).await {
                    prop_assert!(
                        info.holder.is_none() && info.waiters.unwrap_or(0) == 0,
                        "{name:?} after every guard was released: {info:?}"
                    );
                }
            }
            let left = locks.list("").await;
            prop_assert!(
                left.as_ref().is_ok_and(Vec::is_empty),
                "left after every guard was released: {left:?}"
            );
            let _ = locks.close().await;
            Ok(())
        })?;
        // Its tasks end with it, after running to their next await.
        drop(runtime);
        prop_assert_eq!(panics(), panicked, "a task of the backend panicked (see above)");
    }

    #[test]
    fn any_duration_text_parses_or_is_refused(text in prop_oneof![duration_text(), "\\PC{0,30}"]) {
        let _ = fencelock::parse_duration(&text);
    }
}
