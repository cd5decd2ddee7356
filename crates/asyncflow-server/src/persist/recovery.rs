//! Reading a data directory back: the newest complete snapshot, then every log from its
//! generation on, each up to its last whole record.
//!
//! Damage is told apart from a torn write. Only the last log may end torn: the daemon died
//! while writing it, so its last record is incomplete at the end of the file (or, unless
//! `--fsync always` promised every record on the disk, complete with a checksum or payload
//! that never reached it). That tail is cut off so that the next generation starts from a
//! clean end. Anything else — a record that fails its checksum with bytes after it, a record
//! whose length runs past the end while whole records follow it, a damaged earlier log or
//! snapshot — is corruption: start-up is refused, naming the file and offset, and nothing is
//! changed on the disk. With `--recover` (logs only) the damaged file is kept as
//! `<file>.damaged-<n>`, everything from the damage on is dropped (later logs too), and what
//! was dropped is reported.

use std::collections::HashMap;
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use asyncflow_core::payload::{AlignedBytes, ByteStorage};
use asyncflow_core::{Cell, Change, Chunk, MemoryGuard, StoreError};
use asyncflow_proto::{FileId, ProtoError, Record, Stored, decode_record, is_whole_record};

use super::datadir::{DataDir, private_file};
use crate::error::{Error, Result};

/// What recovery found, for the daemon's log line.
#[derive(Debug, Default, Clone)]
pub struct Recovered {
    pub snapshot: Option<u64>,
    pub logs: usize,
    pub records: u64,
    pub payload_bytes: u64,
    /// Bytes cut off the end of torn logs.
    pub torn_bytes: u64,
    /// What `--recover` dropped from damaged logs.
    pub dropped: Vec<Dropped>,
    /// The generation to log into next.
    pub next_generation: u64,
}

/// A log cut short by `--recover`: everything from `offset` on is gone from `file`, and kept
/// in `copy`.
#[derive(Debug, Clone)]
pub struct Dropped {
    pub file: PathBuf,
    pub copy: PathBuf,
    /// Where the damage is, and why it is damage.
    pub offset: u64,
    pub why: String,
    /// Bytes dropped from the file.
    pub bytes: u64,
    /// Whole records found after the damage, dropped with it, and the rows they name.
    pub records: u64,
    pub rows: Vec<u64>,
}

impl std::fmt::Display for Dropped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} at offset {}: {}; dropped {} bytes from there on (a copy is kept as {})",
            self.file.display(),
            self.offset,
            self.why,
            self.bytes,
            self.copy.display()
        )?;
        if self.records > 0 {
            write!(
                f,
                ", among them {} whole records naming {} rows: {}",
                self.records,
                self.rows.len(),
                ranges(&self.rows)
            )?;
        }
        Ok(())
    }
}

/// `1..=3, 7, 9..=12` for sorted rows.
fn ranges(rows: &[u64]) -> String {
    let mut out = Vec::new();
    let mut k = 0;
    while k < rows.len() {
        let mut j = k;
        while j + 1 < rows.len() && rows[j + 1] == rows[j] + 1 {
            j += 1;
        }
        out.push(if j == k { rows[k].to_string() } else { format!("{}..={}", rows[k], rows[j]) });
        k = j + 1;
    }
    if out.is_empty() { "none".to_owned() } else { out.join(", ") }
}

