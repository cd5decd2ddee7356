//! The index's durable history. With journaling on, every change that must survive a restart
//! (tasks, fields, rows, readiness, commits, frees) is noted as a [`Change`] in the order it
//! happened; leases are not, because a restart voids them and their rows are simply delivered
//! again. [`Index::apply`] replays changes on a fresh index and [`Index::dump`] describes a whole
//! index as changes, so a log and a snapshot are the same thing to whoever reads them back.

use std::sync::Arc;

use super::{Counters, FieldId, Index, NewRows, Tags, TaskId};
use crate::error::{Result, StoreError};
use crate::schema::FieldSchema;

/// The most unallocated indexes a snapshot may leave between live rows: a running index keeps
/// every slot from its oldest live row on, so a real gap is never larger than memory allowed.
const MAX_GAP: u64 = 1 << 28;

/// One durable change to the index.
#[derive(Debug, Clone, PartialEq)]
pub enum Change {
    /// A task was registered (task ids follow registration order).
    Task { name: String, scope: Option<Vec<String>> },
    /// A field was first written (field ids follow this order).
    Field { name: String, schema: FieldSchema },
    /// `count` rows were created at indexes `start..start + count`.
    Rows { start: u64, count: u64, new: NewRows },
    /// `fields` became ready on the live ones of `rows`.
    Ready { rows: Vec<u64>, fields: Vec<FieldId> },
    /// `task` committed `rows` (each was live and leased by it).
    Acked { task: TaskId, rows: Vec<u64> },
    /// Every live row of a partition was freed.
    Cleared { partition: String },
    /// These rows were freed.
    Deleted { rows: Vec<u64> },
    /// No row below this index will ever be created (a snapshot's end).
    Next(u64),
    /// The counters as they stood (a snapshot's start).
    Counters(Counters),
}

impl Index {
    /// Starts (or stops) noting durable changes for [`Index::take_changes`].
    pub fn set_journaling(&mut self, on: bool) {
        self.journal = on.then(Vec::new);
    }

    /// The changes noted since the last call, oldest first.
    pub fn take_changes(&mut self) -> Vec<Change> {
        self.journal.as_mut().map(std::mem::take).unwrap_or_default()
    }

    #[inline]
    pub(super) fn note(&mut self, change: impl FnOnce() -> Change) {
        if let Some(journal) = &mut self.journal {
            journal.push(change());
        }
    }

    /// Lease ids handed out from now on are at least `floor`, so that ids a client kept from an
    /// earlier run of the daemon never name a lease of this one.
    pub fn set_lease_floor(&mut self, floor: u64) {
        self.leases.raise_floor(floor);
    }

    /// Replays one change on this index (as made by [`Index::take_changes`] or
    /// [`Index::dump`], in order). Returns the rows it freed. A change that does not fit the
    /// index (a corrupt or foreign log) is an error and changes nothing.
    pub fn apply(&mut self, change: &Change) -> Result<Vec<u64>> {
        let corrupt = |what: String| StoreError::Persistence(format!("log does not fit: {what}"));
        match change {
            Change::Task { name, scope } => {
                self.register_task(name, scope.clone())?;
            }
            Change::Field { name, schema } => {
                self.field_or_register(name, schema);
            }
            Change::Rows { start, count, new } => {
                if *start < self.next {
                    return Err(corrupt(format!("rows from {start} exist already")));
                }
                let n = *count as usize;
                let per_row = |len: usize| len == n || len <= 1;
                if n == 0
                    || new.versions.is_empty()
                    || !per_row(new.versions.len())
                    || !per_row(new.tags.len())
                    || new.groups.as_ref().is_some_and(|g| g.len() != n)
                {
                    return Err(corrupt(format!("rows from {start}: inconsistent metadata")));
                }
                self.advance_to(*start)?;
                self.allocate(new, n);
            }
            Change::Ready { rows, fields } => {
                if let Some(f) = fields.iter().find(|&&f| f as usize >= self.fields.len()) {
                    return Err(corrupt(format!("field id {f} was never registered")));
                }
                // Rows cleared or deleted between the put's admission and its commit: their
                // cells are freed, as the live commit frees them.
                return Ok(self.commit_ready(rows, fields));
            }
            Change::Acked { task, rows } => {
                if *task as usize >= self.tasks.len() {
                    return Err(corrupt(format!("task id {task} was never registered")));
                }
                return Ok(self.commit_rows(*task, rows));
            }
            Change::Cleared { partition } => return Ok(self.clear_partition(partition)),
            Change::Deleted { rows } => {
                self.delete(rows)?;
                return Ok(rows.clone());
            }
            Change::Next(next) => self.advance_to(*next)?,
            Change::Counters(counters) => self.counters = counters.clone(),
        }
        Ok(Vec::new())
    }

