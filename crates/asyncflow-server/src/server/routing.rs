//! Where a request goes once its frame is read: answered on the spot (notices, pings, requests
//! that cannot wait, claims whose rows are there), or left to wait (a claim as a task of the
//! runtime, a put short of memory on the blocking pool), its reply queued for the writer.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use asyncflow_core::{ClaimSpec, Claimable, StoreError, Wait};
use asyncflow_proto::{Failure, PayloadSource, Reply, Request};
use tokio::sync::Notify;
use tokio::sync::futures::OwnedNotified;
use tokio::task::JoinSet;

use super::Daemon;
use super::cells::{Payload, extent};
use super::connection::{Activity, Frame, Replies};
use super::execute::{Execute, Outcome};
use super::outgoing::{Outgoing, ReplyBody};
use super::session::{Session, ShmSession};

/// Runs one request: on the spot if it cannot wait (its reply is returned, for the reader to
/// write), otherwise on the blocking pool (its reply is queued for the writer task).
pub(super) fn dispatch(
    daemon: &Arc<Daemon>,
    session: &Arc<Session>,
    tx: &Replies,
    tasks: &mut JoinSet<u64>,
    in_flight: &mut u64,
    activity: &Arc<Activity>,
    frame: Frame,
) -> Option<Outgoing> {
    let id = frame.header.request_id;
    let req = match Request::decode(frame.header.op, &frame.meta, frame.payload.bytes.len() as u64)
    {
        Ok(req) => req,
        Err(e) => {
            daemon.metrics.protocol_errors.fetch_add(1, Ordering::Relaxed);
            return Some(Outgoing::failure(id, &Failure::Protocol(e.to_string())));
        }
    };
    match req {
        Request::Unpin { pins } => {
            if let Some(shm) = &session.shm {
                shm.unpin(&pins);
            }
            return None;
        }
        Request::Cancel { request } => {
            session.cancel(request);
            daemon.claims.wake_all();
            return None;
        }
        Request::Hello(_) => {
            let e = StoreError::bad_request("this connection already said hello");
            return Some(Outgoing::failure(id, &Failure::Store(e)));
        }
        Request::Ping => return Some(Outgoing::reply(id, &Reply::Done, ReplyBody::default())),
        // A staged put may be no larger than an inline one.
        Request::Stage { bytes, give_back, .. }
            if bytes > u64::from(daemon.config.limits.max_payload) =>
        {
            if let (Some(shm), Some(id)) = (&session.shm, give_back) {
                shm.give_back_spare(id);
            }
            return Some(Outgoing::failure(
                id,
                &over_max_frame(bytes, daemon.config.limits.max_payload),
            ));
        }
        _ => {}
    }
    let notice = frame.header.op.is_notice();
    let deadline = match &req {
        Request::Claim { timeout, .. } | Request::Stage { timeout, .. } => {
            timeout.map(|t| Instant::now() + t)
        }
        Request::Put(p) => p.timeout.map(|t| Instant::now() + t),
        Request::StoreCells(s) => s.timeout.map(|t| Instant::now() + t),
        _ => None,
    };
    let answer = |out: Outgoing| (!notice).then_some(out);
    pay_for_spare(daemon, session, &req);
    // What cannot wait runs right here: handing it to another thread would cost more than it.
    let paid = frame.payload.paid.is_some() || frame.payload.bytes.is_empty();
    if !may_wait(&req, session, daemon, paid) {
        let wait = Wait { deadline, interrupted: None };
        let outcome = daemon.execute(session, req, frame.payload, wait);
        return answer(outgoing(daemon, session, id, outcome, notice));
    }
    if let (Request::Claim { spec, .. }, Some(_)) = (&req, daemon.roles.claim_store()) {
        let wake = daemon.claims.for_claim(&spec.fields, spec.whole_groups);
        // Registered before the first look, so no change after it goes unnoticed.
        let woken = next_change(&wake);
        let claim = WaitingClaim { id, req, deadline, started: Instant::now(), wake };
        // Most claims find their rows already there: answered on the spot.
        if let Some(outcome) = claim.look(daemon, session) {
            return Some(outgoing(daemon, session, id, outcome, false));
        }
        let waiter = Waiter::new(daemon, session, tx, activity, id);
        // Its request stays in memory while it waits, counted against the connection's share.
        let bytes = frame.meta.len() as u64;
        *in_flight += bytes;
        tasks.spawn(async move {
            claim.wait(waiter, woken).await;
            bytes
        });
        return None;
    }
    let (daemon, session, tx) = (Arc::clone(daemon), Arc::clone(session), tx.clone());
    let cancelled = session.track(id);
    let unpaid = if frame.payload.paid.is_some() { 0 } else { frame.payload.bytes.len() };
    let bytes = (frame.meta.len() + unpaid) as u64;
    let held = frame.held;
    *in_flight += bytes;
    let activity = Arc::clone(activity);
    activity.busy.fetch_add(1, Ordering::AcqRel);
    tasks.spawn_blocking(move || {
        let interrupted = || {
            cancelled.load(Ordering::Relaxed)
                || session.closed.load(Ordering::Relaxed)
                || daemon.stopping.load(Ordering::Relaxed)
        };
        let wait = Wait { deadline, interrupted: Some(&interrupted) };
        let outcome = daemon.execute(&session, req, frame.payload, wait);
        drop(held);
        session.untrack(id);
        if !notice {
            tx.send(outgoing(&daemon, &session, id, outcome, false));
        }
        activity.last.store(daemon.uptime(), Ordering::Release);
        activity.busy.fetch_sub(1, Ordering::AcqRel);
        bytes
    });
    None
}

