//! Records of the daemon's write-ahead log and snapshots, as a pure codec like the frames: a
//! record is `[body length u32][CRC-32 of the body u32][body]`, and a reader takes records off
//! the front of a file until one is missing, torn or fails its checksum — that is where the log
//! ends, whatever follows (a crash mid-write leaves exactly such a tail). Payload bytes are not
//! in these records: they sit in payload files that records point into, each chunk with a
//! checksum of its own.

use asyncflow_core::Change;
use asyncflow_core::index::Counters;

use crate::error::ProtoError;
use crate::request::{get_new_rows, put_new_rows};
use crate::wire::{Reader, Writer};

/// Bytes before a record's body: its length and checksum.
pub const RECORD_HEADER: usize = 8;

/// The most a record body may claim to hold; anything larger is a torn or foreign file.
pub const MAX_RECORD: u32 = 1 << 30;

/// A payload file: the log of one generation, or the payload of its snapshot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FileId {
    pub generation: u64,
    pub snapshot: bool,
}

/// A run of payload bytes in a payload file, with the CRC-32 they had when written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkRef {
    pub file: FileId,
    pub offset: u64,
    pub len: u64,
    pub crc: u32,
}

/// Where one cell lies inside the chunks of its record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CellLoc {
    pub chunk: u32,
    pub offset: u64,
    pub len: u64,
    pub first_dim: u64,
}

/// Cells of `fields` on `rows` as stored: `cells[f][k]` is field `fields[f]` of `rows[k]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stored {
    pub rows: Vec<u64>,
    pub fields: Vec<u32>,
    pub chunks: Vec<ChunkRef>,
    pub cells: Vec<Vec<CellLoc>>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Record {
    /// A change to the index (standalone and controller daemons).
    Change(Change),
    /// Fields became ready with these payloads (standalone), or a storage daemon keeps these
    /// cells (storage).
    Stored(Stored),
    /// A storage daemon forgot these rows' payloads.
    Dropped(Vec<u64>),
}

const CHANGE_TASK: u8 = 1;
const CHANGE_FIELD: u8 = 2;
const CHANGE_ROWS: u8 = 3;
const CHANGE_READY: u8 = 4;
const CHANGE_ACKED: u8 = 5;
const CHANGE_CLEARED: u8 = 6;
const CHANGE_DELETED: u8 = 7;
const CHANGE_NEXT: u8 = 8;
const CHANGE_COUNTERS: u8 = 9;
const STORED: u8 = 20;
const DROPPED: u8 = 21;

fn u32s(w: &mut Writer, v: &[u32]) {
    w.list(v, |w, &x| {
        w.u32(x);
    });
}

fn put_change(w: &mut Writer, change: &Change) {
    match change {
        Change::Task { name, scope } => {
            w.u8(CHANGE_TASK).str(name).opt(scope.as_deref(), |w, s| {
                w.strs(s);
            });
        }
        Change::Field { name, schema } => {
            w.u8(CHANGE_FIELD).str(name).schema(schema);
        }
        Change::Rows { start, count, new } => {
            w.u8(CHANGE_ROWS).u64(*start).u64(*count);
            put_new_rows(w, new);
        }
        Change::Ready { rows, fields } => {
            w.u8(CHANGE_READY).u64s(rows);
            u32s(w, fields);
        }
        Change::Acked { task, rows } => {
            w.u8(CHANGE_ACKED).u32(*task).u64s(rows);
        }
        Change::Cleared { partition } => {
            w.u8(CHANGE_CLEARED).str(partition);
        }
        Change::Deleted { rows } => {
            w.u8(CHANGE_DELETED).u64s(rows);
        }
        Change::Next(next) => {
            w.u8(CHANGE_NEXT).u64(*next);
        }
        Change::Counters(c) => {
            w.u8(CHANGE_COUNTERS).list(&c.named(), |w, &(name, value)| {
                w.str(name).u64(value);
            });
        }
    }
}

fn get_change(tag: u8, r: &mut Reader<'_>) -> Result<Change, ProtoError> {
    Ok(match tag {
        CHANGE_TASK => Change::Task { name: r.string()?, scope: r.opt(Reader::strings)? },
        CHANGE_FIELD => Change::Field { name: r.string()?, schema: r.schema()? },
        CHANGE_ROWS => Change::Rows { start: r.u64()?, count: r.u64()?, new: get_new_rows(r)? },
        CHANGE_READY => Change::Ready { rows: r.u64s()?, fields: r.list(4, Reader::u32)? },
        CHANGE_ACKED => Change::Acked { task: r.u32()?, rows: r.u64s()? },
        CHANGE_CLEARED => Change::Cleared { partition: r.string()? },
        CHANGE_DELETED => Change::Deleted { rows: r.u64s()? },
        CHANGE_NEXT => Change::Next(r.u64()?),
        CHANGE_COUNTERS => {
            let mut counters = Counters::default();
            for (name, value) in r.list(12, |r| Ok((r.string()?, r.u64()?)))? {
                counters.set(&name, value);
            }
            Change::Counters(counters)
        }
        t => return Err(ProtoError::malformed(format!("unknown log record kind {t}"))),
    })
}

