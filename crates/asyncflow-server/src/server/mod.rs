//! The daemon: listeners, the role's state, and an orderly stop. See `main.rs` for the start-up
//! order in prose.

mod cells;
mod connection;
mod controller;
mod durable;
mod execute;
mod holders;
mod metadata;
mod metrics;
mod outgoing;
mod ring;
mod roles;
mod routing;
mod session;
mod storage;
mod transit;

use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant, SystemTime};

use asyncflow_core::{Store, StoreConfig, Wait};
use asyncflow_proto::{Request, Role};
use asyncflow_shm::SegmentPool;
use tokio::net::{TcpListener, UnixListener};
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::config::Config;
use crate::error::{Error, Result};
use connection::{Activity, Socket, Ungreeted};
use controller::Controller;
use execute::{Execute, Outcome};
use holders::{Holders, Touch};
use metrics::Metrics;
use roles::Roles;
use session::Session;
use storage::Storage;

/// How long in-flight requests get to finish once a stop is asked for.
const STOP_GRACE: Duration = Duration::from_secs(30);

/// State shared by every connection.
pub struct Daemon {
    pub config: Config,
    roles: Roles,
    /// Segments for the shared-memory path; `None` when it is off.
    pool: Option<SegmentPool>,
    metrics: Metrics,
    /// Set once a stop is asked for: waiting requests give up, the rest finish.
    stopping: AtomicBool,
    /// Wakes the claims waiting on the runtime (see `routing::WaitingClaim`): the store may
    /// have rows for them, or a waiting request was cancelled, lost its connection or the
    /// daemon is stopping.
    claims: Arc<routing::ClaimWakes>,
    /// Connections being served, against `--max-connections`.
    connections: AtomicUsize,
    /// Connections that have not said hello yet, oldest first (see `Ungreeted`).
    unauthenticated: parking_lot::Mutex<std::collections::BTreeMap<u64, Arc<tokio::sync::Notify>>>,
    /// The connections being served, by their place.
    active: parking_lot::Mutex<std::collections::HashMap<u64, Arc<Activity>>>,
    started: Instant,
    /// Drawn at random at the start, sent with every hello (see `ServerHello::instance`).
    instance: u64,
    /// Which connection holds each lease (see `holders.rs`).
    holders: Holders,
    /// Bytes received, running or queued to be sent (see `transit.rs`).
    transit: Arc<transit::Transit>,
}

/// Runs a request for `session`, noting the leases it takes or ends.
impl Execute for Daemon {
    fn execute(
        &self,
        session: &Session,
        req: Request,
        payload: cells::Payload,
        wait: Wait<'_>,
    ) -> Outcome {
        let touch = Touch::of(&req);
        let outcome = self.roles.execute(session, req, payload, wait);
        if let Ok((reply, _)) = &outcome {
            self.holders.note(session.id, touch, reply, Instant::now());
        }
        outcome
    }
}

