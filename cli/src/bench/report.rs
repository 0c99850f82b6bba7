//! The table and the JSON document `bench` prints.

use std::time::Duration;

use serde_json::{Value, json};

use super::driver::Measurement;

/// What was run, for the report header.
pub struct Setup<'a> {
    /// The URL, password redacted.
    pub url: &'a str,
    /// The backend's short name.
    pub backend: &'a str,
    /// The workload's name.
    pub workload: &'a str,
    /// Clients or workers.
    pub clients: usize,
    /// Measured time of each implementation.
    pub duration: Duration,
    /// Interleaved rounds it was split into.
    pub rounds: u16,
    /// Time each holder kept the lock.
    pub hold: Duration,
    /// The library's lease (`--lease`); `None`: the backend's.
    pub lease: Option<Duration>,
}

fn micros(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e6).round()
}

/// One measurement as JSON.
pub fn measurement_json(m: &Measurement) -> Value {
    json!({
        "description": m.description,
        "ops": m.ops,
        "elapsed_s": m.elapsed.as_secs_f64(),
        "ops_per_sec": m.ops_per_sec(),
        "p50_us": micros(m.quantile(0.5)),
        "p99_us": micros(m.quantile(0.99)),
        "p999_us": micros(m.quantile(0.999)),
        "max_us": micros(m.quantile(1.0)),
        "per_client_ops": m.per_client,
        "fairness": m.fairness(),
        "handoffs": m.handoffs,
        "handoffs_per_sec": m.handoffs_per_sec(),
    })
}

/// The whole report as JSON: `fencelock` and `baseline` (null without `--baseline`).
pub fn json(setup: &Setup<'_>, fencelock: &Measurement, baseline: Option<&Measurement>) -> Value {
    json!({
        "url": setup.url,
        "backend": setup.backend,
        "workload": setup.workload,
        "clients": setup.clients,
        "duration_s": setup.duration.as_secs_f64(),
        "rounds": setup.rounds,
        "hold_s": setup.hold.as_secs_f64(),
        "lease_s": setup.lease.map(|l| l.as_secs_f64()),
        "fencelock": measurement_json(fencelock),
        "baseline": baseline.map(measurement_json),
    })
}

/// The whole report as a table.
pub fn table(setup: &Setup<'_>, rows: &[&Measurement]) -> String {
    let lease = setup
        .lease
        .map_or_else(|| "the backend's".to_owned(), |l| format!("{l:?}"));
    let mut out = format!(
        "{} on {} ({}), {} client(s), {:?} each in {} interleaved round(s), hold {:?}, \
         lease {lease}\n\n",
        setup.workload,
        setup.backend,
        setup.url,
        setup.clients,
        setup.duration,
        setup.rounds,
        setup.hold
    );
    out.push_str(&format!(
        "{:<10} {:>9} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>9}  {}\n",
        "impl", "ops", "ops/s", "handoffs/s", "p50", "p99", "p99.9", "max", "fairness", "what"
    ));
    for m in rows {
        let handoffs = m
            .handoffs_per_sec()
            .map_or_else(|| "-".to_owned(), |h| format!("{h:.0}"));
        out.push_str(&format!(
            "{:<10} {:>9} {:>10.0} {:>10} {:>10} {:>10} {:>10} {:>10} {:>9.3}  {}\n",
            m.label,
            m.ops,
            m.ops_per_sec(),
            handoffs,
            format!("{:.2?}", m.quantile(0.5)),
            format!("{:.2?}", m.quantile(0.99)),
            format!("{:.2?}", m.quantile(0.999)),
            format!("{:.2?}", m.quantile(1.0)),
            m.fairness(),
            m.description
        ));
    }
    if rows.iter().any(|m| m.per_client.len() > 1) {
        out.push('\n');
        for m in rows {
            out.push_str(&format!("{} per client: {:?}\n", m.label, m.per_client));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_has_every_field() {
        let mut latencies = super::super::driver::new_histogram();
        for _ in 0..3 {
            latencies.record(10).unwrap();
        }
        let m = Measurement {
            label: "fencelock",
            description: "library".into(),
            ops: 3,
            elapsed: Duration::from_secs(1),
            latencies,
            per_client: vec![3],
            handoffs: None,
        };
        let setup = Setup {
            url: "mem://",
            backend: "mem",
            workload: "uncontended",
            clients: 1,
            duration: Duration::from_secs(1),
            rounds: 3,
            hold: Duration::ZERO,
            lease: None,
        };
        let doc = json(&setup, &m, None);
        assert_eq!(doc["fencelock"]["p50_us"], 10.0);
        assert_eq!(doc["fencelock"]["p999_us"], 10.0);
        assert_eq!(doc["rounds"], 3);
        assert!(doc["baseline"].is_null());
        assert!(table(&setup, &[&m]).contains("fencelock"));
    }
}
