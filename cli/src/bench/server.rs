//! What the servers did during a workload, read from the servers themselves before and
//! after it: the cost of a hand-off to the deployment, which no client-side timing shows.
//!
//! - etcd: `/metrics` on each endpoint's client port (plain HTTP):
//!   `etcd_debugging_mvcc_events_total` (events sent to watchers, summed over the
//!   members) and `etcd_server_proposals_committed_total` (raft proposals, the highest
//!   member's: every member commits each one).
//! - ZooKeeper: the `mntr` four-letter word on each server (it must be in
//!   `4lw.commands.whitelist`): `zk_sum_node_deleted_watch_count` (watch notifications
//!   fired by deletions) and `zk_packets_received`, summed.
//! - Redis: `INFO commandstats` on every server the deployment's locks live on (the
//!   server; each Redlock instance; every Cluster node; the master a Sentinel names):
//!   `PUBLISH` calls (each reaches every client waiting on the name) and script calls
//!   (`EVALSHA` and `EVAL`), summed.
//!
//! Counters that cannot be read (a TLS endpoint, a refused `mntr` or `INFO`, a
//! `migrate://` or config-file backend) are reported as such, with the reason; the
//! workload itself is not affected. A server-wide counter also counts what other clients
//! of the deployment did meanwhile, so run the bench on a quiet deployment.

use std::collections::BTreeMap;
use std::time::Duration;

use fencelock::etcd::EtcdConfig;
use fencelock::redis::{RedisConfig, Topology};
use fencelock::zookeeper::ZkConfig;
use redis::{IntoConnectionInfo, RedisConnectionInfo};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::args::Backend;

/// How long one read of one server may take.
const READ_TIMEOUT: Duration = Duration::from_secs(5);

/// Where the counters are read, as far as the URL tells.
pub(super) enum Servers {
    /// etcd client endpoints, `host:port`.
    Etcd(Vec<String>),
    /// ZooKeeper servers.
    Zk(Vec<(String, u16)>),
    /// Redis: the servers, or the Sentinels to ask for the master, and the credentials.
    Redis {
        /// The servers locks live on (for Cluster: the seeds, whose peers are asked for).
        servers: Vec<(String, u16)>,
        /// Cluster: ask the seeds for every node.
        cluster: bool,
        /// Sentinel: (Sentinels, service, their credentials) to ask for the master.
        sentinel: Option<SentinelSet>,
        /// The servers' credentials.
        auth: RedisConnectionInfo,
    },
}

/// A `host:port` pair.
type Address = (String, u16);

/// The Sentinels to ask for the master, the service's name, and their credentials.
type SentinelSet = (Vec<Address>, String, RedisConnectionInfo);

/// Counter readings by name.
pub(super) type Readings = BTreeMap<&'static str, f64>;

/// The servers of the backend `target` names, or why their counters cannot be read.
pub(super) fn servers(target: &Backend) -> Result<Servers, String> {
    let Backend::Url(url) = target else {
        return Err("read only with the backend given as a URL (--url or FENCELOCK_URL)".into());
    };
    let url = super::baseline::backend_url(url);
    let scheme = url
        .split_once("://")
        .map_or("", |(s, _)| s)
        .to_ascii_lowercase();
    match scheme.as_str() {
        "etcd" => {
            let config = EtcdConfig::from_url(&url).map_err(|e| e.to_string())?;
            Ok(Servers::Etcd(config.endpoints))
        }
        "zk" | "zookeeper" => {
            let config = ZkConfig::from_url(&url).map_err(|e| e.to_string())?;
            let hosts = config
                .hosts()
                .split(',')
                .filter(|h| !h.is_empty())
                .map(|h| host_port(h, 2181))
                .collect::<Result<_, _>>()?;
            Ok(Servers::Zk(hosts))
        }
        "redis" | "redis+sentinel" | "redis+cluster" | "redlock" => {
            let config = RedisConfig::from_url(&url).map_err(|e| e.to_string())?;
            let credentials = |user: &Option<String>, password: &Option<String>| {
                let mut info = RedisConnectionInfo::default();
                if let Some(user) = user {
                    info = info.set_username(user);
                }
                if let Some(password) = password {
                    info = info.set_password(password);
                }
                info
            };
            let auth = credentials(&config.username, &config.password);
            let pairs = |endpoints: &[fencelock::redis::Endpoint]| {
                endpoints
                    .iter()
                    .map(|e| (e.host.clone(), e.port))
                    .collect::<Vec<_>>()
            };
            Ok(match &config.topology {
                Topology::Single { endpoint, .. } => Servers::Redis {
                    servers: vec![(endpoint.host.clone(), endpoint.port)],
                    cluster: false,
                    sentinel: None,
                    auth,
                },
                Topology::Redlock { instances, .. } => Servers::Redis {
                    servers: pairs(instances),
                    cluster: false,
                    sentinel: None,
                    auth,
                },
                Topology::Cluster { seeds, .. } => Servers::Redis {
                    servers: pairs(seeds),
                    cluster: true,
                    sentinel: None,
                    auth,
                },
                Topology::Sentinel {
                    sentinels, service, ..
                } => Servers::Redis {
                    servers: Vec::new(),
                    cluster: false,
                    sentinel: Some((
                        pairs(sentinels),
                        service.clone(),
                        credentials(&config.sentinel_username, &config.sentinel_password),
                    )),
                    auth,
                },
                _ => return Err(format!("not read for {}://", config.topology.scheme())),
            })
        }
        "etcds" | "zks" | "rediss" | "rediss+sentinel" | "rediss+cluster" | "redlocks" => {
            Err(format!("not read over TLS ({scheme}://)"))
        }
        "mem" => Err("mem:// has no server".into()),
        other => Err(format!("not read for {other}://")),
    }
}

