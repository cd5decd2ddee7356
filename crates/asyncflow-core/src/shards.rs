//! The data plane: payload cells keyed by row, spread over N independently locked shards by row
//! index, so writers of different rows never queue on one lock and the control plane's lock is
//! never held while payload bytes move.
//!
//! Rows are numbered densely, so a shard keeps its cells in pages of consecutive rows, with one
//! column of slots per field the page's rows have: a cell costs its view (32 bytes) and a row
//! nothing more, and a page is freed with its last row. A shard that holds rows sparsely (a
//! storage daemon of a cluster of S holds every S-th row) pays a slot for each row it skips.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use parking_lot::Mutex;

use crate::error::{Result, StoreError};
use crate::index::FieldId;
use crate::payload::Cell;

/// Rows of a shard per page.
const PAGE: usize = 1024;

#[derive(Debug)]
struct Page {
    /// Slots holding a row, i.e. at least one cell.
    present: [u64; PAGE / 64],
    live: usize,
    columns: Vec<(FieldId, Box<[Option<Cell>]>)>,
}

impl Page {
    fn new() -> Self {
        Self { present: [0; PAGE / 64], live: 0, columns: Vec::new() }
    }

    fn is_present(&self, slot: usize) -> bool {
        self.present[slot / 64] & (1 << (slot % 64)) != 0
    }

    fn cell(&self, field: FieldId, slot: usize) -> Option<&Cell> {
        let (_, column) = self.columns.iter().find(|(f, _)| *f == field)?;
        column[slot].as_ref()
    }

    /// Puts `cell` in `slot` of `field`'s column; returns whether the slot's row is new.
    fn insert(&mut self, field: FieldId, slot: usize, cell: Cell) -> bool {
        let at = self.columns.iter().position(|(f, _)| *f == field).unwrap_or_else(|| {
            self.columns.push((field, vec![None; PAGE].into_boxed_slice()));
            self.columns.len() - 1
        });
        self.columns[at].1[slot] = Some(cell);
        let new = !self.is_present(slot);
        if new {
            self.present[slot / 64] |= 1 << (slot % 64);
            self.live += 1;
        }
        new
    }

    /// Drops the cells of `slot`; returns whether it held a row.
    fn remove(&mut self, slot: usize) -> bool {
        if !self.is_present(slot) {
            return false;
        }
        self.present[slot / 64] &= !(1 << (slot % 64));
        self.live -= 1;
        for (_, column) in &mut self.columns {
            column[slot] = None;
        }
        true
    }
}

/// Hashes a page number: numbers are small and dense, so a multiply spreads them over the
/// table's buckets well enough, at a fraction of the default hasher's cost on every lookup.
#[derive(Default)]
struct PageHasher(u64);

impl Hasher for PageHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

#[derive(Debug, Default)]
struct Shard {
    pages: HashMap<u64, Page, BuildHasherDefault<PageHasher>>,
    rows: usize,
}

#[derive(Debug)]
pub struct Shards {
    shards: Vec<Mutex<Shard>>,
    /// log2 of the shard count when it is a power of two (the default 8 is): then a row's shard
    /// and place in it are a mask and a shift, not two divisions, on every row a read visits.
    pow2: Option<u32>,
}

impl Shards {
    pub fn new(n: usize) -> Self {
        let n = n.max(1);
        Self {
            shards: (0..n).map(|_| Mutex::new(Shard::default())).collect(),
            pow2: n.is_power_of_two().then(|| n.trailing_zeros()),
        }
    }

    /// The shard of row `index`, and its number within that shard.
    fn split(&self, index: u64) -> (usize, u64) {
        if let Some(bits) = self.pow2 {
            ((index & ((1 << bits) - 1)) as usize, index >> bits)
        } else {
            let n = self.shards.len() as u64;
            ((index % n) as usize, index / n)
        }
    }

    pub fn len(&self) -> usize {
        self.shards.len()
    }

    pub fn is_empty(&self) -> bool {
        self.shards.is_empty()
    }

    /// The shard, page and slot of row `index`.
    fn place(&self, index: u64) -> (usize, u64, usize) {
        let (shard, local) = self.split(index);
        (shard, local / PAGE as u64, (local % PAGE as u64) as usize)
    }

    /// The row in `slot` of page `page` of shard `shard`.
    fn index_of(&self, shard: usize, page: u64, slot: usize) -> u64 {
        (page * PAGE as u64 + slot as u64) * self.shards.len() as u64 + shard as u64
    }