/// Wakes the claims waiting on the runtime. Claims asking for the same fields, of whole groups
/// or not, share one `Notify`; a put wakes only those asking for a field it made ready (with
/// many claims waiting for prompts, each put of samples would otherwise wake every one of them
/// to look again), an ack only those of whole groups.
#[derive(Default)]
pub(super) struct ClaimWakes {
    /// One entry per set of fields and whole-groups flag some waiting claim asks for; an entry
    /// no claim holds any more is dropped when a new set comes.
    sets: parking_lot::Mutex<Vec<WakeSet>>,
}

/// What wakes the claims asking for `fields`, of whole groups or not.
struct WakeSet {
    fields: Vec<String>,
    whole_groups: bool,
    wake: Arc<Notify>,
}

impl ClaimWakes {
    /// What wakes a claim asking for `fields` (of whole groups if `whole_groups`).
    fn for_claim(&self, fields: &[String], whole_groups: bool) -> Arc<Notify> {
        let mut sets = self.sets.lock();
        if let Some(set) =
            sets.iter().find(|s| s.fields == fields && s.whole_groups == whole_groups)
        {
            return Arc::clone(&set.wake);
        }
        sets.retain(|s| Arc::strong_count(&s.wake) > 1);
        let wake = Arc::new(Notify::new());
        sets.push(WakeSet { fields: fields.to_vec(), whole_groups, wake: Arc::clone(&wake) });
        wake
    }

    /// Wakes the claims that may have gained rows (`Store::on_change`'s hook).
    pub(super) fn wake(&self, what: Claimable<'_>) {
        for set in self.sets.lock().iter() {
            if what.concerns(&set.fields, set.whole_groups) {
                set.wake.notify_waiters();
            }
        }
    }

    /// Wakes every waiting claim: one was cancelled, lost its connection, or the daemon stops.
    pub(super) fn wake_all(&self) {
        self.wake(Claimable::Any);
    }
}

/// A future that completes at the next `wake`, registered from now on even before it is first
/// polled.
fn next_change(wake: &Arc<Notify>) -> Pin<Box<OwnedNotified>> {
    let mut woken = Box::pin(Arc::clone(wake).notified_owned());
    woken.as_mut().enable();
    woken
}

/// A claim that may wait for its rows. It waits as a task of the runtime, not a thread: woken
/// when the store may have claimable rows (`Store::on_change`), when a lease runs out, at its
/// deadline, or when it is cancelled, its connection closes or the daemon stops.
struct WaitingClaim {
    id: u64,
    req: Request,
    deadline: Option<Instant>,
    started: Instant,
    /// What wakes it (see [`ClaimWakes`]).
    wake: Arc<Notify>,
}

/// Where a waiting claim's reply goes, and what it answers to while it waits. It is counted out
/// when dropped, however the wait ends (answered, or its task dropped or panicking).
struct Waiter {
    daemon: Arc<Daemon>,
    session: Arc<Session>,
    tx: Replies,
    activity: Arc<Activity>,
    cancelled: Arc<std::sync::atomic::AtomicBool>,
    id: u64,
}

impl Waiter {
    /// Tracked (for a cancel) and counted busy before the reader reads on: a cancel may come
    /// next.
    fn new(
        daemon: &Arc<Daemon>,
        session: &Arc<Session>,
        tx: &Replies,
        activity: &Arc<Activity>,
        id: u64,
    ) -> Self {
        let cancelled = session.track(id);
        activity.busy.fetch_add(1, Ordering::AcqRel);
        activity.waiting.fetch_add(1, Ordering::AcqRel);
        daemon.metrics.waiting_claims.fetch_add(1, Ordering::Relaxed);
        Self {
            daemon: Arc::clone(daemon),
            session: Arc::clone(session),
            tx: tx.clone(),
            activity: Arc::clone(activity),
            cancelled,
            id,
        }
    }
}