impl Daemon {
    /// Nanoseconds since the daemon started.
    fn uptime(&self) -> u64 {
        u64::try_from(self.started.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    /// Gives back the leases whose connection closed longer than the grace ago.
    fn give_back_due(&self) {
        for lease in self.holders.take_due(Instant::now()) {
            if self.roles.release_lease(lease) {
                self.metrics.leases_given_back.fetch_add(1, Ordering::Relaxed);
                tracing::info!(lease, "gave back a lease whose connection closed");
            }
        }
    }
}

/// A random number, never 0, that tells this run of a daemon from any other.
fn instance_id() -> u64 {
    use std::hash::{BuildHasher as _, Hasher as _};
    static STARTED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    // The standard hasher's keys are drawn from the operating system's randomness.
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    h.write_u64(STARTED.fetch_add(1, Ordering::Relaxed));
    let since = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
    h.write_u128(since.map_or(0, |d| d.as_nanos()));
    h.finish().max(1)
}

/// Gives back the leases of closed connections as their grace runs out, until the stop.
async fn give_back_leases(daemon: Arc<Daemon>, mut stop: watch::Receiver<bool>) {
    loop {
        let next = daemon.holders.next_due();
        let due = async {
            match next {
                Some(at) => tokio::time::sleep_until(at.into()).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            () = due => daemon.give_back_due(),
            () = daemon.holders.wake.notified() => {}
            _ = stop.wait_for(|s| *s) => return,
        }
    }
}

fn build_roles(config: &Config) -> Result<Roles> {
    let store_config = StoreConfig {
        shards: config.shards,
        memory_limit: config.memory_limit,
        lease_timeout: config.lease_timeout,
    };
    let store = || -> Result<Arc<Store>> {
        let store = Store::new(store_config.clone())?;
        store.set_lease_floor(durable::lease_floor(SystemTime::now()));
        Ok(Arc::new(store))
    };
    Ok(match config.role {
        Role::Standalone => Roles::Standalone(store()?),
        Role::Controller => Roles::Controller(Controller::new(
            store()?,
            config.storage.clone(),
            config.token.clone(),
        )),
        Role::Storage => Roles::Storage(Storage::new(config.shards, config.memory_limit)),
    })
}

/// A socket file nobody accepts on: connecting is refused (a live daemon's socket accepts).
fn stale_socket(path: &Path) -> bool {
    use std::os::unix::fs::FileTypeExt as _;
    let is_socket = std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_socket());
    is_socket
        && std::os::unix::net::UnixStream::connect(path)
            .is_err_and(|e| e.kind() == std::io::ErrorKind::ConnectionRefused)
}

/// Removes the sockets that daemons of this user left in `dir` under the default name
/// (`asyncflow-store-PID-*.sock`) when they were killed: only socket files of this user whose
/// process is gone and that nobody accepts on (a live daemon's socket is not even touched).
pub fn remove_stale_sockets(dir: &Path) {
    use std::os::unix::fs::MetadataExt as _;
    let Ok(me) = std::fs::metadata("/proc/self").map(|m| m.uid()) else { return };
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let socket = Path::new(name).extension().is_some_and(|e| e == "sock");
        let pid = name.strip_prefix("asyncflow-store-").and_then(|rest| rest.split('-').next());
        let Some(pid) = pid.filter(|_| socket).and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        let path = entry.path();
        let gone = !Path::new(&format!("/proc/{pid}")).exists();
        let mine = std::fs::symlink_metadata(&path).is_ok_and(|m| m.uid() == me);
        if gone && mine && stale_socket(&path) && std::fs::remove_file(&path).is_ok() {
            tracing::info!(path = %path.display(), "removed a stale socket of a daemon that died");
        }
    }
}

/// The Unix socket file, removed when the daemon stops or fails to start.
struct SocketFile(PathBuf);

impl Drop for SocketFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// A Unix socket only this user can connect to, replacing a stale file from an earlier run (a
/// socket nobody accepts on); a live daemon's socket, or a file that is no socket, is left be.
fn bind_shm_socket(path: &Path) -> Result<(UnixListener, SocketFile)> {
    if std::fs::symlink_metadata(path).is_ok() {
        if !stale_socket(path) {
            return Err(Error::Config(format!(
                "--shm-socket {}: the path is in use (a live daemon's socket, or not a socket)",
                path.display()
            )));
        }
        std::fs::remove_file(path)?;
    }
    let listener = UnixListener::bind(path)
        .map_err(|e| Error::Config(format!("cannot listen on {}: {e}", path.display())))?;
    let file = SocketFile(path.to_owned());
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    Ok((listener, file))
}

/// A socket clients connect to: TCP, or the Unix socket of the shared-memory path.
enum Listener {
    Tcp(TcpListener),
    Unix(UnixListener),
}

impl Listener {
    async fn accept(&self) -> std::io::Result<(Socket, String)> {
        match self {
            Listener::Tcp(l) => {
                l.accept().await.map(|(s, peer)| (Socket::Tcp(s), peer.to_string()))
            }
            Listener::Unix(l) => l.accept().await.map(|(s, _)| (Socket::Unix(s), "unix".into())),
        }
    }
}

/// Pauses between failed accepts. A listener whose process is out of descriptors (EMFILE) fails
/// at once and again for as long as a connection waits in its backlog: retried without a pause,
/// it spins a core and floods the log. 5 ms, doubling to 1 s, until a connection is accepted;
/// the first failure of a run and the recovery are logged, not each failure.
#[derive(Default)]
pub(crate) struct AcceptBackoff {
    failures: u64,
    pause: Duration,
}

impl AcceptBackoff {
    const FIRST: Duration = Duration::from_millis(5);
    const MOST: Duration = Duration::from_secs(1);

