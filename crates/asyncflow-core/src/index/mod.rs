//! The control plane: which rows exist, what they belong to (partition, group, version, tags),
//! which of their fields are ready, and where every task stands on every row. It holds no payload
//! bytes and knows no clock: callers pass `now`, so the same state machine runs under real time
//! in the store and under virtual time in the simulator.

mod claim;
mod journal;
mod lease;
mod shared;

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

pub use claim::{ClaimSpec, Claimed, Share, TokenLengths};
pub use journal::Change;
pub use lease::LeaseId;
use lease::Leases;
use shared::SharedClaims;

use crate::bitmap::Bitmap;
use crate::error::{Result, StoreError};
use crate::schema::FieldSchema;

pub type FieldId = u32;
pub type TaskId = u32;
pub type PartitionId = u32;

/// Free-form `(key, value)` labels attached to rows.
pub type Tags = Vec<(String, String)>;

/// Partitions whose name starts with this are pinned: acks never free their rows; only `clear`
/// and `delete` do. Policy weights live in such a partition.
pub const PINNED_PREFIX: &str = "__";

/// Rows a put creates.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NewRows {
    pub partition: String,
    /// One group id per row, or `None` for rows that belong to no group.
    pub groups: Option<Vec<u64>>,
    /// Declared size of the groups in this put; by default, the number of rows each group has
    /// in this put (a group written in one go).
    pub group_size: Option<u32>,
    /// One version for every row, or one per row.
    pub versions: Vec<u64>,
    /// Nothing, one set for every row, or one per row.
    pub tags: Vec<Arc<Tags>>,
}

/// Which rows a put writes to.
#[derive(Debug, Clone)]
pub enum PutTarget {
    New(NewRows),
    Existing(Vec<u64>),
}

/// One column of a put as the index sees it: a name, a schema and a row count.
#[derive(Debug, Clone, Copy)]
pub struct ColumnSpec<'a> {
    pub name: &'a str,
    pub schema: &'a FieldSchema,
    pub rows: usize,
}

/// Rows a put may now fill, and the field ids of its columns.
#[derive(Debug, Clone)]
pub struct Admitted {
    pub rows: Vec<u64>,
    pub fields: Vec<FieldId>,
}

/// Metadata of one row, as reported to readers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowInfo {
    pub index: u64,
    pub partition: String,
    pub group: Option<u64>,
    pub version: u64,
    pub tags: Arc<Tags>,
}

#[derive(Debug, Clone)]
struct RowMeta {
    partition: PartitionId,
    version: u64,
    group: Option<u64>,
    /// How many registered tasks have acked this row.
    acks: u32,
    tags: Arc<Tags>,
}

#[derive(Debug)]
struct FieldState {
    name: String,
    schema: FieldSchema,
    ready: Bitmap,
    ready_rows: u64,
}

#[derive(Debug)]
struct TaskState {
    name: String,
    /// Partition-name prefixes this task consumes; `None` for all.
    scope: Option<Vec<String>>,
    /// Leased or acked by this task: not claimable by it.
    busy: Bitmap,
    acked: Bitmap,
    /// Every row below this global index is acked by this task or gone.
    low_water: u64,
    leased_rows: u64,
    acked_rows: u64,
}

#[derive(Debug)]
struct PartitionState {
    name: String,
    /// Global index range that may hold live rows of this partition.
    first: u64,
    end: u64,
    live_rows: u64,
    pinned: bool,
    /// Per task: whether the task's scope covers this partition.
    covered_by: Vec<bool>,
    /// Acks a row of this partition needs before it is freed.
    required_acks: u32,
}

#[derive(Debug)]
struct GroupState {
    size: u32,
    /// Rows that ever joined the group (members freed since are no longer in `members`).
    joined: u32,
    /// Global indexes, ascending.
    members: Vec<u64>,
}

/// Monotone counters, reported by `stats`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Counters {
    pub puts: u64,
    pub rows_put: u64,
    pub field_ready_updates: u64,
    pub claims: u64,
    pub rows_claimed: u64,
    pub rows_acked: u64,
    pub rows_released: u64,
    pub rows_freed: u64,
    pub leases_expired: u64,
}

