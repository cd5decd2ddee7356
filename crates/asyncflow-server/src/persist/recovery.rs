//! Reading a data directory back: the newest complete snapshot, then every log from its
//! generation on, each up to its last whole record. A log's torn tail (the daemon died while
//! writing it) is cut off so that the next generation starts from a clean end; a record whose
//! payload fails its checksum (the machine died before the bytes reached the disk, which only
//! `--fsync` other than `always` allows) ends the log there, as if it had been torn.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use asyncflow_core::payload::{AlignedBytes, ByteStorage};
use asyncflow_core::{Cell, Chunk, MemoryGuard, StoreError};
use asyncflow_proto::{FileId, Record, Stored, decode_record};

use super::datadir::DataDir;
use crate::error::{Error, Result};

/// What recovery found, for the daemon's log line.
#[derive(Debug, Default, Clone, Copy)]
pub struct Recovered {
    pub snapshot: Option<u64>,
    pub logs: usize,
    pub records: u64,
    pub payload_bytes: u64,
    /// Bytes cut off the end of torn logs.
    pub torn_bytes: u64,
    /// The generation to log into next.
    pub next_generation: u64,
}

/// Reads payload chunks, keeping each payload file open once.
pub struct Payloads<'d> {
    dir: &'d DataDir,
    files: HashMap<FileId, File>,
    read: u64,
}

impl<'d> Payloads<'d> {
    fn new(dir: &'d DataDir) -> Self {
        Self { dir, files: HashMap::new(), read: 0 }
    }

    /// The cells of a stored record, read into fresh chunks paid for by `reserve`; `None` if a
    /// chunk is missing or fails its checksum.
    pub fn cells(
        &mut self,
        stored: &Stored,
        reserve: &dyn Fn(u64) -> Result<MemoryGuard, StoreError>,
    ) -> Result<Option<Vec<Vec<Cell>>>> {
        let mut chunks = Vec::with_capacity(stored.chunks.len());
        for chunk in &stored.chunks {
            let Some(bytes) = self.read(chunk.file, chunk.offset, chunk.len)? else {
                return Ok(None);
            };
            if crc32fast::hash(bytes.as_bytes()) != chunk.crc {
                return Ok(None);
            }
            let guard = reserve(chunk.len).map_err(|e| {
                Error::Config(format!(
                    "the data directory holds more payload than --memory-limit allows: {e}"
                ))
            })?;
            self.read += chunk.len;
            chunks.push(Chunk::new(Box::new(bytes), Some(guard)));
        }
        let cells = stored
            .cells
            .iter()
            .map(|column| {
                column
                    .iter()
                    .map(|loc| Cell {
                        chunk: Arc::clone(&chunks[loc.chunk as usize]),
                        offset: loc.offset as usize,
                        len: loc.len as usize,
                        first_dim: loc.first_dim,
                    })
                    .collect()
            })
            .collect();
        Ok(Some(cells))
    }

    fn read(&mut self, id: FileId, offset: u64, len: u64) -> Result<Option<AlignedBytes>> {
        let file = match self.files.entry(id) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(slot) => {
                match File::open(self.dir.payload(id)) {
                    Ok(f) => slot.insert(f),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
                    Err(e) => return Err(e.into()),
                }
            }
        };
        let size = file.metadata()?.len();
        if offset.checked_add(len).is_none_or(|end| end > size) {
            return Ok(None);
        }
        let mut result = Ok(());
        // SAFETY: the closure zeroes all `len` bytes before reading into them.
        let bytes = unsafe {
            AlignedBytes::filled_by(len as usize, |at| {
                std::ptr::write_bytes(at, 0, len as usize);
                let slice = std::slice::from_raw_parts_mut(at, len as usize);
                result = file.read_exact_at(slice, offset);
            })
        };
        result?;
        Ok(Some(bytes))
    }
}

/// One log or snapshot file, record by record.
struct MetaFile {
    bytes: Vec<u8>,
    at: usize,
}

impl MetaFile {
    fn read(path: &std::path::Path) -> Result<Self> {
        Ok(Self { bytes: std::fs::read(path)?, at: 0 })
    }

    /// The next whole record; `None` at the end or at a torn or corrupt record.
    fn next(&mut self) -> Option<Record> {
        match decode_record(&self.bytes[self.at..]) {
            Ok(Some((record, used))) => {
                self.at += used;
                Some(record)
            }
            Ok(None) | Err(_) => None,
        }
    }

    fn torn(&self) -> u64 {
        (self.bytes.len() - self.at) as u64
    }
}

/// Replays the directory's state: calls `apply` with every record, in order, and the cells of
/// stored records (read through `payloads`). `apply` returns `Ok(false)` to say a record's
/// payload could not be read, which ends that log there.
pub fn replay(
    dir: &DataDir,
    mut apply: impl FnMut(Record, &mut Payloads<'_>) -> Result<bool>,
) -> Result<Recovered> {
    let contents = dir.contents()?;
    let mut payloads = Payloads::new(dir);
    let mut found = Recovered { snapshot: contents.snapshot, ..Recovered::default() };
    if let Some(g) = contents.snapshot {
        let mut snapshot = MetaFile::read(&dir.meta(g, true))?;
        while let Some(record) = snapshot.next() {
            found.records += 1;
            if !apply(record, &mut payloads)? {
                return Err(corrupt(dir, "a snapshot's payload is missing or damaged"));
            }
        }
        if snapshot.torn() > 0 {
            return Err(corrupt(dir, "a complete snapshot has a damaged record"));
        }
    }
    let first = contents.snapshot.unwrap_or(0);
    let logs: Vec<u64> = contents.logs.iter().copied().filter(|&g| g >= first).collect();
    for (k, &g) in logs.iter().enumerate() {
        let path = dir.meta(g, false);
        let mut log = MetaFile::read(&path)?;
        loop {
            let start = log.at;
            let Some(record) = log.next() else { break };
            if !apply(record, &mut payloads)? {
                log.at = start;
                break;
            }
            found.records += 1;
        }
        if log.torn() > 0 {
            if k + 1 < logs.len() {
                // Later logs were started after this one was complete and synced.
                return Err(corrupt(dir, &format!("log {g} is damaged before its end")));
            }
            found.torn_bytes += log.torn();
            let file = std::fs::OpenOptions::new().write(true).open(&path)?;
            file.set_len(log.at as u64)?;
            file.sync_all()?;
        }
        found.logs += 1;
    }
    found.payload_bytes = payloads.read;
    found.next_generation = logs.last().copied().max(contents.snapshot).map_or(1, |g| g + 1);
    Ok(found)
}

fn corrupt(dir: &DataDir, what: &str) -> Error {
    Error::Config(format!(
        "data directory {}: {what}; it cannot be restored (move it aside to start empty)",
        dir.path().display()
    ))
}
