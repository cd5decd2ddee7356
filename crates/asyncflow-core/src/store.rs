//! The embedded store: the index (control plane) under one lock with a condition variable for
//! waiting claims, the payload shards (data plane) under their own locks, and the memory budget.
//! Every operation either completes or leaves the store as it was.

use std::fmt;
use std::fmt::Write as _;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::durability::{Journal, Position, Receipt, Snapshot};
use crate::error::{Result, StoreError};
use crate::index::{
    Admitted, Change, ClaimSpec, Claimed, ColumnSpec, FieldId, Index, IndexStats, LeaseId,
    PutTarget, RowInfo,
};
use crate::memory::{MemoryBudget, MemoryGuard};
use crate::payload::{ByteStorage, Cell, Chunk, ChunkLayout, copy_into_chunk};
use crate::schema::FieldSchema;
use crate::shards::Shards;
use crate::wait::{Attempt, Wait, block_on};

/// The most payload shards a store may have (each is a lock and a table of its own).
pub const MAX_SHARDS: usize = 1 << 16;

#[derive(Debug, Clone)]
pub struct StoreConfig {
    pub shards: usize,
    /// Payload bytes the store may hold; `None` for no limit.
    pub memory_limit: Option<u64>,
    /// How long a claim's lease lasts before its rows are handed out again.
    pub lease_timeout: Duration,
}

impl Default for StoreConfig {
    fn default() -> Self {
        Self { shards: 8, memory_limit: None, lease_timeout: Duration::from_secs(30) }
    }
}

/// One field's data in a put: a cell per row, in row order.
#[derive(Debug, Clone)]
pub struct Column {
    pub name: String,
    pub schema: FieldSchema,
    pub cells: Vec<Cell>,
}

impl Column {
    /// Packs `cells` (`(bytes, first dimension)` each) into one fresh chunk paid for by
    /// `accounting`.
    pub fn pack(
        name: &str,
        schema: FieldSchema,
        cells: &[(&[u8], u64)],
        accounting: Option<MemoryGuard>,
    ) -> Self {
        let layout = ChunkLayout::packed(cells.iter().map(|(b, _)| b.len()));
        let sources: Vec<&[u8]> = cells.iter().map(|(b, _)| *b).collect();
        let chunk = copy_into_chunk(&layout, &sources, accounting);
        let cells = layout
            .spans
            .iter()
            .zip(cells)
            .map(|(&(offset, len), &(_, first_dim))| Cell {
                chunk: Arc::clone(&chunk),
                offset,
                len,
                first_dim,
            })
            .collect();
        Self { name: name.to_owned(), schema, cells }
    }
}

/// Cells read back from the store, with the schema needed to interpret them.
#[derive(Debug, Clone)]
pub struct ReadColumn {
    pub name: String,
    pub schema: FieldSchema,
    pub cells: Vec<Cell>,
}

#[derive(Debug, Clone)]
pub struct StoreStats {
    pub index: IndexStats,
    pub payload_rows: u64,
    pub memory_used: u64,
    pub memory_limit: Option<u64>,
    pub shards: u64,
    pub lease_timeout: Duration,
}

/// Where a store reads the time its leases are measured in: the monotonic clock, unless the
/// caller drives one of its own (a test that moves time on instead of sleeping).
#[derive(Clone)]
pub struct Clock(Arc<dyn Fn() -> Instant + Send + Sync>);

impl Clock {
    pub fn new(now: impl Fn() -> Instant + Send + Sync + 'static) -> Self {
        Self(Arc::new(now))
    }

    pub fn now(&self) -> Instant {
        (self.0)()
    }
}

impl Default for Clock {
    fn default() -> Self {
        Self::new(Instant::now)
    }
}

impl fmt::Debug for Clock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Clock")
    }
}

/// Told which rows were freed, for a store whose payloads also live elsewhere (a controller
/// whose storage daemons must drop them).
type FreeHook = Box<dyn Fn(&[u64]) + Send + Sync>;

