//! AsyncFlow's sample store core, in pure Rust with no I/O: a row is a sample, each RL task's
//! output is a column, and a task claims micro-batches of rows as soon as the columns it needs
//! are ready. Payload bytes (data plane) and row metadata (control plane) are kept apart so that
//! writers never serialise on one lock while bytes move.

pub mod bitmap;
pub mod durability;
pub mod error;
pub mod index;
pub mod memory;
pub mod payload;
pub mod scheduler;
pub mod schema;
pub mod shards;
pub mod store;
pub mod wait;

pub use durability::{Journal, Position, Receipt, Snapshot};
pub use error::{Result, StoreError};
pub use index::{
    Admitted, Change, ClaimSpec, Claimed, ColumnSpec, FieldId, Index, LeaseId, NewRows, PutTarget,
    RowInfo, Share, TokenLengths,
};
pub use memory::{MemoryBudget, MemoryGuard};
pub use payload::{Cell, Chunk, ChunkLayout, copy_into_chunk};
pub use schema::{DType, FieldSchema};
pub use store::{Claimable, Clock, Column, MAX_SHARDS, ReadColumn, Store, StoreConfig, StoreStats};
pub use wait::Wait;