/// `host:port` (or `[v6]:port`, or `host` with `default` port) as a pair.
fn host_port(text: &str, default: u16) -> Result<(String, u16), String> {
    let (host, port) = match text.rsplit_once(':') {
        Some((host, port)) if !host.ends_with(':') && !port.contains(']') => (
            host,
            port.parse().map_err(|_| format!("bad port in {text:?}"))?,
        ),
        _ => (text, default),
    };
    Ok((
        host.trim_start_matches('[')
            .trim_end_matches(']')
            .to_owned(),
        port,
    ))
}

/// Reads every counter of `servers` now.
///
/// # Errors
///
/// Why a server's counters could not be read (refused, not allowed, not answering).
///
/// # Cancel safety
///
/// Cancel safe: it only reads, and drops its connections.
pub(super) async fn read(servers: &Servers) -> Result<Readings, String> {
    tokio::time::timeout(READ_TIMEOUT * 4, read_all(servers))
        .await
        .map_err(|_| "the servers did not answer within 20 s".to_owned())?
}

async fn read_all(servers: &Servers) -> Result<Readings, String> {
    let mut readings = Readings::new();
    match servers {
        Servers::Etcd(endpoints) => {
            let mut proposals: f64 = 0.0;
            let mut events = 0.0;
            for endpoint in endpoints {
                let page = http_get(endpoint, "/metrics").await?;
                events += metric(&page, "etcd_debugging_mvcc_events_total")
                    .ok_or_else(|| format!("{endpoint}/metrics has no watch event count"))?;
                proposals = proposals.max(
                    metric(&page, "etcd_server_proposals_committed_total")
                        .ok_or_else(|| format!("{endpoint}/metrics has no proposal count"))?,
                );
            }
            readings.insert("watch_events", events);
            readings.insert("proposals", proposals);
        }
        Servers::Zk(hosts) => {
            let (mut notifications, mut packets) = (0.0, 0.0);
            for (host, port) in hosts {
                let mntr = four_letter_word(host, *port, "mntr").await?;
                let value = |key: &str| {
                    mntr.lines().find_map(|line| {
                        let (k, v) = line.split_once('\t')?;
                        (k == key).then(|| v.trim().parse::<f64>().ok())?
                    })
                };
                notifications += value("zk_sum_node_deleted_watch_count").ok_or_else(|| {
                    format!(
                        "{host}:{port} answered mntr without zk_sum_node_deleted_watch_count: {}",
                        mntr.lines().next().unwrap_or("")
                    )
                })?;
                packets += value("zk_packets_received").unwrap_or(0.0);
            }
            readings.insert("deletion_notifications", notifications);
            readings.insert("packets_received", packets);
        }
        Servers::Redis {
            servers,
            cluster,
            sentinel,
            auth,
        } => {
            let mut servers = servers.clone();
            if let Some((sentinels, service, sentinel_auth)) = sentinel {
                servers = vec![master_of(sentinels, service, sentinel_auth).await?];
            }
            if *cluster {
                servers = cluster_nodes(&servers, auth).await?;
            }
            let (mut publishes, mut scripts) = (0.0, 0.0);
            for (host, port) in &servers {
                let info: String =
                    redis_query(host, *port, auth, redis::cmd("INFO").arg("commandstats")).await?;
                let calls = |command: &str| {
                    info.lines().find_map(|line| {
                        let rest = line.strip_prefix(&format!("cmdstat_{command}:calls="))?;
                        rest.split(',').next()?.parse::<f64>().ok()
                    })
                };
                publishes += calls("publish").unwrap_or(0.0) + calls("spublish").unwrap_or(0.0);
                scripts += calls("evalsha").unwrap_or(0.0) + calls("eval").unwrap_or(0.0);
            }
            readings.insert("publish_calls", publishes);
            readings.insert("script_calls", scripts);
        }
    }
    Ok(readings)
}

