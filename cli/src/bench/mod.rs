//! `fencelock bench`: the three workloads, against the library and the raw floor.

mod baseline;
mod driver;
mod processes;
mod report;
mod scale;
mod server;

use std::sync::Arc;

use driver::{Cycle, Drive, Library, Measurement, drive};
use fencelock::AcquireOptions;

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
    check_flags(&args)?;
    // bench may keep the in-process default: it measures, it excludes nobody.
    let (target, config) = crate::backend::config(&args.url, true)?;
    if let (Some(index), Some(name)) = (args.waiters_child, &args.waiters_name) {
        // A child of a `--processes` waiters bench (see `processes`).
        let locks = fencelock::connect_config(&config).await?;
        let done = processes::child(&args, locks.clone(), index, name).await;
        let _ = locks.close().await;
        return done.map(|()| code::OK);
    }
    if is_scale(args.workload) {
        if args.processes() > 1 {
            processes::per_process(args.count.unwrap_or(10_000), args.processes())?;
            if config.scheme() == "mem" {
                return Err(Failure::usage(
                    "--processes needs a backend processes can share: mem:// locks \
                     inside one process only",
                ));
            }
        }
        let locks = fencelock::connect_config(&config).await?;
        // A second client, for the held workload's question: does one client holding
        // many locks slow down the others?
        let other = match args.workload {
            Workload::Held => Some(fencelock::connect_config(&config).await?),
            _ => None,
        };
        let prefix = format!("fencelock-bench/{}-{}", std::process::id(), nanos());
        let report = if args.processes() > 1 {
            processes::parent(&args, &target, locks.clone(), &prefix).await
        } else {
            scale::run(&args, &target, locks.clone(), other.clone(), &prefix).await
        };
        let _ = locks.close().await;
        if let Some(other) = other {
            let _ = other.close().await;
        }
        let report = report?;
        if args.json {
            crate::exit::println_out(&report.to_string())?;
        } else {
            crate::exit::print_out(&scale::text(&report))?;
        }
        return Ok(code::OK);
    }
    let clients = match args.workload {
        Workload::Uncontended => 1,
        Workload::Contended | Workload::ManyKeys => usize::from(args.clients()),
        Workload::Waiters | Workload::Held | Workload::Cycles => 1,
    };
    // Contending clients each get their own connection (as separate processes would);
    // many-keys workers share one, as the tasks of one service do.
    let connections = match args.workload {
        Workload::Contended => clients,
        Workload::Uncontended | Workload::ManyKeys => 1,
        Workload::Waiters | Workload::Held | Workload::Cycles => 1,
    };
    let prefix = format!("fencelock-bench/{}-{}", std::process::id(), nanos());
    let baseline_url = match (&target, args.baseline) {
        (_, false) => None,
        (Backend::Url(url), true) => Some(url.clone()),
        (Backend::File(_), true) => {
            return Err(Failure::usage(
                "--baseline needs the backend as a URL (--url or FENCELOCK_URL): the raw \
                 client floor is built from it",
            ));
        }
    };

    let mut library: Vec<Arc<dyn Cycle>> = Vec::new();
    let mut backend = "";
    let options = match args.lease {
        Some(lease) => AcquireOptions::new().lease(lease),
        None => AcquireOptions::new(),
    };
    for _ in 0..connections {
        let locks = fencelock::connect_config(&config).await?;
        backend = locks.backend();
        library.push(Arc::new(Library { locks, options }));
    }
    let library = spread(library, clients);
    let floor = if let Some(url) = &baseline_url {
        let mut raw = Vec::new();
        let mut description = "";
        for _ in 0..connections {
            let (floor, what) = baseline::connect(url).await?;
            description = what;
            raw.push(floor);
        }
        Some((spread(raw, clients), description))
    } else {
        None
    };

    let run = |duration| Drive {
        duration,
        hold: args.hold(),
        quiet: args.quiet,
    };
    let library_label = format!("fencelock {backend} backend");
    // Warm-up: connections, caches, scripts, JIT of the servers. Not measured.
    if !args.warmup().is_zero() {
        let warm = format!("{prefix}/warmup");
        drive(
            "warm-up",
            String::new(),
            args.workload,
            &warm,
            &library,
            run(args.warmup()),
        )
        .await?;
        if let Some((floor, _)) = &floor {
            drive(
                "warm-up",
                String::new(),
                args.workload,
                &warm,
                floor,
                run(args.warmup()),
            )
            .await?;
        }
    }
    // Rounds, interleaved: a slow moment of a shared machine hits both.
    let round = args.duration() / u32::from(args.rounds());
    let mut fencelock: Option<Measurement> = None;
    let mut baseline: Option<Measurement> = None;
    for _ in 0..args.rounds() {
        let m = drive(
            "fencelock",
            library_label.clone(),
            args.workload,
            &prefix,
            &library,
            run(round),
        )
        .await?;
        match &mut fencelock {
            Some(total) => total.merge(m),
            None => fencelock = Some(m),
        }
        if let Some((floor, description)) = &floor {
            let m = drive(
                "baseline",
                (*description).to_owned(),
                args.workload,
                &prefix,
                floor,
                run(round),
            )
            .await?;
            match &mut baseline {
                Some(total) => total.merge(m),
                None => baseline = Some(m),
            }
        }
    }
    let fencelock = fencelock.expect("at least one round");

    let redacted = match &target {
        Backend::Url(url) => fencelock::redact_url(url),
        Backend::File(_) => config.to_string(),
    };
    let setup = report::Setup {
        url: &redacted,
        backend,
        workload: args.workload.as_str(),
        clients,
        duration: args.duration(),
        rounds: args.rounds(),
        hold: args.hold(),
        lease: args.lease,
    };
    if args.json {
        crate::exit::println_out(&report::json(&setup, &fencelock, baseline.as_ref()).to_string())?;
    } else {
        let rows: Vec<&Measurement> = std::iter::once(&fencelock).chain(&baseline).collect();
        crate::exit::print_out(&report::table(&setup, &rows))?;
    }
    Ok(code::OK)
}

