//! The daemon's settings: command-line flags, the environment (`ASYNCFLOW_TOKEN`) and an optional
//! TOML file with the same keys (`listen = "0.0.0.0:7379"`, `memory-limit = "8GiB"`, ...).
//! A flag wins over the file; every value is checked here, before anything is bound.

use std::net::{SocketAddr, ToSocketAddrs};
use std::path::PathBuf;
use std::time::Duration;

use asyncflow_proto::{Limits, Role};
use clap::Parser;
use serde::Deserialize;

use crate::error::{Error, Result};
use crate::persist::{Fsync, PersistConfig};

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RoleFlag {
    /// Metadata and payloads in this one daemon.
    Standalone,
    /// Metadata, readiness and leases; payloads on the `--storage` daemons.
    Controller,
    /// Payloads only, for a controller.
    Storage,
}

/// Flags of `asyncflow-store` (and of `asyncflow store serve`): switches are plain flags;
/// numbers take values starting with `-`, so `--lease-timeout -1` is refused by name.
#[allow(clippy::struct_excessive_bools)]
#[derive(Debug, Default, Parser, Deserialize)]
#[command(name = "asyncflow-store", version, about = "The AsyncFlow sample store daemon")]
#[serde(default, deny_unknown_fields, rename_all = "kebab-case")]
pub struct Flags {
    /// TOML file with any of these settings (flags override it).
    #[arg(long)]
    #[serde(skip)]
    pub config: Option<PathBuf>,
    /// Address to serve on, HOST:PORT (port 0 picks a free one) [default: 127.0.0.1:7379].
    #[arg(long)]
    pub listen: Option<String>,
    /// Payload shards (independently locked) [default: 8].
    #[arg(long, allow_hyphen_values = true)]
    pub shards: Option<usize>,
    /// Payload bytes the store may hold, e.g. 4GiB [default: no limit].
    #[arg(long, allow_hyphen_values = true)]
    #[serde(deserialize_with = "size_text")]
    pub memory_limit: Option<String>,
    /// Seconds a claim's lease lasts [default: 30].
    #[arg(long, allow_hyphen_values = true)]
    pub lease_timeout: Option<f64>,
    /// Seconds the leases of a connection that closed are kept for its client to reconnect and
    /// name them; then their rows are delivered again [default: 5].
    #[arg(long, allow_hyphen_values = true)]
    pub reconnect_grace: Option<f64>,
    /// Token every client must present (else `$ASYNCFLOW_TOKEN`, if set and not empty).
    #[arg(long)]
    pub token: Option<String>,
    /// Serve Prometheus metrics on this HOST:PORT.
    #[arg(long)]
    pub metrics: Option<String>,
    /// Log filter: error, warn, info, debug, trace (or a tracing directive) [default: info].
    #[arg(long)]
    pub log_level: Option<String>,
    /// Log as JSON lines instead of text.
    #[arg(long)]
    pub log_json: bool,
    /// Allow a non-loopback address without a token.
    #[arg(long)]
    pub insecure: bool,
    /// Unix socket offering the shared-memory data path [default: one in the temp directory].
    #[arg(long)]
    pub shm_socket: Option<PathBuf>,
    /// Serve over TCP only, with no shared-memory data path.
    #[arg(long)]
    pub no_shm: bool,
    /// What this daemon is in a sharded deployment [default: standalone].
    #[arg(long, value_enum)]
    pub role: Option<RoleFlag>,
    /// For a controller: the storage daemons, HOST:PORT, comma-separated, in shard order.
    #[arg(long, value_delimiter = ',')]
    pub storage: Vec<String>,
    /// Largest payload one frame (one put) may carry; a larger put is refused with an error and
    /// its connection goes on, e.g. 1GiB [default: 1GiB].
    #[arg(long, allow_hyphen_values = true)]
    #[serde(deserialize_with = "size_text")]
    pub max_frame: Option<String>,
    /// Keep the store in this directory (write-ahead log and snapshots) so that a restart
    /// restores every completed put and every row not yet acked [default: nothing kept].
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// With --data-dir: when the log is forced to disk: always (before each change is
    /// acknowledged), never (left to the kernel), or an interval such as 100ms [default: always].
    #[arg(long, allow_hyphen_values = true)]
    pub fsync: Option<String>,
    /// With --data-dir: replace the log by a snapshot once it holds this much, or twice the live
    /// payload if that is more [default: 256MiB].
    #[arg(long, allow_hyphen_values = true)]
    #[serde(deserialize_with = "size_text")]
    pub compact_after: Option<String>,
    /// With --data-dir: start even if a log is damaged, dropping everything from the damage on;
    /// the damaged file is kept as FILE.damaged-N and what was dropped is printed. Without it a
    /// damaged data directory is refused.
    #[arg(long)]
    pub recover: bool,
    /// Connections served at once (once they said hello). With all taken, a new one is served
    /// in place of the connection idle longest, if it has been idle for --evict-idle-after;
    /// else it is refused [default: 1024].
    #[arg(long, allow_hyphen_values = true)]
    pub max_connections: Option<usize>,
    /// Seconds a served connection must have been idle (no request read or running) before a
    /// new one may take its place at --max-connections [default: 60].
    #[arg(long, allow_hyphen_values = true)]
    pub evict_idle_after: Option<f64>,
    /// Connections that have not said hello yet, kept apart from --max-connections; a new one
    /// beyond that closes the one waiting longest [default: 64].
    #[arg(long, allow_hyphen_values = true)]
    pub max_unauthenticated: Option<usize>,
    /// Seconds a new connection has to say hello before it is closed [default: 5].
    #[arg(long, allow_hyphen_values = true)]
    pub hello_timeout: Option<f64>,
    /// Bytes the daemon may hold in transit, for all connections together: frames being read
    /// and requests running (their metadata, and a put's bytes until the store has room for
    /// them) and replies queued for clients that have not read them. A connection that needs
    /// more stops reading until some is freed. With --memory-limit, the daemon's memory stays
    /// within the limit plus this plus a fixed overhead [default: 256MiB].
    #[arg(long, allow_hyphen_values = true)]
    #[serde(deserialize_with = "size_text")]
    pub max_transit_bytes: Option<String>,
    /// Request bytes one connection may have in flight (read, not yet answered); its reading
    /// pauses beyond that [default: twice --max-frame].
    #[arg(long, allow_hyphen_values = true)]
    #[serde(deserialize_with = "size_text")]
    pub max_connection_bytes: Option<String>,
}

