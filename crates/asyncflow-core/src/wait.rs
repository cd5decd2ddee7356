//! The one blocking discipline shared by every call that can wait (claims waiting for ready rows,
//! puts waiting for memory): sleep on a condition variable, never spin, wake at the caller's
//! deadline or at a time the waiting code names, and give the caller a regular chance to cancel.

use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::error::{Result, StoreError};

/// How often a waiting call asks its caller whether to stop (e.g. to deliver Ctrl-C in Python).
pub const INTERRUPT_POLL: Duration = Duration::from_millis(50);

/// How long a blocking call may wait, and how its caller asks it to stop early.
#[derive(Clone, Copy)]
pub struct Wait<'a> {
    /// `None` waits for ever (still interruptible, if `interrupted` is set).
    pub deadline: Option<Instant>,
    /// Asked every `INTERRUPT_POLL` whether to stop. `None`: nothing can ask, so the wait sleeps
    /// until its deadline or its answer, with no wake-up in between.
    pub interrupted: Option<&'a (dyn Fn() -> bool + Sync)>,
}

impl Wait<'static> {
    /// A wait that only ends at its deadline.
    pub fn until(deadline: Option<Instant>) -> Self {
        Self { deadline, interrupted: None }
    }

    pub fn timeout(timeout: Option<Duration>) -> Self {
        Self::until(timeout.map(|t| Instant::now() + t))
    }
}

impl Wait<'_> {
    /// Whether the caller asks the wait to stop.
    pub fn asked_to_stop(&self) -> bool {
        self.interrupted.is_some_and(|asked| asked())
    }

    /// How long the wait may sleep before asking its caller again: `INTERRUPT_POLL`, or for ever
    /// where nothing can ask.
    pub fn poll(&self) -> Option<Duration> {
        self.interrupted.map(|_| INTERRUPT_POLL)
    }
}

/// What one attempt of a blocking operation concluded.
pub enum Attempt<R> {
    Done(R),
    /// Not yet; try again when notified, or at `wake_at` at the latest.
    Pending {
        wake_at: Option<Instant>,
    },
}

/// Runs `attempt` under `mutex` until it is done, the deadline passes (`Ok(None)`), or the caller
/// interrupts. `attempt` learns through its last argument that this is the final try, so it can
/// settle for a partial result.
pub fn block_on<T, R>(
    mutex: &Mutex<T>,
    cv: &Condvar,
    wait: Wait<'_>,
    mut attempt: impl FnMut(&mut T, Instant, bool) -> Attempt<R>,
) -> Result<Option<R>> {
    let mut last_interrupt_check = Instant::now();
    loop {
        let mut state = mutex.lock();
        let now = Instant::now();
        let last_try = wait.deadline.is_some_and(|d| now >= d);
        match attempt(&mut state, now, last_try) {
            Attempt::Done(r) => return Ok(Some(r)),
            Attempt::Pending { .. } if last_try => return Ok(None),
            Attempt::Pending { wake_at } => {
                let poll = wait.poll().map(|p| now + p);
                match [poll, wait.deadline, wake_at].into_iter().flatten().min() {
                    Some(until) => drop(cv.wait_until(&mut state, until)),
                    None => cv.wait(&mut state),
                }
            }
        }
        drop(state);
        if last_interrupt_check.elapsed() >= INTERRUPT_POLL {
            last_interrupt_check = Instant::now();
            if wait.asked_to_stop() {
                return Err(StoreError::Interrupted);
            }
        }
    }
}