/// Whether `workload` is one of the scale workloads (`scale`), not one driven for a
/// duration (`driver`).
fn is_scale(workload: Workload) -> bool {
    matches!(
        workload,
        Workload::Waiters | Workload::Held | Workload::Cycles
    )
}

/// Refuses a flag given to a workload that would not use it: silently ignored, it
/// would make the report look like it measured what was asked.
///
/// # Errors
///
/// A usage [`Failure`] naming the first such flag and the workload.
fn check_flags(args: &BenchArgs) -> Result<(), Failure> {
    let workload = args.workload;
    let refuse = |flag: &str, meant_for: &str, why: &str| {
        Err(Failure::usage(format!(
            "{flag} is for --workload {meant_for}, not --workload {}: {why}",
            workload.as_str()
        )))
    };
    const DRIVEN: &str = "uncontended, contended or many-keys";
    if is_scale(workload) {
        let timed = "a scale workload runs once, until its --count is done";
        if args.clients.is_some() {
            return refuse(
                "--clients",
                "contended or many-keys",
                "a scale workload runs one client (waiters: --processes for more)",
            );
        }
        if args.duration.is_some() {
            return refuse("--duration", DRIVEN, timed);
        }
        if args.warmup.is_some() {
            return refuse("--warmup", DRIVEN, timed);
        }
        if args.rounds.is_some() {
            return refuse("--rounds", DRIVEN, timed);
        }
        if args.hold.is_some() {
            return refuse(
                "--hold",
                DRIVEN,
                "a scale workload releases each lock at once (held: after 5 lease periods)",
            );
        }
        if args.baseline {
            return refuse(
                "--baseline",
                DRIVEN,
                "a scale workload measures the library alone",
            );
        }
    } else {
        if args.count.is_some() {
            return refuse(
                "--count",
                "waiters, held or cycles",
                "this workload runs for --duration (split into --rounds)",
            );
        }
        if args.clients.is_some() && workload == Workload::Uncontended {
            return refuse(
                "--clients",
                "contended or many-keys",
                "the uncontended workload runs one client",
            );
        }
    }
    if workload != Workload::Waiters {
        if args.processes.is_some() {
            return refuse(
                "--processes",
                "waiters",
                "the waiters queued from several processes",
            );
        }
        if args.waiters_child.is_some() {
            return refuse(
                "--waiters-child",
                "waiters",
                "it is internal to --processes",
            );
        }
    }
    Ok(())
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
