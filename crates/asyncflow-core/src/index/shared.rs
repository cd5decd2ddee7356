//! Shared claims: one claimed batch delivered to several consumers. Whichever consumer of a
//! training step asks first claims the step's whole batch and splits it into `dp_size`
//! token-balanced parts; data-parallel rank r receives part r. Each part goes to `replica_size`
//! peers (tensor/pipeline ranks that must see identical data), each holding its own *seat*: a
//! lease id of its own over the part's one lease.
//!
//! - A batch is named by (task, step, replica). Every caller of one must repeat the same claim
//!   options; only its ranks differ. Claiming again from the same seat returns the same rows
//!   (less those it has acked).
//! - Each part is its own lease, so ranks commit independently. A row is committed for the task
//!   once every peer of its part has acked it; a seat acks a row once.
//! - Releasing (any peer, any rows) hands rows back at once for the whole part: a later claim
//!   delivers them again, and other peers' acks of them fail.
//! - Every part's deadline is `lease_timeout` after the batch was claimed; a renew by any peer
//!   extends its part. A part not fully acked by then is handed back, and acks some of its peers
//!   recorded are void; other parts are unaffected.
//! - A caller whose part has ended (committed, released or expired) gets a lease error, not rows,
//!   and a step whose parts have all ended is not claimed afresh under the same name (the last
//!   `RETIRED_KEPT` ended steps are remembered).
//! - A partial batch may leave parts empty; their ranks get an empty claim with no lease.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use super::claim::{ClaimSpec, Claimed, Share, TokenLengths};
use super::lease::{LeaseId, Leases};
use super::{Index, TaskId};
use crate::error::{Result, StoreError};
use crate::scheduler::{CostModel, Method, PartitionOptions, partition};

/// Ended batches remembered, so that claiming a finished step again fails instead of claiming a
/// fresh batch under its name.
const RETIRED_KEPT: usize = 1024;

/// The most data-parallel parts, or replica peers, one shared batch may have.
const MAX_SHARE: u32 = 1 << 16;

