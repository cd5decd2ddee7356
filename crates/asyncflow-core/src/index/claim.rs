//! Claiming: find rows ready for every requested field and free for the task, oldest first,
//! honouring the partition, version and whole-group options, and lease them in one step.
//! The scan walks 64 rows per machine word, starting at the task's low-water mark. Claims
//! shared by several consumers (`ClaimSpec::share`) are delivered by `shared.rs`.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use super::{FieldId, Index, PartitionId, TaskId};
use crate::error::{Result, StoreError};
use crate::index::lease::LeaseId;
use crate::scheduler::CostModel;

/// Token lengths of `rows` in a field (the first dimension of each row's cell). The index holds
/// no payloads, so whoever does (the store's shards) measures them for balanced shared claims.
pub type TokenLengths<'a> = &'a dyn Fn(&[u64], FieldId) -> Result<Vec<u64>>;

/// What a claim asks for.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ClaimSpec {
    pub task: String,
    pub fields: Vec<String>,
    pub batch_size: usize,
    /// Only rows of this partition.
    pub partition: Option<String>,
    /// Skip rows produced by an older policy version.
    pub min_version: Option<u64>,
    /// Deliver a group's rows all together or not at all. With `share`, a group also stays on
    /// one data-parallel rank.
    pub whole_groups: bool,
    /// Share one claimed batch among several consumers: the data-parallel ranks of a training
    /// step (each gets its token-balanced part) and the peers of a replica group (each gets the
    /// same part). `batch_size` is then the whole step's batch. `None`: an ordinary claim.
    pub share: Option<Share>,
    /// For a claim that settles for a partial batch: once this long has passed, it takes what is
    /// ready (at least one row) instead of waiting on for a full batch until its deadline, and
    /// after that it returns as soon as rows come. `None`: it settles only at its deadline. An
    /// idle consumer can thus wait long for work in one request and still take part of a batch
    /// soon. Not for shared claims.
    pub partial_after: Option<Duration>,
}

impl ClaimSpec {
    /// When a claim started at `started` begins to settle for part of a batch before its
    /// deadline (see `partial_after`); `None` if it does not.
    pub fn partial_from(&self, allow_partial: bool, started: Instant) -> Result<Option<Instant>> {
        let Some(after) = self.partial_after else { return Ok(None) };
        if !allow_partial {
            return Err(StoreError::bad_request(
                "partial_after says when a claim settles for part of a batch; it needs allow_partial",
            ));
        }
        if self.share.is_some() {
            return Err(StoreError::bad_request(
                "partial_after is not for shared claims (with step): a step's batch is claimed \
                 once, for all its consumers",
            ));
        }
        Ok(Some(started + after))
    }
}

/// How one claimed batch is shared (see `shared.rs`).
#[derive(Debug, Clone, PartialEq)]
pub struct Share {
    /// With the task and `replica`, names the shared batch: every consumer of one training step
    /// passes the same value.
    pub step: u64,
    /// Replica group. Groups with different ids claim different batches for the same step (e.g.
    /// data-parallel groups that each pull their own batch); 0 when one batch serves the step.
    pub replica: u64,
    /// The caller's data-parallel rank, below `dp_size`.
    pub dp_rank: u32,
    /// Ranks the batch is split over; 1 for no split.
    pub dp_size: u32,
    /// The caller's rank among the peers that receive the same part, below `replica_size`.
    pub replica_rank: u32,
    /// Peers that receive each part and must all ack it; 1 for no replicas.
    pub replica_size: u32,
    /// Field whose first dimension is a row's token count; `None`: the claim's first field.
    pub balance_field: Option<String>,
    /// What a row costs as a function of its token count.
    pub cost: CostModel,
    /// Parts get equally many rows (±1), or equally many groups with `whole_groups`.
    pub equal_count: bool,
}

impl Default for Share {
    fn default() -> Self {
        Self {
            step: 0,
            replica: 0,
            dp_rank: 0,
            dp_size: 1,
            replica_rank: 0,
            replica_size: 1,
            balance_field: None,
            cost: CostModel::Tokens,
            equal_count: false,
        }
    }
}

/// Rows leased by one claim. An empty claim holds no lease.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Claimed {
    pub lease: Option<LeaseId>,
    pub rows: Vec<u64>,
    /// Policy version of each row.
    pub versions: Vec<u64>,
    /// Group of each row, if any.
    pub groups: Vec<Option<u64>>,
    pub deadline: Option<Instant>,
}