    /// Leaves indexes up to `index` unallocated (rows that were freed before a snapshot).
    fn advance_to(&mut self, index: u64) -> Result<()> {
        if index <= self.next {
            return Ok(());
        }
        if self.live.count_ones() == 0 {
            // Nothing to keep: start the table afresh just below `index`.
            self.rows.clear();
            self.base = index - index % 64;
            self.next = self.base;
            self.drop_front_words(self.live.words());
            for t in &mut self.tasks {
                t.low_water = t.low_water.max(self.base);
            }
        }
        if index - self.next > MAX_GAP {
            return Err(StoreError::Persistence(format!(
                "log does not fit: a gap of {} rows after live rows",
                index - self.next
            )));
        }
        let pad = RowMetaPad::default();
        for _ in self.next..index {
            self.rows.push_back(pad.meta());
        }
        self.next = index;
        self.resize_bitmaps();
        self.compact();
        Ok(())
    }

    /// The whole index as changes that [`Index::apply`] turns back into an equal index (leases
    /// and shared claims aside).
    pub fn dump(&self) -> Vec<Change> {
        let mut out = vec![Change::Counters(self.counters.clone())];
        out.extend(
            self.tasks
                .iter()
                .map(|t| Change::Task { name: t.name.clone(), scope: t.scope.clone() }),
        );
        out.extend(
            self.fields
                .iter()
                .map(|f| Change::Field { name: f.name.clone(), schema: f.schema.clone() }),
        );
        let live = self.live_rows(None);
        self.dump_rows(&live, &mut out);
        for (id, field) in self.fields.iter().enumerate() {
            let rows: Vec<u64> = live
                .iter()
                .copied()
                .filter(|&i| field.ready.get((i - self.base) as usize))
                .collect();
            if !rows.is_empty() {
                out.push(Change::Ready { rows, fields: vec![id as FieldId] });
            }
        }
        for (id, task) in self.tasks.iter().enumerate() {
            let rows: Vec<u64> = live
                .iter()
                .copied()
                .filter(|&i| task.acked.get((i - self.base) as usize))
                .collect();
            if !rows.is_empty() {
                out.push(Change::Acked { task: id as TaskId, rows });
            }
        }
        out.push(Change::Next(self.next));
        out
    }

    /// Live rows as `Rows` changes: one per run of consecutive indexes that share a partition and
    /// agree on whether (and with which declared size) they belong to groups, cut where it would
    /// pass `DUMP_BYTES`. Rows that share one set of tags (those of one put)
    /// write it once: repeated for each, a snapshot's record outgrew what a log may hold, and
    /// the rows restored from it each held a copy.
    fn dump_rows(&self, live: &[u64], out: &mut Vec<Change>) {
        let meta = |i: u64| &self.rows[(i - self.base) as usize];
        let key = |i: u64| {
            let meta = meta(i);
            let size = meta.group.map(|g| self.groups[&(meta.partition, g)].size);
            (meta.partition, meta.group.is_some(), size)
        };
        let mut at = 0;
        while at < live.len() {
            let first = live[at];
            let first_tags = &meta(first).tags;
            let alike = |t: &Arc<Tags>| {
                Arc::ptr_eq(t, first_tags) || (t.is_empty() && first_tags.is_empty())
            };
            // The second row decides: all rows with the first's tags (written once), or each
            // row with its own.
            let mut shared = None;
            let mut bytes = ROW_BYTES + tags_bytes(first_tags);
            let mut end = at + 1;
            while end < live.len() && live[end] == live[end - 1] + 1 && key(live[end]) == key(first)
            {
                let tags = &meta(live[end]).tags;
                let one_set = *shared.get_or_insert(alike(tags));
                if one_set && !alike(tags) {
                    break;
                }
                bytes += ROW_BYTES + if one_set { 0 } else { tags_bytes(tags) };
                if bytes > DUMP_BYTES {
                    break;
                }
                end += 1;
            }
            let run = &live[at..end];
            let metas: Vec<_> = run.iter().map(|&i| meta(i)).collect();
            let (partition, grouped, size) = key(first);
            let tags: Vec<Arc<Tags>> = if shared == Some(false) {
                metas.iter().map(|m| Arc::clone(&m.tags)).collect()
            } else if first_tags.is_empty() {
                Vec::new()
            } else {
                vec![Arc::clone(first_tags)]
            };
            out.push(Change::Rows {
                start: first,
                count: run.len() as u64,
                new: NewRows {
                    partition: self.partitions[partition as usize].name.clone(),
                    groups: grouped.then(|| metas.iter().map(|m| m.group.unwrap_or(0)).collect()),
                    group_size: size,
                    versions: metas.iter().map(|m| m.version).collect(),
                    tags,
                },
            });
            at = end;
        }
    }
}

/// About how many bytes one dumped `Rows` change holds at most (beyond its first row): a
/// snapshot's record must stay well under what the log's reader takes (`MAX_RECORD`, 1 GiB).
const DUMP_BYTES: usize = 16 << 20;
/// A row's version and group id.
const ROW_BYTES: usize = 16;

/// The bytes a set of tags takes in a record, about.
fn tags_bytes(tags: &Tags) -> usize {
    tags.iter().map(|(k, v)| k.len() + v.len() + 16).sum::<usize>() + 8
}

/// The metadata of an index that was never allocated (a gap left by freed rows).
#[derive(Default)]
struct RowMetaPad {
    tags: Arc<Tags>,
}

impl RowMetaPad {
    fn meta(&self) -> super::RowMeta {
        super::RowMeta {
            partition: 0,
            version: 0,
            group: None,
            acks: 0,
            tags: Arc::clone(&self.tags),
        }
    }
}