/// A size in the file: text such as `"4GiB"`, or a number of bytes.
fn size_text<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> std::result::Result<Option<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Size {
        Text(String),
        Bytes(u64),
    }
    Ok(Some(match Size::deserialize(d)? {
        Size::Text(text) => text,
        Size::Bytes(bytes) => bytes.to_string(),
    }))
}

/// Where the token is read from when no flag gives one.
pub const TOKEN_ENV: &str = "ASYNCFLOW_TOKEN";

/// The levels `--log-level` takes as a bare word (anything else must be a directive, with `=`).
const LOG_LEVELS: [&str; 6] = ["error", "warn", "info", "debug", "trace", "off"];

/// A file that TOML refuses, said without quoting the file: its line may hold the token.
fn file_error(path: &std::path::Path, text: &str, e: &toml::de::Error) -> Error {
    let at = e.span().map_or(0, |s| s.start).min(text.len());
    let line = text[..at].matches('\n').count() + 1;
    let line_text = text.lines().nth(line - 1).unwrap_or("");
    let key = line_text.trim_start().trim_start_matches(['"', '\'']);
    let what = if key.starts_with("token") {
        "token must be a quoted string".to_owned()
    } else {
        e.message().to_owned()
    };
    Error::Config(format!("{}: line {line}: {what}", path.display()))
}