    /// After a failed accept: how long to wait before the next.
    pub(crate) fn failed(&mut self, what: &str, error: &std::io::Error) -> Duration {
        if self.failures == 0 {
            tracing::warn!(error = %error, "{what} failed; retrying with pauses up to 1 s");
        }
        self.failures += 1;
        self.pause =
            if self.pause.is_zero() { Self::FIRST } else { (self.pause * 2).min(Self::MOST) };
        self.pause
    }

    /// After an accepted connection.
    pub(crate) fn accepted(&mut self, what: &str) {
        if self.failures > 0 {
            tracing::info!(failures = self.failures, "{what} succeeds again");
        }
        *self = Self::default();
    }
}

async fn accept_loop(
    daemon: Arc<Daemon>,
    listener: Listener,
    stop: watch::Receiver<bool>,
    conns: Arc<parking_lot::Mutex<JoinSet<()>>>,
) {
    let mut stopped = stop.clone();
    let mut backoff = AcceptBackoff::default();
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = stopped.wait_for(|s| *s) => return,
        };
        match accepted {
            Ok((socket, peer)) => {
                backoff.accepted("accept");
                daemon.metrics.connections.fetch_add(1, Ordering::Relaxed);
                // Until it says hello a connection holds a place of its own kind only, for
                // --hello-timeout at most; it takes one under --max-connections after.
                let ungreeted = Ungreeted::enter(&daemon);
                let task =
                    connection::serve(Arc::clone(&daemon), socket, peer, stop.clone(), ungreeted);
                conns.lock().spawn(task);
            }
            Err(e) => {
                let pause = backoff.failed("accept", &e);
                tokio::select! {
                    () = tokio::time::sleep(pause) => {}
                    _ = stopped.wait_for(|s| *s) => return,
                }
            }
        }
    }
}

/// Resolves with the signal's name at the first SIGTERM or SIGINT. Installed before anything
/// is bound, so a stop asked for during start-up is not lost.
pub fn stop_signal() -> Result<impl Future<Output = &'static str>> {
    let mut terminate = signal(SignalKind::terminate())?;
    let mut interrupt = signal(SignalKind::interrupt())?;
    Ok(async move {
        tokio::select! {
            _ = terminate.recv() => "SIGTERM",
            _ = interrupt.recv() => "SIGINT",
        }
    })
}