/// A claim with its names resolved to ids.
struct Resolved {
    task: TaskId,
    /// `None` if some requested field has never been written: nothing can be ready.
    fields: Option<Vec<FieldId>>,
    partition: PartitionFilter,
}

enum PartitionFilter {
    Any,
    /// The claim names a partition that holds no rows yet.
    Unknown,
    Only(PartitionId),
}

/// Rows found by a scan and whether they make a full batch.
struct Found {
    slots: Vec<usize>,
    full: bool,
}

impl Index {
    /// Checks a claim's options; errors here are the caller's mistake, not a reason to wait.
    pub fn check_claim(&self, spec: &ClaimSpec) -> Result<()> {
        self.task_id(&spec.task)?;
        if spec.batch_size == 0 {
            return Err(StoreError::bad_request("batch_size must be at least 1"));
        }
        if spec.fields.is_empty() {
            return Err(StoreError::bad_request("a claim needs at least one field"));
        }
        if let Some(share) = &spec.share {
            share.check(&spec.fields)?;
        }
        Ok(())
    }

    /// Fields of a claim that no put has written yet, for error messages.
    pub fn unwritten_fields(&self, spec: &ClaimSpec) -> Vec<String> {
        spec.fields.iter().filter(|f| !self.field_ids.contains_key(*f)).cloned().collect()
    }

    fn resolve(&self, spec: &ClaimSpec) -> Result<Resolved> {
        self.check_claim(spec)?;
        let fields = spec.fields.iter().map(|f| self.field_ids.get(f).copied()).collect();
        let partition = match &spec.partition {
            None => PartitionFilter::Any,
            Some(p) => self
                .partition_ids
                .get(p)
                .map_or(PartitionFilter::Unknown, |&id| PartitionFilter::Only(id)),
        };
        Ok(Resolved { task: self.task_id(&spec.task)?, fields, partition })
    }

