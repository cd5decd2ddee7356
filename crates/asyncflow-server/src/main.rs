//! `asyncflow-store`, the sample store daemon. Start-up happens in this order, so that a problem
//! is reported before anything is exposed and a stop request is never missed:
//!
//! 1. Settings are read — flags, then `ASYNCFLOW_TOKEN`, then the `--config` file — and checked:
//!    a non-loopback `--listen` without a token is refused here unless `--insecure` is given.
//! 2. Logging starts at `--log-level`, so every later step can report.
//! 3. SIGTERM and SIGINT handlers are installed before any socket exists.
//! 4. The role's state is built: the store (standalone), the store plus the background link that
//!    tells storage daemons about freed rows (controller), or the payload shards (storage).
//! 5. Listeners are bound: TCP at `--listen`, the Unix socket of the shared-memory path (mode
//!    0600), and the metrics address. Any failure stops start-up with exit code 1.
//! 6. Accepting begins and `listening on tcp://ADDR` is printed: from here on clients are served.
//! 7. On SIGTERM or SIGINT the daemon stops accepting, tells waiting claims and puts to give up,
//!    lets every other in-flight request finish and its reply go out, removes its Unix socket,
//!    and exits 0.

fn main() {
    std::process::exit(asyncflow_server::run(std::env::args().skip(1)));
}