impl Counters {
    /// Every counter with its name, in a fixed order (for reports and the wire).
    pub fn named(&self) -> [(&'static str, u64); 9] {
        [
            ("puts", self.puts),
            ("rows_put", self.rows_put),
            ("field_ready_updates", self.field_ready_updates),
            ("claims", self.claims),
            ("rows_claimed", self.rows_claimed),
            ("rows_acked", self.rows_acked),
            ("rows_released", self.rows_released),
            ("rows_freed", self.rows_freed),
            ("leases_expired", self.leases_expired),
        ]
    }

    /// Sets the counter called `name`; returns false if there is none (a newer peer's counter).
    pub fn set(&mut self, name: &str, value: u64) -> bool {
        let slot = match name {
            "puts" => &mut self.puts,
            "rows_put" => &mut self.rows_put,
            "field_ready_updates" => &mut self.field_ready_updates,
            "claims" => &mut self.claims,
            "rows_claimed" => &mut self.rows_claimed,
            "rows_acked" => &mut self.rows_acked,
            "rows_released" => &mut self.rows_released,
            "rows_freed" => &mut self.rows_freed,
            "leases_expired" => &mut self.leases_expired,
            _ => return false,
        };
        *slot = value;
        true
    }
}

/// A point-in-time summary of the index.
#[derive(Debug, Clone, Default)]
pub struct IndexStats {
    pub live_rows: u64,
    pub resident_slots: u64,
    pub active_leases: u64,
    pub counters: Counters,
    /// `(name, schema, rows ready)`.
    pub fields: Vec<(String, FieldSchema, u64)>,
    /// `(name, rows leased, rows acked)`.
    pub tasks: Vec<(String, u64, u64)>,
    /// `(name, live rows)`.
    pub partitions: Vec<(String, u64)>,
}

#[derive(Debug, Default)]
pub struct Index {
    /// Global index of slot 0; always a multiple of 64 so bitmaps drop whole words.
    base: u64,
    /// Next global index to hand out.
    next: u64,
    rows: VecDeque<RowMeta>,
    live: Bitmap,
    fields: Vec<FieldState>,
    field_ids: HashMap<String, FieldId>,
    tasks: Vec<TaskState>,
    task_ids: HashMap<String, TaskId>,
    partitions: Vec<PartitionState>,
    partition_ids: HashMap<String, PartitionId>,
    /// Groups are scoped to their partition: `(partition, group id)`.
    groups: HashMap<(PartitionId, u64), GroupState>,
    leases: Leases,
    shared: SharedClaims,
    counters: Counters,
    /// Durable changes not yet taken, when journaling is on (see `journal.rs`).
    journal: Option<Vec<journal::Change>>,
}

impl Index {
    pub fn new() -> Self {
        Self::default()
    }

    // ---- tasks -------------------------------------------------------------------------------

    /// Registers a consumer. Idempotent: registering a known name returns its id.
    /// Registers a consumer of the partitions whose names start with one of `scope`'s prefixes
    /// (`None`: every partition). The task can claim only rows in its scope, and rows are
    /// retained until every task whose scope covers them has acked them. Registering a known name
    /// again with the same scope returns its id.
    pub fn register_task(&mut self, name: &str, scope: Option<Vec<String>>) -> Result<TaskId> {
        if name.is_empty() {
            return Err(StoreError::bad_request("a task needs a non-empty name"));
        }
        if let Some(&id) = self.task_ids.get(name) {
            let known = &self.tasks[id as usize].scope;
            if *known != scope {
                return Err(StoreError::bad_request(format!(
                    "task {name:?} is already registered with partitions {known:?}"
                )));
            }
            return Ok(id);
        }
        let id = self.tasks.len() as TaskId;
        let words = self.live.words();
        for part in &mut self.partitions {
            let covers = scope_covers(scope.as_deref(), &part.name);
            part.covered_by.push(covers);
            part.required_acks += u32::from(covers);
        }
        self.tasks.push(TaskState {
            name: name.to_owned(),
            scope,
            busy: Bitmap::with_words(words),
            acked: Bitmap::with_words(words),
            low_water: self.base,
            leased_rows: 0,
            acked_rows: 0,
        });
        self.task_ids.insert(name.to_owned(), id);
        if self.journal.is_some() {
            let scope = self.tasks[id as usize].scope.clone();
            self.note(|| Change::Task { name: name.to_owned(), scope });
        }
        Ok(id)
    }

