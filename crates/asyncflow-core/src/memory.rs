//! Memory accounting for payload bytes. A put reserves its bytes before it copies anything, and
//! the reservation travels with the payload chunks it pays for: the bytes return to the budget
//! only when the last reference to a chunk is dropped, so the account never claims memory is free
//! while a reader still holds a view into it.

use std::sync::Arc;
use std::time::Instant;

use parking_lot::{Condvar, Mutex};

use crate::error::{Result, StoreError};
use crate::wait::{Attempt, Wait, block_on};

#[derive(Debug)]
pub struct MemoryBudget {
    limit: Option<u64>,
    used: Mutex<u64>,
    freed: Condvar,
}

impl MemoryBudget {
    /// `limit`: bytes, or `None` for no limit.
    pub fn new(limit: Option<u64>) -> Arc<Self> {
        Arc::new(Self { limit, used: Mutex::new(0), freed: Condvar::new() })
    }

    pub fn limit(&self) -> Option<u64> {
        self.limit
    }

    pub fn used(&self) -> u64 {
        *self.used.lock()
    }

    /// Reserves `bytes`, waiting for room until the wait's deadline. A request larger than the
    /// whole limit fails at once: no amount of waiting can satisfy it.
    pub fn reserve(self: &Arc<Self>, bytes: u64, wait: Wait<'_>) -> Result<MemoryGuard> {
        let Some(limit) = self.limit else {
            *self.used.lock() += bytes;
            return Ok(self.guard(bytes));
        };
        if bytes > limit {
            return Err(StoreError::MemoryLimit(format!(
                "a put of {bytes} bytes can never fit in the {limit}-byte limit"
            )));
        }
        let started = Instant::now();
        let granted = block_on(&self.used, &self.freed, wait, |used, _, _| {
            if *used + bytes <= limit {
                *used += bytes;
                Attempt::Done(())
            } else {
                Attempt::Pending { wake_at: None }
            }
        })?;
        match granted {
            Some(()) => Ok(self.guard(bytes)),
            None => Err(StoreError::MemoryLimit(format!(
                "no room for {bytes} bytes after waiting {:.3}s ({} of {limit} bytes in use)",
                started.elapsed().as_secs_f64(),
                self.used(),
            ))),
        }
    }

    fn guard(self: &Arc<Self>, bytes: u64) -> MemoryGuard {
        MemoryGuard { budget: Arc::clone(self), bytes }
    }

    fn release(&self, bytes: u64) {
        if bytes == 0 {
            return;
        }
        let mut used = self.used.lock();
        *used -= bytes;
        drop(used);
        self.freed.notify_all();
    }
}

/// Reserved bytes; returned to the budget on drop.
#[derive(Debug)]
pub struct MemoryGuard {
    budget: Arc<MemoryBudget>,
    bytes: u64,
}

impl MemoryGuard {
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Carves `bytes` out of this reservation into a guard of its own (e.g. one per chunk).
    pub fn split(&mut self, bytes: u64) -> Result<MemoryGuard> {
        if bytes > self.bytes {
            return Err(StoreError::bad_request(format!(
                "cannot take {bytes} bytes from a reservation of {}",
                self.bytes
            )));
        }
        self.bytes -= bytes;
        Ok(MemoryGuard { budget: Arc::clone(&self.budget), bytes })
    }
}

impl Drop for MemoryGuard {
    fn drop(&mut self) {
        self.budget.release(self.bytes);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn guards_return_their_bytes_on_drop() {
        let budget = MemoryBudget::new(Some(100));
        let mut g = budget.reserve(60, Wait::timeout(Some(Duration::ZERO))).unwrap();
        let part = g.split(20).unwrap();
        assert_eq!(budget.used(), 60);
        drop(g);
        assert_eq!(budget.used(), 20);
        drop(part);
        assert_eq!(budget.used(), 0);
    }

    #[test]
    fn a_request_larger_than_the_limit_fails_at_once() {
        let budget = MemoryBudget::new(Some(100));
        let err = budget.reserve(101, Wait::timeout(None)).unwrap_err();
        assert!(matches!(err, StoreError::MemoryLimit(_)));
        assert_eq!(budget.used(), 0);
    }

    #[test]
    fn a_full_budget_times_out_then_admits_after_release() {
        let budget = MemoryBudget::new(Some(100));
        let held = budget.reserve(80, Wait::timeout(None)).unwrap();
        let err = budget.reserve(40, Wait::timeout(Some(Duration::from_millis(20)))).unwrap_err();
        assert!(matches!(err, StoreError::MemoryLimit(_)));
        let waiter = {
            let budget = Arc::clone(&budget);
            std::thread::spawn(move || {
                budget.reserve(40, Wait::timeout(Some(Duration::from_secs(10))))
            })
        };
        std::thread::sleep(Duration::from_millis(20));
        drop(held);
        let g = waiter.join().unwrap().unwrap();
        assert_eq!(g.bytes(), 40);
        assert_eq!(budget.used(), 40);
    }
}