/// Called whenever rows may have become claimable (see [`Store::on_change`]).
type ChangeHook = Box<dyn Fn(Claimable<'_>) + Send + Sync>;

/// Why rows may have become claimable, as told to [`Store::on_change`]'s hook: a claim that
/// asks for none of the fields that became ready cannot have gained rows.
#[derive(Debug, Clone, Copy)]
pub enum Claimable<'a> {
    /// These fields became ready on some rows; nothing else changed.
    Fields(&'a [String]),
    /// A lease was acked: only a claim of whole groups may have gained rows (it skips the
    /// members its task acked, so an ack can leave the rest of a group claimable).
    Acked,
    /// Anything may have: leases released or run out, a shared batch claimed, a lease's
    /// deadline moved.
    Any,
}

impl Claimable<'_> {
    /// Whether a claim asking for `fields` (of whole groups if `whole_groups`) may have gained
    /// rows.
    pub fn concerns(&self, fields: &[String], whole_groups: bool) -> bool {
        match self {
            Claimable::Fields(ready) => fields.iter().any(|f| ready.contains(f)),
            Claimable::Acked => whole_groups,
            Claimable::Any => true,
        }
    }
}

#[derive(Debug)]
pub struct Store {
    config: StoreConfig,
    clock: Clock,
    index: Mutex<Index>,
    /// Signalled whenever rows may have become claimable (new readiness, released leases).
    changed: Condvar,
    /// Called at the same moments, for waiters that do not block a thread on `changed`.
    on_change: OnceHook<ChangeHook>,
    shards: Shards,
    memory: Arc<MemoryBudget>,
    on_free: OnceHook<FreeHook>,
    /// Where durable changes go; unset for a store that forgets everything when it stops.
    journal: OnceLock<Arc<dyn Journal>>,
}

struct OnceHook<H>(OnceLock<H>);

impl<H> Default for OnceHook<H> {
    fn default() -> Self {
        Self(OnceLock::new())
    }
}

impl fmt::Debug for dyn Journal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Journal")
    }
}

impl<H> fmt::Debug for OnceHook<H> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.0.get().is_some() { "OnceHook(set)" } else { "OnceHook(unset)" })
    }
}

impl Store {
    pub fn new(config: StoreConfig) -> Result<Self> {
        Self::with_clock(config, Clock::default())
    }

    /// A store whose leases run on `clock`. Waits (claim and put timeouts) still run on the
    /// monotonic clock: a driven clock decides when leases expire, not how long a call blocks.
    pub fn with_clock(config: StoreConfig, clock: Clock) -> Result<Self> {
        if !(1..=MAX_SHARDS).contains(&config.shards) {
            return Err(StoreError::bad_request(format!(
                "a store has from 1 to {MAX_SHARDS} shards, not {}",
                config.shards
            )));
        }
        if config.lease_timeout.is_zero() {
            return Err(StoreError::bad_request("lease_timeout must be positive"));
        }
        Ok(Self {
            index: Mutex::new(Index::new()),
            changed: Condvar::new(),
            on_change: OnceHook::default(),
            shards: Shards::new(config.shards),
            memory: MemoryBudget::new(config.memory_limit),
            on_free: OnceHook::default(),
            journal: OnceLock::new(),
            config,
            clock,
        })
    }

    /// Sends every later durable change to `journal` (see [`Journal`]). Only the first journal
    /// set counts; set it before the store is shared.
    pub fn set_journal(&self, journal: Arc<dyn Journal>) {
        let mut index = self.index.lock();
        if self.journal.set(journal).is_ok() {
            index.set_journaling(true);
        }
    }

    /// Lease ids handed out from now on are at least `floor` (see [`Index::set_lease_floor`]).
    pub fn set_lease_floor(&self, floor: u64) {
        self.index.lock().set_lease_floor(floor);
    }

    /// Hands the index's latest changes to the journal; call with the index lock held.
    fn append(&self, index: &mut Index, receipt: Option<Receipt>) -> Option<Position> {
        let journal = self.journal.get()?;
        let changes = index.take_changes();
        if changes.is_empty() && receipt.is_none() {
            return None;
        }
        Some(journal.append(changes, receipt))
    }

    /// Makes the changes appended up to `at` durable; call after the index lock is released.
    fn sync(&self, at: Option<Position>) -> Result<()> {
        match (self.journal.get(), at) {
            (Some(journal), Some(at)) => journal.sync(at),
            _ => Ok(()),
        }
    }

    /// Runs `change` on the index, journals what it did, and makes that durable.
    fn change<T>(&self, change: impl FnOnce(&mut Index) -> Result<T>) -> Result<T> {
        let mut index = self.index.lock();
        let out = change(&mut index);
        let at = self.append(&mut index, None);
        drop(index);
        self.sync(at)?;
        out
    }

