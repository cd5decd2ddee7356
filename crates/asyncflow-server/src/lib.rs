//! The AsyncFlow store as a network service: the `asyncflow-store` daemon (standalone, or a
//! controller with storage daemons for sharding across hosts), and the Rust client that the
//! Python bindings use. Frames are `asyncflow-proto`; same-host payloads go through
//! `asyncflow-shm`.

pub mod auth;
pub mod client;
pub mod config;
pub mod error;
pub mod host;
pub mod persist;
mod received;
pub mod server;

use std::io::Write as _;

pub use error::{Error, Result};

fn init_logging(level: &str, json: bool) {
    let filter = tracing_subscriber::EnvFilter::try_new(level)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let colour = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(colour);
    // A second daemon in one process (tests, notebooks) keeps the first subscriber.
    let _ = if json { builder.json().try_init() } else { builder.try_init() };
}

/// Descriptors one connection may hold in the daemon: its socket, and on the shared-memory path
/// its rings' four bells and its own event loop (an epoll and its waker).
const DESCRIPTORS_PER_CONNECTION: u64 = 7;

/// Raises the soft open-file limit to the hard one (as servers commonly do: the soft default,
/// often 1024, is too small for `--max-connections`' default), and warns if even that is too
/// small for `max_connections`. A process out of descriptors refuses new connections.
fn raise_open_file_limit(max_connections: usize) {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let mut limit = getrlimit(Resource::Nofile);
    // No hard limit: as far as the kernel lets a process open (fs.nr_open, 1 Mi by default).
    let nr_open = std::fs::read_to_string("/proc/sys/fs/nr_open").ok();
    let ceiling = limit.maximum.or_else(|| nr_open?.trim().parse().ok()).unwrap_or(1 << 20);
    if limit.current.is_some_and(|soft| soft < ceiling) {
        let raised = rustix::process::Rlimit { current: Some(ceiling), maximum: limit.maximum };
        match setrlimit(Resource::Nofile, raised) {
            Ok(()) => limit = raised,
            Err(e) => tracing::debug!(error = %e, "cannot raise the open-file limit"),
        }
    }
    let wanted = (max_connections as u64).saturating_mul(DESCRIPTORS_PER_CONNECTION) + 64;
    if let Some(soft) = limit.current.filter(|&soft| soft < wanted) {
        tracing::warn!(
            limit = soft,
            max_connections,
            "the open-file limit (ulimit -n) may run out before --max-connections does: new \
             connections then wait until others close"
        );
    }
}

/// The daemon's command line: parses `args` (without the program name), serves until SIGTERM or
/// SIGINT, and returns the process exit code. Prints `listening on tcp://ADDR` on stdout once
/// clients can connect.
pub fn run<I: IntoIterator<Item = String>>(args: I) -> i32 {
    run_as("asyncflow-store", args)
}

/// [`run`] under another name: `program` is what usage, `--help` and errors call the command
/// (`asyncflow store serve` when the Python CLI runs it).
pub fn run_as<I: IntoIterator<Item = String>>(program: &str, args: I) -> i32 {
    let command_line = std::iter::once(program.to_owned()).chain(args);
    let command = <config::Flags as clap::CommandFactory>::command().bin_name(program);
    let flags = match command
        .try_get_matches_from(command_line)
        .and_then(|m| <config::Flags as clap::FromArgMatches>::from_arg_matches(&m))
    {
        Ok(f) => f,
        Err(e) => {
            let _ = e.print();
            return e.exit_code();
        }
    };
    let config = match flags.resolve() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{program}: {e}");
            return 2;
        }
    };
    init_logging(&config.log_level, config.log_json);
    raise_open_file_limit(config.max_connections);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(std::thread::available_parallelism().map_or(2, |n| n.get().min(4)))
        .thread_name("asyncflow-store")
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("{program}: cannot start the runtime: {e}");
            return 1;
        }
    };
    let served = runtime.block_on(async {
        let stop = server::stop_signal()?;
        let ready = |address| {
            println!("listening on tcp://{address}");
            let _ = std::io::stdout().flush();
        };
        server::serve(config, ready, stop).await
    });
    match served {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("{program}: {e}");
            1
        }
    }
}
