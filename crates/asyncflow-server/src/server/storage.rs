//! The storage role: payload cells keyed by the controller's row indexes and field ids, with a
//! memory budget, and nothing else — no readiness, no leases. The controller decides when rows
//! are ready and tells this daemon when to forget them.

use std::sync::Arc;
use std::time::Duration;

use asyncflow_core::shards::Shards;
use asyncflow_core::{DType, FieldSchema, MemoryBudget, StoreError, StoreStats, Wait};
use asyncflow_proto::{Reply, Request, StoreCells};

use super::cells::{cells_in, incoming_chunk, outgoing_cells};
use super::metadata::Outcome;
use super::outgoing::Answer;
use super::session::Session;

pub struct Storage {
    shards: Shards,
    pub memory: Arc<MemoryBudget>,
}

impl Storage {
    pub fn new(shards: usize, memory_limit: Option<u64>) -> Self {
        Self { shards: Shards::new(shards), memory: MemoryBudget::new(memory_limit) }
    }

    fn keep(&self, session: &Session, s: &StoreCells, payload: Vec<u8>, wait: Wait<'_>) -> Outcome {
        if let Some((_, cells)) = s.columns.iter().find(|(_, c)| c.len() != s.rows.len()) {
            return Err(StoreError::schema(format!(
                "{} cells given for {} rows",
                cells.len(),
                s.rows.len()
            )));
        }
        let chunk = incoming_chunk(session, s.source, payload, |b| self.memory.reserve(b, wait))?;
        let columns = s
            .columns
            .iter()
            .map(|(field, metas)| Ok((*field, cells_in(&chunk, metas)?)))
            .collect::<Result<Vec<_>, StoreError>>()?;
        self.shards.insert(&s.rows, &columns);
        Ok((Reply::Done, Answer::default()))
    }

    pub fn forget(&self, rows: &[u64]) {
        self.shards.remove(rows);
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

    pub fn execute(
        &self,
        session: &Session,
        req: Request,
        payload: Vec<u8>,
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
                Ok(outgoing_cells(session, columns))
            }
            Request::DropRows { rows } => {
                self.forget(&rows);
                Ok((Reply::Done, Answer::default()))
            }
            Request::Stats => Ok((Reply::Stats(Box::new(self.stats())), Answer::default())),
            other => Err(StoreError::bad_request(format!(
                "{:?} goes to the controller, not to a storage daemon",
                other.op()
            ))),
        }
    }
}
