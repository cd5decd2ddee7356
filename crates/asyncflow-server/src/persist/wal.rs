//! The write-ahead log of one generation: a metadata log of records and a payload file of the
//! bytes they point into.
//!
//! - Payload bytes are written first, outside every lock: a writer reserves a range of the
//!   payload file with one atomic add and writes it with `pwrite`, so puts never queue on a
//!   lock while bytes move (a crash may leave a hole, which nothing points to).
//! - Records are appended to an in-memory buffer while the caller holds the store's index lock,
//!   so the log's order is the order the changes happened, and appending never waits on I/O.
//! - `sync` writes the buffer out after the lock is gone: whoever comes first writes everyone's
//!   records (and, with `--fsync always`, syncs them: one fdatasync serves every waiter).
//!
//! A change a client was told about has at least reached the kernel, so it survives the
//! daemon's death; the fsync policy decides whether it also survives the machine's.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use asyncflow_core::{Position, StoreError};
use asyncflow_proto::{ChunkRef, FileId, Record};
use parking_lot::Mutex;

use super::datadir::{DataDir, private_file};

/// When written records are forced to the disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fsync {
    /// Before every change is acknowledged (concurrent changes share one fdatasync).
    Always,
    /// Every this long, in the background: a machine crash loses at most this much.
    Every(Duration),
    /// When the kernel decides (and at rotation and shutdown).
    Never,
}

/// The shortest and longest `--fsync` interval.
const MIN_INTERVAL: Duration = Duration::from_millis(1);
const MAX_INTERVAL: Duration = Duration::from_secs(24 * 3600);

impl Fsync {
    /// `always`, `never`, or an interval such as `100ms` or `1s`.
    pub fn parse(text: &str) -> Result<Self, String> {
        match text {
            "always" => Ok(Fsync::Always),
            "never" => Ok(Fsync::Never),
            other => {
                let (number, scale) = if let Some(ms) = other.strip_suffix("ms") {
                    (ms, 1e-3)
                } else if let Some(s) = other.strip_suffix('s') {
                    (s, 1.0)
                } else {
                    (other, 1.0)
                };
                let interval = number
                    .trim()
                    .parse::<f64>()
                    .ok()
                    .filter(|v| v.is_finite() && *v > 0.0)
                    .and_then(|v| Duration::try_from_secs_f64(v * scale).ok())
                    .filter(|d| (MIN_INTERVAL..=MAX_INTERVAL).contains(d));
                interval.map(Fsync::Every).ok_or_else(|| {
                    format!(
                        "--fsync takes always, never, or an interval from 1ms to 1 day like \
                         100ms, not {text:?}"
                    )
                })
            }
        }
    }
}

pub(super) fn failed(what: &str, e: &std::io::Error) -> StoreError {
    StoreError::Persistence(format!("cannot {what}: {e}"))
}

/// Payload bytes of one generation.
pub struct PayloadFile {
    pub id: FileId,
    file: File,
    end: AtomicU64,
    /// Bytes written, and those on the disk as of the last sync (0 when never written).
    #[cfg(test)]
    synced_to: std::sync::Mutex<u64>,
}

impl PayloadFile {
    fn create(dir: &DataDir, id: FileId) -> std::io::Result<Self> {
        let file = private_file(&dir.payload(id), true)?;
        Ok(Self {
            id,
            file,
            end: AtomicU64::new(0),
            #[cfg(test)]
            synced_to: std::sync::Mutex::new(0),
        })
    }

    /// Writes `chunks` at a fresh place, each on a 64-byte boundary; returns where they went.
    pub fn write(&self, chunks: &[&[u8]]) -> Result<Vec<ChunkRef>, StoreError> {
        let total: u64 = chunks.iter().map(|c| (c.len() as u64).next_multiple_of(64)).sum();
        let mut at = self.end.fetch_add(total, Ordering::Relaxed);
        let mut refs = Vec::with_capacity(chunks.len());
        for bytes in chunks {
            self.file.write_all_at(bytes, at).map_err(|e| failed("write the payload log", &e))?;
            refs.push(ChunkRef {
                file: self.id,
                offset: at,
                len: bytes.len() as u64,
                crc: crc32fast::hash(bytes),
            });
            at += (bytes.len() as u64).next_multiple_of(64);
        }
        Ok(refs)
    }

    pub fn bytes(&self) -> u64 {
        self.end.load(Ordering::Relaxed)
    }

