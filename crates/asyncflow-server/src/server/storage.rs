//! The storage role: payload cells keyed by the controller's row indexes and field ids, with a
//! memory budget, and nothing else — no readiness, no leases. The controller decides when rows
//! are ready and tells this daemon when to forget them. With a data directory, cells are logged
//! before they are kept and drops as they happen, in the order both reach the shards.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use asyncflow_core::shards::Shards;
use asyncflow_core::{
    Cell, Change, DType, FieldSchema, MemoryBudget, Position, Snapshot, StoreError, StoreStats,
    Wait,
};
use asyncflow_proto::{Record, Reply, Request, StoreCells};
use parking_lot::Mutex;

use crate::persist::{Payloads, Persistence};

use super::cells::{Payload, cells_in, extent, incoming_chunk, outgoing_cells};
use super::execute::{Execute, Outcome};
use super::outgoing::ReplyBody;
use super::session::Session;

pub struct Storage {
    shards: Shards,
    pub memory: Arc<MemoryBudget>,
    /// Keeps the log's order the shards' order.
    order: Mutex<()>,
    persistence: OnceLock<Arc<Persistence>>,
}

impl Storage {
    pub fn new(shards: usize, memory_limit: Option<u64>) -> Self {
        Self {
            shards: Shards::new(shards),
            memory: MemoryBudget::new(memory_limit),
            order: Mutex::new(()),
            persistence: OnceLock::new(),
        }
    }

    /// Logs every later change to `persistence` (after [`Storage::restore`] is done).
    pub fn set_persistence(&self, persistence: Arc<Persistence>) {
        let _ = self.persistence.set(persistence);
    }

    /// Replays one record of the data directory.
    pub fn restore(&self, record: Record, payloads: &mut Payloads<'_>) -> crate::Result<bool> {
        match record {
            Record::Stored(stored) => {
                let reserve =
                    |bytes| self.memory.reserve(bytes, Wait::timeout(Some(Duration::ZERO)));
                let Some(cells) = payloads.cells(&stored, &reserve)? else {
                    return Ok(false);
                };
                let columns: Vec<(u32, Vec<Cell>)> = stored.fields.into_iter().zip(cells).collect();
                self.shards.insert(&stored.rows, &columns);
            }
            Record::Dropped(rows) => self.shards.remove(&rows),
            Record::Change(_) => {
                return Err(crate::Error::Config(
                    "this data directory holds an index log, not a storage daemon's".into(),
                ));
            }
        }
        Ok(true)
    }

    /// Every cell kept, for a snapshot; `rotate` starts the next log with nothing changing.
    pub fn snapshot(&self, rotate: &dyn Fn()) -> Snapshot {
        let order = self.order.lock();
        let fields = self.shards.by_field();
        rotate();
        drop(order);
        let mut snapshot = Snapshot::default();
        for (field, rows, cells) in fields {
            snapshot.changes.push(Change::Ready { rows, fields: vec![field] });
            snapshot.cells.push(vec![cells]);
        }
        snapshot
    }

    fn sync(&self, at: Option<Position>) -> Result<(), StoreError> {
        match (self.persistence.get(), at) {
            (Some(p), Some(at)) => p.sync(at),
            _ => Ok(()),
        }
    }

    fn keep(&self, session: &Session, s: &StoreCells, payload: Payload, wait: Wait<'_>) -> Outcome {
        // The staged region is taken first, so that a put that fails still frees it.
        let extent = extent(s.columns.iter().flat_map(|(_, metas)| metas));
        let chunk =
            incoming_chunk(session, s.source, payload, extent, |b| self.memory.reserve(b, wait))?;
        if let Some((_, cells)) = s.columns.iter().find(|(_, c)| c.len() != s.rows.len()) {
            return Err(StoreError::schema(format!(
                "{} cells given for {} rows",
                cells.len(),
                s.rows.len()
            )));
        }
        let columns = s
            .columns
            .iter()
            .map(|(field, metas)| Ok((*field, cells_in(&chunk, metas)?)))
            .collect::<Result<Vec<_>, StoreError>>()?;
        let persistence = self.persistence.get();
        let receipt = match persistence {
            Some(p) => {
                let views: Vec<(u32, &[Cell])> =
                    columns.iter().map(|(f, c)| (*f, c.as_slice())).collect();
                Some(p.write_cells(&views)?)
            }
            None => None,
        };
        let order = self.order.lock();
        self.shards.insert(&s.rows, &columns);
        let at = persistence.zip(receipt).map(|(p, r)| {
            p.append_stored(s.rows.clone(), columns.iter().map(|c| c.0).collect(), r)
        });
        drop(order);
        self.sync(at)?;
        Ok((Reply::Done, ReplyBody::default()))
    }

    pub fn forget(&self, rows: &[u64]) -> Result<(), StoreError> {
        let order = self.order.lock();
        self.shards.remove(rows);
        let at = self.persistence.get().map(|p| p.append_dropped(rows.to_vec()));
        drop(order);
        self.sync(at)
    }

    pub fn stats(&self) -> StoreStats {
        StoreStats {
            index: asyncflow_core::index::IndexStats::default(),
            payload_rows: self.shards.rows() as u64,
            memory_used: self.memory.used(),
            memory_limit: self.memory.limit(),
            shards: self.shards.len() as u64,
            lease_timeout: Duration::ZERO,
        }
    }
}

impl Execute for Storage {
    fn execute(
        &self,
        session: &Session,
        req: Request,
        payload: Payload,
        wait: Wait<'_>,
    ) -> Outcome {
        match req {
            Request::StoreCells(s) => self.keep(session, &s, payload, wait),
            Request::FetchCells { rows, fields } => {
                let cells = self.shards.get(&rows, &fields)?;
                // Only the controller knows names and schemas; the client has them from `Locate`.
                let unnamed = FieldSchema::ragged(DType::U8, vec![]);
                let columns =
                    cells.into_iter().map(|c| (String::new(), unnamed.clone(), c)).collect();
                Ok(outgoing_cells(session, columns).read_reply())
            }
            Request::DropRows { rows } => {
                self.forget(&rows)?;
                Ok((Reply::Done, ReplyBody::default()))
            }
            Request::Stats => Ok((Reply::Stats(Box::new(self.stats())), ReplyBody::default())),
            other => Err(StoreError::bad_request(format!(
                "{:?} goes to the controller, not to a storage daemon",
                other.op()
            ))),
        }
    }
}
