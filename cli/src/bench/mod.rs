//! `fencelock bench`: the three workloads, against the library and the raw floor.

mod baseline;
mod driver;
mod report;

use std::sync::Arc;

use driver::{Cycle, Library, Measurement, drive};

use crate::args::{Backend, BenchArgs, Workload};
use crate::exit::{Failure, code};

/// Runs the benchmark and prints the report.
///
/// # Errors
///
/// A [`Failure`] for a bad URL or when the backend fails during the run.
///
/// # Cancel safety
///
/// Dropping it ends the run; guards still held are released in the background.
pub async fn bench(args: BenchArgs) -> Result<u8, Failure> {
    // bench may keep the in-process default: it measures, it excludes nobody.
    let (target, config) = crate::backend::config(&args.url, true)?;
    let clients = match args.workload {
        Workload::Uncontended => 1,
        Workload::Contended | Workload::ManyKeys => usize::from(args.clients),
    };
    // Contending clients each get their own connection (as separate processes would);
    // many-keys workers share one, as the tasks of one service do.
    let connections = match args.workload {
        Workload::Contended => clients,
        Workload::Uncontended | Workload::ManyKeys => 1,
    };
    let prefix = format!("fencelock-bench/{}-{}", std::process::id(), nanos());

    let mut library: Vec<Arc<dyn Cycle>> = Vec::new();
    let mut backend = "";
    for _ in 0..connections {
        let locks = fencelock::connect_config(&config).await?;
        backend = locks.backend();
        library.push(Arc::new(Library(locks)));
    }
    let library = spread(library, clients);
    let fencelock = drive(
        "fencelock",
        format!("fencelock {backend} backend"),
        args.workload,
        &prefix,
        library,
        args.duration,
    )
    .await?;

    let baseline = if args.baseline {
        let Backend::Url(url) = &target else {
            return Err(Failure::usage(
                "--baseline needs the backend as a URL (--url or FENCELOCK_URL): the raw \
                 client floor is built from it",
            ));
        };
        let mut raw = Vec::new();
        let mut description = "";
        for _ in 0..connections {
            let (floor, what) = baseline::connect(url).await?;
            description = what;
            raw.push(floor);
        }
        let raw = spread(raw, clients);
        Some(
            drive(
                "baseline",
                description.to_owned(),
                args.workload,
                &prefix,
                raw,
                args.duration,
            )
            .await?,
        )
    } else {
        None
    };

    let redacted = match &target {
        Backend::Url(url) => fencelock::redact_url(url),
        Backend::File(_) => config.to_string(),
    };
    let setup = report::Setup {
        url: &redacted,
        backend,
        workload: args.workload.as_str(),
        clients,
        duration: args.duration,
    };
    if args.json {
        println!("{}", report::json(&setup, &fencelock, baseline.as_ref()));
    } else {
        let rows: Vec<&Measurement> = std::iter::once(&fencelock).chain(&baseline).collect();
        print!("{}", report::table(&setup, &rows));
    }
    Ok(code::OK)
}

/// `clients` handles over the given connections, round robin.
fn spread(connections: Vec<Arc<dyn Cycle>>, clients: usize) -> Vec<Arc<dyn Cycle>> {
    (0..clients)
        .map(|i| connections[i % connections.len()].clone())
        .collect()
}

fn nanos() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
}
