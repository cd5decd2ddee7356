//! A connection to a daemon that outlives its sockets. When the link breaks (the daemon
//! restarted, or the network hiccuped), the next request connects again, backing off from
//! `BACKOFF_FIRST` to `BACKOFF_MAX` with jitter, for up to the policy's reconnect timeout; then
//! it fails with an error that names the daemon, how long it tried and why it failed.
//!
//! Leases this client holds are named in the hello of every new link, so the daemon keeps them
//! for it instead of giving them back once the old link's `--reconnect-grace` is over.
//!
//! A request that was in flight when its link broke is sent again on the new link only if that
//! cannot change its outcome: reads, and claims (a claim whose reply was lost leaves a lease
//! that expires, so its rows are delivered again all the same). Puts, acks and the other
//! changes fail instead, saying that they may or may not have been applied.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use asyncflow_core::{StoreError, Wait};
use asyncflow_proto::{Request, ServerHello};
use parking_lot::Mutex;

use super::link::{Answer, Link, Pending, Preference};
use crate::error::{Error, Result};

const BACKOFF_FIRST: Duration = Duration::from_millis(25);
const BACKOFF_MAX: Duration = Duration::from_secs(2);
/// The most leases a hello names (those that run out last): a hello is small.
const MAX_HELLO_LEASES: usize = 4096;

/// How long a client waits on the daemon before it says so.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Policy {
    /// The longest a request waits for its reply beyond its own timeout (and for connecting,
    /// the hello, and each write); also how long a daemon may stay silent, pings unanswered,
    /// before its link is given up.
    pub request_timeout: Duration,
    /// How long a broken link is tried again before requests fail.
    pub reconnect_timeout: Duration,
}

impl Default for Policy {
    fn default() -> Self {
        Self {
            request_timeout: Duration::from_secs(60),
            reconnect_timeout: Duration::from_secs(30),
        }
    }
}

impl Policy {
    /// How often a silent daemon is pinged while requests wait on it.
    pub fn ping_interval(&self) -> Duration {
        (self.request_timeout / 4).clamp(Duration::from_millis(20), Duration::from_secs(5))
    }

    /// When to give up on the reply to `req` if it has not come.
    pub(crate) fn deadline(&self, req: &Request) -> Option<Instant> {
        let own = match req {
            Request::Claim { timeout, .. } | Request::Stage { timeout, .. } => *timeout,
            Request::Put(p) => p.timeout,
            Request::StoreCells(s) => s.timeout,
            _ => Some(Duration::ZERO),
        };
        // A request that may wait for ever waits for as long as the daemon answers pings.
        own.map(|t| Instant::now() + t + self.request_timeout)
    }
}

/// Whether sending `req` again cannot change what it did.
fn retry_is_safe(req: &Request) -> bool {
    matches!(
        req,
        Request::Claim { .. }
            | Request::Read { .. }
            | Request::Rows { .. }
            | Request::Schema { .. }
            | Request::ReadyFields { .. }
            | Request::Stats
            | Request::Ping
            | Request::RegisterTask { .. }
            | Request::Locate { .. }
            | Request::FetchCells { .. }
    )
}

pub struct Connection {
    address: String,
    token: Option<String>,
    prefer: Preference,
    policy: Policy,
    link: Mutex<Arc<Link>>,
    /// Leases this client holds, with when each runs out (`None`: never).
    leases: Mutex<HashMap<u64, Option<Instant>>>,
}

impl Connection {
    /// Connects to `address` (HOST:PORT) once: a daemon that cannot be reached at first is a
    /// mistake to report at once, not an outage to wait out.
    pub fn open(
        address: &str,
        token: Option<&str>,
        prefer: Preference,
        policy: Policy,
    ) -> Result<Self> {
        let link = Link::open(address, token, prefer, policy)?;
        Ok(Self {
            address: address.to_owned(),
            token: token.map(str::to_owned),
            prefer,
            policy,
            link: Mutex::new(link),
            leases: Mutex::new(HashMap::new()),
        })
    }

    /// Notes a lease this client holds for `left` (`None`: until it is acked or released).
    pub fn hold(&self, lease: u64, left: Option<Duration>) {
        let until = left.and_then(|d| Instant::now().checked_add(d));
        self.leases.lock().insert(lease, until);
    }

    /// Notes that this client holds `lease` no more.
    pub fn forget(&self, lease: u64) {
        self.leases.lock().remove(&lease);
    }

    /// The leases to name in a new link's hello: those that have not run out, the longest-lived
    /// first, at most [`MAX_HELLO_LEASES`].
    fn held(&self) -> Vec<u64> {
        let now = Instant::now();
        let mut leases = self.leases.lock();
        leases.retain(|_, until| until.is_none_or(|u| u > now));
        let mut held: Vec<(Option<Instant>, u64)> =
            leases.iter().map(|(&lease, &until)| (until, lease)).collect();
        // Those that run out last first; one that never runs out before them all.
        held.sort_unstable_by(|a, b| match (a.0, b.0) {
            (None, None) => a.1.cmp(&b.1),
            (None, Some(_)) => std::cmp::Ordering::Less,
            (Some(_), None) => std::cmp::Ordering::Greater,
            (Some(x), Some(y)) => y.cmp(&x),
        });
        held.into_iter().take(MAX_HELLO_LEASES).map(|(_, lease)| lease).collect()
    }