    /// Whether the row in `slot` belongs to a partition in the task's scope.
    #[inline]
    fn in_scope(&self, slot: usize, task: TaskId) -> bool {
        self.partitions[self.rows[slot].partition as usize].covered_by[task as usize]
    }

    pub fn task_id(&self, name: &str) -> Result<TaskId> {
        self.task_ids.get(name).copied().ok_or_else(|| StoreError::UnknownTask(name.to_owned()))
    }

    pub fn task_names(&self) -> Vec<String> {
        self.tasks.iter().map(|t| t.name.clone()).collect()
    }

    // ---- fields ------------------------------------------------------------------------------

    pub fn field_id(&self, name: &str) -> Result<FieldId> {
        self.field_ids.get(name).copied().ok_or_else(|| StoreError::UnknownField(name.to_owned()))
    }

    pub fn field_schema(&self, id: FieldId) -> &FieldSchema {
        &self.fields[id as usize].schema
    }

    pub fn field_name(&self, id: FieldId) -> &str {
        &self.fields[id as usize].name
    }

    /// Checks a column against the field's fixed schema, if it has one.
    fn check_column(&self, col: &ColumnSpec<'_>) -> Result<()> {
        if col.name.is_empty() {
            return Err(StoreError::bad_request("a field needs a non-empty name"));
        }
        col.schema.validate()?;
        if let Some(&id) = self.field_ids.get(col.name) {
            let fixed = &self.fields[id as usize].schema;
            if fixed != col.schema {
                return Err(StoreError::schema(format!(
                    "field {:?} is {fixed}, this put has {}",
                    col.name, col.schema
                )));
            }
        }
        Ok(())
    }

    fn field_or_register(&mut self, name: &str, schema: &FieldSchema) -> FieldId {
        if let Some(&id) = self.field_ids.get(name) {
            return id;
        }
        let id = self.fields.len() as FieldId;
        self.fields.push(FieldState {
            name: name.to_owned(),
            schema: schema.clone(),
            ready: Bitmap::with_words(self.live.words()),
            ready_rows: 0,
        });
        self.field_ids.insert(name.to_owned(), id);
        self.note(|| Change::Field { name: name.to_owned(), schema: schema.clone() });
        id
    }

    // ---- rows --------------------------------------------------------------------------------

    #[inline]
    fn slot(&self, index: u64) -> Option<usize> {
        (index >= self.base && index < self.next).then(|| (index - self.base) as usize)
    }

    /// Whether the row exists and its payload has not been freed.
    pub fn is_live(&self, index: u64) -> bool {
        self.slot(index).is_some_and(|s| self.live.get(s))
    }

    fn live_slot(&self, index: u64) -> Result<usize> {
        self.slot(index).filter(|&s| self.live.get(s)).ok_or(StoreError::UnknownIndex(index))
    }

    pub fn row_info(&self, index: u64) -> Result<RowInfo> {
        let meta = &self.rows[self.live_slot(index)?];
        Ok(RowInfo {
            index,
            partition: self.partitions[meta.partition as usize].name.clone(),
            group: meta.group,
            version: meta.version,
            tags: Arc::clone(&meta.tags),
        })
    }

    /// Live rows, oldest first, optionally of one partition.
    pub fn live_rows(&self, partition: Option<&str>) -> Vec<u64> {
        let (first, end) = match partition {
            None => (self.base, self.next),
            Some(name) => match self.partition_ids.get(name) {
                Some(&p) => (self.partitions[p as usize].first, self.partitions[p as usize].end),
                None => return Vec::new(),
            },
        };
        let pid = partition.and_then(|name| self.partition_ids.get(name).copied());
        (first.max(self.base)..end.min(self.next))
            .filter(|&i| {
                let s = (i - self.base) as usize;
                self.live.get(s) && pid.is_none_or(|p| self.rows[s].partition == p)
            })
            .collect()
    }