/// Serves until `stop` resolves (with the reason), then stops accepting, lets in-flight requests
/// finish and returns. `ready` hears the bound address once clients can connect.
pub async fn serve(
    config: Config,
    ready: impl FnOnce(SocketAddr),
    stop: impl Future<Output = &'static str>,
) -> Result<()> {
    let roles = build_roles(&config)?;
    // Restored before anything is bound: no client sees the store half restored.
    let persistence = durable::open(&config, &roles)?;
    let pool = config.shm_socket.as_ref().map(|_| {
        let cache = config.memory_limit.map_or(1 << 30, |l| l / 2).min(1 << 30);
        SegmentPool::new(cache as usize)
    });

    let tcp = TcpListener::bind(config.listen)
        .await
        .map_err(|e| Error::Config(format!("cannot listen on {}: {e}", config.listen)))?;
    let address = tcp.local_addr()?;
    if config.shm_socket.is_some() {
        remove_stale_sockets(&std::env::temp_dir());
    }
    // Removed on every way out of here, a failed start included.
    let (unix, _socket_file) = match config.shm_socket.as_deref().map(bind_shm_socket) {
        Some(bound) => {
            let (listener, file) = bound?;
            (Some(listener), Some(file))
        }
        None => (None, None),
    };
    let metrics = match config.metrics {
        Some(addr) => Some(
            TcpListener::bind(addr)
                .await
                .map_err(|e| Error::Config(format!("cannot serve metrics on {addr}: {e}")))?,
        ),
        None => None,
    };

    let holders = Holders::new(config.reconnect_grace);
    let transit = transit::Transit::new(config.max_transit_bytes);
    let claims = Arc::new(routing::ClaimWakes::default());
    if let Some(store) = roles.claim_store() {
        let claims = Arc::clone(&claims);
        store.on_change(move |what| claims.wake(what));
    }
    let daemon = Arc::new(Daemon {
        config,
        roles,
        pool,
        metrics: Metrics::default(),
        stopping: AtomicBool::new(false),
        claims,
        connections: AtomicUsize::new(0),
        unauthenticated: parking_lot::Mutex::new(std::collections::BTreeMap::new()),
        active: parking_lot::Mutex::new(std::collections::HashMap::new()),
        started: Instant::now(),
        instance: instance_id(),
        transit,
        holders,
    });
    let maintained = Arc::new(AtomicBool::new(false));
    let maintenance = persistence.map(|persistence| {
        let (daemon, stop) = (Arc::clone(&daemon), Arc::clone(&maintained));
        std::thread::Builder::new()
            .name("asyncflow-persist".into())
            .spawn(move || durable::maintain(&persistence, &daemon.roles, &stop))
            .expect("cannot start the thread that keeps the log")
    });
    let (stop_tx, stop_rx) = watch::channel(false);
    let conns = Arc::new(parking_lot::Mutex::new(JoinSet::new()));
    let mut acceptors = JoinSet::new();
    let listeners = std::iter::once(Listener::Tcp(tcp)).chain(unix.map(Listener::Unix));
    for listener in listeners {
        acceptors.spawn(accept_loop(
            Arc::clone(&daemon),
            listener,
            stop_rx.clone(),
            Arc::clone(&conns),
        ));
    }
    tokio::spawn(give_back_leases(Arc::clone(&daemon), stop_rx.clone()));
    if let Some(listener) = metrics {
        tracing::info!(address = %listener.local_addr()?, "serving metrics");
        tokio::spawn(metrics::serve(Arc::clone(&daemon), listener));
    }
    tracing::info!(address = %address, role = daemon.config.role.name(), shm = ?daemon.config.shm_socket, "serving");
    ready(address);

    let reason = stop.await;
    tracing::info!(reason, "stopping: no new connections, finishing in-flight requests");
    daemon.stopping.store(true, Ordering::Relaxed);
    daemon.claims.wake_all();
    let _ = stop_tx.send(true);
    while acceptors.join_next().await.is_some() {}
    let mut conns = std::mem::take(&mut *conns.lock());
    let drained =
        tokio::time::timeout(STOP_GRACE, async { while conns.join_next().await.is_some() {} })
            .await;
    if drained.is_err() {
        tracing::warn!("in-flight requests did not finish in time; stopping anyway");
    }
    maintained.store(true, Ordering::Relaxed);
    if let Some(thread) = maintenance {
        let _ = thread.join();
    }
    tracing::info!("stopped");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failed_accepts_pause_longer_each_time_up_to_a_second_until_one_succeeds() {
        let mut backoff = AcceptBackoff::default();
        let error = std::io::Error::from_raw_os_error(24);
        let pauses: Vec<u64> =
            (0..10).map(|_| backoff.failed("accept", &error).as_millis() as u64).collect();
        assert_eq!(pauses, [5, 10, 20, 40, 80, 160, 320, 640, 1000, 1000]);
        backoff.accepted("accept");
        assert_eq!(backoff.failed("accept", &error), Duration::from_millis(5));
    }
}