    /// `(shard, position)` of each of `rows`, grouped by the shard that owns the row (positions
    /// ascending within a shard), so each shard is locked once; take the groups with
    /// `chunk_by(same_shard)`. A counting sort: one pass to count each shard's rows, one to
    /// place them.
    fn by_shard(&self, rows: &[u64]) -> Vec<(usize, usize)> {
        let n = self.shards.len();
        let mut starts = vec![0usize; n + 1];
        for &index in rows {
            starts[self.split(index).0 + 1] += 1;
        }
        for s in 0..n {
            starts[s + 1] += starts[s];
        }
        let mut order = vec![(0, 0); rows.len()];
        for (k, &index) in rows.iter().enumerate() {
            let shard = self.split(index).0;
            order[starts[shard]] = (shard, k);
            starts[shard] += 1;
        }
        order
    }

    /// Stores `columns[f].1[k]` as field `columns[f].0` of row `rows[k]`, replacing any cell
    /// the row already had for that field.
    pub fn insert(&self, rows: &[u64], columns: &[(FieldId, Vec<Cell>)]) {
        for group in self.by_shard(rows).chunk_by(same_shard) {
            let mut shard = self.shards[group[0].0].lock();
            let Shard { pages, rows: count } = &mut *shard;
            for &(_, k) in group {
                let (_, page, slot) = self.place(rows[k]);
                let page = pages.entry(page).or_insert_with(Page::new);
                for (field, column) in columns {
                    if page.insert(*field, slot, column[k].clone()) {
                        *count += 1;
                    }
                }
            }
        }
    }

    /// Runs `each(k, cell)` for field `field` of every row `rows[k]`; a row without that field
    /// (or without any) is [`StoreError::UnknownIndex`].
    pub(crate) fn visit(
        &self,
        rows: &[u64],
        field: FieldId,
        mut each: impl FnMut(usize, &Cell),
    ) -> Result<()> {
        for group in self.by_shard(rows).chunk_by(same_shard) {
            let shard = self.shards[group[0].0].lock();
            // Rows claimed together mostly share a page: look each page up once in a run.
            let mut last: Option<(u64, Option<&Page>)> = None;
            for &(_, k) in group {
                let (_, page_no, slot) = self.place(rows[k]);
                let page = match last {
                    Some((no, page)) if no == page_no => page,
                    _ => {
                        let page = shard.pages.get(&page_no);
                        last = Some((page_no, page));
                        page
                    }
                };
                let cell = page.and_then(|p| p.cell(field, slot));
                each(k, cell.ok_or(StoreError::UnknownIndex(rows[k]))?);
            }
        }
        Ok(())
    }

    /// The cells of `fields` on `rows`, as `[field][row]`.
    pub fn get(&self, rows: &[u64], fields: &[FieldId]) -> Result<Vec<Vec<Cell>>> {
        fields
            .iter()
            .map(|&field| {
                let mut column: Vec<Option<Cell>> = vec![None; rows.len()];
                self.visit(rows, field, |k, cell| column[k] = Some(cell.clone()))?;
                Ok(column.into_iter().map(|c| c.expect("every row visited")).collect())
            })
            .collect()
    }

    /// The first dimension of field `field` on each of `rows` (its token count, for a sequence).
    pub fn first_dims(&self, rows: &[u64], field: FieldId) -> Result<Vec<u64>> {
        let mut out = vec![0; rows.len()];
        self.visit(rows, field, |k, cell| out[k] = cell.first_dim)?;
        Ok(out)
    }

    /// Drops the payloads of `rows`.
    pub fn remove(&self, rows: &[u64]) {
        for group in self.by_shard(rows).chunk_by(same_shard) {
            let mut shard = self.shards[group[0].0].lock();
            for &(_, k) in group {
                let (_, page_no, slot) = self.place(rows[k]);
                let Some(page) = shard.pages.get_mut(&page_no) else { continue };
                if page.remove(slot) {
                    let empty = page.live == 0;
                    shard.rows -= 1;
                    if empty {
                        shard.pages.remove(&page_no);
                    }
                }
            }
        }
    }