    pub fn hello(&self) -> ServerHello {
        self.link.lock().hello().clone()
    }

    pub fn is_shm(&self) -> bool {
        self.link.lock().is_shm()
    }

    pub fn has_rings(&self) -> bool {
        self.link.lock().has_rings()
    }

    pub fn address(&self) -> &str {
        &self.address
    }

    /// The current link, connecting again first if it broke.
    pub fn link(&self, wait: Wait<'_>) -> Result<Arc<Link>> {
        let mut link = self.link.lock();
        if !link.is_broken() {
            return Ok(Arc::clone(&link));
        }
        let started = Instant::now();
        let mut delay = BACKOFF_FIRST;
        let mut tries = 0u32;
        loop {
            tries += 1;
            let last = match Link::open_holding(
                &self.address,
                self.token.as_deref(),
                self.prefer,
                self.policy,
                &self.held(),
            ) {
                Ok(fresh) => {
                    tracing::info!(address = %self.address, tries, "reconnected to the store daemon");
                    *link = Arc::clone(&fresh);
                    return Ok(fresh);
                }
                // A refused token will not be accepted on the next try either.
                Err(e @ Error::Auth(_)) => return Err(e),
                Err(e) => e,
            };
            let left = self.policy.reconnect_timeout.saturating_sub(started.elapsed());
            if left.is_zero() {
                return Err(Error::connection(format!(
                    "the store daemon at {} is unreachable: tried {tries} times over {:.1}s; last error: {last}",
                    self.address,
                    started.elapsed().as_secs_f64()
                )));
            }
            sleep_interruptibly(jitter(delay).min(left), wait)?;
            delay = (delay * 2).min(BACKOFF_MAX);
        }
    }

    /// The current link for a request that may not go twice: one whose daemon has closed its
    /// end is replaced first, even if its reader has not noticed yet, since a request written
    /// into it is lost with nobody knowing whether it ran.
    pub fn live_link(&self, wait: Wait<'_>) -> Result<Arc<Link>> {
        let link = self.link(wait)?;
        if link.hung_up() { self.link(wait) } else { Ok(link) }
    }

    /// Sends a request on the current link (connecting again first if it broke).
    pub fn send(&self, req: &Request, payload: &[&[u8]], wait: Wait<'_>) -> Result<Pending> {
        let link = if retry_is_safe(req) { self.link(wait)? } else { self.live_link(wait)? };
        match link.send(req, payload) {
            // The link broke before the request was all written, so the daemon never ran it:
            // whatever it is, it may go again on a new link.
            Err(Error::Connection(_)) => self.link(wait)?.send(req, payload),
            sent => sent,
        }
    }

    /// Sends `req` and waits for its answer (see the module documentation for what happens
    /// when the link breaks meanwhile).
    pub fn call(&self, req: &Request, payload: &[&[u8]], wait: Wait<'_>) -> Result<Answer> {
        // Failing to connect again is final; only a link that broke under the request is not.
        let sent = self.send(req, payload, wait)?;
        match sent.wait(wait) {
            Err(Error::Connection(why)) if retry_is_safe(req) => {
                tracing::debug!(address = %self.address, error = %why, "sending a request again on a new link");
                let again = self.send(req, payload, wait).and_then(|sent| sent.wait(wait));
                again.map_err(|e| match e {
                    Error::Connection(then) => Error::connection(format!("{why}; then {then}")),
                    other => other,
                })
            }
            Err(Error::Connection(why)) => Err(Error::connection(format!(
                "{why} (the request may or may not have been carried out)"
            ))),
            other => other,
        }
    }

    /// Sends a request that gets no reply.
    pub fn notify(&self, req: &Request) -> Result<()> {
        self.link(Wait { deadline: None, interrupted: None })?.notify(req)
    }
}

/// `delay` give or take a quarter, so that many clients cut off at once do not all come back in
/// the same instant.
fn jitter(delay: Duration) -> Duration {
    let clock = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let nanos = clock ^ std::process::id().wrapping_mul(2_654_435_761);
    let spread = f64::from(nanos % 1000) / 1000.0 - 0.5;
    delay.mul_f64(1.0 + spread / 2.0)
}

fn sleep_interruptibly(total: Duration, wait: Wait<'_>) -> Result<()> {
    let until = Instant::now() + total;
    loop {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Ok(());
        }
        std::thread::sleep(wait.poll().map_or(left, |poll| left.min(poll)));
        if wait.asked_to_stop() {
            return Err(Error::Store(StoreError::Interrupted));
        }
    }
}
