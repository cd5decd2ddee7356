//! Replies: what comes back for a request, with the request's id. A `Reply` frame carries one
//! [`Reply`]; a `Failure` frame one [`Failure`], which restores the daemon's error variant by
//! variant so a remote call fails exactly as an embedded one would.

use std::sync::Arc;
use std::time::Duration;

use asyncflow_core::index::{Counters, IndexStats};
use asyncflow_core::{FieldSchema, RowInfo, StoreError, StoreStats};

use crate::error::ProtoError;
use crate::frame::Op;
use crate::hello::{Role, ServerHello};
use crate::request::{get_tags, put_tags};
use crate::wire::{Reader, Writer};

/// Rows leased by a claim; `expires_in` is what the lease had left when the reply was built.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WireClaimed {
    pub lease: Option<u64>,
    pub rows: Vec<u64>,
    pub versions: Vec<u64>,
    pub groups: Vec<Option<u64>>,
    pub expires_in: Option<Duration>,
}

/// A cell in a shared-memory segment the receiver has mapped (or receives with this frame).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SharedCell {
    pub segment: u64,
    pub offset: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CellPlace {
    /// At this offset of the frame's payload section.
    Inline(u64),
    Shared(SharedCell),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WireCell {
    pub place: CellPlace,
    pub len: u64,
    pub first_dim: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WireColumn {
    pub name: String,
    pub schema: FieldSchema,
    pub cells: Vec<WireCell>,
}

/// A shared-memory region the daemon set aside for this connection's next put: `len` bytes at
/// `offset` of `segment`, to be written and then named by a put as `PayloadSource::Staged(stage)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Spare {
    pub stage: u64,
    pub cell: SharedCell,
    pub len: u64,
    pub segments: Segments,
}

/// Shared-memory segments this connection learns about (their descriptors travel beside the
/// frame, in this order) and ones it may now unmap.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Segments {
    pub new: Vec<(u64, u64)>,
    pub retired: Vec<u64>,
}

#[derive(Debug, Clone)]
pub enum Reply {
    Hello(ServerHello),
    Done,
    Rows(Vec<u64>),
    /// A controller admitted a put whose payload goes to storage daemons.
    Admitted {
        rows: Vec<u64>,
        fields: Vec<u32>,
    },
    Claimed(WireClaimed),
    Renewed(Duration),
    /// Read cells; with shared cells, `pin` keeps them alive until the client sends `Unpin`.
    Cells {
        columns: Vec<WireColumn>,
        pin: Option<u64>,
        segments: Segments,
    },
    RowInfos(Vec<RowInfo>),
    Count(u64),
    Schema(FieldSchema),
    Stats(Box<StoreStats>),
    /// A writable shared-memory region: `len` bytes at `offset` of `segment`.
    Staged {
        stage: u64,
        cell: SharedCell,
        len: u64,
        segments: Segments,
    },
    Located {
        fields: Vec<(u32, FieldSchema)>,
    },
    /// Per row, the names of its ready fields.
    Names(Vec<Vec<String>>),
    /// `reply`, and a spare region for the connection's next put, so that put need not stage
    /// one first. `reply` is of a kind that introduces no segments of its own.
    WithSpare {
        reply: Box<Reply>,
        spare: Spare,
    },
    /// A claim answered with its rows' cells of the claimed fields, as `Cells` would bring them.
    ClaimedCells {
        claimed: WireClaimed,
        columns: Vec<WireColumn>,
        pin: Option<u64>,
        segments: Segments,
    },
}

/// Why a request failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Failure {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("authentication failed: {0}")]
    Auth(String),
    #[error("protocol error: {0}")]
    Protocol(String),
    #[error("unavailable: {0}")]
    Unavailable(String),
}

fn put_claimed(w: &mut Writer, c: &WireClaimed) {
    w.opt(c.lease, |w, l| {
        w.u64(l);
    });
    w.varints(&c.rows).varints(&c.versions).list(&c.groups, |w, g| {
        w.opt(*g, |w, g| {
            w.varint(g);
        });
    });
    w.opt(c.expires_in, |w, d| {
        w.duration(d);
    });
}

