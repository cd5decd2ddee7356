//! A request sent and waited for: read for by the caller itself for a moment, then handed over
//! by the watcher; and the token that keeps a read's cells pinned.

use std::cell::Cell;
use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use asyncflow_core::{StoreError, Wait};
use asyncflow_proto::Request;

use super::frames::Started;
use super::{Answer, Delivery, Link, timed_out};
use crate::error::{Error, Result};

/// How long a caller reads the socket for its reply before it sleeps until the watcher hands it
/// over.
pub(super) const SPIN: Duration = Duration::from_micros(200);

/// How long a claim the daemon may hold is read for when the thread's last such claim waited
/// longer than `SPIN`: long enough for a reply the daemon sends at once. A worker whose claims
/// wait for rows to be put would otherwise spend `SPIN` of CPU on every one of them.
const SHORT_SPIN: Duration = Duration::from_micros(30);

thread_local! {
    /// Whether this thread's last claim that the daemon could hold waited longer than `SPIN`.
    static LAST_CLAIM_WAITED: Cell<bool> = const { Cell::new(false) };
}

/// A request sent and not yet answered.
pub struct Pending {
    pub(super) link: Arc<Link>,
    pub(super) id: u64,
    pub(super) rx: Receiver<Delivery>,
    /// What the request was, for error messages.
    pub(super) what: &'static str,
    /// When to give up on the reply (see `Policy::deadline`).
    pub(super) deadline: Option<Instant>,
    /// A claim the daemon may hold until rows are ready (one with a timeout other than zero).
    pub(super) may_wait: bool,
}

/// Keeps a read's shared cells pinned on the daemon until the last view of them is dropped.
pub struct PinToken {
    pub(super) link: Weak<Link>,
    pub(super) pin: u64,
}

impl Drop for PinToken {
    fn drop(&mut self) {
        if let Some(link) = self.link.upgrade() {
            link.unpin(self.pin);
        }
    }
}

impl Pending {
    /// Waits for the answer until its deadline (none: for as long as the daemon is alive); if
    /// the caller interrupts or the deadline passes, tells the daemon to stop working on it.
    pub fn wait(self, wait: Wait<'_>) -> Result<Answer> {
        let started = Instant::now();
        let spin = if self.may_wait && LAST_CLAIM_WAITED.get() { SHORT_SPIN } else { SPIN };
        let answer = if let Some(delivery) = self.read_for_itself(started + spin) {
            delivery
        } else {
            self.link.sleep_until_answered(self.id);
            self.sleep(started, wait)
        };
        if self.may_wait {
            LAST_CLAIM_WAITED.set(started.elapsed() > SPIN);
        }
        answer.map(|(reply, payload)| Answer { reply, payload, link: Arc::clone(&self.link) })
    }

    /// Reads the socket on this thread until `until`, whenever nobody else reads it, handing on
    /// replies for others; `None` if the reply has not come by then.
    fn read_for_itself(&self, until: Instant) -> Option<Delivery> {
        let stays = || false;
        // A look at a ring costs no system call: yield the core only now and then.
        let yield_every = if self.link.has_rings() { 64 } else { 1 };
        let mut turns = 0u32;
        loop {
            match self.rx.try_recv() {
                Ok(delivery) => return Some(delivery),
                Err(TryRecvError::Disconnected) => {
                    return Some(Err(Error::connection("connection closed")));
                }
                Err(TryRecvError::Empty) => {}
            }
            if let Some(mut reader) = self.link.reader.try_lock() {
                // One system call finds out whether a frame has come and reads its start.
                let mut started = Started::default();
                match reader.stream.read_now(&mut started.head, &mut started.fds) {
                    Err(e)
                        if matches!(
                            e.kind(),
                            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted
                        ) => {}
                    got => {
                        // Reading on finishes the frame. After nothing read (the daemon hung
                        // up) or an error, it meets the same and breaks the link, saying why.
                        started.have = got.unwrap_or(0);
                        self.link.read_rest_of_one(&mut reader, started, &stays);
                        continue;
                    }
                }
            }
            if Instant::now() >= until {
                return None;
            }
            turns += 1;
            if turns.is_multiple_of(yield_every) {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
    }

    /// Sleeps until the watcher hands the reply over, the caller interrupts, or the deadline
    /// passes.
    fn sleep(&self, started: Instant, wait: Wait<'_>) -> Delivery {
        let deadline = self.deadline;
        loop {
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            let received = match [left, wait.poll()].into_iter().flatten().min() {
                Some(poll) => self.rx.recv_timeout(poll),
                None => self.rx.recv().map_err(|_| RecvTimeoutError::Disconnected),
            };
            match received {
                Ok(delivery) => return delivery,
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(Error::connection("connection closed"));
                }
                Err(RecvTimeoutError::Timeout) => {
                    if wait.asked_to_stop() {
                        self.abandon();
                        return Err(Error::Store(StoreError::Interrupted));
                    }
                    if deadline.is_some_and(|d| Instant::now() >= d) {
                        self.abandon();
                        return Err(timed_out(self.what, &self.link.address, started.elapsed()));
                    }
                }
            }
        }
    }

    fn abandon(&self) {
        self.link.pending.lock().remove(&self.id);
        let _ = self.link.notify(&Request::Cancel { request: self.id });
    }
}
