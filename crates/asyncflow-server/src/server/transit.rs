//! Bytes in transit: frames being received and requests running (their metadata, and payloads
//! not yet paid for from the store's memory), and replies queued for a client that has not read
//! them yet. They are held in one pool of `--max-transit-bytes` for the whole daemon, so that
//! with `--memory-limit` the daemon's memory stays within the limit plus this pool plus a fixed
//! overhead, whatever clients send or fail to read. A connection that needs more of the pool
//! than is free stops reading until some is given back (its client's writes then wait in its
//! socket); replies, which cannot wait, may run the pool over, and then every connection with
//! replies queued stops reading until they are written.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::sync::Notify;

pub struct Transit {
    limit: u64,
    used: AtomicU64,
    freed: Notify,
}

/// Bytes taken from the pool, given back on drop.
pub struct TransitGuard {
    pool: Arc<Transit>,
    bytes: u64,
}

impl Drop for TransitGuard {
    fn drop(&mut self) {
        if self.bytes > 0 {
            self.pool.give_back(self.bytes);
        }
    }
}

impl TransitGuard {
    #[cfg(test)]
    fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl Transit {
    pub fn new(limit: u64) -> Arc<Self> {
        Arc::new(Self { limit, used: AtomicU64::new(0), freed: Notify::new() })
    }

    pub fn limit(&self) -> u64 {
        self.limit
    }

    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Acquire)
    }

    /// Whether the pool is over its limit (only replies run it over).
    pub fn over(&self) -> bool {
        self.used() > self.limit
    }

    fn try_take(&self, bytes: u64) -> bool {
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(bytes).filter(|&after| after <= self.limit)
            })
            .is_ok()
    }

    /// Takes `bytes` (at most the limit: the caller checks), waiting until they are free.
    pub async fn take(self: &Arc<Self>, bytes: u64) -> TransitGuard {
        debug_assert!(bytes <= self.limit);
        loop {
            let freed = self.freed.notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            if self.try_take(bytes) {
                return TransitGuard { pool: Arc::clone(self), bytes };
            }
            freed.await;
        }
    }

    /// Takes `bytes` at once, over the limit if need be (for replies, which cannot wait).
    pub fn force(self: &Arc<Self>, bytes: u64) -> TransitGuard {
        self.used.fetch_add(bytes, Ordering::AcqRel);
        TransitGuard { pool: Arc::clone(self), bytes }
    }

    fn give_back(&self, bytes: u64) {
        self.used.fetch_sub(bytes, Ordering::AcqRel);
        self.freed.notify_waiters();
    }

    /// Waits until some bytes are given back.
    pub async fn wait_freed(&self) {
        self.freed.notified().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_take_waits_for_room_and_forced_bytes_run_it_over() {
        let pool = Transit::new(100);
        let a = pool.take(60).await;
        assert!(!pool.try_take(50));
        let waiting = tokio::spawn({
            let pool = Arc::clone(&pool);
            async move { pool.take(50).await.bytes() }
        });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished());
        drop(a);
        assert_eq!(waiting.await.unwrap(), 50);
        assert_eq!(pool.used(), 0);
        let forced = pool.force(150);
        assert!(pool.over());
        drop(forced);
        assert_eq!(pool.used(), 0);
    }
}
