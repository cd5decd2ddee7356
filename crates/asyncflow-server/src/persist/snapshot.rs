//! Writing a snapshot: the store's live state (see `asyncflow_core::Snapshot`) as records in
//! `snap-g.meta`, ready cells packed into `snap-g.payload` in chunks of at most `CHUNK` bytes
//! (so restoring never needs one giant allocation). Both are written under temporary names,
//! synced, and renamed payload first: a snapshot whose `.meta` exists is complete.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use asyncflow_core::{Cell, Change, Snapshot, StoreError};
use asyncflow_proto::{CellLoc, ChunkRef, FileId, Record, Stored};

use super::datadir::{DataDir, private_file};
use super::wal::failed;

/// The most payload bytes one restored chunk holds.
const CHUNK: u64 = 64 << 20;
static ZEROS: [u8; 64] = [0; 64];

struct PayloadWriter {
    out: BufWriter<File>,
    id: FileId,
    at: u64,
}

impl PayloadWriter {
    /// Writes `cells` one after another (each on a 64-byte boundary) as one chunk.
    fn chunk(&mut self, cells: &[&Cell]) -> std::io::Result<(ChunkRef, Vec<CellLoc>)> {
        let start = self.at;
        let mut crc = crc32fast::Hasher::new();
        let mut locs = Vec::with_capacity(cells.len());
        let mut offset = 0u64;
        for cell in cells {
            let pad = offset.next_multiple_of(64) - offset;
            self.out.write_all(&ZEROS[..pad as usize])?;
            crc.update(&ZEROS[..pad as usize]);
            offset += pad;
            self.out.write_all(cell.bytes())?;
            crc.update(cell.bytes());
            locs.push(CellLoc {
                chunk: 0,
                offset,
                len: cell.len as u64,
                first_dim: cell.first_dim,
            });
            offset += cell.len as u64;
        }
        let tail = offset.next_multiple_of(64) - offset;
        self.out.write_all(&ZEROS[..tail as usize])?;
        self.at += offset + tail;
        Ok((ChunkRef { file: self.id, offset: start, len: offset, crc: crc.finalize() }, locs))
    }
}

/// The `Ready` change of one field with its cells, as stored records of bounded chunks.
fn stored_runs(
    payload: &mut PayloadWriter,
    rows: &[u64],
    field: u32,
    cells: &[Cell],
) -> std::io::Result<Vec<Record>> {
    let mut records = Vec::new();
    let mut from = 0;
    while from < rows.len() {
        let mut to = from;
        let mut bytes = 0u64;
        while to < rows.len() && (to == from || bytes + cells[to].len as u64 <= CHUNK) {
            bytes += (cells[to].len as u64).next_multiple_of(64);
            to += 1;
        }
        let run: Vec<&Cell> = cells[from..to].iter().collect();
        let (chunk, locs) = payload.chunk(&run)?;
        records.push(Record::Stored(Stored {
            rows: rows[from..to].to_vec(),
            fields: vec![field],
            chunks: vec![chunk],
            cells: vec![locs],
        }));
        from = to;
    }
    Ok(records)
}

/// Writes `snapshot` as generation `generation`'s snapshot. A `Ready` change with cells is
/// stored with them; without (a controller's), it stays a plain change. One that fails (out of
/// disk space) leaves no file behind.
pub fn write(dir: &DataDir, generation: u64, snapshot: Snapshot) -> Result<(), StoreError> {
    let id = FileId { generation, snapshot: true };
    let (meta_path, payload_path) = (dir.meta(generation, true), dir.payload(id));
    let (meta_tmp, payload_tmp) =
        (DataDir::unfinished(&meta_path), DataDir::unfinished(&payload_path));
    let written = write_files(snapshot, id, &meta_tmp, &payload_tmp);
    if written.is_err() {
        let _ = std::fs::remove_file(&meta_tmp);
        let _ = std::fs::remove_file(&payload_tmp);
    }
    written?;
    let io = |e: std::io::Error| failed("write a snapshot", &e);
    std::fs::rename(&payload_tmp, &payload_path).map_err(io)?;
    std::fs::rename(&meta_tmp, &meta_path).map_err(io)?;
    dir.sync().map_err(|e| StoreError::Persistence(e.to_string()))
}

/// The snapshot's two files under their temporary names, synced.
fn write_files(
    snapshot: Snapshot,
    id: FileId,
    meta_tmp: &Path,
    payload_tmp: &Path,
) -> Result<(), StoreError> {
    let io = |e: std::io::Error| failed("write a snapshot", &e);
    let mut payload = PayloadWriter {
        out: BufWriter::new(private_file(payload_tmp, true).map_err(io)?),
        id,
        at: 0,
    };
    let mut meta = BufWriter::new(private_file(meta_tmp, true).map_err(io)?);
    let with_cells = !snapshot.cells.is_empty();
    let mut cells = snapshot.cells.into_iter();
    let mut buf = Vec::new();
    for change in snapshot.changes {
        let records = match change {
            Change::Ready { rows, fields } if with_cells => {
                let columns = cells.next().ok_or_else(|| {
                    StoreError::Persistence("a snapshot is missing the cells of a field".into())
                })?;
                let mut records = Vec::new();
                for (&field, column) in fields.iter().zip(&columns) {
                    records.extend(stored_runs(&mut payload, &rows, field, column).map_err(io)?);
                }
                records
            }
            change => vec![Record::Change(change)],
        };
        buf.clear();
        for record in &records {
            record.encode_into(&mut buf);
        }
        meta.write_all(&buf).map_err(io)?;
    }
    let payload = payload.out.into_inner().map_err(|e| io(e.into_error()))?;
    payload.sync_all().map_err(io)?;
    let meta = meta.into_inner().map_err(|e| io(e.into_error()))?;
    meta.sync_all().map_err(io)
}

#[cfg(test)]
mod tests {
    use super::*;
    use asyncflow_proto::Role;

    #[test]
    fn a_snapshot_that_fails_leaves_no_file_behind() {
        // Out of disk space, its first file stayed, holding the space the daemon needed.
        let path = crate::persist::datadir::temp("snapshot-fails");
        let dir = DataDir::open(&path, Role::Standalone).unwrap();
        let meta_tmp = DataDir::unfinished(&dir.meta(2, true));
        std::fs::create_dir(&meta_tmp).unwrap(); // the second file cannot be made
        let snapshot = Snapshot { changes: Vec::new(), cells: Vec::new() };
        assert!(write(&dir, 2, snapshot).is_err());
        let payload = dir.payload(FileId { generation: 2, snapshot: true });
        assert!(!DataDir::unfinished(&payload).exists());
        std::fs::remove_dir_all(&path).unwrap();
    }
}