fn check_token(token: Option<&str>) -> Result<()> {
    if token == Some("") {
        return Err(Error::Config(
            "the token is empty: give one (--token, $ASYNCFLOW_TOKEN or the file's token), or \
             none for a daemon any local user may use"
                .into(),
        ));
    }
    Ok(())
}

/// A level, or a tracing directive (one with `=`): a misspelt level would filter out every line.
fn check_log_level(level: &str) -> Result<()> {
    if !level.contains('=') && !LOG_LEVELS.contains(&level.to_ascii_lowercase().as_str()) {
        return Err(Error::Config(format!(
            "--log-level {level:?}: not one of {} (or a directive such as \
             asyncflow_server=debug)",
            LOG_LEVELS.join(", ")
        )));
    }
    tracing_subscriber::EnvFilter::try_new(level)
        .map(|_| ())
        .map_err(|e| Error::Config(format!("--log-level {level:?}: {e}")))
}

/// A `HOST:PORT` a controller connects to (resolved only then: the host may not be up yet).
fn check_host_port(flag: &str, text: &str) -> Result<()> {
    match text.rsplit_once(':') {
        Some((host, port)) if !host.trim().is_empty() && port.parse::<u16>().is_ok() => Ok(()),
        _ => Err(Error::Config(format!("{flag}: {text:?} is not HOST:PORT"))),
    }
}

/// Checked settings.
#[derive(Debug, Clone)]
pub struct Config {
    pub listen: SocketAddr,
    pub shards: usize,
    pub memory_limit: Option<u64>,
    pub lease_timeout: Duration,
    pub reconnect_grace: Duration,
    pub token: Option<String>,
    pub metrics: Option<SocketAddr>,
    pub log_level: String,
    pub log_json: bool,
    /// `None`: no shared-memory path.
    pub shm_socket: Option<PathBuf>,
    pub role: Role,
    pub storage: Vec<String>,
    pub limits: Limits,
    /// `None`: the store is forgotten when the daemon stops.
    pub persist: Option<PersistConfig>,
    pub max_connections: usize,
    pub evict_idle_after: Duration,
    pub max_unauthenticated: usize,
    pub hello_timeout: Duration,
    pub max_connection_bytes: u64,
    pub max_transit_bytes: u64,
}

/// Bytes in a size such as `4GiB`, `512MB` or `1048576`.
pub fn parse_size(text: &str) -> Result<u64> {
    let t = text.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let not_a_size = || Error::Config(format!("not a size: {text:?} (try 4GiB)"));
    let scale: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" => 1000,
        "kib" => 1 << 10,
        "m" | "mb" => 1000_u64.pow(2),
        "mib" => 1 << 20,
        "g" | "gb" => 1000_u64.pow(3),
        "gib" => 1 << 30,
        "t" | "tb" => 1000_u64.pow(4),
        "tib" => 1 << 40,
        _ => return Err(not_a_size()),
    };
    let value: f64 = number.parse().map_err(|_| not_a_size())?;
    let bytes = value * scale as f64;
    // 2^64 itself is the first float `as u64` would saturate.
    if !(bytes.is_finite() && bytes >= 0.0 && bytes < u64::MAX as f64) {
        return Err(Error::Config(format!("{text:?} is more bytes than can be counted")));
    }
    Ok(bytes as u64)
}

/// A size flag's value: a size, and not zero.
fn size_flag(flag: &str, text: &str) -> Result<u64> {
    match parse_size(text) {
        Ok(0) => Err(Error::Config(format!("{flag} must be more than 0 bytes, not {text:?}"))),
        Ok(bytes) => Ok(bytes),
        Err(e) => Err(Error::Config(format!("{flag}: {e}"))),
    }
}