    fn sync(&self) -> std::io::Result<()> {
        #[cfg(test)]
        let end = self.bytes();
        self.file.sync_data()?;
        #[cfg(test)]
        {
            *self.synced_to.lock().unwrap() = end;
        }
        Ok(())
    }
}

/// Records appended and not yet written.
struct Pending {
    bytes: Vec<u8>,
    /// Position just past the last appended record.
    end: Position,
}

struct Writer {
    meta: File,
    /// Everything before this position is in the kernel ...
    written: Position,
    /// ... and everything before this one on the disk.
    synced: Position,
    /// Bytes in the current generation's metadata log.
    meta_bytes: u64,
}

pub struct Wal {
    fsync: Fsync,
    pending: Mutex<Pending>,
    writer: Mutex<Writer>,
    payload: Mutex<Arc<PayloadFile>>,
    /// Payload files a snapshot replaced that puts may still be writing to: synced with the
    /// current one until the snapshot ends their generation's log. (Synced only as they were
    /// replaced, a put that wrote to one afterwards was acknowledged with its bytes unsynced.)
    retired: Mutex<Vec<Arc<PayloadFile>>>,
    /// Set once a write failed: from then on every change is refused.
    broken: Mutex<Option<String>>,
}

impl Wal {
    /// Starts generation `generation`: its (empty) log and payload file.
    pub fn create(dir: &DataDir, generation: u64, fsync: Fsync) -> std::io::Result<Self> {
        let meta = Self::open_meta(dir, generation)?;
        let payload = PayloadFile::create(dir, FileId { generation, snapshot: false })?;
        dir.sync().map_err(|e| std::io::Error::other(e.to_string()))?;
        Ok(Self {
            fsync,
            pending: Mutex::new(Pending { bytes: Vec::new(), end: 0 }),
            writer: Mutex::new(Writer { meta, written: 0, synced: 0, meta_bytes: 0 }),
            payload: Mutex::new(Arc::new(payload)),
            retired: Mutex::new(Vec::new()),
            broken: Mutex::new(None),
        })
    }

    fn open_meta(dir: &DataDir, generation: u64) -> std::io::Result<File> {
        private_file(&dir.meta(generation, false), true)
    }

    pub fn fsync(&self) -> Fsync {
        self.fsync
    }

    /// Fails if an earlier write failed: a log with a hole must not grow.
    pub fn check(&self) -> Result<(), StoreError> {
        match &*self.broken.lock() {
            Some(why) => Err(StoreError::Persistence(format!(
                "the write-ahead log failed earlier ({why}); restart the daemon"
            ))),
            None => Ok(()),
        }
    }

    fn fail(&self, e: StoreError) -> StoreError {
        self.broken.lock().get_or_insert_with(|| e.to_string());
        e
    }

    /// The payload file new puts write to.
    pub fn payload(&self) -> Arc<PayloadFile> {
        Arc::clone(&self.payload.lock())
    }

    /// Writes a put's chunks to the current payload file.
    pub fn write_payload(&self, chunks: &[&[u8]]) -> Result<Vec<ChunkRef>, StoreError> {
        self.check()?;
        self.payload().write(chunks).map_err(|e| self.fail(e))
    }

    /// Buffers `records`; cheap enough to call under the index lock.
    pub fn append(&self, records: &[Record]) -> Position {
        let mut pending = self.pending.lock();
        let before = pending.bytes.len();
        for record in records {
            record.encode_into(&mut pending.bytes);
        }
        pending.end += (pending.bytes.len() - before) as u64;
        pending.end
    }

    /// Writes out everything appended up to `position` (and syncs it with `--fsync always`).
    pub fn sync(&self, position: Position) -> Result<(), StoreError> {
        self.check()?;
        let mut writer = self.writer.lock();
        let durable = if self.fsync == Fsync::Always { writer.synced } else { writer.written };
        if durable >= position {
            return Ok(());
        }
        self.write_out(&mut writer).map_err(|e| self.fail(e))?;
        if self.fsync == Fsync::Always {
            self.sync_files(&mut writer).map_err(|e| self.fail(e))?;
        }
        Ok(())
    }

    fn write_out(&self, writer: &mut Writer) -> Result<(), StoreError> {
        let (bytes, end) = {
            let mut pending = self.pending.lock();
            (std::mem::take(&mut pending.bytes), pending.end)
        };
        if !bytes.is_empty() {
            use std::io::Write as _;
            writer.meta.write_all(&bytes).map_err(|e| failed("write the log", &e))?;
            writer.meta_bytes += bytes.len() as u64;
        }
        writer.written = end;
        Ok(())
    }