/// The counters' growth from `before` to `after` per `per` (hand-offs), as JSON; or
/// why they were not read.
pub(super) fn per_handoff(
    before: &Result<Readings, String>,
    after: &Result<Readings, String>,
    per: usize,
) -> Value {
    match (before, after) {
        (Ok(before), Ok(after)) => {
            let mut out = serde_json::Map::new();
            for (name, end) in after {
                if let Some(start) = before.get(name) {
                    out.insert(
                        (*name).to_owned(),
                        json!((end - start).max(0.0) / per.max(1) as f64),
                    );
                }
            }
            Value::Object(out)
        }
        (Err(why), _) | (_, Err(why)) => json!({ "not_read": why }),
    }
}

/// A Prometheus text page's sum of the samples of `name` (every label set).
fn metric(page: &str, name: &str) -> Option<f64> {
    let samples: Vec<f64> = page
        .lines()
        .filter(|line| {
            line.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with(' ') || rest.starts_with('{'))
        })
        .filter_map(|line| line.rsplit(' ').next()?.parse().ok())
        .collect();
    (!samples.is_empty()).then(|| samples.iter().sum())
}

/// The body of `GET path` from `endpoint` (`host:port`), over plain HTTP/1.0 (so the
/// reply is neither chunked nor kept alive). Written out rather than pulling an HTTP
/// client crate into the CLI for one unauthenticated text page.
async fn http_get(endpoint: &str, path: &str) -> Result<String, String> {
    let endpoint = endpoint
        .strip_prefix("http://")
        .unwrap_or(endpoint)
        .trim_end_matches('/');
    let reply = talk(
        endpoint,
        format!("GET {path} HTTP/1.0\r\nHost: {endpoint}\r\n\r\n"),
    )
    .await?;
    let (head, body) = reply
        .split_once("\r\n\r\n")
        .ok_or_else(|| format!("{endpoint}: not an HTTP reply"))?;
    if !head.starts_with("HTTP/1.0 200") && !head.starts_with("HTTP/1.1 200") {
        return Err(format!(
            "{endpoint}{path}: {}",
            head.lines().next().unwrap_or("no status")
        ));
    }
    Ok(body.to_owned())
}

/// A ZooKeeper four-letter word's answer.
async fn four_letter_word(host: &str, port: u16, word: &str) -> Result<String, String> {
    let answer = talk(&format!("{host}:{port}"), word.to_owned()).await?;
    if answer.contains("is not executed because it is not in the whitelist") {
        return Err(format!(
            "{host}:{port} refuses `{word}` (add it to 4lw.commands.whitelist)"
        ));
    }
    Ok(answer)
}

/// Sends `request` to `address` and reads the reply until the server closes.
async fn talk(address: &str, request: String) -> Result<String, String> {
    let exchange = async {
        let mut stream = TcpStream::connect(address).await?;
        stream.write_all(request.as_bytes()).await?;
        let mut reply = Vec::new();
        stream.read_to_end(&mut reply).await?;
        Ok::<_, std::io::Error>(String::from_utf8_lossy(&reply).into_owned())
    };
    match tokio::time::timeout(READ_TIMEOUT, exchange).await {
        Ok(Ok(reply)) => Ok(reply),
        Ok(Err(error)) => Err(format!("{address}: {error}")),
        Err(_) => Err(format!("{address}: no answer within {READ_TIMEOUT:?}")),
    }
}

/// One command on one Redis server.
async fn redis_query<T: redis::FromRedisValue>(
    host: &str,
    port: u16,
    auth: &RedisConnectionInfo,
    command: &redis::Cmd,
) -> Result<T, String> {
    let fail = |e: redis::RedisError| format!("{host}:{port}: {}", crate::exit::one_line(&e));
    let info = (host, port)
        .into_connection_info()
        .map_err(fail)?
        .set_redis_settings(auth.clone());
    let query = async {
        let mut connection = redis::Client::open(info)?
            .get_multiplexed_async_connection()
            .await?;
        command.query_async(&mut connection).await
    };
    match tokio::time::timeout(READ_TIMEOUT, query).await {
        Ok(result) => result.map_err(fail),
        Err(_) => Err(format!("{host}:{port}: no answer within {READ_TIMEOUT:?}")),
    }
}

/// The master the first answering Sentinel names for `service`.
async fn master_of(
    sentinels: &[(String, u16)],
    service: &str,
    auth: &RedisConnectionInfo,
) -> Result<(String, u16), String> {
    let mut last = "no Sentinel given".to_owned();
    for (host, port) in sentinels {
        let asked = redis_query::<Option<(String, u16)>>(
            host,
            *port,
            auth,
            redis::cmd("SENTINEL")
                .arg("get-master-addr-by-name")
                .arg(service),
        )
        .await;
        match asked {
            Ok(Some(master)) => return Ok(master),
            Ok(None) => last = format!("{host}:{port} knows no master {service:?}"),
            Err(why) => last = why,
        }
    }
    Err(last)
}