/// The longest `--lease-timeout`: a year (a deadline this far out never overflows a clock).
pub const MAX_LEASE_SECS: f64 = 365.0 * 24.0 * 3600.0;
pub use asyncflow_core::MAX_SHARDS;

/// Seconds given as a float, as a duration in `(0, max]`.
pub fn seconds(flag: &str, value: f64, max: f64) -> Result<Duration> {
    if !(value.is_finite() && value > 0.0 && value <= max) {
        return Err(Error::Config(format!(
            "{flag} must be a number of seconds above 0 and at most {max}, not {value}"
        )));
    }
    Duration::try_from_secs_f64(value)
        .map_err(|e| Error::Config(format!("{flag} {value}: {e}")))
        .and_then(|d| {
            if d.is_zero() {
                Err(Error::Config(format!("{flag} {value} is too short to count")))
            } else {
                Ok(d)
            }
        })
}

fn resolve(what: &str, addr: &str) -> Result<SocketAddr> {
    addr.to_socket_addrs()
        .map_err(|e| Error::Config(format!("{what} {addr:?}: {e}")))?
        .next()
        .ok_or_else(|| Error::Config(format!("{what} {addr:?} resolves to nothing")))
}

/// A socket path of this process alone: port 0 (any free port) is not unique, so several
/// daemons in one process are told apart by a counter.
fn default_shm_socket(listen: SocketAddr) -> PathBuf {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let name = format!("asyncflow-store-{}-{}-{n}.sock", std::process::id(), listen.port());
    std::env::temp_dir().join(name)
}

/// How many connections are served, and how long one may take to say hello or stay idle.
struct Places {
    max_connections: usize,
    max_unauthenticated: usize,
    evict_idle_after: Duration,
    hello_timeout: Duration,
}

impl Places {
    fn of(f: &Flags) -> Result<Self> {
        let max_connections = f.max_connections.unwrap_or(1024);
        if max_connections == 0 {
            return Err(Error::Config("--max-connections must be at least 1".into()));
        }
        let max_unauthenticated = f.max_unauthenticated.unwrap_or(64);
        if max_unauthenticated == 0 {
            return Err(Error::Config("--max-unauthenticated must be at least 1".into()));
        }
        Ok(Self {
            max_connections,
            max_unauthenticated,
            evict_idle_after: seconds(
                "--evict-idle-after",
                f.evict_idle_after.unwrap_or(60.0),
                MAX_LEASE_SECS,
            )?,
            hello_timeout: seconds("--hello-timeout", f.hello_timeout.unwrap_or(5.0), 3600.0)?,
        })
    }
}

impl Flags {
    /// Parses `args` (without the program name).
    pub fn parse_args<I: IntoIterator<Item = String>>(args: I) -> Result<Self> {
        let command_line = std::iter::once("asyncflow-store".to_owned()).chain(args);
        Flags::try_parse_from(command_line).map_err(|e| Error::Config(e.render().to_string()))
    }