    /// Payload first, then records: a record on the disk never points at bytes that are not.
    fn sync_files(&self, writer: &mut Writer) -> Result<(), StoreError> {
        self.sync_payloads()?;
        writer.meta.sync_data().map_err(|e| failed("sync the log", &e))?;
        writer.synced = writer.written;
        Ok(())
    }

    /// Writes and syncs everything appended so far (the `--fsync` interval's tick, and stop).
    pub fn flush(&self) -> Result<(), StoreError> {
        self.check()?;
        let mut writer = self.writer.lock();
        self.write_out(&mut writer).map_err(|e| self.fail(e))?;
        self.sync_files(&mut writer).map_err(|e| self.fail(e))
    }

    /// Bytes logged in the current generation.
    pub fn bytes(&self) -> u64 {
        self.writer.lock().meta_bytes + self.payload().bytes()
    }

    /// Every payload file a record may point into, the retired ones too.
    fn sync_payloads(&self) -> Result<(), StoreError> {
        let retired = self.retired.lock().clone();
        for file in retired.iter().chain([&self.payload()]) {
            file.sync().map_err(|e| failed("sync the payload log", &e))?;
        }
        Ok(())
    }

    /// Starts a new payload file: puts from now on write their bytes there. The old one is kept
    /// among the retired files, synced with the log until `rotate_meta` lets it go.
    pub fn rotate_payload(&self, dir: &DataDir, generation: u64) -> std::io::Result<()> {
        let next = PayloadFile::create(dir, FileId { generation, snapshot: false })?;
        let old = std::mem::replace(&mut *self.payload.lock(), Arc::new(next));
        self.retired.lock().push(old);
        Ok(())
    }

    /// Ends the current log and starts the next generation's: everything appended so far is
    /// written and synced to the old one. Call where no record can be appended meanwhile.
    /// The puts that wrote to retired payload files have all committed by then: those files are
    /// synced a last time and let go.
    pub fn rotate_meta(&self, dir: &DataDir, generation: u64) -> Result<(), StoreError> {
        let mut writer = self.writer.lock();
        self.write_out(&mut writer).map_err(|e| self.fail(e))?;
        self.sync_payloads().map_err(|e| self.fail(e))?;
        self.retired.lock().clear();
        writer.meta.sync_data().map_err(|e| self.fail(failed("sync the log", &e)))?;
        writer.synced = writer.written;
        writer.meta =
            Self::open_meta(dir, generation).map_err(|e| self.fail(failed("start a log", &e)))?;
        writer.meta_bytes = 0;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_put_that_writes_to_a_replaced_payload_file_is_synced_before_it_is_acknowledged() {
        // A snapshot replaces the payload file while a put is still writing its bytes there;
        // the put's commit synced only the new file.
        let path = crate::persist::datadir::temp("wal-retired");
        let dir = DataDir::open(&path, asyncflow_proto::Role::Standalone).unwrap();
        let wal = Wal::create(&dir, 1, Fsync::Always).unwrap();
        let writing = wal.payload(); // the put took the file ...
        wal.rotate_payload(&dir, 2).unwrap(); // ... the snapshot replaced it ...
        writing.write(&[&[7u8; 4096]]).unwrap(); // ... and the put's bytes landed after
        let at = wal.append(&[Record::Dropped(vec![1])]);
        wal.sync(at).unwrap(); // the put's commit
        assert_eq!(*writing.synced_to.lock().unwrap(), writing.bytes());
        wal.rotate_meta(&dir, 2).unwrap();
        assert!(wal.retired.lock().is_empty(), "let go once its generation's log ended");
        std::fs::remove_dir_all(&path).unwrap();
    }

    #[test]
    fn fsync_policies_parse() {
        assert_eq!(Fsync::parse("always"), Ok(Fsync::Always));
        assert_eq!(Fsync::parse("never"), Ok(Fsync::Never));
        assert_eq!(Fsync::parse("100ms"), Ok(Fsync::Every(Duration::from_millis(100))));
        assert_eq!(Fsync::parse("2s"), Ok(Fsync::Every(Duration::from_secs(2))));
        assert!(Fsync::parse("sometimes").is_err());
        assert!(Fsync::parse("0ms").is_err());
        for hostile in ["1e20s", "1e20", "inf", "nan", "-1s", "0.0001ms", "2e5"] {
            assert!(Fsync::parse(hostile).is_err(), "{hostile}");
        }
    }
}