impl Share {
    pub(super) fn check(&self, fields: &[String]) -> Result<()> {
        // Every part and every seat costs memory up front (the partitioner keeps k loads per
        // tuple): bound them, so one odd claim cannot abort the process that holds the store.
        if self.dp_size > MAX_SHARE || self.replica_size > MAX_SHARE {
            return Err(StoreError::bad_request(format!(
                "dp_size and replica_size must be at most {MAX_SHARE}, not {} and {}",
                self.dp_size, self.replica_size
            )));
        }
        if self.dp_rank >= self.dp_size {
            return Err(StoreError::bad_request(format!(
                "dp_rank {} must be below dp_size {}",
                self.dp_rank, self.dp_size
            )));
        }
        if self.replica_rank >= self.replica_size {
            return Err(StoreError::bad_request(format!(
                "replica_rank {} must be below replica_size {}",
                self.replica_rank, self.replica_size
            )));
        }
        if let Some(field) = &self.balance_field
            && !fields.contains(field)
        {
            return Err(StoreError::bad_request(format!(
                "balance_field {field:?} must be one of the claimed fields, so that it is ready"
            )));
        }
        self.cost.validate()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
struct ShareKey {
    task: TaskId,
    step: u64,
    replica: u64,
}

#[derive(Debug)]
struct SharedBatch {
    /// The claim that opened it, with the caller's ranks zeroed: what every caller must repeat.
    terms: ClaimSpec,
    parts: Vec<Part>,
    retired: bool,
}

#[derive(Debug)]
struct Part {
    /// The lease on the part's rows; `None` for an empty part.
    lease: Option<LeaseId>,
    /// Rows as claimed, ascending; a row's position indexes `acks` and every seat's `acked`.
    rows: Vec<u64>,
    versions: Vec<u64>,
    groups: Vec<Option<u64>>,
    /// How many peers have acked each row.
    acks: Vec<u32>,
    seats: Vec<Seat>,
}

impl Part {
    fn position(&self, row: u64) -> usize {
        self.rows.binary_search(&row).expect("a part's lease only holds the part's rows")
    }
}

#[derive(Debug)]
struct Seat {
    id: LeaseId,
    acked: Vec<bool>,
}

#[derive(Debug, Clone, Copy)]
struct SeatRef {
    key: ShareKey,
    part: usize,
    peer: usize,
}

#[derive(Debug, Default)]
pub(super) struct SharedClaims {
    batches: HashMap<ShareKey, SharedBatch>,
    seats: HashMap<LeaseId, SeatRef>,
    retired: VecDeque<ShareKey>,
}

impl SharedClaims {
    pub(super) fn is_seat(&self, id: LeaseId) -> bool {
        self.seats.contains_key(&id)
    }
}

/// The claim with the caller's own ranks zeroed.
fn terms(spec: &ClaimSpec) -> ClaimSpec {
    let mut terms = spec.clone();
    if let Some(share) = &mut terms.share {
        share.dp_rank = 0;
        share.replica_rank = 0;
    }
    terms
}

/// The options in which `asked` differs from a shared batch's `first` terms, each as
/// `name first (asked: value)`, by the names the Python `ClaimOptions` gives them.
fn differences(first: &ClaimSpec, asked: &ClaimSpec) -> String {
    let mut out = Vec::new();
    let mut compare = |name: &str, a: String, b: String| {
        if a != b {
            out.push(format!("{name} {a} (asked: {b})"));
        }
    };
    compare("fields", format!("{:?}", first.fields), format!("{:?}", asked.fields));
    compare("batch_size", first.batch_size.to_string(), asked.batch_size.to_string());
    compare("partition", format!("{:?}", first.partition), format!("{:?}", asked.partition));
    compare("min_version", format!("{:?}", first.min_version), format!("{:?}", asked.min_version));
    compare("whole_groups", first.whole_groups.to_string(), asked.whole_groups.to_string());
    let (a, b) = (first.share.clone().unwrap_or_default(), asked.share.clone().unwrap_or_default());
    compare("dp_size", a.dp_size.to_string(), b.dp_size.to_string());
    compare("replica_size", a.replica_size.to_string(), b.replica_size.to_string());
    compare("balance_field", format!("{:?}", a.balance_field), format!("{:?}", b.balance_field));
    compare("cost", cost_name(a.cost), cost_name(b.cost));
    compare("equal_count", a.equal_count.to_string(), b.equal_count.to_string());
    if out.is_empty() {
        return format!("{first:?} (asked: {asked:?})"); // (an option not named above)
    }
    out.join(", ")
}

fn cost_name(cost: CostModel) -> String {
    match cost {
        CostModel::Tokens => "tokens".into(),
        CostModel::Attention { linear_weight } => {
            format!("attention, linear_weight {linear_weight}")
        }
    }
}

/// A lease error about the part's lease, told to the holder of seat `id`.
fn for_seat(err: StoreError, id: LeaseId) -> StoreError {
    match err {
        StoreError::Lease { reason, .. } => StoreError::Lease { id, reason },
        other => other,
    }
}

impl Index {
    pub(super) fn try_claim_shared(
        &mut self,
        spec: &ClaimSpec,
        share: &Share,
        now: Instant,
        lease_timeout: Duration,
        accept_partial: bool,
        lengths: TokenLengths<'_>,
    ) -> Result<Option<Claimed>> {
        self.check_claim(spec)?;
        let key =
            ShareKey { task: self.task_id(&spec.task)?, step: share.step, replica: share.replica };
        self.retire_ended();
        if !self.shared.batches.contains_key(&key) {
            let Some(slots) = self.find(spec, accept_partial)? else {
                return Ok(None);
            };
            if slots.is_empty() {
                return Ok(Some(Claimed::default()));
            }
            self.open_batch(key, spec, share, &slots, now + lease_timeout, lengths)?;
        }
        self.join(key, spec, share, now).map(Some)
    }

    /// Splits `slots` into balanced parts and leases each; fails, changing nothing, if the
    /// split is impossible or lengths cannot be measured.
    fn open_batch(
        &mut self,
        key: ShareKey,
        spec: &ClaimSpec,
        share: &Share,
        slots: &[usize],
        deadline: Instant,
        lengths: TokenLengths<'_>,
    ) -> Result<()> {
        let rows: Vec<u64> = slots.iter().map(|&s| self.base + s as u64).collect();
        let field = self.field_id(share.balance_field.as_deref().unwrap_or(&spec.fields[0]))?;
        let tokens = lengths(&rows, field)?;
        if tokens.len() != rows.len() {
            return Err(StoreError::bad_request("token lengths do not match the claimed rows"));
        }
        let groups: Vec<Option<u64>> = slots.iter().map(|&s| self.rows[s].group).collect();
        let options = PartitionOptions {
            groups: spec.whole_groups.then_some(groups.as_slice()),
            equal_count: share.equal_count,
            method: Method::Balanced,
        };
        let split = partition(&share.cost.costs(&tokens), share.dp_size as usize, &options)?;

        let mut parts = Vec::with_capacity(split.len());
        for (p, positions) in split.into_iter().enumerate() {
            let mut part_slots: Vec<usize> = positions.iter().map(|&i| slots[i]).collect();
            part_slots.sort_unstable();
            let claimed = self.lease_slots(key.task, &part_slots, deadline);
            let part = new_part(claimed, share.replica_size, &mut self.leases);
            for (peer, seat) in part.seats.iter().enumerate() {
                self.shared.seats.insert(seat.id, SeatRef { key, part: p, peer });
            }
            parts.push(part);
        }
        self.shared.batches.insert(key, SharedBatch { terms: terms(spec), parts, retired: false });
        Ok(())
    }

    /// The caller's view of an open batch: its part's rows still held and not yet acked by it.
    fn join(
        &self,
        key: ShareKey,
        spec: &ClaimSpec,
        share: &Share,
        now: Instant,
    ) -> Result<Claimed> {
        let batch = &self.shared.batches[&key];
        let task = &self.tasks[key.task as usize].name;
        if batch.terms != terms(spec) {
            return Err(StoreError::bad_request(format!(
                "step {} of task {task:?} (replica {}) was claimed with other options; every \
                 caller must repeat the first one's, and this one differs in {}",
                key.step,
                key.replica,
                differences(&batch.terms, spec)
            )));
        }
        let part = &batch.parts[share.dp_rank as usize];
        let Some(lease) = part.lease else {
            return Ok(Claimed::default());
        };
        let seat = &part.seats[share.replica_rank as usize];
        let refuse = |reason: String| StoreError::Lease { id: seat.id, reason };
        let Some((held, deadline)) = self.leases.holding(lease).filter(|(_, d)| *d > now) else {
            return Err(refuse(format!(
                "part {} of step {} of task {task:?} ended (committed, released or expired) \
                 before this caller took it; claim a later step",
                share.dp_rank, key.step
            )));
        };
        let mut claimed =
            Claimed { lease: Some(seat.id), deadline: Some(deadline), ..Claimed::default() };
        for &row in held {
            let at = part.position(row);
            if !seat.acked[at] {
                claimed.rows.push(row);
                claimed.versions.push(part.versions[at]);
                claimed.groups.push(part.groups[at]);
            }
        }
        if claimed.rows.is_empty() {
            return Err(refuse("this caller has already acked its whole part".to_owned()));
        }
        Ok(claimed)
    }

    /// Marks every batch whose parts have all ended, and forgets the oldest beyond the limit.
    fn retire_ended(&mut self) {
        let leases = &self.leases;
        let mut ended: Vec<ShareKey> = self
            .shared
            .batches
            .iter_mut()
            .filter(|(_, b)| {
                !b.retired
                    && b.parts.iter().all(|p| p.lease.is_none_or(|l| leases.holding(l).is_none()))
            })
            .map(|(key, b)| {
                b.retired = true;
                *key
            })
            .collect();
        ended.sort_unstable();
        self.shared.retired.extend(ended);
        while self.shared.retired.len() > RETIRED_KEPT {
            let key = self.shared.retired.pop_front().expect("over the limit");
            for part in self.shared.batches.remove(&key).map(|b| b.parts).unwrap_or_default() {
                for seat in part.seats {
                    self.shared.seats.remove(&seat.id);
                }
            }
        }
    }

    fn seat_lease(&self, id: LeaseId) -> (SeatRef, LeaseId) {
        let at = self.shared.seats[&id];
        let lease = self.shared.batches[&at.key].parts[at.part].lease;
        (at, lease.expect("only parts with a lease have seats"))
    }

    /// Records a seat's ack of `subset` (default: every row it holds and has not acked) and
    /// commits the rows every peer has now acked; returns the rows that were freed.
    pub(super) fn ack_seat(
        &mut self,
        id: LeaseId,
        subset: Option<&[u64]>,
        now: Instant,
    ) -> Result<Vec<u64>> {
        let (at, lease) = self.seat_lease(id);
        self.check_lease(lease, subset, now).map_err(|e| for_seat(e, id))?;
        let (held, _) = self.leases.holding(lease).expect("checked above");
        let part = &self.shared.batches[&at.key].parts[at.part];
        let seat = &part.seats[at.peer];
        let mut positions: Vec<usize> = match subset {
            Some(rows) => rows.iter().map(|&r| part.position(r)).collect(),
            None => held.iter().map(|&r| part.position(r)).filter(|&i| !seat.acked[i]).collect(),
        };
        positions.sort_unstable();
        positions.dedup();
        if positions.is_empty() {
            return Err(StoreError::Lease {
                id,
                reason: "this holder has already acked every row it holds".to_owned(),
            });
        }
        if let Some(&i) = positions.iter().find(|&&i| seat.acked[i]) {
            return Err(StoreError::Lease {
                id,
                reason: format!("row {} was already acked by this holder", part.rows[i]),
            });
        }

        let part = &mut self.shared.batches.get_mut(&at.key).expect("seat's batch").parts[at.part];
        let peers = part.seats.len() as u32;
        let mut commit = Vec::new();
        for i in positions {
            part.seats[at.peer].acked[i] = true;
            part.acks[i] += 1;
            if part.acks[i] == peers {
                commit.push(part.rows[i]);
            }
        }
        if commit.is_empty() {
            return Ok(Vec::new());
        }
        self.ack(lease, Some(&commit), now)
    }

    /// Whether seat `id` has acked every row its part still holds: a peer with nothing left to
    /// do there.
    pub(super) fn seat_is_done(&self, id: LeaseId) -> bool {
        let (at, lease) = self.seat_lease(id);
        let Some((held, _)) = self.leases.holding(lease) else {
            return false;
        };
        let part = &self.shared.batches[&at.key].parts[at.part];
        held.iter().all(|&r| part.seats[at.peer].acked[part.position(r)])
    }

    /// Hands rows of a seat's part back for every peer.
    pub(super) fn release_seat(
        &mut self,
        id: LeaseId,
        subset: Option<&[u64]>,
        now: Instant,
    ) -> Result<()> {
        let (_, lease) = self.seat_lease(id);
        self.release(lease, subset, now).map_err(|e| for_seat(e, id))
    }

    /// Extends a seat's part, for every peer.
    pub(super) fn renew_seat(
        &mut self,
        id: LeaseId,
        now: Instant,
        timeout: Duration,
    ) -> Result<Instant> {
        let (_, lease) = self.seat_lease(id);
        self.renew(lease, now, timeout).map_err(|e| for_seat(e, id))
    }
}

fn new_part(claimed: Claimed, peers: u32, leases: &mut Leases) -> Part {
    let n = claimed.rows.len();
    let seats = match claimed.lease {
        Some(_) => {
            (0..peers).map(|_| Seat { id: leases.reserve_id(), acked: vec![false; n] }).collect()
        }
        None => Vec::new(),
    };
    Part {
        lease: claimed.lease,
        rows: claimed.rows,
        versions: claimed.versions,
        groups: claimed.groups,
        acks: vec![0; n],
        seats,
    }
}