    /// With the environment's token and the file's settings: a flag wins over the environment,
    /// which wins over the file. An empty variable is not set (as clients read it); an empty
    /// flag or key is a mistake (see `check_token`): auth is never dropped by an empty value.
    fn with_file(mut self) -> Result<Self> {
        if self.token.is_none() {
            self.token = std::env::var(TOKEN_ENV).ok().filter(|t| !t.is_empty());
        }
        let Some(path) = self.config.take() else {
            return Ok(self);
        };
        let text = std::fs::read_to_string(&path)
            .map_err(|e| Error::Config(format!("{}: {e}", path.display())))?;
        let file: Flags = toml::from_str(&text).map_err(|e| file_error(&path, &text, &e))?;
        Ok(Flags {
            config: Some(path),
            listen: self.listen.or(file.listen),
            shards: self.shards.or(file.shards),
            memory_limit: self.memory_limit.or(file.memory_limit),
            lease_timeout: self.lease_timeout.or(file.lease_timeout),
            reconnect_grace: self.reconnect_grace.or(file.reconnect_grace),
            token: self.token.or(file.token),
            metrics: self.metrics.or(file.metrics),
            log_level: self.log_level.or(file.log_level),
            log_json: self.log_json || file.log_json,
            insecure: self.insecure || file.insecure,
            shm_socket: self.shm_socket.or(file.shm_socket),
            no_shm: self.no_shm || file.no_shm,
            role: self.role.or(file.role),
            storage: if self.storage.is_empty() { file.storage } else { self.storage },
            max_frame: self.max_frame.or(file.max_frame),
            data_dir: self.data_dir.or(file.data_dir),
            fsync: self.fsync.or(file.fsync),
            compact_after: self.compact_after.or(file.compact_after),
            recover: self.recover || file.recover,
            max_connections: self.max_connections.or(file.max_connections),
            evict_idle_after: self.evict_idle_after.or(file.evict_idle_after),
            max_unauthenticated: self.max_unauthenticated.or(file.max_unauthenticated),
            hello_timeout: self.hello_timeout.or(file.hello_timeout),
            max_connection_bytes: self.max_connection_bytes.or(file.max_connection_bytes),
            max_transit_bytes: self.max_transit_bytes.or(file.max_transit_bytes),
        })
    }