fn get_claimed(r: &mut Reader<'_>) -> Result<WireClaimed, ProtoError> {
    Ok(WireClaimed {
        lease: r.opt(Reader::u64)?,
        rows: r.varints()?,
        versions: r.varints()?,
        groups: r.list(1, |r| r.opt(Reader::varint))?,
        expires_in: r.opt(Reader::duration)?,
    })
}

fn put_cells(w: &mut Writer, columns: &[WireColumn], pin: Option<u64>, segments: &Segments) {
    w.list(columns, put_column);
    w.opt(pin, |w, p| {
        w.u64(p);
    });
    put_segments(w, segments);
}

fn put_segments(w: &mut Writer, s: &Segments) {
    w.list(&s.new, |w, &(id, len)| {
        w.u64(id).u64(len);
    });
    w.u64s(&s.retired);
}

fn get_segments(r: &mut Reader<'_>) -> Result<Segments, ProtoError> {
    Ok(Segments { new: r.list(16, |r| Ok((r.u64()?, r.u64()?)))?, retired: r.u64s()? })
}

fn put_shared(w: &mut Writer, c: SharedCell) {
    w.u64(c.segment).u64(c.offset);
}

fn get_shared(r: &mut Reader<'_>) -> Result<SharedCell, ProtoError> {
    Ok(SharedCell { segment: r.u64()?, offset: r.u64()? })
}

fn put_column(w: &mut Writer, c: &WireColumn) {
    // A column has a cell per row: its numbers as varints (a few bytes each, not eight).
    w.str(&c.name).schema(&c.schema).list(&c.cells, |w, cell| {
        match cell.place {
            CellPlace::Inline(offset) => {
                w.u8(0).varint(offset);
            }
            CellPlace::Shared(s) => {
                w.u8(1).varint(s.segment).varint(s.offset);
            }
        }
        w.varint(cell.len).varint(cell.first_dim);
    });
}

fn get_column(r: &mut Reader<'_>) -> Result<WireColumn, ProtoError> {
    Ok(WireColumn {
        name: r.string()?,
        schema: r.schema()?,
        cells: r.list(4, |r| {
            let place = match r.u8()? {
                0 => CellPlace::Inline(r.varint()?),
                1 => CellPlace::Shared(SharedCell { segment: r.varint()?, offset: r.varint()? }),
                t => return Err(ProtoError::malformed(format!("unknown cell place {t}"))),
            };
            Ok(WireCell { place, len: r.varint()?, first_dim: r.varint()? })
        })?,
    })
}

fn put_row_info(w: &mut Writer, i: &RowInfo) {
    w.u64(i.index).str(&i.partition);
    w.opt(i.group, |w, g| {
        w.u64(g);
    });
    w.u64(i.version);
    put_tags(w, &i.tags);
}

fn get_row_info(r: &mut Reader<'_>) -> Result<RowInfo, ProtoError> {
    Ok(RowInfo {
        index: r.u64()?,
        partition: r.string()?,
        group: r.opt(Reader::u64)?,
        version: r.u64()?,
        tags: Arc::new(get_tags(r)?),
    })
}

fn put_stats(w: &mut Writer, s: &StoreStats) {
    let i = &s.index;
    w.u64(i.live_rows).u64(i.resident_slots).u64(i.active_leases);
    // By name, so either side may know counters the other does not.
    w.list(&i.counters.named(), |w, &(name, value)| {
        w.str(name).u64(value);
    });
    w.list(&i.fields, |w, (name, schema, ready)| {
        w.str(name).schema(schema).u64(*ready);
    });
    w.list(&i.tasks, |w, (name, leased, acked)| {
        w.str(name).u64(*leased).u64(*acked);
    });
    w.list(&i.partitions, |w, (name, live)| {
        w.str(name).u64(*live);
    });
    w.u64(s.payload_rows).u64(s.memory_used);
    w.opt(s.memory_limit, |w, l| {
        w.u64(l);
    });
    w.u64(s.shards).duration(s.lease_timeout);
}