    /// Validates a put and, if it is acceptable, registers its new fields and allocates its new
    /// rows (live, nothing ready yet). Nothing changes if it fails.
    pub fn admit_put(
        &mut self,
        columns: &[ColumnSpec<'_>],
        target: &PutTarget,
    ) -> Result<Admitted> {
        let n = self.check_put(columns, target)?;
        let fields = columns.iter().map(|c| self.field_or_register(c.name, c.schema)).collect();
        let rows = match target {
            PutTarget::Existing(indexes) => indexes.clone(),
            PutTarget::New(new) => self.allocate(new, n),
        };
        self.counters.puts += 1;
        Ok(Admitted { rows, fields })
    }

    /// Every check of a put, with no change; returns its row count.
    fn check_put(&self, columns: &[ColumnSpec<'_>], target: &PutTarget) -> Result<usize> {
        let Some(first) = columns.first() else {
            return Err(StoreError::bad_request("a put needs at least one field"));
        };
        let n = first.rows;
        if n == 0 {
            return Err(StoreError::bad_request("a put needs at least one row"));
        }
        for (i, col) in columns.iter().enumerate() {
            if col.rows != n {
                return Err(StoreError::schema(format!(
                    "field {:?} has {} rows but field {:?} has {n}",
                    col.name, col.rows, first.name
                )));
            }
            if columns[..i].iter().any(|c| c.name == col.name) {
                return Err(StoreError::bad_request(format!("field {:?} given twice", col.name)));
            }
            self.check_column(col)?;
        }
        match target {
            PutTarget::Existing(indexes) => self.check_existing(indexes, n)?,
            PutTarget::New(new) => self.check_new(new, n)?,
        }
        Ok(n)
    }

    fn check_existing(&self, indexes: &[u64], n: usize) -> Result<()> {
        if indexes.len() != n {
            return Err(StoreError::schema(format!(
                "{} indexes given for {n} rows of data",
                indexes.len()
            )));
        }
        let mut seen = std::collections::HashSet::with_capacity(n);
        for &i in indexes {
            self.live_slot(i)?;
            if !seen.insert(i) {
                return Err(StoreError::bad_request(format!("row index {i} given twice")));
            }
        }
        Ok(())
    }

    fn check_new(&self, new: &NewRows, n: usize) -> Result<()> {
        if new.partition.is_empty() {
            return Err(StoreError::bad_request("a partition needs a non-empty name"));
        }
        if ![1, n].contains(&new.versions.len()) {
            return Err(StoreError::bad_request(format!(
                "{} versions given for {n} rows (give one, or one per row)",
                new.versions.len()
            )));
        }
        if ![0, 1, n].contains(&new.tags.len()) {
            return Err(StoreError::bad_request(format!(
                "{} tag sets given for {n} rows (give none, one, or one per row)",
                new.tags.len()
            )));
        }
        let Some(groups) = &new.groups else {
            return match new.group_size {
                Some(_) => Err(StoreError::bad_request("group_size given without groups")),
                None => Ok(()),
            };
        };
        if groups.len() != n {
            return Err(StoreError::bad_request(format!(
                "{} group ids given for {n} rows",
                groups.len()
            )));
        }
        if new.group_size == Some(0) {
            return Err(StoreError::bad_request("group_size must be at least 1"));
        }
        let pid = self.partition_ids.get(&new.partition).copied();
        for (group, added) in count_by_group(groups) {
            let (size, existing) = match pid.and_then(|p| self.groups.get(&(p, group))) {
                Some(g) => {
                    if new.group_size.is_some_and(|s| s != g.size) {
                        return Err(StoreError::bad_request(format!(
                            "group {group} was declared with {} rows, not {}",
                            g.size,
                            new.group_size.unwrap_or_default()
                        )));
                    }
                    (g.size as usize, g.joined as usize)
                }
                None => (new.group_size.map_or(added, |s| s as usize), 0),
            };
            if existing + added > size {
                return Err(StoreError::bad_request(format!(
                    "group {group} would have {} rows but its size is {size}",
                    existing + added
                )));
            }
        }
        Ok(())
    }

    fn partition_or_register(&mut self, name: &str) -> PartitionId {
        if let Some(&id) = self.partition_ids.get(name) {
            return id;
        }
        let id = self.partitions.len() as PartitionId;
        let covered_by: Vec<bool> =
            self.tasks.iter().map(|t| scope_covers(t.scope.as_deref(), name)).collect();
        self.partitions.push(PartitionState {
            name: name.to_owned(),
            first: self.next,
            end: self.next,
            live_rows: 0,
            pinned: name.starts_with(PINNED_PREFIX),
            required_acks: covered_by.iter().map(|&c| u32::from(c)).sum(),
            covered_by,
        });
        self.partition_ids.insert(name.to_owned(), id);
        id
    }

    fn allocate(&mut self, new: &NewRows, n: usize) -> Vec<u64> {
        let pid = self.partition_or_register(&new.partition);
        let start = self.next;
        let part = &mut self.partitions[pid as usize];
        if part.live_rows == 0 {
            part.first = start;
        }
        part.end = start + n as u64;
        part.live_rows += n as u64;

        self.next += n as u64;
        self.resize_bitmaps();

        let empty_tags = Arc::new(Tags::new());
        for k in 0..n {
            let index = start + k as u64;
            let group = new.groups.as_ref().map(|g| g[k]);
            self.rows.push_back(RowMeta {
                partition: pid,
                version: new.versions[if new.versions.len() == 1 { 0 } else { k }],
                group,
                acks: 0,
                tags: match new.tags.len() {
                    0 => Arc::clone(&empty_tags),
                    1 => Arc::clone(&new.tags[0]),
                    _ => Arc::clone(&new.tags[k]),
                },
            });
            self.live.set((index - self.base) as usize);
        }
        if let Some(groups) = &new.groups {
            for (group, added) in count_by_group(groups) {
                let size = new.group_size.map_or(added as u32, |s| s);
                self.groups.entry((pid, group)).or_insert(GroupState {
                    size,
                    joined: 0,
                    members: Vec::new(),
                });
            }
            for (k, &group) in groups.iter().enumerate() {
                // Rows are appended in index order, so members stay sorted.
                let g = self.groups.get_mut(&(pid, group)).expect("registered above");
                g.joined += 1;
                g.members.push(start + k as u64);
            }
        }
        self.counters.rows_put += n as u64;
        self.note(|| Change::Rows { start, count: n as u64, new: new.clone() });
        (start..self.next).collect()
    }

    /// Drops the first `words` words of every bitmap (the caller drops their rows).
    fn drop_front_words(&mut self, words: usize) {
        self.live.drop_front_words(words);
        for f in &mut self.fields {
            f.ready.drop_front_words(words);
        }
        for t in &mut self.tasks {
            t.busy.drop_front_words(words);
            t.acked.drop_front_words(words);
        }
    }

    /// Grows every bitmap to cover the slots up to `next`.
    fn resize_bitmaps(&mut self) {
        let words = (self.next - self.base).div_ceil(64) as usize;
        self.live.resize_words(words);
        for f in &mut self.fields {
            f.ready.resize_words(words);
        }
        for t in &mut self.tasks {
            t.busy.resize_words(words);
            t.acked.resize_words(words);
        }
    }

    /// Marks `fields` ready on `rows` once their payloads are in place. Returns the rows that were
    /// freed meanwhile (their partition was cleared), whose payloads the caller must drop again.
    pub fn commit_ready(&mut self, rows: &[u64], fields: &[FieldId]) -> Vec<u64> {
        if self.journal.is_some() {
            let (rows, fields) = (rows.to_vec(), fields.to_vec());
            self.note(|| Change::Ready { rows, fields });
        }
        let mut gone = Vec::new();
        for &index in rows {
            let Some(slot) = self.slot(index).filter(|&s| self.live.get(s)) else {
                gone.push(index);
                continue;
            };
            for &f in fields {
                let field = &mut self.fields[f as usize];
                if field.ready.set(slot) {
                    field.ready_rows += 1;
                }
            }
        }
        self.counters.field_ready_updates += ((rows.len() - gone.len()) * fields.len()) as u64;
        gone
    }

    /// Checks that every row is live and every field is ready on it; returns the field ids.
    pub fn check_readable(&self, indexes: &[u64], fields: &[String]) -> Result<Vec<FieldId>> {
        let ids = fields.iter().map(|f| self.field_id(f)).collect::<Result<Vec<_>>>()?;
        for &index in indexes {
            let slot = self.live_slot(index)?;
            for &f in &ids {
                if !self.fields[f as usize].ready.get(slot) {
                    return Err(StoreError::bad_request(format!(
                        "field {:?} is not ready on row {index}",
                        self.fields[f as usize].name
                    )));
                }
            }
        }
        Ok(ids)
    }

    /// Names of the fields ready on each row (e.g. to snapshot rows whatever stage they are at).
    pub fn ready_fields(&self, indexes: &[u64]) -> Result<Vec<Vec<String>>> {
        indexes
            .iter()
            .map(|&index| {
                let slot = self.live_slot(index)?;
                Ok(self
                    .fields
                    .iter()
                    .filter(|f| f.ready.get(slot))
                    .map(|f| f.name.clone())
                    .collect())
            })
            .collect()
    }

    // ---- freeing -----------------------------------------------------------------------------

    fn free_slot(&mut self, slot: usize) {
        if !self.live.clear(slot) {
            return;
        }
        let index = self.base + slot as u64;
        for f in &mut self.fields {
            if f.ready.clear(slot) {
                f.ready_rows -= 1;
            }
        }
        let meta = &self.rows[slot];
        self.partitions[meta.partition as usize].live_rows -= 1;
        if let Some(group) = meta.group {
            let key = (meta.partition, group);
            if let Some(g) = self.groups.get_mut(&key) {
                g.members.retain(|&m| m != index);
                if g.members.is_empty() {
                    self.groups.remove(&key);
                }
            }
        }
        self.counters.rows_freed += 1;
    }

    /// Frees every live row of a partition; returns the freed indexes. Unknown partitions hold
    /// no rows, so clearing one frees nothing.
    pub fn clear_partition(&mut self, partition: &str) -> Vec<u64> {
        let freed = self.live_rows(Some(partition));
        if !freed.is_empty() {
            self.note(|| Change::Cleared { partition: partition.to_owned() });
        }
        for &index in &freed {
            self.free_slot((index - self.base) as usize);
        }
        self.compact();
        freed
    }

    /// Frees the given rows; fails, freeing none, if any is unknown.
    pub fn delete(&mut self, indexes: &[u64]) -> Result<()> {
        let slots = indexes.iter().map(|&i| self.live_slot(i)).collect::<Result<Vec<_>>>()?;
        self.note(|| Change::Deleted { rows: indexes.to_vec() });
        for slot in slots {
            self.free_slot(slot);
        }
        self.compact();
        Ok(())
    }

    /// Forgets whole leading words of rows that are all gone.
    fn compact(&mut self) {
        let mut drop_words = 0usize;
        while (drop_words + 1) as u64 * 64 <= self.next - self.base
            && self.live.word(drop_words) == 0
        {
            drop_words += 1;
        }
        if drop_words == 0 {
            return;
        }
        self.drop_front_words(drop_words);
        self.rows.drain(..drop_words * 64);
        self.base += drop_words as u64 * 64;
        for t in &mut self.tasks {
            t.low_water = t.low_water.max(self.base);
        }
    }

    // ---- reporting ---------------------------------------------------------------------------

    pub fn stats(&self) -> IndexStats {
        IndexStats {
            live_rows: self.live.count_ones(),
            resident_slots: self.next - self.base,
            active_leases: self.leases.active() as u64,
            counters: self.counters.clone(),
            fields: self
                .fields
                .iter()
                .map(|f| (f.name.clone(), f.schema.clone(), f.ready_rows))
                .collect(),
            tasks: self
                .tasks
                .iter()
                .map(|t| (t.name.clone(), t.leased_rows, t.acked_rows))
                .collect(),
            partitions: self
                .partitions
                .iter()
                .filter(|p| p.live_rows > 0)
                .map(|p| (p.name.clone(), p.live_rows))
                .collect(),
        }
    }
}

fn scope_covers(scope: Option<&[String]>, partition: &str) -> bool {
    scope.is_none_or(|prefixes| prefixes.iter().any(|p| partition.starts_with(p.as_str())))
}

/// `(group, rows of it)` in first-seen order.
fn count_by_group(groups: &[u64]) -> Vec<(u64, usize)> {
    let mut counts: Vec<(u64, usize)> = Vec::new();
    let mut at: HashMap<u64, usize> = HashMap::new();
    for &g in groups {
        if let Some(&i) = at.get(&g) {
            counts[i].1 += 1;
        } else {
            at.insert(g, counts.len());
            counts.push((g, 1));
        }
    }
    counts
}
