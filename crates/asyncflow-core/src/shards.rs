//! The data plane: payload cells keyed by row, spread over N independently locked shards by row
//! index, so writers of different rows never queue on one lock and the control plane's lock is
//! never held while payload bytes move.

use std::collections::HashMap;

use parking_lot::Mutex;

use crate::error::{Result, StoreError};
use crate::index::FieldId;
use crate::payload::Cell;

type RowCells = Vec<(FieldId, Cell)>;

#[derive(Debug)]
pub struct Shards {
    shards: Vec<Mutex<HashMap<u64, RowCells>>>,
}

impl Shards {
    pub fn new(n: usize) -> Self {
        Self { shards: (0..n.max(1)).map(|_| Mutex::new(HashMap::new())).collect() }
    }

    pub fn len(&self) -> usize {
        self.shards.len()
    }

    pub fn is_empty(&self) -> bool {
        self.shards.is_empty()
    }

    fn shard_of(&self, index: u64) -> usize {
        (index % self.shards.len() as u64) as usize
    }

    /// Positions of `rows` grouped by the shard that owns them, so each shard is locked once.
    fn by_shard(&self, rows: &[u64]) -> Vec<Vec<usize>> {
        let mut buckets = vec![Vec::new(); self.shards.len()];
        for (k, &index) in rows.iter().enumerate() {
            buckets[self.shard_of(index)].push(k);
        }
        buckets
    }

    /// Stores `columns[f].1[k]` as field `columns[f].0` of row `rows[k]`, replacing any cell
    /// the row already had for that field.
    pub fn insert(&self, rows: &[u64], columns: &[(FieldId, Vec<Cell>)]) {
        for (shard, positions) in self.by_shard(rows).into_iter().enumerate() {
            if positions.is_empty() {
                continue;
            }
            let mut map = self.shards[shard].lock();
            for k in positions {
                let cells = map.entry(rows[k]).or_default();
                for (field, column) in columns {
                    let cell = column[k].clone();
                    match cells.iter_mut().find(|(f, _)| f == field) {
                        Some(slot) => slot.1 = cell,
                        None => cells.push((*field, cell)),
                    }
                }
            }
        }
    }

    /// The cells of `fields` on `rows`, as `[field][row]`.
    pub fn get(&self, rows: &[u64], fields: &[FieldId]) -> Result<Vec<Vec<Cell>>> {
        let mut out: Vec<Vec<Option<Cell>>> = vec![vec![None; rows.len()]; fields.len()];
        for (shard, positions) in self.by_shard(rows).into_iter().enumerate() {
            if positions.is_empty() {
                continue;
            }
            let map = self.shards[shard].lock();
            for k in positions {
                let cells = map.get(&rows[k]).ok_or(StoreError::UnknownIndex(rows[k]))?;
                for (j, field) in fields.iter().enumerate() {
                    out[j][k] = cells.iter().find(|(f, _)| f == field).map(|(_, c)| c.clone());
                }
            }
        }
        out.into_iter()
            .map(|column| {
                column
                    .into_iter()
                    .zip(rows)
                    .map(|(cell, &index)| cell.ok_or(StoreError::UnknownIndex(index)))
                    .collect()
            })
            .collect()
    }

    /// The first dimension of field `field` on each of `rows` (its token count, for a sequence).
    pub fn first_dims(&self, rows: &[u64], field: FieldId) -> Result<Vec<u64>> {
        let mut out = vec![0; rows.len()];
        for (shard, positions) in self.by_shard(rows).into_iter().enumerate() {
            if positions.is_empty() {
                continue;
            }
            let map = self.shards[shard].lock();
            for k in positions {
                let cell = map
                    .get(&rows[k])
                    .and_then(|cells| cells.iter().find(|(f, _)| *f == field))
                    .ok_or(StoreError::UnknownIndex(rows[k]))?;
                out[k] = cell.1.first_dim;
            }
        }
        Ok(out)
    }

    /// Drops the payloads of `rows`.
    pub fn remove(&self, rows: &[u64]) {
        for (shard, positions) in self.by_shard(rows).into_iter().enumerate() {
            if positions.is_empty() {
                continue;
            }
            let mut map = self.shards[shard].lock();
            for k in positions {
                map.remove(&rows[k]);
            }
        }
    }

    /// Every row's cells, by field: `(field, rows ascending, their cells)` (for snapshots of
    /// stores that keep payloads only).
    pub fn by_field(&self) -> Vec<(FieldId, Vec<u64>, Vec<Cell>)> {
        let mut fields: std::collections::BTreeMap<FieldId, Vec<(u64, Cell)>> =
            std::collections::BTreeMap::new();
        for shard in &self.shards {
            for (&row, cells) in shard.lock().iter() {
                for (field, cell) in cells {
                    fields.entry(*field).or_default().push((row, cell.clone()));
                }
            }
        }
        fields
            .into_iter()
            .map(|(field, mut cells)| {
                cells.sort_unstable_by_key(|(row, _)| *row);
                let (rows, cells) = cells.into_iter().unzip();
                (field, rows, cells)
            })
            .collect()
    }

    /// Rows with a payload, across all shards.
    pub fn rows(&self) -> usize {
        self.shards.iter().map(|s| s.lock().len()).sum()
    }
}
