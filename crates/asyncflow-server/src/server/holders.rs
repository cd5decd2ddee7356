//! Which connection holds each lease. When a connection closes, its leases are kept for
//! `--reconnect-grace` and then given back, so a consumer that crashed has its rows delivered
//! again within seconds rather than at the end of the lease timeout. A client that reconnects
//! within the grace names the leases it still holds in its hello (or acks, releases or renews
//! them on its new connection), and they are its new connection's from then on.

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant};

use asyncflow_proto::{PutRequest, Reply, Request};
use parking_lot::Mutex;
use tokio::sync::Notify;

/// A lease's holder: a connection, or none since `orphaned` (its connection closed then).
#[derive(Debug, Clone, Copy)]
struct Holder {
    session: Option<u64>,
    /// When the lease runs out by itself (`None`: it never does).
    expires: Option<Instant>,
    /// When it is given back, once its connection closed.
    returns: Option<Instant>,
}

#[derive(Default)]
struct Inner {
    by_lease: HashMap<u64, Holder>,
    /// Leases of closed connections, by when they are given back.
    due: BTreeSet<(Instant, u64)>,
    /// How many leases were held after the last sweep of expired ones.
    swept: usize,
}

/// What a request does to the leases its connection holds.
#[derive(Debug, Clone, Copy)]
pub enum Touch {
    None,
    /// A claim: its reply names the lease.
    Claim,
    /// A whole lease acked or released: nobody holds it any more.
    End(u64),
    /// Renewed, or acked or released in part: the connection holds it.
    Keep(u64),
}

impl Touch {
    pub fn of(req: &Request) -> Self {
        match req {
            Request::Claim { .. } => Touch::Claim,
            Request::Ack { lease, subset: None }
            | Request::Release { lease, subset: None }
            | Request::Put(PutRequest { ack: Some(lease), .. }) => Touch::End(*lease),
            Request::Ack { lease, .. }
            | Request::Release { lease, .. }
            | Request::Renew { lease, .. } => Touch::Keep(*lease),
            _ => Touch::None,
        }
    }
}

pub struct Holders {
    grace: Duration,
    inner: Mutex<Inner>,
    /// Wakes the task that gives leases back when one is due sooner than it expected.
    pub wake: Notify,
}

impl Holders {
    pub fn new(grace: Duration) -> Self {
        Self { grace, inner: Mutex::new(Inner::default()), wake: Notify::new() }
    }

    /// Notes what a request that succeeded did to the leases of connection `session`.
    pub fn note(&self, session: u64, touch: Touch, reply: &Reply, now: Instant) {
        let mut inner = self.inner.lock();
        match touch {
            Touch::None => {}
            Touch::Claim => {
                let (Reply::Claimed(claimed) | Reply::ClaimedCells { claimed, .. }) = reply else {
                    return;
                };
                if let Some(lease) = claimed.lease {
                    let expires = claimed.expires_in.and_then(|d| now.checked_add(d));
                    inner.hold(lease, session, expires);
                    inner.sweep(now);
                }
            }
            Touch::End(lease) => inner.forget(lease),
            Touch::Keep(lease) => {
                let expires = match reply {
                    Reply::Renewed(left) => now.checked_add(*left),
                    _ => inner.by_lease.get(&lease).and_then(|h| h.expires),
                };
                if inner.by_lease.contains_key(&lease) || matches!(reply, Reply::Renewed(_)) {
                    inner.hold(lease, session, expires);
                }
            }
        }
    }

    /// A new connection says it holds `leases` (from a connection of the same client that
    /// broke): those still known are its own now. Returns how many were.
    pub fn attach(&self, session: u64, leases: &[u64]) -> usize {
        let mut inner = self.inner.lock();
        let mut kept = 0;
        for &lease in leases {
            if let Some(expires) = inner.by_lease.get(&lease).map(|h| h.expires) {
                inner.hold(lease, session, expires);
                kept += 1;
            }
        }
        kept
    }

    /// Connection `session` closed: its leases are given back once the grace is over.
    pub fn closed(&self, session: u64, now: Instant) {
        let returns = now.checked_add(self.grace).unwrap_or(now);
        let mut inner = self.inner.lock();
        let Inner { by_lease, due, .. } = &mut *inner;
        let mut any = false;
        for (&lease, holder) in by_lease.iter_mut() {
            if holder.session == Some(session) {
                holder.session = None;
                holder.returns = Some(returns);
                due.insert((returns, lease));
                any = true;
            }
        }
        drop(inner);
        if any {
            self.wake.notify_one();
        }
    }

    /// When the next lease is due to be given back.
    pub fn next_due(&self) -> Option<Instant> {
        self.inner.lock().due.first().map(|&(at, _)| at)
    }