    /// Merges the environment and the configuration file, and checks every value.
    pub fn resolve(self) -> Result<Config> {
        let f = self.with_file()?;
        check_token(f.token.as_deref())?;
        let Places { max_connections, max_unauthenticated, evict_idle_after, hello_timeout } =
            Places::of(&f)?;
        let listen = resolve("--listen", f.listen.as_deref().unwrap_or("127.0.0.1:7379"))?;
        let token = f.token;
        if !listen.ip().is_loopback() && token.is_none() && !f.insecure {
            return Err(Error::Config(format!(
                "refusing to serve {listen} (not loopback) without --token; pass --insecure to \
                 allow any client on the network"
            )));
        }
        let lease_timeout =
            seconds("--lease-timeout", f.lease_timeout.unwrap_or(30.0), MAX_LEASE_SECS)?;
        let reconnect_grace =
            seconds("--reconnect-grace", f.reconnect_grace.unwrap_or(5.0), MAX_LEASE_SECS)?;
        let shards = f.shards.unwrap_or(8);
        if !(1..=MAX_SHARDS).contains(&shards) {
            return Err(Error::Config(format!(
                "--shards must be from 1 to {MAX_SHARDS}, not {shards}"
            )));
        }
        let log_level = f.log_level.unwrap_or_else(|| "info".into());
        check_log_level(&log_level)?;
        let role = match f.role.unwrap_or(RoleFlag::Standalone) {
            RoleFlag::Standalone => Role::Standalone,
            RoleFlag::Controller => Role::Controller,
            RoleFlag::Storage => Role::Storage,
        };
        if (role == Role::Controller) == f.storage.is_empty() {
            return Err(Error::Config("--storage is given exactly for --role controller".into()));
        }
        for address in &f.storage {
            check_host_port("--storage", address)?;
        }
        let max_payload = match f.max_frame.as_deref() {
            Some(text) => size_flag("--max-frame", text)?,
            None => 1 << 30,
        };
        let max_payload = u32::try_from(max_payload)
            .map_err(|_| Error::Config("--max-frame must be below 4GiB".into()))?;
        let persist = match f.data_dir {
            None if f.fsync.is_some() || f.compact_after.is_some() || f.recover => {
                return Err(Error::Config(
                    "--fsync, --compact-after and --recover need --data-dir".into(),
                ));
            }
            None => None,
            Some(dir) => Some(PersistConfig {
                dir,
                fsync: Fsync::parse(f.fsync.as_deref().unwrap_or("always"))
                    .map_err(Error::Config)?,
                compact_after: match f.compact_after.as_deref() {
                    Some(text) => size_flag("--compact-after", text)?,
                    None => 256 << 20,
                },
                recover: f.recover,
            }),
        };
        let max_connection_bytes = match f.max_connection_bytes.as_deref() {
            Some(text) => size_flag("--max-connection-bytes", text)?,
            None => 2 * u64::from(max_payload),
        };
        if max_connection_bytes < u64::from(max_payload) {
            return Err(Error::Config(
                "--max-connection-bytes must hold at least one frame of --max-frame".into(),
            ));
        }
        Ok(Config {
            listen,
            shards,
            memory_limit: f
                .memory_limit
                .as_deref()
                .map(|text| size_flag("--memory-limit", text))
                .transpose()?,
            lease_timeout,
            reconnect_grace,
            token,
            metrics: f.metrics.as_deref().map(|m| resolve("--metrics", m)).transpose()?,
            log_level,
            log_json: f.log_json,
            shm_socket: (!f.no_shm)
                .then(|| f.shm_socket.unwrap_or_else(|| default_shm_socket(listen))),
            role,
            storage: f.storage,
            limits: Limits { max_payload, ..Limits::DEFAULT },
            persist,
            max_connections,
            evict_idle_after,
            max_unauthenticated,
            hello_timeout,
            max_connection_bytes,
            max_transit_bytes: match f.max_transit_bytes.as_deref() {
                Some(text) => size_flag("--max-transit-bytes", text)?,
                None => 256 << 20,
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(args: &[&str]) -> Result<Config> {
        Flags::parse_args(args.iter().map(|s| (*s).to_owned()))?.resolve()
    }

    #[test]
    fn sizes_use_binary_and_decimal_units() {
        assert_eq!(parse_size("4GiB").unwrap(), 4 << 30);
        assert_eq!(parse_size("512MB").unwrap(), 512_000_000);
        assert_eq!(parse_size("1.5KiB").unwrap(), 1536);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert!(parse_size("lots").is_err());
    }

    #[test]
    fn defaults_serve_loopback_with_shared_memory() {
        let c = config(&[]).unwrap();
        assert_eq!(c.listen.to_string(), "127.0.0.1:7379");
        assert_eq!((c.shards, c.lease_timeout), (8, Duration::from_secs(30)));
        assert_eq!(c.reconnect_grace, Duration::from_secs(5));
        assert!(c.shm_socket.is_some() && c.token.is_none());
    }

    #[test]
    fn a_public_address_needs_a_token_or_insecure() {
        assert!(matches!(config(&["--listen", "0.0.0.0:0"]), Err(Error::Config(_))));
        assert!(config(&["--listen", "0.0.0.0:0", "--token", "t"]).is_ok());
        assert!(config(&["--listen", "0.0.0.0:0", "--insecure"]).is_ok());
    }

    #[test]
    fn the_file_fills_in_what_flags_leave_out() {
        let path = std::env::temp_dir().join(format!("af-config-{}.toml", std::process::id()));
        std::fs::write(&path, "shards = 3\nmemory-limit = \"1MiB\"\nlease-timeout = 2.5\n")
            .unwrap();
        let c = config(&["--config", path.to_str().unwrap(), "--shards", "5"]).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!((c.shards, c.memory_limit), (5, Some(1 << 20)));
        assert_eq!(c.lease_timeout, Duration::from_secs_f64(2.5));
    }

    #[test]
    fn persistence_is_off_unless_a_data_dir_is_given() {
        assert!(config(&[]).unwrap().persist.is_none());
        let c = config(&["--data-dir", "/tmp/x", "--fsync", "50ms"]).unwrap();
        let p = c.persist.unwrap();
        assert_eq!(p.fsync, Fsync::Every(Duration::from_millis(50)));
        assert_eq!(p.compact_after, 256 << 20);
        assert_eq!(
            config(&["--data-dir", "/tmp/x"]).unwrap().persist.unwrap().fsync,
            Fsync::Always
        );
        assert!(config(&["--fsync", "always"]).is_err(), "--fsync alone means a mistake");
        assert!(config(&["--data-dir", "/tmp/x", "--fsync", "often"]).is_err());
    }

    #[test]
    fn recover_is_a_flag_and_a_file_key_and_needs_a_data_dir() {
        assert!(!config(&["--data-dir", "/tmp/x"]).unwrap().persist.unwrap().recover);
        assert!(config(&["--data-dir", "/tmp/x", "--recover"]).unwrap().persist.unwrap().recover);
        assert!(config(&["--recover"]).is_err(), "--recover alone means a mistake");
        let path = std::env::temp_dir().join(format!("af-recover-{}.toml", std::process::id()));
        std::fs::write(&path, "data-dir = \"/tmp/x\"\nrecover = true\n").unwrap();
        let c = config(&["--config", path.to_str().unwrap()]);
        std::fs::remove_file(&path).unwrap();
        assert!(c.unwrap().persist.unwrap().recover);
    }

    #[test]
    fn connection_limits_have_defaults_and_sane_bounds() {
        let c = config(&["--max-frame", "1MiB"]).unwrap();
        assert_eq!((c.max_connections, c.max_connection_bytes), (1024, 2 << 20));
        assert!(config(&["--max-connections", "0"]).is_err());
        assert_eq!((c.max_unauthenticated, c.hello_timeout), (64, Duration::from_secs(5)));
        assert_eq!(c.evict_idle_after, Duration::from_secs(60));
        assert!(config(&["--max-frame", "1MiB", "--max-connection-bytes", "1KiB"]).is_err());
    }

    #[test]
    fn hostile_numbers_are_refused_naming_the_flag() {
        let hostile = ["1e20", "-1", "nan", "NaN", "inf", "-inf", "0", "1e400", "", "x"];
        let numeric = [
            "--lease-timeout",
            "--reconnect-grace",
            "--shards",
            "--memory-limit",
            "--max-frame",
            "--compact-after",
            "--max-connections",
            "--evict-idle-after",
            "--max-unauthenticated",
            "--hello-timeout",
            "--max-connection-bytes",
            "--max-transit-bytes",
            "--fsync",
        ];
        for flag in numeric {
            for value in hostile {
                let mut args = vec![flag, value];
                if matches!(flag, "--compact-after" | "--fsync") {
                    args.extend(["--data-dir", "/tmp/x"]);
                }
                // No value may panic; a refusal names the flag.
                match config(&args) {
                    Err(e) => assert!(e.to_string().contains(flag), "{flag} {value:?}: {e}"),
                    Ok(c) => panic!("{flag} {value:?} was accepted: {c:?}"),
                }
            }
        }
        // Huge but finite values and units are refused, not wrapped or saturated.
        for args in [
            ["--lease-timeout", "1e300"],
            ["--memory-limit", "99999999999999999999TiB"],
            ["--memory-limit", "1e20"],
            ["--shards", "99999999999"],
            ["--max-frame", "5GiB"],
            ["--log-level", "loud=[[["],
        ] {
            let err = config(&args).unwrap_err().to_string();
            assert!(err.contains(args[0]), "{args:?}: {err}");
        }
        let fsync = config(&["--data-dir", "/tmp/x", "--fsync", "1e20s"]).unwrap_err();
        assert!(fsync.to_string().contains("--fsync"), "{fsync}");
        // The file's values are checked the same way.
        let path = std::env::temp_dir().join(format!("af-hostile-{}.toml", std::process::id()));
        for line in [
            "lease-timeout = 1e20",
            "lease-timeout = nan",
            "lease-timeout = -inf",
            "reconnect-grace = -1.0",
            "reconnect-grace = 1e20",
        ] {
            std::fs::write(&path, line).unwrap();
            let err = config(&["--config", path.to_str().unwrap()]).unwrap_err().to_string();
            let key = line.split(' ').next().unwrap();
            assert!(err.contains(key), "{line}: {err}");
        }
        std::fs::remove_file(&path).unwrap();
        // And the daemon exits 2, as for a usage error, without starting.
        for args in [["--lease-timeout", "1e20"], ["--lease-timeout", "-1"], ["--shards", "0"]] {
            assert_eq!(crate::run(args.map(str::to_owned)), 2, "{args:?}");
        }
    }

    #[test]
    fn a_controller_needs_storage_daemons() {
        assert!(config(&["--role", "controller"]).is_err());
        assert!(config(&["--role", "controller", "--storage", "127.0.0.1:1,127.0.0.1:2"]).is_ok());
        assert!(config(&["--storage", "127.0.0.1:1"]).is_err());
        for bad in ["127.0.0.1:1,", "127.0.0.1:1,not an address", "host:99999", ":7379"] {
            let err = config(&["--role", "controller", "--storage", bad]).unwrap_err();
            assert!(err.to_string().contains("is not HOST:PORT"), "{bad:?}: {err}");
        }
    }

    /// Writes `text` to a file of this test's own and resolves `args` with it as `--config`.
    fn with_file(name: &str, text: &str, args: &[&str]) -> Result<Config> {
        let path = std::env::temp_dir().join(format!("af-{name}-{}.toml", std::process::id()));
        std::fs::write(&path, text).unwrap();
        let mut all = vec!["--config", path.to_str().unwrap()];
        all.extend(args);
        let c = config(&all);
        std::fs::remove_file(&path).unwrap();
        c
    }

    #[test]
    fn an_empty_token_is_refused_not_taken_for_none() {
        let empty = |c: Result<Config>| c.unwrap_err().to_string().contains("token is empty");
        assert!(empty(config(&["--token", ""])));
        assert!(empty(with_file("empty-token", "token = \"\"\n", &[])));
        // Nor does an empty flag hide the file's token.
        assert!(empty(with_file("token-and-empty", "token = \"s3cret\"\n", &["--token", ""])));
        let flag_wins = with_file("token-flag", "token = \"s3cret\"\n", &["--token", "other"]);
        assert_eq!(flag_wins.unwrap().token.as_deref(), Some("other"));
    }

    #[test]
    fn a_file_error_on_the_token_line_does_not_quote_the_token() {
        for line in ["token = Sup3rSecret", "token = 123456789", "\"token\" = 123456789"] {
            let err = with_file("bad-token", &format!("shards = 2\n{line}\n"), &[])
                .unwrap_err()
                .to_string();
            let secret = line.rsplit(' ').next().unwrap();
            assert!(!err.contains(secret) && err.contains("line 2: token"), "{line}: {err}");
        }
        // Other mistakes say what is wrong, and where.
        let err = with_file("bad-shards", "shards = \"x\"\n", &[]).unwrap_err().to_string();
        assert!(err.contains("line 1") && err.contains("invalid type"), "{err}");
    }

    #[test]
    fn sizes_in_the_file_may_be_numbers_of_bytes() {
        let text = "memory-limit = 1048576\nmax-transit-bytes = \"64MiB\"\n";
        let c = with_file("sizes", text, &[]).unwrap();
        assert_eq!((c.memory_limit, c.max_transit_bytes), (Some(1 << 20), 64 << 20));
    }

    #[test]
    fn a_log_level_is_a_level_or_a_directive() {
        for level in ["warning", "verbose", "warn,info"] {
            let err = config(&["--log-level", level]).unwrap_err().to_string();
            assert!(err.contains("--log-level") && err.contains("not one of"), "{level}: {err}");
        }
        for level in
            ["warn", "WARN", "off", "asyncflow_server=debug", "warn,asyncflow_server=trace"]
        {
            assert!(config(&["--log-level", level]).is_ok(), "{level}");
        }
    }
}
