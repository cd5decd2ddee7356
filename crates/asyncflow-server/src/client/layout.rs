//! Where a put's cells go in the payload it sends: each column's cells on a cell boundary (rows
//! of one array end to end, as they lie in it), columns one after another, so the daemon can keep
//! the received bytes as they are and view every cell in place. The same layout serves a frame's payload (TCP) and a staged region (shared memory).

use asyncflow_core::FieldSchema;
use asyncflow_proto::{CellMeta, ColumnMeta, align_payload};

use super::link::padding;

/// One field of a put: its name, schema, and each row's bytes with the row's first dimension.
pub struct PutColumn<'a> {
    pub name: String,
    pub schema: FieldSchema,
    pub cells: Vec<(&'a [u8], u64)>,
}

/// The cells of some rows of some columns, placed.
pub struct Layout<'a> {
    pub columns: Vec<Vec<CellMeta>>,
    /// `(offset, bytes)` of every cell, in payload order.
    pub sources: Vec<(u64, &'a [u8])>,
    pub total: u64,
}

impl<'a> Layout<'a> {
    /// Places the cells of rows at `positions` (all rows when `None`) of every column.
    pub fn place(columns: &[PutColumn<'a>], positions: Option<&[usize]>) -> Self {
        let mut at = 0u64;
        let mut sources = Vec::new();
        let mut metas = Vec::with_capacity(columns.len());
        for column in columns {
            let rows: Box<dyn Iterator<Item = &(&'a [u8], u64)>> = match positions {
                Some(p) => Box::new(p.iter().map(|&k| &column.cells[k])),
                None => Box::new(column.cells.iter()),
            };
            let mut cells = Vec::new();
            // Where the previous cell ended in the caller's memory: cells that follow each other
            // there (rows of one array) follow each other here too, as the embedded store keeps
            // them; a 64-byte boundary for each would make a scalar cell cost 64 bytes.
            let mut after: Option<*const u8> = None;
            for &(bytes, first_dim) in rows {
                if after != Some(bytes.as_ptr()) {
                    at = align_payload(at);
                }
                after = Some(bytes.as_ptr_range().end);
                cells.push(CellMeta { offset: at, len: bytes.len() as u64, first_dim });
                sources.push((at, bytes));
                at += bytes.len() as u64;
            }
            metas.push(cells);
        }
        Self { columns: metas, sources, total: at }
    }

    /// The column metadata of a put, with names and schemas.
    pub fn column_metas(&self, columns: &[PutColumn<'_>]) -> Vec<ColumnMeta> {
        columns
            .iter()
            .zip(&self.columns)
            .map(|(c, cells)| ColumnMeta {
                name: c.name.clone(),
                schema: c.schema.clone(),
                cells: cells.clone(),
            })
            .collect()
    }

    /// The payload as parts to write in order: padding, cell, padding, cell, ...
    pub fn parts(&self) -> Vec<&'a [u8]> {
        let mut parts = Vec::with_capacity(self.sources.len() * 2);
        let mut at = 0u64;
        for &(offset, bytes) in &self.sources {
            if offset > at {
                parts.push(padding((offset - at) as usize));
            }
            parts.push(bytes);
            at = offset + bytes.len() as u64;
        }
        parts
    }
}

#[cfg(test)]
mod tests {
    use asyncflow_core::DType;

    use super::*;

    #[test]
    fn cells_start_on_boundaries_and_parts_fill_the_gaps() {
        let buffer: Vec<u8> = (0..100).collect();
        // Apart in the caller's memory: each on its own boundary.
        let (a, b) = (&buffer[..10], &buffer[20..90]);
        let col = PutColumn {
            name: "x".into(),
            schema: FieldSchema::ragged(DType::U8, vec![]),
            cells: vec![(a, 10), (b, 70)],
        };
        let layout = Layout::place(std::slice::from_ref(&col), None);
        let offsets: Vec<u64> = layout.columns[0].iter().map(|c| c.offset).collect();
        assert_eq!((offsets, layout.total), (vec![0, 64], 134));
        let flat: Vec<u8> = layout.parts().concat();
        assert_eq!(flat.len(), 134);
        assert_eq!((&flat[..10], &flat[64..134]), (a, b));
        let second = Layout::place(std::slice::from_ref(&col), Some(&[1]));
        assert_eq!((second.columns[0][0].offset, second.total), (0, 70));
    }

    #[test]
    fn rows_of_one_array_stay_end_to_end_and_the_next_column_starts_on_a_boundary() {
        let buffer: Vec<u8> = (0..12).collect();
        let rows = |at: usize| (&buffer[at..at + 4], 1);
        let col = |name: &str| PutColumn {
            name: name.into(),
            schema: FieldSchema::scalar(DType::F32),
            cells: vec![rows(0), rows(4), rows(8)],
        };
        let layout = Layout::place(&[col("x"), col("y")], None);
        let offsets: Vec<Vec<u64>> =
            layout.columns.iter().map(|c| c.iter().map(|m| m.offset).collect()).collect();
        assert_eq!(offsets, [vec![0, 4, 8], vec![64, 68, 72]]);
        assert_eq!(layout.total, 76);
        // Rows taken out of order are not end to end in the caller's memory: each on a boundary.
        let some = Layout::place(&[col("x")], Some(&[2, 0]));
        let offsets: Vec<u64> = some.columns[0].iter().map(|m| m.offset).collect();
        assert_eq!(offsets, [0, 64]);
    }
}