impl Drop for Waiter {
    fn drop(&mut self) {
        self.session.untrack(self.id);
        self.daemon.metrics.waiting_claims.fetch_sub(1, Ordering::Relaxed);
        self.activity.last.store(self.daemon.uptime(), Ordering::Release);
        self.activity.waiting.fetch_sub(1, Ordering::AcqRel);
        self.activity.busy.fetch_sub(1, Ordering::AcqRel);
    }
}

impl WaitingClaim {
    /// Waits for the claim's rows and queues its reply; `woken` has been registered for the
    /// next change since before the claim's last look.
    async fn wait(self, waiter: Waiter, mut woken: Pin<Box<OwnedNotified>>) {
        let (daemon, session) = (&waiter.daemon, &waiter.session);
        let store = daemon.roles.claim_store().expect("only a daemon that serves claims waits");
        let outcome = loop {
            let settle = self.settle_at().filter(|&at| at > Instant::now());
            match [self.deadline, store.next_lease_deadline(), settle].into_iter().flatten().min() {
                Some(at) => tokio::select! {
                    () = &mut woken => {}
                    () = tokio::time::sleep_until(at.into()) => {}
                },
                None => (&mut woken).await,
            }
            woken = next_change(&self.wake);
            let interrupted = waiter.cancelled.load(Ordering::Relaxed)
                || session.closed.load(Ordering::Relaxed)
                || daemon.stopping.load(Ordering::Relaxed);
            if interrupted {
                break Err(StoreError::Interrupted);
            }
            if let Some(outcome) = self.look(daemon, session) {
                break outcome;
            }
        };
        let reply = outgoing(daemon, session, self.id, outcome, false);
        let tx = waiter.tx.clone();
        drop(waiter); // counted out before the reply can reach the client
        tx.send(reply);
    }

    /// When the claim starts to settle for part of a batch before its deadline, if it does
    /// (`ClaimSpec::partial_after`).
    fn settle_at(&self) -> Option<Instant> {
        let Request::Claim { spec, allow_partial, .. } = &self.req else {
            unreachable!("only claims wait as tasks");
        };
        spec.partial_from(*allow_partial, self.started).ok().flatten()
    }

    /// One look for the rows, without waiting: `None` if the claim should wait on. Past its
    /// deadline it settles for a partial batch if it allows one, or times out; past its
    /// `partial_after`, for a partial batch of at least one row.
    fn look(&self, daemon: &Daemon, session: &Session) -> Option<Outcome> {
        let Request::Claim { spec, allow_partial, timeout, read } = &self.req else {
            unreachable!("only claims wait as tasks");
        };
        let settle_at = match spec.partial_from(*allow_partial, self.started) {
            Ok(at) => at,
            Err(e) => return Some(Err(e)),
        };
        let now = Instant::now();
        let last = self.deadline.is_some_and(|d| now >= d);
        let early = !last && settle_at.is_some_and(|at| now >= at);
        // Each look is a claim that does not wait: whether it settles is decided here.
        let attempt = Request::Claim {
            spec: ClaimSpec { partial_after: None, ..spec.clone() },
            allow_partial: *allow_partial && (last || early),
            timeout: *timeout,
            read: *read,
        };
        let wait = Wait { deadline: Some(now), interrupted: None };
        match daemon.execute(session, attempt, Payload::default(), wait) {
            Err(StoreError::Timeout { what, .. }) if last => {
                Some(Err(StoreError::Timeout { what, waited: now - self.started }))
            }
            Err(StoreError::Timeout { .. }) => None,
            Ok((Reply::Claimed(c) | Reply::ClaimedCells { claimed: c, .. }, _))
                if early && c.lease.is_none() =>
            {
                None
            }
            outcome => Some(outcome),
        }
    }
}

/// Pays now for a put into the connection's spare region if the store has room, as an inline
/// put's bytes are when read: then the put cannot wait.
fn pay_for_spare(daemon: &Daemon, session: &Session, req: &Request) {
    if let (Request::Put(p), Some(shm)) = (req, &session.shm)
        && let PayloadSource::Staged(stage) = p.source
        && daemon.config.memory_limit.is_some()
    {
        let now = Wait { deadline: Some(Instant::now()), interrupted: None };
        let extent = extent(p.columns.iter().flat_map(|c| &c.cells));
        shm.pay_spare(stage, extent, |bytes| daemon.roles.reserve(bytes, now));
    }
}

