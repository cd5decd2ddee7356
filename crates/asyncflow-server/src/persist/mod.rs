//! Persistence for the daemon (`--data-dir`): a write-ahead log of every durable change with
//! the payload bytes it needs, and snapshots that replace the log once it has grown well past
//! the live data. A restart replays the newest snapshot and the logs after it, so every put that
//! completed and every row not yet acked comes back; leases do not (their rows are delivered
//! again). One [`Persistence`] serves every role: a standalone daemon logs index changes with
//! payloads, a controller index changes only, a storage daemon stored and dropped cells.
//!
//! - `datadir.rs`: which files make up the state, and the lock.
//! - `wal.rs`: the log of the current generation and the fsync policy.
//! - `snapshot.rs`: writing a snapshot.
//! - `recovery.rs`: reading it all back.

mod datadir;
mod recovery;
mod snapshot;
mod wal;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use asyncflow_core::{Cell, Change, FieldId, Journal, Position, Receipt, Snapshot, StoreError};
use asyncflow_proto::{CellLoc, ChunkRef, Record, Role, Stored};
use parking_lot::{Condvar, Mutex};

pub use datadir::DataDir;
pub use recovery::{Dropped, Payloads, Recovered};
pub use wal::Fsync;

use crate::error::{Error, Result};

/// `--data-dir`, `--fsync`, `--compact-after` and `--recover`.
#[derive(Debug, Clone)]
pub struct PersistConfig {
    pub dir: PathBuf,
    pub fsync: Fsync,
    /// A snapshot replaces the log once it holds this many bytes, or twice the live payload
    /// bytes if that is more.
    pub compact_after: u64,
    /// Start from a damaged log by dropping everything from the damage on (a copy is kept).
    pub recover: bool,
}

/// A put's payload, written and waiting for its commit record.
struct Written {
    generation: u64,
    chunks: Vec<ChunkRef>,
    cells: Vec<Vec<CellLoc>>,
}

pub struct Persistence {
    dir: DataDir,
    wal: wal::Wal,
    compact_after: u64,
    /// The generation the log is in.
    generation: AtomicU64,
    written: Mutex<HashMap<u64, Written>>,
    /// Signalled when a written payload is committed or discarded.
    settled: Condvar,
    next_receipt: AtomicU64,
    /// One snapshot at a time.
    compacting: Mutex<()>,
}

