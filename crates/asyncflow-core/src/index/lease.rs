//! Leases: a claim's promise that its rows are the holder's alone, for this task, until a
//! deadline. Ack commits the rows (once: the lease is gone afterwards); release or expiry returns
//! them to the pool, which is what makes delivery at-least-once and commits exactly-once.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use super::{Index, TaskId};
use crate::error::{Result, StoreError};

pub type LeaseId = u64;

/// How many expired lease ids are remembered, so a late ack hears "expired" not "unknown".
const REMEMBERED_EXPIRIES: usize = 4096;

#[derive(Debug)]
struct Lease {
    task: TaskId,
    rows: Vec<u64>,
    deadline: Instant,
}

#[derive(Debug, Default)]
pub(super) struct Leases {
    next_id: LeaseId,
    /// Ids below this were granted by an earlier run of the daemon.
    floor: LeaseId,
    active: HashMap<LeaseId, Lease>,
    /// Deadlines, soonest first; entries for leases already gone or renewed are skipped.
    expiry: BinaryHeap<Reverse<(Instant, LeaseId)>>,
    expired: VecDeque<LeaseId>,
    expired_set: HashSet<LeaseId>,
}

impl Leases {
    pub(super) fn grant(&mut self, task: TaskId, rows: Vec<u64>, deadline: Instant) -> LeaseId {
        self.next_id += 1;
        let id = self.next_id;
        self.active.insert(id, Lease { task, rows, deadline });
        self.expiry.push(Reverse((deadline, id)));
        id
    }

    pub(super) fn active(&self) -> usize {
        self.active.len()
    }

    /// Makes every id granted from now on at least `floor`.
    pub(super) fn raise_floor(&mut self, floor: u64) {
        self.next_id = self.next_id.max(floor.saturating_sub(1));
        self.floor = self.floor.max(floor);
    }

    /// A fresh id from the lease id space, for holders that share a lease (see `shared.rs`).
    pub(super) fn reserve_id(&mut self) -> LeaseId {
        self.next_id += 1;
        self.next_id
    }

    /// Rows an active lease still holds, and its deadline.
    pub(super) fn holding(&self, id: LeaseId) -> Option<(&[u64], Instant)> {
        self.active.get(&id).map(|l| (l.rows.as_slice(), l.deadline))
    }

    fn remember_expired(&mut self, id: LeaseId) {
        if self.expired.len() == REMEMBERED_EXPIRIES
            && let Some(old) = self.expired.pop_front()
        {
            self.expired_set.remove(&old);
        }
        self.expired.push_back(id);
        self.expired_set.insert(id);
    }

    pub(super) fn missing(&self, id: LeaseId) -> StoreError {
        let reason = if self.expired_set.contains(&id) {
            "expired before it was acked; its rows were handed out again"
        } else if id < self.floor {
            "from before the daemon restarted (leases do not survive a restart); its rows that \
             were not acked are delivered again"
        } else {
            "unknown, or already acked or released"
        };
        StoreError::Lease { id, reason: reason.to_owned() }
    }
}

impl Index {
    /// The soonest lease deadline, if any: a waiting claim should look again then.
    pub fn next_lease_deadline(&self) -> Option<Instant> {
        self.leases.expiry.peek().map(|Reverse((d, _))| *d)
    }

    /// Returns the rows of every lease past its deadline to the pool; returns how many leases
    /// expired.
    pub fn expire_leases(&mut self, now: Instant) -> usize {
        let mut expired = 0;
        while let Some(&Reverse((deadline, id))) = self.leases.expiry.peek() {
            if deadline > now {
                break;
            }
            self.leases.expiry.pop();
            if self.leases.active.get(&id).is_some_and(|l| l.deadline <= now) {
                self.end_lease(id);
                self.leases.remember_expired(id);
                self.counters.leases_expired += 1;
                expired += 1;
            }
        }
        expired
    }

    /// Checks that a lease is active at `now` and that `subset` (if given) lies inside it.
    pub(super) fn check_lease(
        &mut self,
        id: LeaseId,
        subset: Option<&[u64]>,
        now: Instant,
    ) -> Result<()> {
        let Some(lease) = self.leases.active.get(&id) else {
            return Err(self.leases.missing(id));
        };
        if lease.deadline <= now {
            self.expire_leases(now);
            return Err(self.leases.missing(id));
        }
        if let Some(subset) = subset {
            let held: HashSet<u64> = lease.rows.iter().copied().collect();
            if let Some(bad) = subset.iter().find(|i| !held.contains(i)) {
                return Err(StoreError::Lease {
                    id,
                    reason: format!("row {bad} is not held by this lease"),
                });
            }
        }
        Ok(())
    }

    /// Commits rows of a lease (all of them, or `subset`) for its task. Rows every registered task
    /// has now acked are freed (unless pinned); their indexes are returned so the caller can drop
    /// their payloads.
    pub fn ack(&mut self, id: LeaseId, subset: Option<&[u64]>, now: Instant) -> Result<Vec<u64>> {
        if self.shared.is_seat(id) {
            return self.ack_seat(id, subset, now);
        }
        self.check_lease(id, subset, now)?;
        let (task, rows) = self.take_rows(id, subset);
        self.tasks[task as usize].leased_rows -= rows.len() as u64;
        let live: Vec<u64> = rows.into_iter().filter(|&i| self.is_live(i)).collect();
        if self.journal.is_some() {
            let rows = live.clone();
            self.note(|| super::Change::Acked { task, rows });
        }
        Ok(self.commit_rows(task, &live))
    }