/// Whether a request can block: claims wait for rows, and under a memory limit puts (and the
/// staging of their shared memory) wait for room — an inline put only if its bytes (`paid`) were
/// not paid for when read, a put in a staged region only if that region is the connection's
/// spare and not paid for yet.
fn may_wait(req: &Request, session: &Session, daemon: &Daemon, paid: bool) -> bool {
    let unpaid = |source: &PayloadSource| match source {
        PayloadSource::Inline => !paid,
        PayloadSource::Staged(id) => session.shm.as_ref().is_some_and(|s| s.is_unpaid_spare(*id)),
        PayloadSource::Elsewhere => false,
    };
    match req {
        Request::Claim { .. } => true,
        Request::Stage { .. } | Request::StoreCells(_) => daemon.config.memory_limit.is_some(),
        Request::Put(p) => daemon.config.memory_limit.is_some() && unpaid(&p.source),
        _ => false,
    }
}

/// The reply frame for a request's outcome; for a `notice`, which gets none, only counted.
fn outgoing(
    daemon: &Daemon,
    session: &Session,
    id: u64,
    outcome: Outcome,
    notice: bool,
) -> Outgoing {
    daemon.metrics.requests.fetch_add(1, Ordering::Relaxed);
    match outcome {
        Ok((reply, answer)) => {
            // A reply that brings no segments of its own can bring a spare region: then the
            // client's next put needs no round trip to stage one.
            let offer = match reply {
                _ if notice => None,
                Reply::Cells { .. }
                | Reply::Staged { .. }
                | Reply::WithSpare { .. }
                | Reply::ClaimedCells { .. } => None,
                _ => session.shm.as_ref().and_then(ShmSession::offer_spare),
            };
            match offer {
                Some((spare, fds)) => {
                    let reply = Reply::WithSpare { reply: Box::new(reply), spare };
                    Outgoing::reply(id, &reply, ReplyBody { fds, ..answer })
                }
                None => Outgoing::reply(id, &reply, answer),
            }
        }
        Err(StoreError::Interrupted) if daemon.stopping.load(Ordering::Relaxed) => {
            Outgoing::failure(id, &Failure::Unavailable("the daemon is shutting down".into()))
        }
        Err(e) => {
            daemon.metrics.request_errors.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(peer = %session.peer, error = %e, "request failed");
            Outgoing::failure(id, &Failure::Store(e))
        }
    }
}

/// The refusal of a put whose payload (`bytes`) is larger than the daemon's `--max-frame`,
/// inline or staged alike.
pub(super) fn over_max_frame(bytes: u64, max_frame: u32) -> Failure {
    Failure::Store(StoreError::bad_request(format!(
        "a put of {bytes} bytes exceeds the daemon's --max-frame of {max_frame}; put fewer rows \
         at once"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(fields: &[&str]) -> Vec<String> {
        fields.iter().map(|f| (*f).to_owned()).collect()
    }

    /// Whether a wake-up registered before `act` has come.
    fn woken_by(wake: &Arc<Notify>, act: impl FnOnce()) -> bool {
        let mut woken = next_change(wake);
        act();
        let waker = std::task::Waker::noop();
        woken.as_mut().poll(&mut std::task::Context::from_waker(waker)).is_ready()
    }

    #[test]
    fn a_put_wakes_only_the_claims_asking_for_a_field_it_made_ready() {
        let wakes = ClaimWakes::default();
        let prompts = wakes.for_claim(&names(&["prompt", "answer"]), false);
        let rewards = wakes.for_claim(&names(&["response", "reward"]), false);
        assert!(Arc::ptr_eq(&prompts, &wakes.for_claim(&names(&["prompt", "answer"]), false)));
        let ready = names(&["reward"]);
        assert!(!woken_by(&prompts, || wakes.wake(Claimable::Fields(&ready))));
        assert!(woken_by(&rewards, || wakes.wake(Claimable::Fields(&ready))));
        assert!(woken_by(&prompts, || wakes.wake_all()));
        assert!(woken_by(&rewards, || wakes.wake(Claimable::Any)));
    }

    #[test]
    fn an_ack_wakes_only_the_claims_of_whole_groups() {
        let wakes = ClaimWakes::default();
        let fields = names(&["reward"]);
        let plain = wakes.for_claim(&fields, false);
        let whole = wakes.for_claim(&fields, true);
        assert!(!Arc::ptr_eq(&plain, &whole));
        assert!(!woken_by(&plain, || wakes.wake(Claimable::Acked)));
        assert!(woken_by(&whole, || wakes.wake(Claimable::Acked)));
    }

    #[test]
    fn a_set_of_fields_no_claim_waits_for_is_forgotten() {
        let wakes = ClaimWakes::default();
        drop(wakes.for_claim(&names(&["once"]), false));
        let kept = wakes.for_claim(&names(&["kept"]), false);
        let sets = wakes.sets.lock();
        assert_eq!(sets.len(), 1);
        assert_eq!(sets[0].fields, names(&["kept"]));
        drop((sets, kept));
    }
}