fn put_stored(w: &mut Writer, s: &Stored) {
    w.u8(STORED).u64s(&s.rows);
    u32s(w, &s.fields);
    w.list(&s.chunks, |w, c| {
        w.u64(c.file.generation).bool(c.file.snapshot).u64(c.offset).u64(c.len).u32(c.crc);
    });
    w.list(&s.cells, |w, column| {
        w.list(column, |w, c| {
            w.u32(c.chunk).u64(c.offset).u64(c.len).u64(c.first_dim);
        });
    });
}

fn get_stored(r: &mut Reader<'_>) -> Result<Stored, ProtoError> {
    let stored = Stored {
        rows: r.u64s()?,
        fields: r.list(4, Reader::u32)?,
        chunks: r.list(29, |r| {
            Ok(ChunkRef {
                file: FileId { generation: r.u64()?, snapshot: r.bool()? },
                offset: r.u64()?,
                len: r.u64()?,
                crc: r.u32()?,
            })
        })?,
        cells: r.list(4, |r| {
            r.list(28, |r| {
                Ok(CellLoc {
                    chunk: r.u32()?,
                    offset: r.u64()?,
                    len: r.u64()?,
                    first_dim: r.u64()?,
                })
            })
        })?,
    };
    stored.check()?;
    Ok(stored)
}

impl Stored {
    /// Every cell names a chunk of the record and lies inside it; there is a column per field
    /// and a cell per row.
    fn check(&self) -> Result<(), ProtoError> {
        if self.cells.len() != self.fields.len()
            || self.cells.iter().any(|c| c.len() != self.rows.len())
        {
            return Err(ProtoError::malformed("stored cells do not match their rows and fields"));
        }
        for c in self.cells.iter().flatten() {
            let chunk = self.chunks.get(c.chunk as usize);
            let end = c.offset.checked_add(c.len);
            if chunk.is_none_or(|k| end.is_none_or(|e| e > k.len)) {
                return Err(ProtoError::malformed("a stored cell lies outside its chunk"));
            }
        }
        Ok(())
    }
}

impl Record {
    /// The record's body (without length and checksum).
    pub fn encode_body(&self) -> Vec<u8> {
        let mut w = Writer::new();
        match self {
            Record::Change(change) => put_change(&mut w, change),
            Record::Stored(s) => put_stored(&mut w, s),
            Record::Dropped(rows) => {
                w.u8(DROPPED).u64s(rows);
            }
        }
        w.buf
    }

    /// Appends the whole record — length, checksum, body — to `out`.
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        let body = self.encode_body();
        let len = u32::try_from(body.len()).expect("a log record over 4 GiB");
        out.extend_from_slice(&len.to_le_bytes());
        out.extend_from_slice(&crc32fast::hash(&body).to_le_bytes());
        out.extend_from_slice(&body);
    }

    pub fn decode_body(body: &[u8]) -> Result<Self, ProtoError> {
        let mut r = Reader::new(body);
        let record = match r.u8()? {
            STORED => Record::Stored(get_stored(&mut r)?),
            DROPPED => Record::Dropped(r.u64s()?),
            tag => Record::Change(get_change(tag, &mut r)?),
        };
        r.finish()?;
        Ok(record)
    }
}

/// The record at the start of `buf` and the bytes it took; `Ok(None)` where the log ends
/// cleanly (no bytes left), an error where it ends torn, corrupt or foreign.
pub fn decode_record(buf: &[u8]) -> Result<Option<(Record, usize)>, ProtoError> {
    let Some((crc, body)) = split_record(buf)? else {
        return Ok(None);
    };
    if crc32fast::hash(body) != crc {
        return Err(ProtoError::malformed("log record fails its checksum"));
    }
    Ok(Some((Record::decode_body(body)?, RECORD_HEADER + body.len())))
}

/// Whether a whole record starts at the start of `buf`: exactly when [`decode_record`] gives
/// one. For a search at every offset of a damaged file, the body is decoded before its checksum
/// is computed: at an offset inside a record the decoder gives up after a few bytes nearly
/// always, while the checksum reads all the bytes the offset's length claims (megabytes inside a
/// large record, at each of its millions of offsets).
pub fn is_whole_record(buf: &[u8]) -> bool {
    match split_record(buf) {
        Ok(Some((crc, body))) => Record::decode_body(body).is_ok() && crc32fast::hash(body) == crc,
        _ => false,
    }
}