fn get_stats(r: &mut Reader<'_>) -> Result<StoreStats, ProtoError> {
    let (live_rows, resident_slots, active_leases) = (r.u64()?, r.u64()?, r.u64()?);
    let mut counters = Counters::default();
    for (name, value) in r.list(12, |r| Ok((r.string()?, r.u64()?)))? {
        counters.set(&name, value);
    }
    let index = IndexStats {
        live_rows,
        resident_slots,
        active_leases,
        counters,
        fields: r.list(14, |r| Ok((r.string()?, r.schema()?, r.u64()?)))?,
        tasks: r.list(20, |r| Ok((r.string()?, r.u64()?, r.u64()?)))?,
        partitions: r.list(12, |r| Ok((r.string()?, r.u64()?)))?,
    };
    Ok(StoreStats {
        index,
        payload_rows: r.u64()?,
        memory_used: r.u64()?,
        memory_limit: r.opt(Reader::u64)?,
        shards: r.u64()?,
        lease_timeout: r.duration()?,
    })
}

impl Reply {
    /// About as many bytes as `encode` writes (a few bytes a row and a cell), so that a long
    /// reply is written without growing its buffer again and again.
    fn size_hint(&self) -> usize {
        let cells = |columns: &[WireColumn]| -> usize {
            columns.iter().map(|c| 32 + 8 * c.cells.len()).sum()
        };
        match self {
            Reply::Claimed(c) => 64 + 6 * c.rows.len(),
            Reply::Cells { columns, .. } => 64 + cells(columns),
            Reply::ClaimedCells { claimed, columns, .. } => {
                64 + 6 * claimed.rows.len() + cells(columns)
            }
            _ => 256,
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::with_capacity(self.size_hint());
        match self {
            Reply::Hello(h) => {
                w.u8(0).str(&h.version).u8(h.role as u8).str(&h.host);
                w.opt(h.shm_socket.as_deref(), |w, s| {
                    w.str(s);
                });
                w.strs(&h.storage);
                w.u64(h.instance);
                if h.ring != 0 {
                    w.u64(h.ring);
                }
            }
            Reply::Done => {
                w.u8(1);
            }
            Reply::Rows(rows) => {
                w.u8(2).u64s(rows);
            }
            Reply::Admitted { rows, fields } => {
                w.u8(3).u64s(rows).list(fields, |w, &f| {
                    w.u32(f);
                });
            }
            Reply::Claimed(c) => {
                put_claimed(w.u8(4), c);
            }
            Reply::Renewed(d) => {
                w.u8(5).duration(*d);
            }
            Reply::Cells { columns, pin, segments } => {
                put_cells(w.u8(6), columns, *pin, segments);
            }
            Reply::RowInfos(infos) => {
                w.u8(7).list(infos, put_row_info);
            }
            Reply::Count(n) => {
                w.u8(8).u64(*n);
            }
            Reply::Schema(s) => {
                w.u8(9).schema(s);
            }
            Reply::Stats(s) => {
                w.u8(10);
                put_stats(&mut w, s);
            }
            Reply::Staged { stage, cell, len, segments } => {
                w.u8(11).u64(*stage);
                put_shared(&mut w, *cell);
                w.u64(*len);
                put_segments(&mut w, segments);
            }
            Reply::Located { fields } => {
                w.u8(12).list(fields, |w, (id, schema)| {
                    w.u32(*id).schema(schema);
                });
            }
            Reply::Names(rows) => {
                w.u8(13).list(rows, |w, names| {
                    w.strs(names);
                });
            }
            Reply::WithSpare { reply, spare } => {
                w.u8(14);
                w.buf.extend_from_slice(&reply.encode());
                w.u64(spare.stage);
                put_shared(&mut w, spare.cell);
                w.u64(spare.len);
                put_segments(&mut w, &spare.segments);
            }
            Reply::ClaimedCells { claimed, columns, pin, segments } => {
                put_claimed(w.u8(15), claimed);
                put_cells(&mut w, columns, *pin, segments);
            }
        }
        w.buf
    }

    /// Decodes a reply whose frame carries `payload_len` payload bytes; inline cells must lie
    /// inside them.
    pub fn decode(meta: &[u8], payload_len: u64) -> Result<Self, ProtoError> {
        let mut r = Reader::new(meta);
        let reply = Self::decode_body(&mut r)?;
        r.finish()?;
        if let Reply::Cells { columns, .. } | Reply::ClaimedCells { columns, .. } = &reply {
            for cell in columns.iter().flat_map(|c| &c.cells) {
                if let CellPlace::Inline(offset) = cell.place
                    && offset.checked_add(cell.len).is_none_or(|end| end > payload_len)
                {
                    return Err(ProtoError::malformed("an inline cell outside the payload"));
                }
            }
        } else if payload_len != 0 {
            return Err(ProtoError::malformed("a reply without cells carries a payload"));
        }
        Ok(reply)
    }

    fn decode_body(r: &mut Reader<'_>) -> Result<Self, ProtoError> {
        let kind = r.u8()?;
        Self::decode_kind(kind, r)
    }

    fn decode_kind(kind: u8, r: &mut Reader<'_>) -> Result<Self, ProtoError> {
        Ok(match kind {
            0 => Reply::Hello(ServerHello {
                version: r.string()?,
                role: Role::from_code(r.u8()?)?,
                host: r.string()?,
                shm_socket: r.opt(Reader::string)?,
                storage: r.strings()?,
                instance: if r.remaining() > 0 { r.u64()? } else { 0 },
                ring: if r.remaining() > 0 { r.u64()? } else { 0 },
            }),
            1 => Reply::Done,
            2 => Reply::Rows(r.u64s()?),
            3 => Reply::Admitted { rows: r.u64s()?, fields: r.list(4, Reader::u32)? },
            4 => Reply::Claimed(get_claimed(r)?),
            5 => Reply::Renewed(r.duration()?),
            6 => Reply::Cells {
                columns: r.list(10, get_column)?,
                pin: r.opt(Reader::u64)?,
                segments: get_segments(r)?,
            },
            // Index 8, partition 4 + its bytes, group tag 1, version 8, tags 4.
            7 => Reply::RowInfos(r.list(25, get_row_info)?),
            8 => Reply::Count(r.u64()?),
            9 => Reply::Schema(r.schema()?),
            10 => Reply::Stats(Box::new(get_stats(r)?)),
            11 => Reply::Staged {
                stage: r.u64()?,
                cell: get_shared(r)?,
                len: r.u64()?,
                segments: get_segments(r)?,
            },
            12 => Reply::Located { fields: r.list(6, |r| Ok((r.u32()?, r.schema()?)))? },
            13 => Reply::Names(r.list(4, Reader::strings)?),
            14 => Reply::WithSpare {
                // Checked before it is decoded, so that nesting cannot recurse.
                reply: match r.u8()? {
                    6 | 11 | 14 | 15 => {
                        return Err(ProtoError::malformed("a spare beside a reply with segments"));
                    }
                    inner => Box::new(Self::decode_kind(inner, r)?),
                },
                spare: Spare {
                    stage: r.u64()?,
                    cell: get_shared(r)?,
                    len: r.u64()?,
                    segments: get_segments(r)?,
                },
            },
            15 => Reply::ClaimedCells {
                claimed: get_claimed(r)?,
                columns: r.list(10, get_column)?,
                pin: r.opt(Reader::u64)?,
                segments: get_segments(r)?,
            },
            t => return Err(ProtoError::malformed(format!("unknown reply kind {t}"))),
        })
    }
}

impl Failure {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::new();
        match self {
            Failure::Store(e) => match e {
                StoreError::Timeout { what, waited } => {
                    w.u8(0).str(what).duration(*waited);
                }
                StoreError::MemoryLimit(m) => {
                    w.u8(1).str(m);
                }
                StoreError::Schema(m) => {
                    w.u8(2).str(m);
                }
                StoreError::UnknownField(f) => {
                    w.u8(3).str(f);
                }
                StoreError::UnknownIndex(i) => {
                    w.u8(4).u64(*i);
                }
                StoreError::UnknownTask(t) => {
                    w.u8(5).str(t);
                }
                StoreError::Lease { id, reason } => {
                    w.u8(6).u64(*id).str(reason);
                }
                StoreError::BadRequest(m) => {
                    w.u8(7).str(m);
                }
                StoreError::Interrupted => {
                    w.u8(8);
                }
                StoreError::Persistence(m) => {
                    w.u8(9).str(m);
                }
            },
            Failure::Auth(m) => {
                w.u8(20).str(m);
            }
            Failure::Protocol(m) => {
                w.u8(21).str(m);
            }
            Failure::Unavailable(m) => {
                w.u8(22).str(m);
            }
        }
        w.buf
    }

