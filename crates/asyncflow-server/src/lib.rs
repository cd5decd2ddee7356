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