    /// Marks live `rows` acked by `task` (and busy, so it never claims them again); frees the
    /// rows every task that must has now acked, unless pinned. Returns the freed rows.
    pub(super) fn commit_rows(&mut self, task: TaskId, rows: &[u64]) -> Vec<u64> {
        let mut freed = Vec::new();
        for &index in rows {
            let Some(slot) = self.slot(index).filter(|&s| self.live.get(s)) else {
                continue;
            };
            let t = &mut self.tasks[task as usize];
            t.busy.set(slot);
            if !t.acked.set(slot) {
                continue;
            }
            t.acked_rows += 1;
            self.counters.rows_acked += 1;
            let meta = &mut self.rows[slot];
            meta.acks += 1;
            let part = &self.partitions[meta.partition as usize];
            if meta.acks >= part.required_acks && !part.pinned {
                self.free_slot(slot);
                freed.push(index);
            }
        }
        self.advance_low_water(task);
        if !freed.is_empty() {
            self.compact();
        }
        freed
    }

    /// Hands rows of a lease (all, or `subset`) back at once, to be delivered again.
    pub fn release(&mut self, id: LeaseId, subset: Option<&[u64]>, now: Instant) -> Result<()> {
        if self.shared.is_seat(id) {
            return self.release_seat(id, subset, now);
        }
        self.check_lease(id, subset, now)?;
        let (task, rows) = self.take_rows(id, subset);
        self.return_rows(task, &rows);
        self.counters.rows_released += rows.len() as u64;
        Ok(())
    }

    /// Hands back a lease whose holder went away (its connection closed); whether anything
    /// was handed back. As `release`, except that a replica peer that has acked every row its
    /// part still holds leaves the part to its peers: their lease goes on.
    pub fn give_back(&mut self, id: LeaseId, now: Instant) -> Result<bool> {
        if self.shared.is_seat(id) && self.seat_is_done(id) {
            return Ok(false);
        }
        self.release(id, None, now).map(|()| true)
    }

    /// Moves a lease's deadline to `now + timeout`.
    pub fn renew(&mut self, id: LeaseId, now: Instant, timeout: Duration) -> Result<Instant> {
        if self.shared.is_seat(id) {
            return self.renew_seat(id, now, timeout);
        }
        self.check_lease(id, None, now)?;
        let deadline = now + timeout;
        self.leases.active.get_mut(&id).expect("checked above").deadline = deadline;
        self.leases.expiry.push(Reverse((deadline, id)));
        Ok(deadline)
    }

    /// Removes `subset` (or everything) from a lease, ending it when it is left empty.
    fn take_rows(&mut self, id: LeaseId, subset: Option<&[u64]>) -> (TaskId, Vec<u64>) {
        let lease = self.leases.active.get_mut(&id).expect("lease checked by the caller");
        let task = lease.task;
        let rows = match subset {
            None => std::mem::take(&mut lease.rows),
            Some(subset) => {
                let take: HashSet<u64> = subset.iter().copied().collect();
                let (taken, kept) = lease.rows.iter().partition(|i| take.contains(i));
                lease.rows = kept;
                taken
            }
        };
        if lease.rows.is_empty() {
            self.leases.active.remove(&id);
        }
        (task, rows)
    }

    /// Ends a lease without committing its rows.
    fn end_lease(&mut self, id: LeaseId) {
        if let Some(lease) = self.leases.active.remove(&id) {
            self.return_rows(lease.task, &lease.rows);
        }
    }

    fn return_rows(&mut self, task: TaskId, rows: &[u64]) {
        for &index in rows {
            let slot = self.slot(index);
            let t = &mut self.tasks[task as usize];
            t.leased_rows -= 1;
            if let Some(slot) = slot {
                t.busy.clear(slot);
            }
        }
    }

    /// Moves the task's low-water mark past rows it has acked, rows that are gone and rows
    /// outside its scope.
    fn advance_low_water(&mut self, task: TaskId) {
        let t = &self.tasks[task as usize];
        let mut at = t.low_water.max(self.base);
        while at < self.next {
            let slot = (at - self.base) as usize;
            let (w, bit) = (slot / 64, slot % 64);
            let mut pending = !(t.acked.word(w) | !self.live.word(w)) & (u64::MAX << bit);
            while pending != 0 {
                let s = w * 64 + pending.trailing_zeros() as usize;
                if self.in_scope(s, task) {
                    break;
                }
                pending &= pending - 1;
            }
            if pending == 0 {
                at += 64 - bit as u64;
            } else {
                at = self.base + (w * 64) as u64 + u64::from(pending.trailing_zeros());
                break;
            }
        }
        self.tasks[task as usize].low_water = at.min(self.next);
    }
}