    /// Takes the leases due to be given back by `now`.
    pub fn take_due(&self, now: Instant) -> Vec<u64> {
        let mut inner = self.inner.lock();
        let mut out = Vec::new();
        while let Some(&(at, lease)) = inner.due.first() {
            if at > now {
                break;
            }
            inner.due.pop_first();
            if inner.by_lease.get(&lease).is_some_and(|h| h.returns == Some(at)) {
                inner.by_lease.remove(&lease);
                out.push(lease);
            }
        }
        out
    }

    /// Leases held, by a connection or waiting out the grace.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.inner.lock().by_lease.len()
    }
}

impl Inner {
    fn hold(&mut self, lease: u64, session: u64, expires: Option<Instant>) {
        let old =
            self.by_lease.insert(lease, Holder { session: Some(session), expires, returns: None });
        if let Some(at) = old.and_then(|h| h.returns) {
            self.due.remove(&(at, lease));
        }
    }

    fn forget(&mut self, lease: u64) {
        if let Some(at) = self.by_lease.remove(&lease).and_then(|h| h.returns) {
            self.due.remove(&(at, lease));
        }
    }

    /// Drops leases of live connections that ran out by themselves (or were acked in parts),
    /// once the map has doubled since the last sweep: the store forgot them already.
    fn sweep(&mut self, now: Instant) {
        if self.by_lease.len() < 2 * self.swept + 1024 {
            return;
        }
        self.by_lease.retain(|_, h| h.returns.is_some() || h.expires.is_none_or(|e| e > now));
        self.swept = self.by_lease.len();
    }
}

#[cfg(test)]
mod tests {
    use asyncflow_proto::WireClaimed;

    use super::*;

    fn claimed(lease: u64, secs: u64) -> Reply {
        Reply::Claimed(WireClaimed {
            lease: Some(lease),
            rows: vec![1],
            expires_in: Some(Duration::from_secs(secs)),
            ..WireClaimed::default()
        })
    }

    #[test]
    fn a_closed_connections_leases_are_due_after_the_grace() {
        let holders = Holders::new(Duration::from_secs(5));
        let t0 = Instant::now();
        holders.note(1, Touch::Claim, &claimed(10, 3600), t0);
        holders.note(1, Touch::Claim, &claimed(11, 3600), t0);
        holders.note(2, Touch::Claim, &claimed(20, 3600), t0);
        holders.note(1, Touch::End(11), &Reply::Done, t0);
        holders.closed(1, t0);
        assert_eq!(holders.next_due(), Some(t0 + Duration::from_secs(5)));
        assert!(holders.take_due(t0 + Duration::from_secs(4)).is_empty());
        assert_eq!(holders.take_due(t0 + Duration::from_secs(5)), vec![10]);
        // The other connection's lease stays.
        assert_eq!(holders.len(), 1);
        assert_eq!(holders.next_due(), None);
    }

    #[test]
    fn a_lease_named_again_within_the_grace_is_kept() {
        let holders = Holders::new(Duration::from_secs(5));
        let t0 = Instant::now();
        holders.note(1, Touch::Claim, &claimed(10, 3600), t0);
        holders.note(1, Touch::Claim, &claimed(11, 3600), t0);
        holders.note(1, Touch::Claim, &claimed(12, 3600), t0);
        holders.closed(1, t0);
        // A reconnected client names 10 in its hello, renews 11, and an unknown lease.
        assert_eq!(holders.attach(2, &[10, 99]), 1);
        holders.note(2, Touch::Keep(11), &Reply::Renewed(Duration::from_secs(60)), t0);
        assert_eq!(holders.take_due(t0 + Duration::from_secs(6)), vec![12]);
        // The old connection's close, seen late, does not take them from the new one.
        holders.closed(1, t0);
        assert!(holders.take_due(t0 + Duration::from_secs(60)).is_empty());
        holders.closed(2, t0 + Duration::from_secs(60));
        let mut due = holders.take_due(t0 + Duration::from_secs(65));
        due.sort_unstable();
        assert_eq!(due, vec![10, 11]);
    }

    #[test]
    fn leases_that_ran_out_are_swept_as_the_map_grows() {
        let holders = Holders::new(Duration::from_secs(5));
        let t0 = Instant::now();
        for lease in 0..1000 {
            holders.note(1, Touch::Claim, &claimed(lease, 1), t0);
        }
        let later = t0 + Duration::from_secs(2);
        for lease in 1000..1100 {
            holders.note(1, Touch::Claim, &claimed(lease, 3600), later);
        }
        assert!(holders.len() < 200, "{} leases kept", holders.len());
    }
}