    /// Leases a full batch if one is ready, or (with `accept_partial`) whatever is ready, possibly
    /// nothing. Returns `None` when the caller should keep waiting. A shared claim that must be
    /// balanced by token length fails here: use [`Index::try_claim_with`] and measure them.
    pub fn try_claim(
        &mut self,
        spec: &ClaimSpec,
        now: Instant,
        lease_timeout: Duration,
        accept_partial: bool,
    ) -> Result<Option<Claimed>> {
        let unmeasured: TokenLengths<'_> = &|_, _| {
            Err(StoreError::bad_request(
                "this index holds no payloads to measure token lengths with; use try_claim_with",
            ))
        };
        self.try_claim_with(spec, now, lease_timeout, accept_partial, unmeasured)
    }

    /// [`Index::try_claim`], measuring token lengths with `lengths` for shared claims.
    pub fn try_claim_with(
        &mut self,
        spec: &ClaimSpec,
        now: Instant,
        lease_timeout: Duration,
        accept_partial: bool,
        lengths: TokenLengths<'_>,
    ) -> Result<Option<Claimed>> {
        if let Some(share) = &spec.share {
            return self.try_claim_shared(spec, share, now, lease_timeout, accept_partial, lengths);
        }
        let Some(found) = self.find(spec, accept_partial)? else {
            return Ok(None);
        };
        let task = self.task_id(&spec.task)?;
        Ok(Some(self.lease_slots(task, &found, now + lease_timeout)))
    }

    /// The slots a claim would lease now: `None` if the batch is not full and the caller would
    /// rather wait.
    pub(super) fn find(
        &self,
        spec: &ClaimSpec,
        accept_partial: bool,
    ) -> Result<Option<Vec<usize>>> {
        let resolved = self.resolve(spec)?;
        let found = self.scan(spec, &resolved)?;
        Ok((found.full || accept_partial).then_some(found.slots))
    }

    /// Leases `slots` to `task` until `deadline`; an empty set holds no lease.
    pub(super) fn lease_slots(
        &mut self,
        task: TaskId,
        slots: &[usize],
        deadline: Instant,
    ) -> Claimed {
        if slots.is_empty() {
            return Claimed::default();
        }
        let rows: Vec<u64> = slots.iter().map(|&s| self.base + s as u64).collect();
        let versions = slots.iter().map(|&s| self.rows[s].version).collect();
        let groups = slots.iter().map(|&s| self.rows[s].group).collect();
        let t = &mut self.tasks[task as usize];
        for &slot in slots {
            t.busy.set(slot);
        }
        t.leased_rows += rows.len() as u64;
        self.counters.claims += 1;
        self.counters.rows_claimed += rows.len() as u64;
        let lease = self.leases.grant(task, rows.clone(), deadline);
        Claimed { lease: Some(lease), rows, versions, groups, deadline: Some(deadline) }
    }

    fn scan(&self, spec: &ClaimSpec, r: &Resolved) -> Result<Found> {
        let want = spec.batch_size;
        let none = Found { slots: Vec::new(), full: false };
        let Some(fields) = &r.fields else {
            return Ok(none);
        };
        let task = &self.tasks[r.task as usize];
        let (mut first, mut end) = (task.low_water.max(self.base), self.next);
        let partition = match r.partition {
            PartitionFilter::Any => None,
            PartitionFilter::Unknown => return Ok(none),
            PartitionFilter::Only(p) => {
                let part = &self.partitions[p as usize];
                first = first.max(part.first);
                end = end.min(part.end);
                Some(p)
            }
        };
        if first >= end {
            return Ok(none);
        }
        let (lo, hi) = ((first - self.base) as usize, (end - self.base) as usize);

        let mut slots = Vec::with_capacity(want.min(4096));
        let mut seen_groups = HashSet::new();
        for w in lo / 64..hi.div_ceil(64) {
            let mut m = self.live.word(w) & !task.busy.word(w);
            for &f in fields {
                if m == 0 {
                    break;
                }
                m &= self.fields[f as usize].ready.word(w);
            }
            if w == lo / 64 {
                m &= u64::MAX << (lo % 64);
            }
            if w == (hi - 1) / 64 && hi % 64 != 0 {
                m &= (1u64 << (hi % 64)) - 1;
            }
            while m != 0 {
                let slot = w * 64 + m.trailing_zeros() as usize;
                m &= m - 1;
                if !self.passes_filters(slot, r.task, partition, spec.min_version) {
                    continue;
                }
                let group = self.rows[slot].group;
                if !spec.whole_groups || group.is_none() {
                    slots.push(slot);
                } else if let Some(g) =
                    group.filter(|&g| seen_groups.insert((self.rows[slot].partition, g)))
                {
                    let key = (self.rows[slot].partition, g);
                    let Some(members) = self.claimable_group(key, r.task, fields, partition, spec)
                    else {
                        continue;
                    };
                    if members.len() > want {
                        return Err(StoreError::bad_request(format!(
                            "group {g} has {} rows, more than batch_size {want}; \
                             whole_groups can never deliver it",
                            members.len()
                        )));
                    }
                    if slots.len() + members.len() > want {
                        // The next group does not fit: the batch is as full as it can get.
                        return Ok(Found { full: true, slots });
                    }
                    slots.extend(members);
                }
                if slots.len() == want {
                    return Ok(Found { full: true, slots });
                }
            }
        }
        Ok(Found { full: false, slots })
    }

    #[inline]
    fn passes_filters(
        &self,
        slot: usize,
        task: TaskId,
        partition: Option<PartitionId>,
        min_version: Option<u64>,
    ) -> bool {
        let meta = &self.rows[slot];
        partition.is_none_or(|p| meta.partition == p)
            && min_version.is_none_or(|v| meta.version >= v)
            && self.in_scope(slot, task)
    }

    /// The slots of group `g` if the group is complete and every member is claimable now.
    fn claimable_group(
        &self,
        key: (PartitionId, u64),
        task: TaskId,
        fields: &[FieldId],
        partition: Option<PartitionId>,
        spec: &ClaimSpec,
    ) -> Option<Vec<usize>> {
        let group = self.groups.get(&key)?;
        if group.joined != group.size {
            return None;
        }
        let t = &self.tasks[task as usize];
        let mut slots = Vec::with_capacity(group.members.len());
        for &index in &group.members {
            let slot = self.slot(index)?;
            // Members this task committed already are done with: the rest is the group now.
            if t.acked.get(slot) {
                continue;
            }
            let ok = self.live.get(slot)
                && !t.busy.get(slot)
                && fields.iter().all(|&f| self.fields[f as usize].ready.get(slot))
                && self.passes_filters(slot, task, partition, spec.min_version);
            if !ok {
                return None;
            }
            slots.push(slot);
        }
        (!slots.is_empty()).then_some(slots)
    }
}