    pub fn decode(meta: &[u8]) -> Result<Self, ProtoError> {
        let mut r = Reader::new(meta);
        let store = |e: StoreError| Failure::Store(e);
        let f = match r.u8()? {
            0 => store(StoreError::Timeout { what: r.string()?, waited: r.duration()? }),
            1 => store(StoreError::MemoryLimit(r.string()?)),
            2 => store(StoreError::Schema(r.string()?)),
            3 => store(StoreError::UnknownField(r.string()?)),
            4 => store(StoreError::UnknownIndex(r.u64()?)),
            5 => store(StoreError::UnknownTask(r.string()?)),
            6 => store(StoreError::Lease { id: r.u64()?, reason: r.string()? }),
            7 => store(StoreError::BadRequest(r.string()?)),
            8 => store(StoreError::Interrupted),
            9 => store(StoreError::Persistence(r.string()?)),
            20 => Failure::Auth(r.string()?),
            21 => Failure::Protocol(r.string()?),
            22 => Failure::Unavailable(r.string()?),
            t => return Err(ProtoError::malformed(format!("unknown failure kind {t}"))),
        };
        r.finish()?;
        Ok(f)
    }
}

/// Decodes the body of a frame that answers a request: `Ok(Ok(reply))` or `Ok(Err(failure))`.
pub fn decode_answer(
    op: Op,
    meta: &[u8],
    payload_len: u64,
) -> Result<Result<Reply, Failure>, ProtoError> {
    match op {
        Op::Reply => Reply::decode(meta, payload_len).map(Ok),
        Op::Failure if payload_len == 0 => Failure::decode(meta).map(Err),
        Op::Failure => Err(ProtoError::malformed("a failure carries no payload")),
        other => Err(ProtoError::malformed(format!("{other:?} where a reply was expected"))),
    }
}