/// How recovery treats damage: what the logs were written under, and whether to cut it out.
#[derive(Debug, Clone, Copy)]
pub struct Policy {
    /// `--fsync always`: every complete record reached the disk with its payload.
    pub synced: bool,
    /// `--recover`.
    pub recover: bool,
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
        // A record that passed its checksum yet points outside its chunks is damage too.
        let inside = |loc: &asyncflow_proto::CellLoc| {
            chunks.get(loc.chunk as usize).is_some_and(|c: &Arc<Chunk>| {
                loc.offset.checked_add(loc.len).is_some_and(|end| end <= c.as_bytes().len() as u64)
            })
        };
        if stored.cells.iter().flatten().any(|loc| !inside(loc)) {
            return Ok(None);
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

/// Why a log stops being readable at some offset.
enum Damage {
    /// A write the daemon died in: cut off.
    Torn,
    /// Anything else: refused, or cut out with `--recover`.
    Corrupt(String),
}

/// The first whole record at or after `from`, if any (a torn write is never followed by one).
fn next_whole(bytes: &[u8], from: usize) -> Option<usize> {
    (from..bytes.len()).find(|&at| is_whole_record(&bytes[at..]))
}

/// Why the record at `at`, which does not decode, stops the log.
fn classify(bytes: &[u8], at: usize, error: &ProtoError, policy: Policy) -> Damage {
    let rest = &bytes[at..];
    let end = rest
        .first_chunk::<8>()
        .map(|head| 8 + u64::from(u32::from_le_bytes([head[0], head[1], head[2], head[3]])));
    match end {
        // Incomplete at the end of the file: torn, unless its length is impossible or whole
        // records follow it (a torn write is the last thing in a log).
        _ if matches!(error, ProtoError::TooLarge { .. }) => Damage::Corrupt(error.to_string()),
        None => Damage::Torn,
        Some(end) if end > rest.len() as u64 => match next_whole(bytes, at + 1) {
            None => Damage::Torn,
            Some(next) => Damage::Corrupt(format!(
                "a record's length runs past the end of the file, yet a whole record follows \
                 at offset {next}"
            )),
        },
        // Complete and last: unless every record was synced, its bytes may never have reached
        // the disk.
        Some(end) if end == rest.len() as u64 && !policy.synced => Damage::Torn,
        Some(_) => Damage::Corrupt(error.to_string()),
    }
}

/// One log or snapshot file, record by record.
struct MetaFile {
    path: PathBuf,
    bytes: Vec<u8>,
    at: usize,
}

impl MetaFile {
    fn read(path: &Path) -> Result<Self> {
        let bytes = std::fs::read(path)
            .map_err(|e| Error::Config(format!("cannot read {}: {e}", path.display())))?;
        Ok(Self { path: path.to_owned(), bytes, at: 0 })
    }

    /// Replays records until the end or the first one that does not decode or whose payload
    /// cannot be read; returns the damage found, if any, with `at` on the record it is in.
    fn replay(
        &mut self,
        payloads: &mut Payloads<'_>,
        apply: &mut impl FnMut(Record, &mut Payloads<'_>) -> Result<bool>,
        records: &mut u64,
        policy: Policy,
    ) -> Result<Option<Damage>> {
        loop {
            match decode_record(&self.bytes[self.at..]) {
                Ok(None) => return Ok(None),
                Ok(Some((record, used))) => {
                    if !apply(record, payloads)? {
                        let last = self.at + used == self.bytes.len();
                        return Ok(Some(if last && !policy.synced {
                            Damage::Torn
                        } else {
                            Damage::Corrupt(
                                "the payload of a record is missing or fails its checksum".into(),
                            )
                        }));
                    }
                    self.at += used;
                    *records += 1;
                }
                Err(e) => return Ok(Some(classify(&self.bytes, self.at, &e, policy))),
            }
        }
    }

    fn rest(&self) -> u64 {
        (self.bytes.len() - self.at) as u64
    }

    /// The whole records after the damaged one at `at`, and the rows they name.
    fn after_damage(&self) -> (u64, Vec<u64>) {
        let (mut records, mut rows) = (0, Vec::new());
        let mut from = self.at + 1;
        while let Some(at) = next_whole(&self.bytes, from) {
            let Ok(Some((record, used))) = decode_record(&self.bytes[at..]) else { break };
            records += 1;
            rows.extend(record_rows(&record));
            from = at + used;
        }
        rows.sort_unstable();
        rows.dedup();
        (records, rows)
    }
}

/// The rows a record adds, fills or removes.
fn record_rows(record: &Record) -> Vec<u64> {
    match record {
        Record::Stored(stored) => stored.rows.clone(),
        Record::Dropped(rows) => rows.clone(),
        Record::Change(change) => match change {
            Change::Rows { start, count, .. } => (*start..start.saturating_add(*count)).collect(),
            Change::Ready { rows, .. } => rows.clone(),
            _ => Vec::new(),
        },
    }
}

/// `path` with `.damaged-<n>` appended, for the first `n` not taken.
fn damaged_name(path: &Path) -> PathBuf {
    let mut n = 1u64;
    loop {
        let mut name = path.as_os_str().to_owned();
        name.push(format!(".damaged-{n}"));
        let name = PathBuf::from(name);
        if !name.exists() {
            return name;
        }
        n += 1;
    }
}

/// Replays the directory's state: calls `apply` with every record, in order, and the cells of
/// stored records (read through `payloads`). `apply` returns `Ok(false)` to say a record's
/// payload could not be read, which is damage (or, at the very end, a torn write).
pub fn replay(
    dir: &DataDir,
    policy: Policy,
    mut apply: impl FnMut(Record, &mut Payloads<'_>) -> Result<bool>,
) -> Result<Recovered> {
    let contents = dir.contents()?;
    let mut payloads = Payloads::new(dir);
    let mut found = Recovered { snapshot: contents.snapshot, ..Recovered::default() };
    if let Some(g) = contents.snapshot {
        let mut snapshot = MetaFile::read(&dir.meta(g, true))?;
        let strict = Policy { synced: true, recover: false };
        if let Some(damage) =
            snapshot.replay(&mut payloads, &mut apply, &mut found.records, strict)?
        {
            let why = match damage {
                Damage::Torn => "a record is cut short".to_owned(),
                Damage::Corrupt(why) => why,
            };
            return Err(corrupt(
                dir,
                &snapshot,
                &why,
                "a damaged snapshot cannot be recovered (--recover repairs logs only)",
            ));
        }
    }
    let first = contents.snapshot.unwrap_or(0);
    let logs: Vec<u64> = contents.logs.iter().copied().filter(|&g| g >= first).collect();
    found.next_generation = logs.last().copied().max(contents.snapshot).map_or(1, |g| g + 1);
    for (k, &g) in logs.iter().enumerate() {
        let mut log = MetaFile::read(&dir.meta(g, false))?;
        let damage = log.replay(&mut payloads, &mut apply, &mut found.records, policy)?;
        found.logs += 1;
        let later = &logs[k + 1..];
        let why = match damage {
            None => continue,
            Some(Damage::Torn) if later.is_empty() => {
                found.torn_bytes += log.rest();
                cut(&log.path, log.at as u64)?;
                break;
            }
            // Later logs were started after this one was complete and synced.
            Some(Damage::Torn) => "a record is cut short, and later logs follow".to_owned(),
            Some(Damage::Corrupt(why)) => why,
        };
        if !policy.recover {
            return Err(corrupt(
                dir,
                &log,
                &why,
                "restart with --recover to keep a copy of the damaged file and drop everything \
                 from that offset on",
            ));
        }
        found.dropped.push(recover(dir, &log, g, why, false)?);
        for &later in later {
            let whole = MetaFile::read(&dir.meta(later, false))?;
            let why = format!("it follows the damaged log {}", log.path.display());
            found.dropped.push(recover(dir, &whole, later, why, true)?);
        }
        break;
    }
    found.payload_bytes = payloads.read;
    Ok(found)
}

/// Cuts `path` to `len` bytes, durably.
fn cut(path: &Path, len: u64) -> Result<()> {
    let file = std::fs::OpenOptions::new().write(true).open(path)?;
    file.set_len(len)?;
    file.sync_all()?;
    Ok(())
}

/// `--recover`: keeps a copy of `log` (and a link to its payload file, which nothing changes)
/// and cuts it at the damage.
fn recover(
    dir: &DataDir,
    log: &MetaFile,
    generation: u64,
    why: String,
    whole: bool,
) -> Result<Dropped> {
    let copy = damaged_name(&log.path);
    let io = |what: &str, e: std::io::Error| {
        Error::Config(format!("--recover cannot {what} {}: {e}", log.path.display()))
    };
    private_file(&copy, true)
        .and_then(|mut f| f.write_all(&log.bytes))
        .map_err(|e| io("copy", e))?;
    File::open(&copy).and_then(|f| f.sync_all()).map_err(|e| io("sync the copy of", e))?;
    let payload = dir.payload(FileId { generation, snapshot: false });
    if payload.exists() {
        let _ = std::fs::hard_link(&payload, damaged_name(&payload));
    }
    dir.sync()?;
    let (records, rows) = if whole { whole_records(&log.bytes) } else { log.after_damage() };
    cut(&log.path, log.at as u64).map_err(|e| io("cut", std::io::Error::other(e.to_string())))?;
    let dropped = Dropped {
        file: log.path.clone(),
        copy,
        offset: log.at as u64,
        why,
        bytes: log.rest(),
        records,
        rows,
    };
    tracing::warn!(dropped = %dropped, "--recover dropped part of the data directory");
    Ok(dropped)
}

/// The records of an undamaged stretch and the rows they name.
fn whole_records(mut bytes: &[u8]) -> (u64, Vec<u64>) {
    let (mut records, mut rows) = (0, Vec::new());
    while let Ok(Some((record, used))) = decode_record(bytes) {
        records += 1;
        rows.extend(record_rows(&record));
        bytes = &bytes[used..];
    }
    rows.sort_unstable();
    rows.dedup();
    (records, rows)
}

fn corrupt(dir: &DataDir, file: &MetaFile, why: &str, what_now: &str) -> Error {
    Error::Config(format!(
        "data directory {} is damaged: {} at offset {} (of {} bytes): {why}; refusing to start \
         so that nothing is lost: {what_now}",
        dir.path().display(),
        file.path.display(),
        file.at,
        file.bytes.len(),
    ))
}