impl Persistence {
    /// Opens the data directory of a daemon of `role` (a controller's over the storage daemons
    /// `storage`), replays it through `apply` (see [`recovery::replay`]) and starts a new
    /// generation of the log.
    pub fn open(
        config: &PersistConfig,
        role: Role,
        storage: &[String],
        apply: impl FnMut(Record, &mut Payloads<'_>) -> Result<bool>,
    ) -> Result<(Arc<Self>, Recovered)> {
        let dir = DataDir::open(&config.dir, role)?;
        if role == Role::Controller {
            dir.check_storage(storage)?;
        }
        let policy =
            recovery::Policy { synced: config.fsync == Fsync::Always, recover: config.recover };
        let recovered = recovery::replay(&dir, policy, apply)?;
        let generation = recovered.next_generation;
        let wal = wal::Wal::create(&dir, generation, config.fsync).map_err(|e| {
            Error::Config(format!(
                "data directory {}: cannot start a log: {e}",
                config.dir.display()
            ))
        })?;
        let persistence = Arc::new(Self {
            dir,
            wal,
            compact_after: config.compact_after,
            generation: AtomicU64::new(generation),
            written: Mutex::new(HashMap::new()),
            settled: Condvar::new(),
            next_receipt: AtomicU64::new(1),
            compacting: Mutex::new(()),
        });
        Ok((persistence, recovered))
    }

    pub fn fsync(&self) -> Fsync {
        self.wal.fsync()
    }

    /// Writes the cells of a put (`columns[f].1[k]`: field `columns[f].0` of row `k`), each
    /// chunk they live in once.
    pub fn write_cells(&self, columns: &[(FieldId, &[Cell])]) -> Result<Receipt, StoreError> {
        let mut chunk_of: HashMap<*const asyncflow_core::Chunk, u32> = HashMap::new();
        let mut chunks: Vec<&[u8]> = Vec::new();
        let cells = columns
            .iter()
            .map(|(_, column)| {
                column
                    .iter()
                    .map(|cell| {
                        let chunk =
                            *chunk_of.entry(Arc::as_ptr(&cell.chunk)).or_insert_with(|| {
                                chunks.push(cell.chunk.as_bytes());
                                (chunks.len() - 1) as u32
                            });
                        CellLoc {
                            chunk,
                            offset: cell.offset as u64,
                            len: cell.len as u64,
                            first_dim: cell.first_dim,
                        }
                    })
                    .collect()
            })
            .collect();
        let id = self.next_receipt.fetch_add(1, Ordering::Relaxed);
        {
            // Noted under the lock a snapshot checks, before writing: a snapshot either sees
            // this put and waits for it, or started first and this put writes to its files.
            let mut written = self.written.lock();
            let generation = self.generation.load(Ordering::Acquire);
            written.insert(id, Written { generation, chunks: Vec::new(), cells: Vec::new() });
        }
        match self.wal.write_payload(&chunks) {
            Ok(refs) => {
                let mut written = self.written.lock();
                let entry = written.get_mut(&id).expect("inserted above");
                (entry.chunks, entry.cells) = (refs, cells);
                Ok(Receipt(id))
            }
            Err(e) => {
                self.discard(Receipt(id));
                Err(e)
            }
        }
    }

    fn settle(&self, receipt: Receipt) -> Option<Written> {
        let written = self.written.lock().remove(&receipt.0);
        self.settled.notify_all();
        written
    }

    /// Buffers changes; a `Ready` change is stored with the payload of `receipt`.
    pub fn append_changes(&self, changes: Vec<Change>, receipt: Option<Receipt>) -> Position {
        let mut written = receipt.and_then(|r| self.settle(r));
        let records: Vec<Record> = changes
            .into_iter()
            .map(|change| match (change, written.take()) {
                (Change::Ready { rows, fields }, Some(w)) => {
                    Record::Stored(Stored { rows, fields, chunks: w.chunks, cells: w.cells })
                }
                (change, w) => {
                    written = w;
                    Record::Change(change)
                }
            })
            .collect();
        self.wal.append(&records)
    }

    /// Buffers a storage daemon's stored cells.
    pub fn append_stored(
        &self,
        rows: Vec<u64>,
        fields: Vec<FieldId>,
        receipt: Receipt,
    ) -> Position {
        let Some(w) = self.settle(receipt) else {
            return self.wal.append(&[]);
        };
        self.wal.append(&[Record::Stored(Stored {
            rows,
            fields,
            chunks: w.chunks,
            cells: w.cells,
        })])
    }

    /// Buffers a storage daemon's dropped rows.
    pub fn append_dropped(&self, rows: Vec<u64>) -> Position {
        self.wal.append(&[Record::Dropped(rows)])
    }

    pub fn sync(&self, position: Position) -> Result<(), StoreError> {
        self.wal.sync(position)
    }

    /// Refuses changes once the log has failed.
    pub fn check(&self) -> Result<(), StoreError> {
        self.wal.check()
    }

    /// Writes and syncs everything so far (the `--fsync` interval's tick; stop).
    pub fn flush(&self) -> Result<(), StoreError> {
        self.wal.flush()
    }

    /// Whether the log has grown enough to be replaced by a snapshot of `live_bytes`.
    pub fn wants_snapshot(&self, live_bytes: u64) -> bool {
        self.wal.bytes() > self.compact_after.max(live_bytes.saturating_mul(2))
    }

    /// Replaces the log by a snapshot. `take` captures the state with the index (or storage)
    /// held still, calling the function it is given at that very point to start the next log.
    pub fn compact(
        &self,
        take: impl FnOnce(&dyn Fn()) -> Result<Snapshot, StoreError>,
    ) -> Result<(), StoreError> {
        let _one = self.compacting.lock();
        self.check()?;
        let next = self.generation.load(Ordering::Acquire) + 1;
        // New puts write their bytes to the next generation; the snapshot waits for every put
        // that wrote to an older one to commit, so no later record points into a file that the
        // snapshot makes obsolete.
        self.wal
            .rotate_payload(&self.dir, next)
            .map_err(|e| wal::failed("start a payload log", &e))?;
        self.generation.store(next, Ordering::Release);
        let mut written = self.written.lock();
        while written.values().any(|w| w.generation < next) {
            self.settled.wait_for(&mut written, Duration::from_millis(100));
        }
        drop(written);
        let rotated = Mutex::new(Ok(()));
        let snapshot = take(&|| *rotated.lock() = self.wal.rotate_meta(&self.dir, next))?;
        rotated.into_inner()?;
        snapshot::write(&self.dir, next, snapshot)?;
        self.dir.remove_before(next).map_err(|e| StoreError::Persistence(e.to_string()))
    }

    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }
}

impl Journal for Persistence {
    fn write_payload(&self, columns: &[(FieldId, &[Cell])]) -> asyncflow_core::Result<Receipt> {
        self.write_cells(columns)
    }

    fn append(&self, changes: Vec<Change>, receipt: Option<Receipt>) -> Position {
        self.append_changes(changes, receipt)
    }

    fn sync(&self, position: Position) -> asyncflow_core::Result<()> {
        Persistence::sync(self, position)
    }

    fn discard(&self, receipt: Receipt) {
        self.settle(receipt);
    }
}