#[cfg(test)]
mod tests {
    use asyncflow_core::DType;

    use super::*;

    #[test]
    fn a_servers_hello_round_trips_with_or_without_rings() {
        for ring in [0, 1 << 20] {
            let hello = Reply::Hello(ServerHello {
                version: "v".into(),
                role: Role::Standalone,
                host: "h".into(),
                shm_socket: Some("/s".into()),
                storage: vec![],
                instance: 5,
                ring,
            });
            let back = Reply::decode(&hello.encode(), 0).unwrap();
            assert_eq!(format!("{back:?}"), format!("{hello:?}"));
        }
    }

    #[test]
    fn every_store_error_survives_the_wire() {
        let errors = [
            StoreError::Timeout { what: "rows".into(), waited: Duration::from_millis(250) },
            StoreError::MemoryLimit("full".into()),
            StoreError::Schema("shape".into()),
            StoreError::UnknownField("f".into()),
            StoreError::UnknownIndex(9),
            StoreError::UnknownTask("t".into()),
            StoreError::Lease { id: 3, reason: "expired".into() },
            StoreError::BadRequest("bad".into()),
            StoreError::Interrupted,
            StoreError::Persistence("disk full".into()),
        ];
        for e in errors {
            let f = Failure::Store(e);
            assert_eq!(Failure::decode(&f.encode()).unwrap(), f);
        }
    }

    /// A column of two 8-byte cells: one inline at `inline_at`, one in shared segment 2.
    fn two_cells(inline_at: u64) -> Vec<WireColumn> {
        vec![WireColumn {
            name: "x".into(),
            schema: FieldSchema::scalar(DType::F64),
            cells: vec![
                WireCell { place: CellPlace::Inline(inline_at), len: 8, first_dim: 1 },
                WireCell {
                    place: CellPlace::Shared(SharedCell { segment: 2, offset: 128 }),
                    len: 8,
                    first_dim: 1,
                },
            ],
        }]
    }

    #[test]
    fn cells_round_trip_and_inline_ones_are_bounded_by_the_payload() {
        let reply = Reply::Cells {
            columns: two_cells(64),
            pin: Some(5),
            segments: Segments { new: vec![(2, 4096)], retired: vec![1] },
        };
        let back = Reply::decode(&reply.encode(), 72).unwrap();
        assert_eq!(format!("{back:?}"), format!("{reply:?}"));
        assert!(Reply::decode(&reply.encode(), 71).is_err());
    }