    /// Every row's cells, by field: `(field, rows ascending, their cells)` (for snapshots of
    /// stores that keep payloads only).
    pub fn by_field(&self) -> Vec<(FieldId, Vec<u64>, Vec<Cell>)> {
        let mut fields: std::collections::BTreeMap<FieldId, Vec<(u64, Cell)>> =
            std::collections::BTreeMap::new();
        for (s, shard) in self.shards.iter().enumerate() {
            for (&page_no, page) in &shard.lock().pages {
                for (field, column) in &page.columns {
                    let cells = fields.entry(*field).or_default();
                    for (slot, cell) in column.iter().enumerate() {
                        if let Some(cell) = cell {
                            cells.push((self.index_of(s, page_no, slot), cell.clone()));
                        }
                    }
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
        self.shards.iter().map(|s| s.lock().rows).sum()
    }
}

fn same_shard(a: &(usize, usize), b: &(usize, usize)) -> bool {
    a.0 == b.0
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::payload::{ChunkLayout, copy_into_chunk};

    fn cells(values: &[u8]) -> Vec<Cell> {
        let sources: Vec<&[u8]> = values.iter().map(std::slice::from_ref).collect();
        let layout = ChunkLayout::contiguous(sources.iter().map(|s| s.len()));
        let chunk = copy_into_chunk(&layout, &sources, None);
        (0..values.len())
            .map(|k| Cell { chunk: Arc::clone(&chunk), offset: k, len: 1, first_dim: 1 })
            .collect()
    }

    fn bytes(shards: &Shards, rows: &[u64], field: FieldId) -> Result<Vec<u8>> {
        Ok(shards.get(rows, &[field])?.remove(0).iter().map(|c| c.bytes()[0]).collect())
    }

    #[test]
    fn cells_come_back_by_row_and_field_and_a_second_insert_replaces() {
        let shards = Shards::new(3);
        let rows: Vec<u64> = (0..5000).collect();
        let values: Vec<u8> = rows.iter().map(|r| (r % 251) as u8).collect();
        shards.insert(&rows, &[(0, cells(&values))]);
        assert_eq!(bytes(&shards, &[4999, 0, 1024, 3071], 0).unwrap(), vec![230, 0, 20, 59]);
        // Another field on some rows; the first field of one row replaced.
        shards.insert(&[7, 3000], &[(1, cells(&[1, 2])), (0, cells(&[9, 9]))]);
        assert_eq!(bytes(&shards, &[3000, 7], 1).unwrap(), vec![2, 1]);
        assert_eq!(bytes(&shards, &[7, 8], 0).unwrap(), vec![9, 8]);
        assert!(matches!(bytes(&shards, &[8], 1), Err(StoreError::UnknownIndex(8))));
        assert!(matches!(bytes(&shards, &[5000], 0), Err(StoreError::UnknownIndex(5000))));
        assert_eq!(shards.rows(), 5000);
    }

    #[test]
    fn a_row_has_the_same_place_whether_the_shard_count_is_a_power_of_two_or_not() {
        for n in 1..=9u64 {
            let shards = Shards::new(n as usize);
            assert_eq!(shards.pow2.is_some(), n.is_power_of_two());
            for index in (0..5000).chain([u64::MAX - 1, u64::MAX]) {
                assert_eq!(shards.split(index), ((index % n) as usize, index / n), "{n} {index}");
            }
            let rows: Vec<u64> = (0..100).map(|k| k * 37 % 101).collect();
            let order = shards.by_shard(&rows);
            let mut expected: Vec<(usize, usize)> =
                rows.iter().enumerate().map(|(k, &r)| ((r % n) as usize, k)).collect();
            expected.sort_unstable();
            assert_eq!(order, expected);
        }
    }

    #[test]
    fn removing_rows_frees_their_pages_and_forgets_them() {
        let shards = Shards::new(2);
        let rows: Vec<u64> = (0..4 * PAGE as u64).collect();
        shards.insert(&rows, &[(0, cells(&vec![5; rows.len()]))]);
        let pages = |s: &Shards| s.shards.iter().map(|s| s.lock().pages.len()).sum::<usize>();
        assert_eq!(pages(&shards), 4);
        // Every row of the first page of each shard, and one more: two pages go.
        let gone: Vec<u64> = (0..=2 * PAGE as u64).collect();
        shards.remove(&gone);
        shards.remove(&gone);
        assert_eq!((pages(&shards), shards.rows()), (2, rows.len() - gone.len()));
        assert!(matches!(bytes(&shards, &[2 * PAGE as u64], 0), Err(StoreError::UnknownIndex(_))));
        assert_eq!(bytes(&shards, &[2 * PAGE as u64 + 1], 0).unwrap(), vec![5]);
    }

    #[test]
    fn by_field_lists_every_cell_in_row_order() {
        let shards = Shards::new(4);
        let rows = [9000, 3, 17, 2048];
        shards.insert(&rows, &[(2, cells(&[1, 2, 3, 4]))]);
        shards.insert(&[17], &[(5, cells(&[7]))]);
        let listed: Vec<(FieldId, Vec<u64>, Vec<u8>)> = shards
            .by_field()
            .into_iter()
            .map(|(f, r, c)| (f, r, c.iter().map(|c| c.bytes()[0]).collect()))
            .collect();
        assert_eq!(
            listed,
            vec![(2, vec![3, 17, 2048, 9000], vec![2, 3, 4, 1]), (5, vec![17], vec![7])]
        );
    }
}