/// The checksum and body of the record at the start of `buf`, unchecked.
fn split_record(buf: &[u8]) -> Result<Option<(u32, &[u8])>, ProtoError> {
    if buf.is_empty() {
        return Ok(None);
    }
    let Some(head) = buf.first_chunk::<RECORD_HEADER>() else {
        return Err(ProtoError::Truncated { needed: RECORD_HEADER - buf.len() });
    };
    let len = u32::from_le_bytes(head[0..4].try_into().expect("4"));
    let crc = u32::from_le_bytes(head[4..8].try_into().expect("4"));
    if len > MAX_RECORD {
        return Err(ProtoError::TooLarge {
            what: "log record",
            len: len.into(),
            max: MAX_RECORD.into(),
        });
    }
    let end = RECORD_HEADER + len as usize;
    let Some(body) = buf.get(RECORD_HEADER..end) else {
        return Err(ProtoError::Truncated { needed: end - buf.len() });
    };
    Ok(Some((crc, body)))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use asyncflow_core::{DType, FieldSchema, NewRows};

    use super::*;

    fn records() -> Vec<Record> {
        let counters = Counters { rows_put: 7, ..Counters::default() };
        vec![
            Record::Change(Change::Task { name: "t".into(), scope: Some(vec!["p".into()]) }),
            Record::Change(Change::Field {
                name: "x".into(),
                schema: FieldSchema::ragged(DType::F32, vec![2]),
            }),
            Record::Change(Change::Rows {
                start: 64,
                count: 2,
                new: NewRows {
                    partition: "p".into(),
                    groups: Some(vec![1, 1]),
                    group_size: Some(2),
                    versions: vec![3, 4],
                    tags: vec![Arc::new(vec![("k".into(), "v".into())])],
                },
            }),
            Record::Change(Change::Ready { rows: vec![64, 65], fields: vec![0] }),
            Record::Change(Change::Acked { task: 0, rows: vec![64] }),
            Record::Change(Change::Cleared { partition: "p".into() }),
            Record::Change(Change::Deleted { rows: vec![65] }),
            Record::Change(Change::Next(128)),
            Record::Change(Change::Counters(counters)),
            Record::Stored(Stored {
                rows: vec![64, 65],
                fields: vec![0],
                chunks: vec![ChunkRef {
                    file: FileId { generation: 3, snapshot: true },
                    offset: 4096,
                    len: 100,
                    crc: 0xdead_beef,
                }],
                cells: vec![vec![
                    CellLoc { chunk: 0, offset: 0, len: 8, first_dim: 1 },
                    CellLoc { chunk: 0, offset: 64, len: 16, first_dim: 2 },
                ]],
            }),
            Record::Dropped(vec![1, 2, 3]),
        ]
    }

    #[test]
    fn every_record_round_trips() {
        let mut log = Vec::new();
        for r in records() {
            r.encode_into(&mut log);
        }
        let mut rest = &log[..];
        let mut back = Vec::new();
        while let Some((record, used)) = decode_record(rest).unwrap() {
            back.push(record);
            rest = &rest[used..];
        }
        assert_eq!(back, records());
    }

    #[test]
    fn a_torn_or_flipped_tail_ends_the_log() {
        let mut log = Vec::new();
        records()[0].encode_into(&mut log);
        let whole = log.len();
        records()[1].encode_into(&mut log);
        for cut in whole + 1..log.len() {
            let (_, used) = decode_record(&log[..cut]).unwrap().unwrap();
            assert!(decode_record(&log[used..cut]).is_err(), "cut at {cut}");
        }
        let mut flipped = log.clone();
        *flipped.last_mut().unwrap() ^= 1;
        assert!(decode_record(&flipped[whole..]).is_err());
    }

    #[test]
    fn a_whole_record_is_found_where_decoding_finds_one() {
        let mut log = Vec::new();
        for r in records() {
            r.encode_into(&mut log);
        }
        let mut flipped = log.clone();
        flipped[40] ^= 4;
        for bytes in [&log[..], &log[..log.len() - 3], &flipped[..]] {
            let mut found = 0;
            for at in 0..bytes.len() {
                let decoded = matches!(decode_record(&bytes[at..]), Ok(Some(_)));
                assert_eq!(is_whole_record(&bytes[at..]), decoded, "offset {at}");
                found += usize::from(decoded);
            }
            assert!(found >= records().len() - 2, "{found} whole records found");
        }
        let mut empty = Vec::new();
        Record::Dropped(vec![]).encode_into(&mut empty);
        let mut bad_crc = empty.clone();
        bad_crc[4] ^= 1;
        assert!(is_whole_record(&empty) && !is_whole_record(&bad_crc) && !is_whole_record(&[]));
    }

    #[test]
    fn a_cell_outside_its_chunk_is_refused() {
        let Record::Stored(mut s) = records().swap_remove(9) else { unreachable!() };
        s.cells[0][1].offset = 90;
        assert!(Record::decode_body(&Record::Stored(s).encode_body()).is_err());
    }
}