    #[test]
    fn a_claim_with_its_cells_round_trips_and_inline_cells_are_bounded_by_the_payload() {
        let claimed = WireClaimed {
            lease: Some(3),
            rows: vec![10, 11],
            versions: vec![1, 1],
            groups: vec![None, Some(4)],
            expires_in: Some(Duration::from_secs(30)),
        };
        let reply = Reply::ClaimedCells {
            claimed,
            columns: two_cells(0),
            pin: Some(6),
            segments: Segments { new: vec![(2, 4096)], retired: vec![] },
        };
        let bytes = reply.encode();
        let back = Reply::decode(&bytes, 8).unwrap();
        assert_eq!(format!("{back:?}"), format!("{reply:?}"));
        assert!(Reply::decode(&bytes, 7).is_err());
        for cut in 0..bytes.len() {
            assert!(Reply::decode(&bytes[..cut], 8).is_err(), "cut at {cut}");
        }
        let beside_a_spare = Reply::WithSpare { reply: Box::new(reply), spare: spare() };
        assert!(Reply::decode(&beside_a_spare.encode(), 8).is_err());
    }

    #[test]
    fn row_infos_with_short_partition_names_round_trip() {
        let info = |index| RowInfo {
            index,
            partition: String::new(),
            group: None,
            version: 1,
            tags: Arc::new(Vec::new()),
        };
        let reply = Reply::RowInfos((0..6).map(info).collect());
        let back = Reply::decode(&reply.encode(), 0).unwrap();
        assert_eq!(format!("{back:?}"), format!("{reply:?}"));
    }

    fn spare() -> Spare {
        Spare {
            stage: 7,
            cell: SharedCell { segment: 3, offset: 0 },
            len: 1 << 20,
            segments: Segments { new: vec![(3, 1 << 20)], retired: vec![2] },
        }
    }

    #[test]
    fn a_spare_round_trips_beside_a_reply() {
        for inner in [Reply::Done, Reply::Rows(vec![4, 5]), Reply::Count(3)] {
            let reply = Reply::WithSpare { reply: Box::new(inner), spare: spare() };
            let back = Reply::decode(&reply.encode(), 0).unwrap();
            assert_eq!(format!("{back:?}"), format!("{reply:?}"));
            assert!(Reply::decode(&reply.encode(), 8).is_err(), "no payload with a spare");
        }
    }

    #[test]
    fn a_malformed_spare_is_an_error() {
        let reply = Reply::WithSpare { reply: Box::new(Reply::Rows(vec![1])), spare: spare() };
        let bytes = reply.encode();
        // Every truncation, and any trailing byte, fails to decode rather than panic.
        for cut in 0..bytes.len() {
            assert!(Reply::decode(&bytes[..cut], 0).is_err(), "cut at {cut}");
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(Reply::decode(&longer, 0).is_err());
        // A segment list claiming more entries than the frame holds.
        let mut w = Writer::new();
        w.u8(14).u8(1).u64(1).u64(1).u64(0).u64(64).u32(u32::MAX);
        assert!(Reply::decode(&w.buf, 0).is_err());
        // Beside a reply that brings segments itself, or another spare: however deep.
        let cells = Reply::Cells { columns: vec![], pin: None, segments: Segments::default() };
        let nested = Reply::WithSpare { reply: Box::new(reply), spare: spare() };
        for inner in [cells, nested] {
            let bad = Reply::WithSpare { reply: Box::new(inner), spare: spare() };
            assert!(Reply::decode(&bad.encode(), 0).is_err());
        }
        let deep = vec![14u8; 100_000];
        assert!(Reply::decode(&deep, 0).is_err());
    }

    #[test]
    fn stats_round_trip() {
        let mut stats = StoreStats {
            index: IndexStats::default(),
            payload_rows: 3,
            memory_used: 100,
            memory_limit: Some(1000),
            shards: 4,
            lease_timeout: Duration::from_secs(30),
        };
        stats.index.counters.claims = 7;
        stats.index.fields.push(("x".into(), FieldSchema::scalar(DType::I32), 2));
        stats.index.tasks.push(("t".into(), 1, 2));
        let back = Reply::decode(&Reply::Stats(Box::new(stats.clone())).encode(), 0).unwrap();
        assert_eq!(format!("{back:?}"), format!("{:?}", Reply::Stats(Box::new(stats))));
    }
}