/// The masters of the cluster the first answering seed is in (`CLUSTER NODES`): where
/// scripts run (a replica's counters would count them again).
async fn cluster_nodes(
    seeds: &[(String, u16)],
    auth: &RedisConnectionInfo,
) -> Result<Vec<(String, u16)>, String> {
    let mut last = "no seed given".to_owned();
    for (host, port) in seeds {
        match redis_query::<String>(host, *port, auth, redis::cmd("CLUSTER").arg("NODES")).await {
            Ok(nodes) => return masters(&nodes, host),
            Err(why) => last = why,
        }
    }
    Err(last)
}

/// The reachable masters a `CLUSTER NODES` reply lists: `id ip:port@cport[,hostname]
/// flags ...` per line. A node that has not learned its own address lists it as
/// `:port@cport`: it is the one asked (`asked`). Nodes flagged failing, without an
/// address or still in the handshake are left out.
fn masters(reply: &str, asked: &str) -> Result<Vec<(String, u16)>, String> {
    let mut masters = Vec::new();
    for line in reply.lines().filter(|line| !line.trim().is_empty()) {
        let mut fields = line.split(' ');
        let (Some(_id), Some(address), Some(flags)) = (fields.next(), fields.next(), fields.next())
        else {
            return Err(format!("CLUSTER NODES: unexpected line {line:?}"));
        };
        let flags: Vec<&str> = flags.split(',').collect();
        let unusable = ["fail", "fail?", "noaddr", "handshake"];
        if !flags.contains(&"master") || flags.iter().any(|f| unusable.contains(f)) {
            continue;
        }
        let address = address.split(['@', ',']).next().unwrap_or(address);
        let address = match address.strip_prefix(':') {
            Some(port) if asked.contains(':') => format!("[{asked}]:{port}"),
            Some(port) => format!("{asked}:{port}"),
            None => address.to_owned(),
        };
        masters.push(host_port(&address, 6379)?);
    }
    if masters.is_empty() {
        return Err("CLUSTER NODES lists no reachable master".into());
    }
    Ok(masters)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_and_ports_are_read() {
        assert_eq!(host_port("a:1", 2181), Ok(("a".into(), 1)));
        assert_eq!(host_port("a", 2181), Ok(("a".into(), 2181)));
        assert_eq!(host_port("[::1]:7", 2181), Ok(("::1".into(), 7)));
        assert_eq!(host_port("[::1]", 2181), Ok(("::1".into(), 2181)));
        assert!(host_port("a:x", 2181).is_err());
    }

    #[test]
    fn cluster_masters_are_read_from_cluster_nodes() {
        let reply = "a 10.0.0.1:7000@17000,n1 myself,master - 0 0 1 connected 0-5460\n\
                     b 10.0.0.2:7001@17001 master - 0 0 2 connected 5461-10922\n\
                     c 10.0.0.3:7002@17002 slave b 0 0 2 connected\n\
                     d 10.0.0.4:7003@17003 master,fail - 0 0 3 disconnected\n\
                     e :7004@17004 master,noaddr - 0 0 4 disconnected\n";
        assert_eq!(
            masters(reply, "seed"),
            Ok(vec![("10.0.0.1".into(), 7000), ("10.0.0.2".into(), 7001)])
        );
        // A node that has not learned its own address is the one asked.
        let alone = "a :7000@17000 myself,master - 0 0 1 connected 0-16383\n";
        assert_eq!(
            masters(alone, "10.0.0.9"),
            Ok(vec![("10.0.0.9".into(), 7000)])
        );
        assert_eq!(masters(alone, "::1"), Ok(vec![("::1".into(), 7000)]));
        assert!(masters("", "seed").is_err());
        assert!(masters("garbage", "seed").is_err());
    }

    #[test]
    fn metrics_sum_every_label_set() {
        let page = "# HELP x\nx_total{a=\"1\"} 2\nx_total{a=\"2\"} 3\nx_totals 100\nx_total 5\n";
        assert_eq!(metric(page, "x_total"), Some(10.0));
        assert_eq!(metric(page, "y_total"), None);
    }

    #[test]
    fn growth_is_per_handoff_or_says_why_not() {
        let before = Ok(Readings::from([("a", 10.0)]));
        let after = Ok(Readings::from([("a", 30.0)]));
        assert_eq!(per_handoff(&before, &after, 10), json!({"a": 2.0}));
        let refused = Err("refused".to_owned());
        assert_eq!(
            per_handoff(&before, &refused, 10),
            json!({"not_read": "refused"})
        );
    }
}