    /// Calls `hook` with the rows of every later free (ack by all tasks, clear, delete). Only
    /// the first hook set counts.
    pub fn on_free(&self, hook: impl Fn(&[u64]) + Send + Sync + 'static) {
        let _ = self.on_free.0.set(Box::new(hook));
    }

    /// Calls `hook` whenever rows may have become claimable (new readiness, released or expired
    /// leases, a shared batch claimed), after waking the claims blocked in [`Store::claim`]. A
    /// caller that waits without a thread tries again when called, or at
    /// [`Store::next_lease_deadline`]. Only the first hook set counts.
    pub fn on_change(&self, hook: impl Fn(Claimable<'_>) + Send + Sync + 'static) {
        let _ = self.on_change.0.set(Box::new(hook));
    }

    fn notify_changed(&self) {
        self.notify(Claimable::Any);
    }

    fn notify(&self, what: Claimable<'_>) {
        self.changed.notify_all();
        if let Some(hook) = self.on_change.0.get() {
            hook(what);
        }
    }

    /// When the earliest lease runs out, on the store's clock; `None` when none is held.
    pub fn next_lease_deadline(&self) -> Option<Instant> {
        self.index.lock().next_lease_deadline()
    }

    fn free_payloads(&self, rows: &[u64]) {
        if rows.is_empty() {
            return;
        }
        self.shards.remove(rows);
        if let Some(hook) = self.on_free.0.get() {
            hook(rows);
        }
    }

    pub fn config(&self) -> &StoreConfig {
        &self.config
    }

    /// Reserves payload bytes before a put copies them; the guard pays for the put's chunks.
    pub fn reserve(&self, bytes: u64, wait: Wait<'_>) -> Result<MemoryGuard> {
        self.memory.reserve(bytes, wait)
    }

    /// Reserves memory for `cells` (waiting as `wait` allows) and packs them into a column.
    pub fn pack_column(
        &self,
        name: &str,
        schema: FieldSchema,
        cells: &[(&[u8], u64)],
        wait: Wait<'_>,
    ) -> Result<Column> {
        let layout = ChunkLayout::packed(cells.iter().map(|(b, _)| b.len()));
        let guard = self.reserve(layout.total as u64, wait)?;
        Ok(Column::pack(name, schema, cells, Some(guard)))
    }

    /// Registers a consumer of the partitions starting with one of `scope`'s prefixes (`None`:
    /// all). Rows are retained until every task whose scope covers them has acked them.
    pub fn register_task(&self, name: &str, scope: Option<Vec<String>>) -> Result<()> {
        self.change(|index| index.register_task(name, scope).map(|_| ()))
    }

    /// Writes new rows, or fields of existing rows. The rows' fields become ready (claimable)
    /// only once all their payloads are in place.
    pub fn put(&self, columns: Vec<Column>, target: &PutTarget) -> Result<Vec<u64>> {
        for column in &columns {
            check_cells(column)?;
        }
        let specs: Vec<ColumnSpec<'_>> = columns
            .iter()
            .map(|c| ColumnSpec { name: &c.name, schema: &c.schema, rows: c.cells.len() })
            .collect();
        let admitted = self.admit(&specs, target)?;
        drop(specs);
        let cells: Vec<(FieldId, Vec<Cell>)> =
            admitted.fields.iter().copied().zip(columns.into_iter().map(|c| c.cells)).collect();
        let receipt = match self.journal.get() {
            None => None,
            Some(journal) => {
                let views: Vec<(FieldId, &[Cell])> =
                    cells.iter().map(|(f, c)| (*f, c.as_slice())).collect();
                match journal.write_payload(&views) {
                    Ok(receipt) => Some(receipt),
                    Err(e) => {
                        if matches!(target, PutTarget::New(_)) {
                            let _ = self.delete(&admitted.rows);
                        }
                        return Err(e);
                    }
                }
            }
        };
        self.shards.insert(&admitted.rows, &cells);
        self.commit_with(&admitted.rows, &admitted.fields, receipt)?;
        Ok(admitted.rows)
    }

    /// The first half of a put whose payloads are kept elsewhere: checks the columns and
    /// creates (or selects) the rows, with nothing ready until [`Store::commit`].
    pub fn admit(&self, columns: &[ColumnSpec<'_>], target: &PutTarget) -> Result<Admitted> {
        let mut index = self.index.lock();
        let admitted = index.admit_put(columns, target);
        let at = self.append(&mut index, None);
        drop(index);
        // Durable before its rows are named to the client: a store that lost the admission in
        // a crash would give the same indexes to another put, whose rows the first put's commit
        // would then complete in its place (its own rows lost).
        self.sync(at)?;
        admitted
    }

    /// Records the first dimension of cells whose bytes live elsewhere (on a controller's
    /// storage daemons): shared claims balance their parts by these token counts. Each column is
    /// a field and one first dimension per row of `rows`; freeing a row forgets them.
    pub fn note_first_dims(&self, rows: &[u64], columns: &[(FieldId, Vec<u64>)]) {
        let nothing = Chunk::new(Box::new(NoBytes), None);
        let cells: Vec<(FieldId, Vec<Cell>)> = columns
            .iter()
            .map(|(field, dims)| {
                let cell =
                    |&first_dim| Cell { chunk: Arc::clone(&nothing), offset: 0, len: 0, first_dim };
                (*field, dims.iter().map(cell).collect())
            })
            .collect();
        self.shards.insert(rows, &cells);
    }

    /// Makes `fields` ready on `rows` now that their payloads are in place.
    pub fn commit(&self, rows: &[u64], fields: &[FieldId]) -> Result<()> {
        self.commit_with(rows, fields, None)
    }

    fn commit_with(
        &self,
        rows: &[u64],
        fields: &[FieldId],
        receipt: Option<Receipt>,
    ) -> Result<()> {
        let mut index = self.index.lock();
        let gone = index.commit_ready(rows, fields);
        let at = self.append(&mut index, receipt);
        let names: Vec<String> = if self.on_change.0.get().is_some() {
            fields.iter().map(|&f| index.field_name(f).to_owned()).collect()
        } else {
            Vec::new()
        };
        drop(index);
        self.notify(Claimable::Fields(&names));
        self.free_payloads(&gone);
        self.sync(at)
    }

    /// Leases up to `spec.batch_size` rows, waiting for a full batch until the wait's deadline;
    /// then returns what is ready if `allow_partial`, else fails with `Timeout`. With
    /// `spec.partial_after` (and `allow_partial`) it settles for part of a batch, but not for
    /// none, once that has passed. A shared claim (`spec.share`) returns the caller's part of its
    /// step's batch, claiming the batch if the caller is the first to ask.
    pub fn claim(&self, spec: &ClaimSpec, allow_partial: bool, wait: Wait<'_>) -> Result<Claimed> {
        self.index.lock().check_claim(spec)?;
        let started = Instant::now();
        let settle_at = spec.partial_from(allow_partial, started)?;
        let lease_timeout = self.config.lease_timeout;
        // Shard locks are taken under the index lock here, never the other way round.
        let lengths = |rows: &[u64], field| self.shards.first_dims(rows, field);
        let outcome = block_on(&self.index, &self.changed, wait, |index, _, last_try| {
            let now = self.clock.now();
            if index.expire_leases(now) > 0 {
                self.notify_changed();
            }
            let early = !last_try && settle_at.is_some_and(|at| now >= at);
            let partial = allow_partial && (last_try || early);
            match index.try_claim_with(spec, now, lease_timeout, partial, &lengths) {
                // Before the deadline, part of a batch is at least one row.
                Ok(Some(claimed)) if early && claimed.rows.is_empty() => {
                    Attempt::Pending { wake_at: index.next_lease_deadline() }
                }
                Ok(Some(claimed)) => {
                    if spec.share.is_some() {
                        // The other consumers of a shared batch may be waiting for it to exist.
                        self.notify_changed();
                    }
                    Attempt::Done(Ok(claimed))
                }
                Ok(None) => {
                    let settle = settle_at.filter(|&at| at > now);
                    let wake_at = [index.next_lease_deadline(), settle].into_iter().flatten().min();
                    Attempt::Pending { wake_at }
                }
                Err(e) => Attempt::Done(Err(e)),
            }
        })?;
        match outcome {
            Some(result) => result,
            None => Err(self.claim_timeout(spec, started.elapsed())),
        }
    }

    fn claim_timeout(&self, spec: &ClaimSpec, waited: Duration) -> StoreError {
        let unwritten = self.index.lock().unwritten_fields(spec);
        let mut what = format!(
            "{} rows ready for task {:?} with fields {:?}",
            spec.batch_size, spec.task, spec.fields
        );
        if let Some(p) = &spec.partition {
            let _ = write!(what, " in partition {p:?}");
        }
        if !unwritten.is_empty() {
            let _ = write!(what, " (no put has written {unwritten:?} yet)");
        }
        StoreError::Timeout { what, waited }
    }

    /// Commits a lease (or `subset` of its rows); frees rows every task has now acked.
    pub fn ack(&self, lease: LeaseId, subset: Option<&[u64]>) -> Result<()> {
        let freed = self.change(|index| index.ack(lease, subset, self.clock.now()))?;
        self.free_payloads(&freed);
        self.notify(Claimable::Acked);
        Ok(())
    }

    /// Returns a lease's rows (or `subset`) to be delivered again at once.
    pub fn release(&self, lease: LeaseId, subset: Option<&[u64]>) -> Result<()> {
        self.index.lock().release(lease, subset, self.clock.now())?;
        self.notify_changed();
        Ok(())
    }

    /// Hands back a lease whose holder went away; whether anything was (see `Index::give_back`).
    pub fn give_back(&self, lease: LeaseId) -> Result<bool> {
        let gave = self.index.lock().give_back(lease, self.clock.now())?;
        if gave {
            self.notify_changed();
        }
        Ok(gave)
    }

    /// Extends a lease by `timeout` (default: the store's lease timeout) from now.
    pub fn renew(&self, lease: LeaseId, timeout: Option<Duration>) -> Result<Instant> {
        let timeout = timeout.unwrap_or(self.config.lease_timeout);
        let mut index = self.index.lock();
        let earliest = index.next_lease_deadline();
        let until = index.renew(lease, self.clock.now(), timeout)?;
        let sooner = index.next_lease_deadline() < earliest;
        drop(index);
        // A claim that waits without a thread sleeps until the earliest deadline it last saw.
        if sooner {
            self.notify_changed();
        }
        Ok(until)
    }

    /// The cells of `fields` on `rows`, one column per field.
    pub fn read(&self, rows: &[u64], fields: &[String]) -> Result<Vec<ReadColumn>> {
        let (ids, schemas): (Vec<FieldId>, Vec<FieldSchema>) =
            self.locate(rows, fields)?.into_iter().unzip();
        let cells = self.shards.get(rows, &ids)?;
        Ok(fields
            .iter()
            .zip(schemas)
            .zip(cells)
            .map(|((name, schema), cells)| ReadColumn { name: name.clone(), schema, cells })
            .collect())
    }

    /// Runs `each(f, k, cell)` on the cell of `fields[f]` on `rows[k]`, for every field and row,
    /// in no set order, without copying a cell; returns the fields' schemas. For rows just
    /// claimed for `fields`, which are ready on them: unlike [`Store::read`] it does not check
    /// that again. Fails part way if a row has no cell of a field (it was freed meanwhile).
    pub fn visit_claimed_cells(
        &self,
        rows: &[u64],
        fields: &[String],
        mut each: impl FnMut(usize, usize, &Cell),
    ) -> Result<Vec<FieldSchema>> {
        let (ids, schemas): (Vec<FieldId>, Vec<FieldSchema>) =
            self.locate(&[], fields)?.into_iter().unzip();
        for (f, &id) in ids.iter().enumerate() {
            self.shards.visit(rows, id, |k, cell| each(f, k, cell))?;
        }
        Ok(schemas)
    }

    /// Checks that `fields` are ready on every one of `rows`; returns their ids and schemas.
    pub fn locate(&self, rows: &[u64], fields: &[String]) -> Result<Vec<(FieldId, FieldSchema)>> {
        let index = self.index.lock();
        let ids = index.check_readable(rows, fields)?;
        Ok(ids.into_iter().map(|f| (f, index.field_schema(f).clone())).collect())
    }

    pub fn row_info(&self, rows: &[u64]) -> Result<Vec<RowInfo>> {
        let index = self.index.lock();
        rows.iter().map(|&i| index.row_info(i)).collect()
    }

    /// Names of the fields ready on each row.
    pub fn ready_fields(&self, rows: &[u64]) -> Result<Vec<Vec<String>>> {
        self.index.lock().ready_fields(rows)
    }

    /// Live rows, oldest first, optionally of one partition.
    pub fn rows(&self, partition: Option<&str>) -> Vec<RowInfo> {
        let index = self.index.lock();
        index
            .live_rows(partition)
            .into_iter()
            .map(|i| index.row_info(i).expect("listed rows are live"))
            .collect()
    }

    /// Frees every row of a partition; returns how many.
    pub fn clear(&self, partition: &str) -> Result<u64> {
        let freed = self.change(|index| Ok(index.clear_partition(partition)))?;
        self.free_payloads(&freed);
        Ok(freed.len() as u64)
    }

    /// Frees the given rows; fails, freeing none, if any is unknown.
    pub fn delete(&self, rows: &[u64]) -> Result<()> {
        self.change(|index| index.delete(rows))?;
        self.free_payloads(rows);
        Ok(())
    }

    pub fn field_schema(&self, name: &str) -> Result<FieldSchema> {
        let index = self.index.lock();
        Ok(index.field_schema(index.field_id(name)?).clone())
    }

    /// The live part of the store as changes and, with `payloads`, cells (see [`Snapshot`]);
    /// a store whose payloads live elsewhere (a controller's) has none to give. `rotate` runs
    /// while nothing can change the index, so a journal can start its next log exactly here.
    pub fn snapshot(&self, payloads: bool, rotate: impl FnOnce()) -> Result<Snapshot> {
        let mut index = self.index.lock();
        // Changes noted but not yet appended belong before the snapshot, in the old log.
        let at = self.append(&mut index, None);
        let changes = index.dump();
        let mut cells = Vec::new();
        for change in &changes {
            if let (true, Change::Ready { rows, fields }) = (payloads, change) {
                cells.push(self.shards.get(rows, fields)?);
            }
        }
        rotate();
        drop(index);
        self.sync(at)?;
        Ok(Snapshot { changes, cells })
    }

    /// Replays one change read back from a journal; `cells` (`[field][row]`) are the payload of
    /// a `Ready` change. Used before the store is shared, while it has no journal.
    pub fn restore(&self, change: &Change, cells: Option<Vec<Vec<Cell>>>) -> Result<()> {
        if let (Change::Ready { rows, fields }, Some(cells)) = (change, cells) {
            if cells.len() != fields.len() || cells.iter().any(|c| c.len() != rows.len()) {
                return Err(StoreError::Persistence(
                    "log does not fit: cells do not match their rows and fields".into(),
                ));
            }
            let columns: Vec<(FieldId, Vec<Cell>)> = fields.iter().copied().zip(cells).collect();
            self.shards.insert(rows, &columns);
        }
        let freed = self.index.lock().apply(change)?;
        self.free_payloads(&freed);
        Ok(())
    }

    /// Live rows on which no field is ready: rows whose put never completed (its producer or
    /// the daemon stopped between admitting and committing it).
    pub fn unfinished_rows(&self) -> Vec<u64> {
        let live = self.index.lock().live_rows(None);
        self.unfinished(&live)
    }

    /// Those of `rows` that are live with no field ready (see [`Store::unfinished_rows`]).
    pub fn unfinished(&self, rows: &[u64]) -> Vec<u64> {
        let index = self.index.lock();
        rows.iter()
            .copied()
            .filter(|&i| index.ready_fields(&[i]).is_ok_and(|f| f[0].is_empty()))
            .collect()
    }

    pub fn stats(&self) -> StoreStats {
        let index = self.index.lock().stats();
        StoreStats {
            index,
            payload_rows: self.shards.rows() as u64,
            memory_used: self.memory.used(),
            memory_limit: self.memory.limit(),
            shards: self.shards.len() as u64,
            lease_timeout: self.config.lease_timeout,
        }
    }
}

fn check_cells(column: &Column) -> Result<()> {
    column.schema.validate()?;
    for (k, cell) in column.cells.iter().enumerate() {
        let expected = column.schema.cell_bytes(cell.first_dim)?;
        if cell.len as u64 != expected {
            return Err(StoreError::schema(format!(
                "row {k} of field {:?} has {} bytes; a {} cell of first dimension {} needs {expected}",
                column.name, cell.len, column.schema, cell.first_dim
            )));
        }
    }
    Ok(())
}

/// The bytes of a cell kept elsewhere: none here.
struct NoBytes;

impl ByteStorage for NoBytes {
    fn as_bytes(&self) -> &[u8] {
        &[]
    }
}
