//! How a store's changes outlive its process. The store itself does no I/O: it hands every
//! durable change to a [`Journal`] (the daemon's write-ahead log) at three points, chosen so that
//! payload bytes never move under the index lock and the log's order is the index's order:
//!
//! 1. `write_payload`, outside every lock, before a put commits: the put's bytes go out first.
//! 2. `append`, under the index lock, right after the change: the journal only buffers here.
//! 3. `sync`, after the lock is released and before the call returns: the change is made as
//!    durable as the journal's policy says, so whatever a caller was told happened, happened.

use crate::error::Result;
use crate::index::{Change, FieldId};
use crate::payload::Cell;

/// What `write_payload` returns: the journal's name for the bytes it wrote, to be committed
/// with the put's `Ready` change (or discarded if the put fails).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Receipt(pub u64);

/// A point in the journal's history: everything appended before it.
pub type Position = u64;

pub trait Journal: Send + Sync {
    /// Writes the cells of a put, `columns[f].1[k]` being field `columns[f].0` of its `k`-th
    /// row, before the put commits.
    fn write_payload(&self, columns: &[(FieldId, &[Cell])]) -> Result<Receipt>;

    /// Takes changes just made to the index, in order, while the index lock is held, so it must
    /// not block on I/O. `receipt` holds the payload of the `Ready` change among them.
    fn append(&self, changes: Vec<Change>, receipt: Option<Receipt>) -> Position;

    /// Makes everything appended up to `position` durable, as the journal's policy says.
    fn sync(&self, position: Position) -> Result<()>;

    /// Forgets the payload of a put that failed before it committed.
    fn discard(&self, receipt: Receipt);
}

/// The live part of a store at one instant, as changes plus the cells of every ready field:
/// what a snapshot writes, and what [`crate::Store::restore`] reads back.
#[derive(Debug, Default)]
pub struct Snapshot {
    pub changes: Vec<Change>,
    /// For the `k`-th `Ready` change among `changes`: its cells, `[field][row]`.
    pub cells: Vec<Vec<Vec<Cell>>>,
}
