//! The real store index under virtual time, with every call counted and timed in real seconds
//! (what the control plane would cost a real run at this scale).

use std::time::{Duration, Instant};

use asyncflow_core::{
    ClaimSpec, Claimed, ColumnSpec, DType, FieldSchema, Index, NewRows, PutTarget,
};

use crate::error::Result;

/// Leases never expire in the simulation: no worker dies.
const LEASE: Duration = Duration::from_secs(1 << 30);

pub struct TimedIndex {
    index: Index,
    base: Instant,
    pub calls: u64,
    pub seconds: f64,
}

/// An ordinary claim (no sharing) of `fields` for `task`.
pub fn spec(
    task: &str,
    fields: &[&str],
    batch_size: usize,
    partition: Option<String>,
    whole_groups: bool,
) -> ClaimSpec {
    ClaimSpec {
        task: task.to_owned(),
        fields: fields.iter().map(|f| (*f).to_owned()).collect(),
        batch_size,
        partition,
        whole_groups,
        ..ClaimSpec::default()
    }
}

impl TimedIndex {
    /// An index with the pipeline's consumers registered, as the main job registers them.
    pub fn new(prompts: &str, samples: &str) -> Result<Self> {
        let mut index = Index::new();
        index.register_task("rollout", Some(vec![prompts.to_owned()]))?;
        for task in ["reward", "advantage", "reference", "train"] {
            index.register_task(task, Some(vec![samples.to_owned()]))?;
        }
        Ok(Self { index, base: Instant::now(), calls: 0, seconds: 0.0 })
    }

    fn at(&self, t: f64) -> Instant {
        self.base + Duration::from_secs_f64(t)
    }

    fn call<T>(&mut self, f: impl FnOnce(&mut Index) -> T) -> T {
        let start = Instant::now();
        let out = f(&mut self.index);
        self.seconds += start.elapsed().as_secs_f64();
        self.calls += 1;
        out
    }

    /// Puts new rows with one field (no payload: only the control plane runs); `versions` has one
    /// version for every row, or one per row.
    pub fn put_new(
        &mut self,
        field: &str,
        partition: String,
        groups: Vec<u64>,
        group_size: u32,
        versions: Vec<u64>,
    ) -> Result<Vec<u64>> {
        let schema = FieldSchema::ragged(DType::I64, vec![]);
        let rows = groups.len();
        let target = PutTarget::New(NewRows {
            partition,
            groups: Some(groups),
            group_size: Some(group_size),
            versions,
            tags: Vec::new(),
        });
        self.call(|ix| {
            let admitted =
                ix.admit_put(&[ColumnSpec { name: field, schema: &schema, rows }], &target)?;
            ix.commit_ready(&admitted.rows, &admitted.fields);
            Ok(admitted.rows)
        })
    }

    /// Marks `field` ready on existing rows.
    pub fn fill(&mut self, rows: &[u64], field: &str) -> Result<()> {
        let schema = FieldSchema::ragged(DType::F32, vec![]);
        let target = PutTarget::Existing(rows.to_vec());
        self.call(|ix| {
            let column = ColumnSpec { name: field, schema: &schema, rows: rows.len() };
            let admitted = ix.admit_put(&[column], &target)?;
            ix.commit_ready(&admitted.rows, &admitted.fields);
            Ok(())
        })
    }

    /// A claim at virtual time `now`; `None` when nothing (or, unless `partial`, not a full
    /// batch) is ready.
    pub fn claim(&mut self, now: f64, spec: &ClaimSpec, partial: bool) -> Result<Option<Claimed>> {
        let at = self.at(now);
        let claimed = self.call(|ix| ix.try_claim(spec, at, LEASE, partial))?;
        Ok(claimed.filter(|c| !c.rows.is_empty()))
    }

    pub fn ack(&mut self, now: f64, claimed: &Claimed) -> Result<()> {
        let (at, id) = (self.at(now), claimed.lease.expect("non-empty claims hold a lease"));
        self.call(|ix| ix.ack(id, None, at))?;
        Ok(())
    }

    /// Acks only the claim's `rows` of its lease (the lease may hold more).
    pub fn ack_rows(&mut self, now: f64, claimed: &Claimed) -> Result<()> {
        let (at, id) = (self.at(now), claimed.lease.expect("non-empty claims hold a lease"));
        self.call(|ix| ix.ack(id, Some(&claimed.rows), at))?;
        Ok(())
    }

    /// Hands rows (all, or `rows`) of a claim back to be claimed again.
    pub fn release(&mut self, now: f64, claimed: &Claimed, rows: Option<&[u64]>) -> Result<()> {
        let (at, id) = (self.at(now), claimed.lease.expect("non-empty claims hold a lease"));
        self.call(|ix| ix.release(id, rows, at))?;
        Ok(())
    }
}
