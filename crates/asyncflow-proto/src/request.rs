//! Requests: what a client (or the controller) asks a daemon to do. Each maps to one [`Op`]; its
//! metadata is encoded here, and any payload bytes it carries sit in the frame's payload section
//! at the offsets its [`CellMeta`]s name.

use std::sync::Arc;
use std::time::Duration;

use asyncflow_core::{ClaimSpec, FieldSchema, NewRows, PutTarget};

use crate::claim;
use crate::error::ProtoError;
use crate::frame::Op;
use crate::hello::Hello;
use crate::wire::{Reader, Writer};

/// Where one cell's bytes are: `len` bytes at `offset` of the payload (frame or staged region).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CellMeta {
    pub offset: u64,
    pub len: u64,
    pub first_dim: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ColumnMeta {
    pub name: String,
    pub schema: FieldSchema,
    pub cells: Vec<CellMeta>,
}

/// Where a put's cell offsets point.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PayloadSource {
    /// Into this frame's payload section.
    Inline,
    /// Into a shared-memory region the daemon handed out: asked for with `Stage`, or set aside
    /// unasked as the connection's spare (`Reply::WithSpare`).
    Staged(u64),
    /// Nowhere: the controller only admits the rows; the bytes go to storage daemons.
    Elsewhere,
}

#[derive(Debug, Clone)]
pub struct PutRequest {
    pub columns: Vec<ColumnMeta>,
    pub target: PutTarget,
    pub timeout: Option<Duration>,
    pub source: PayloadSource,
    /// A lease this client holds, acked whole once the put is in: the put of a stage's results
    /// and the ack of the rows they came from, in one round trip. Nothing is acked if the put
    /// fails; an ack that fails (the lease ended) leaves the put in place, as two requests would.
    pub ack: Option<u64>,
}

/// Payload cells for a storage daemon: `columns[f].1[k]` is field `columns[f].0` of `rows[k]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreCells {
    pub rows: Vec<u64>,
    pub columns: Vec<(u32, Vec<CellMeta>)>,
    pub timeout: Option<Duration>,
    pub source: PayloadSource,
}

#[derive(Debug, Clone)]
pub enum Request {
    Hello(Hello),
    RegisterTask {
        name: String,
        /// Partition-name prefixes the task consumes; `None` for all.
        scope: Option<Vec<String>>,
    },
    Put(PutRequest),
    /// With `read`, the claimed rows' cells of the claimed fields come with the reply
    /// (`Reply::ClaimedCells`), so that reading them takes no second round trip.
    Claim {
        spec: ClaimSpec,
        allow_partial: bool,
        timeout: Option<Duration>,
        read: bool,
    },
    Ack {
        lease: u64,
        subset: Option<Vec<u64>>,
    },
    Release {
        lease: u64,
        subset: Option<Vec<u64>>,
    },
    Renew {
        lease: u64,
        timeout: Option<Duration>,
    },
    Read {
        rows: Vec<u64>,
        fields: Vec<String>,
    },
    Rows {
        rows: Option<Vec<u64>>,
        partition: Option<String>,
    },
    Clear {
        partition: String,
    },
    Delete {
        rows: Vec<u64>,
    },
    Schema {
        field: String,
    },
    /// The names of the fields ready on each row.
    ReadyFields {
        rows: Vec<u64>,
    },
    Stats,
    /// Are you there? Answered at once with `Done`; a client sends it to tell a daemon that is
    /// slow to answer from one that has stopped answering.
    Ping,
    /// Reserve a shared-memory region of `bytes` for a put that follows; `give_back` is the
    /// connection's spare region (see `Reply::WithSpare`), too small for this put, which the client
    /// will not write.
    Stage {
        bytes: u64,
        timeout: Option<Duration>,
        give_back: Option<u64>,
    },
    /// The client dropped its views of these read pins (no reply).
    Unpin {
        pins: Vec<u64>,
    },
    /// Stop waiting on this earlier request of the same connection (no reply).
    Cancel {
        request: u64,
    },
    /// Controller: the payloads of these admitted rows are in place; make the fields ready.
    Commit {
        rows: Vec<u64>,
        fields: Vec<u32>,
    },
    /// Controller: check `fields` are readable on `rows`; answer their ids and schemas.
    Locate {
        rows: Vec<u64>,
        fields: Vec<String>,
    },
    /// Storage: keep these cells.
    StoreCells(StoreCells),
    /// Storage: the cells of `fields` (ids) on `rows`.
    FetchCells {
        rows: Vec<u64>,
        fields: Vec<u32>,
    },
    /// Storage: forget these rows' payloads (no reply).
    DropRows {
        rows: Vec<u64>,
    },
}

fn put_cells(w: &mut Writer, cells: &[CellMeta]) {
    w.list(cells, |w, c| {
        w.u64(c.offset).u64(c.len).u64(c.first_dim);
    });
}

fn get_cells(r: &mut Reader<'_>) -> Result<Vec<CellMeta>, ProtoError> {
    r.list(24, |r| Ok(CellMeta { offset: r.u64()?, len: r.u64()?, first_dim: r.u64()? }))
}

fn put_source(w: &mut Writer, s: PayloadSource) {
    match s {
        PayloadSource::Inline => w.u8(0),
        PayloadSource::Staged(id) => w.u8(1).u64(id),
        PayloadSource::Elsewhere => w.u8(2),
    };
}

fn get_source(r: &mut Reader<'_>) -> Result<PayloadSource, ProtoError> {
    match r.u8()? {
        0 => Ok(PayloadSource::Inline),
        1 => Ok(PayloadSource::Staged(r.u64()?)),
        2 => Ok(PayloadSource::Elsewhere),
        t => Err(ProtoError::malformed(format!("unknown payload source {t}"))),
    }
}

fn put_timeout(w: &mut Writer, t: Option<Duration>) {
    w.opt(t, |w, d| {
        w.duration(d);
    });
}

fn put_subset(w: &mut Writer, s: Option<&Vec<u64>>) {
    w.opt(s, |w, v| {
        w.u64s(v);
    });
}

pub(crate) fn put_tags(w: &mut Writer, tags: &[(String, String)]) {
    w.list(tags, |w, (k, v)| {
        w.str(k).str(v);
    });
}

pub(crate) fn get_tags(r: &mut Reader<'_>) -> Result<Vec<(String, String)>, ProtoError> {
    r.list(8, |r| Ok((r.string()?, r.string()?)))
}

fn put_target(w: &mut Writer, target: &PutTarget) {
    match target {
        PutTarget::Existing(rows) => {
            w.u8(1).u64s(rows);
        }
        PutTarget::New(new) => {
            w.u8(0);
            put_new_rows(w, new);
        }
    }
}

/// The metadata of rows a put creates (also part of log records).
pub(crate) fn put_new_rows(w: &mut Writer, new: &NewRows) {
    w.str(&new.partition);
    w.opt(new.groups.as_ref(), |w, g| {
        w.u64s(g);
    });
    w.opt(new.group_size, |w, s| {
        w.u32(s);
    });
    w.u64s(&new.versions);
    w.list(&new.tags, |w, t| put_tags(w, t));
}

pub(crate) fn get_new_rows(r: &mut Reader<'_>) -> Result<NewRows, ProtoError> {
    Ok(NewRows {
        partition: r.string()?,
        groups: r.opt(Reader::u64s)?,
        group_size: r.opt(Reader::u32)?,
        versions: r.u64s()?,
        tags: r.list(4, |r| get_tags(r).map(Arc::new))?,
    })
}

fn get_target(r: &mut Reader<'_>) -> Result<PutTarget, ProtoError> {
    match r.u8()? {
        1 => Ok(PutTarget::Existing(r.u64s()?)),
        0 => Ok(PutTarget::New(get_new_rows(r)?)),
        t => Err(ProtoError::malformed(format!("unknown put target {t}"))),
    }
}

/// Checks that every cell lies inside a payload of `payload_len` bytes.
fn check_inline(cells: &[CellMeta], payload_len: u64) -> Result<(), ProtoError> {
    for c in cells {
        let end = c.offset.checked_add(c.len);
        if end.is_none_or(|e| e > payload_len) {
            return Err(ProtoError::malformed(format!(
                "cell at {}+{} lies outside the {payload_len}-byte payload",
                c.offset, c.len
            )));
        }
    }
    Ok(())
}

impl Request {
    pub fn op(&self) -> Op {
        match self {
            Request::Hello(_) => Op::Hello,
            Request::RegisterTask { .. } => Op::RegisterTask,
            Request::Put(_) => Op::Put,
            Request::Claim { .. } => Op::Claim,
            Request::Ack { .. } => Op::Ack,
            Request::Release { .. } => Op::Release,
            Request::Renew { .. } => Op::Renew,
            Request::Read { .. } => Op::Read,
            Request::Rows { .. } => Op::Rows,
            Request::Clear { .. } => Op::Clear,
            Request::Delete { .. } => Op::Delete,
            Request::Schema { .. } => Op::Schema,
            Request::ReadyFields { .. } => Op::ReadyFields,
            Request::Stats => Op::Stats,
            Request::Ping => Op::Ping,
            Request::Stage { .. } => Op::Stage,
            Request::Unpin { .. } => Op::Unpin,
            Request::Cancel { .. } => Op::Cancel,
            Request::Commit { .. } => Op::Commit,
            Request::Locate { .. } => Op::Locate,
            Request::StoreCells(_) => Op::StoreCells,
            Request::FetchCells { .. } => Op::FetchCells,
            Request::DropRows { .. } => Op::DropRows,
        }
    }

    /// The metadata section of this request's frame.
    pub fn encode(&self) -> Vec<u8> {
        // Most requests (a claim, an ack, a put's metadata) fit: written without regrowing.
        let mut w = Writer::with_capacity(256);
        match self {
            Request::Hello(h) => {
                w.opt(h.token.as_deref(), |w, t| {
                    w.str(t);
                })
                .str(&h.host);
                if !h.leases.is_empty() || h.ring != 0 || h.probe {
                    w.u64s(&h.leases);
                }
                if h.ring != 0 || h.probe {
                    w.u64(h.ring);
                }
                if h.probe {
                    w.bool(true);
                }
            }
            Request::RegisterTask { name, scope } => {
                w.str(name).opt(scope.as_deref(), |w, s| {
                    w.strs(s);
                });
            }
            Request::Put(p) => {
                w.list(&p.columns, |w, c| {
                    w.str(&c.name).schema(&c.schema);
                    put_cells(w, &c.cells);
                });
                put_target(&mut w, &p.target);
                put_timeout(&mut w, p.timeout);
                put_source(&mut w, p.source);
                // Last and only when set, so that a put without one reads as before.
                if let Some(lease) = p.ack {
                    w.u64(lease);
                }
            }
            Request::Claim { spec, allow_partial, timeout, read } => {
                claim::encode(&mut w, spec);
                w.bool(*allow_partial);
                put_timeout(&mut w, *timeout);
                w.bool(*read);
            }
            Request::Ack { lease, subset } | Request::Release { lease, subset } => {
                w.u64(*lease);
                put_subset(&mut w, subset.as_ref());
            }
            Request::Renew { lease, timeout } => {
                w.u64(*lease);
                put_timeout(&mut w, *timeout);
            }
            Request::Read { rows, fields } | Request::Locate { rows, fields } => {
                w.u64s(rows).strs(fields);
            }
            Request::Rows { rows, partition } => {
                put_subset(&mut w, rows.as_ref());
                w.opt(partition.as_deref(), |w, p| {
                    w.str(p);
                });
            }
            Request::Clear { partition } => {
                w.str(partition);
            }
            Request::Delete { rows }
            | Request::DropRows { rows }
            | Request::ReadyFields { rows } => {
                w.u64s(rows);
            }
            Request::Schema { field } => {
                w.str(field);
            }
            Request::Stats | Request::Ping => {}
            Request::Stage { bytes, timeout, give_back } => {
                w.u64(*bytes);
                put_timeout(&mut w, *timeout);
                w.opt(*give_back, |w, id| {
                    w.u64(id);
                });
            }
            Request::Unpin { pins } => {
                w.u64s(pins);
            }
            Request::Cancel { request } => {
                w.u64(*request);
            }
            Request::Commit { rows, fields } | Request::FetchCells { rows, fields } => {
                w.u64s(rows).list(fields, |w, &f| {
                    w.u32(f);
                });
            }
            Request::StoreCells(s) => {
                w.u64s(&s.rows).list(&s.columns, |w, (field, cells)| {
                    w.u32(*field);
                    put_cells(w, cells);
                });
                put_timeout(&mut w, s.timeout);
                put_source(&mut w, s.source);
            }
        }
        w.buf
    }

    /// Decodes the metadata of a request frame with operation `op` whose payload section holds
    /// `payload_len` bytes; inline cells must lie inside it.
    pub fn decode(op: Op, meta: &[u8], payload_len: u64) -> Result<Self, ProtoError> {
        let mut r = Reader::new(meta);
        let req = Self::decode_body(op, &mut r)?;
        r.finish()?;
        req.check_payload(payload_len)?;
        Ok(req)
    }

    fn decode_body(op: Op, r: &mut Reader<'_>) -> Result<Self, ProtoError> {
        let fields32 = |r: &mut Reader<'_>| r.list(4, Reader::u32);
        Ok(match op {
            Op::Hello => Request::Hello(Hello {
                token: r.opt(Reader::string)?,
                host: r.string()?,
                leases: if r.remaining() > 0 { r.u64s()? } else { Vec::new() },
                ring: if r.remaining() > 0 { r.u64()? } else { 0 },
                probe: r.remaining() > 0 && r.bool()?,
            }),
            Op::RegisterTask => {
                Request::RegisterTask { name: r.string()?, scope: r.opt(Reader::strings)? }
            }
            Op::Put => Request::Put(PutRequest {
                columns: r.list(10, |r| {
                    Ok(ColumnMeta { name: r.string()?, schema: r.schema()?, cells: get_cells(r)? })
                })?,
                target: get_target(r)?,
                timeout: r.opt(Reader::duration)?,
                source: get_source(r)?,
                ack: if r.remaining() > 0 { Some(r.u64()?) } else { None },
            }),
            Op::Claim => Request::Claim {
                spec: claim::decode(r)?,
                allow_partial: r.bool()?,
                timeout: r.opt(Reader::duration)?,
                read: r.bool()?,
            },
            Op::Ack => Request::Ack { lease: r.u64()?, subset: r.opt(Reader::u64s)? },
            Op::Release => Request::Release { lease: r.u64()?, subset: r.opt(Reader::u64s)? },
            Op::Renew => Request::Renew { lease: r.u64()?, timeout: r.opt(Reader::duration)? },
            Op::Read => Request::Read { rows: r.u64s()?, fields: r.strings()? },
            Op::Locate => Request::Locate { rows: r.u64s()?, fields: r.strings()? },
            Op::Rows => {
                Request::Rows { rows: r.opt(Reader::u64s)?, partition: r.opt(Reader::string)? }
            }
            Op::Clear => Request::Clear { partition: r.string()? },
            Op::Delete => Request::Delete { rows: r.u64s()? },
            Op::DropRows => Request::DropRows { rows: r.u64s()? },
            Op::ReadyFields => Request::ReadyFields { rows: r.u64s()? },
            Op::Schema => Request::Schema { field: r.string()? },
            Op::Stats => Request::Stats,
            Op::Ping => Request::Ping,
            Op::Stage => Request::Stage {
                bytes: r.u64()?,
                timeout: r.opt(Reader::duration)?,
                give_back: r.opt(Reader::u64)?,
            },
            Op::Unpin => Request::Unpin { pins: r.u64s()? },
            Op::Cancel => Request::Cancel { request: r.u64()? },
            Op::Commit => Request::Commit { rows: r.u64s()?, fields: fields32(r)? },
            Op::FetchCells => Request::FetchCells { rows: r.u64s()?, fields: fields32(r)? },
            Op::StoreCells => Request::StoreCells(StoreCells {
                rows: r.u64s()?,
                columns: r.list(8, |r| Ok((r.u32()?, get_cells(r)?)))?,
                timeout: r.opt(Reader::duration)?,
                source: get_source(r)?,
            }),
            Op::Reply | Op::Failure => {
                return Err(ProtoError::malformed("a reply where a request was expected"));
            }
        })
    }

    fn check_payload(&self, payload_len: u64) -> Result<(), ProtoError> {
        let (cells, source): (Vec<&[CellMeta]>, _) = match self {
            Request::Put(p) => (p.columns.iter().map(|c| c.cells.as_slice()).collect(), p.source),
            Request::StoreCells(s) => {
                (s.columns.iter().map(|c| c.1.as_slice()).collect(), s.source)
            }
            _ if payload_len == 0 => return Ok(()),
            _ => return Err(ProtoError::malformed(format!("{:?} carries no payload", self.op()))),
        };
        match source {
            PayloadSource::Inline => {
                cells.into_iter().try_for_each(|c| check_inline(c, payload_len))
            }
            _ if payload_len == 0 => Ok(()),
            _ => Err(ProtoError::malformed("a staged put with an inline payload")),
        }
    }
}

#[cfg(test)]
mod tests {
    use asyncflow_core::DType;

    use super::*;

    fn put(source: PayloadSource, offset: u64) -> Request {
        Request::Put(PutRequest {
            columns: vec![ColumnMeta {
                name: "x".into(),
                schema: FieldSchema::ragged(DType::F32, vec![2]),
                cells: vec![CellMeta { offset, len: 8, first_dim: 1 }],
            }],
            target: PutTarget::New(NewRows {
                partition: "p".into(),
                groups: Some(vec![3]),
                group_size: Some(1),
                versions: vec![1],
                tags: vec![Arc::new(vec![("k".into(), "v".into())])],
            }),
            timeout: Some(Duration::from_millis(1500)),
            source,
            ack: None,
        })
    }

    fn round_trip(req: &Request, payload_len: u64) -> Result<Request, ProtoError> {
        Request::decode(req.op(), &req.encode(), payload_len)
    }

    #[test]
    fn a_hello_round_trips_with_or_without_leases_rings_and_probe() {
        let cases = [(vec![], 0), (vec![7, 9], 0), (vec![], 1 << 20), (vec![3], 4096)];
        for ((leases, ring), probe) in
            cases.into_iter().flat_map(|c| [(c.clone(), false), (c, true)])
        {
            let req = Request::Hello(Hello { token: None, host: "h".into(), leases, ring, probe });
            assert_eq!(format!("{:?}", round_trip(&req, 0).unwrap()), format!("{req:?}"));
        }
    }

    #[test]
    fn a_put_round_trips_with_its_target_and_cells() {
        let req = put(PayloadSource::Inline, 64);
        let back = round_trip(&req, 72).unwrap();
        assert_eq!(format!("{back:?}"), format!("{req:?}"));
    }

    #[test]
    fn a_put_that_acks_round_trips_and_one_without_is_encoded_as_before() {
        let Request::Put(plain) = put(PayloadSource::Inline, 64) else { unreachable!() };
        let acking = Request::Put(PutRequest { ack: Some(u64::MAX - 1), ..plain.clone() });
        let Request::Put(back) = round_trip(&acking, 72).unwrap() else { panic!("not a put") };
        assert_eq!(back.ack, Some(u64::MAX - 1));
        let plain_bytes = Request::Put(plain).encode();
        // The lease is the one thing the acking put adds, at the end.
        assert_eq!(acking.encode()[..plain_bytes.len()], plain_bytes[..]);
        assert!(acking.encode().len() > plain_bytes.len());
        let Request::Put(back) = Request::decode(Op::Put, &plain_bytes, 72).unwrap() else {
            panic!("not a put")
        };
        assert_eq!(back.ack, None);
    }

    #[test]
    fn an_inline_cell_outside_the_payload_is_malformed() {
        assert!(round_trip(&put(PayloadSource::Inline, 64), 71).is_err());
        assert!(round_trip(&put(PayloadSource::Inline, u64::MAX - 2), 100).is_err());
    }

    #[test]
    fn staged_cells_are_not_checked_against_the_frame_but_may_not_bring_one() {
        assert!(round_trip(&put(PayloadSource::Staged(4), 1 << 40), 0).is_ok());
        assert!(round_trip(&put(PayloadSource::Staged(4), 0), 8).is_err());
    }

    #[test]
    fn a_stage_round_trips_with_or_without_a_spare_to_give_back() {
        for give_back in [None, Some(9)] {
            let req = Request::Stage { bytes: 1 << 20, timeout: None, give_back };
            let bytes = req.encode();
            let back = Request::decode(Op::Stage, &bytes, 0).unwrap();
            assert_eq!(format!("{back:?}"), format!("{req:?}"));
            for cut in 0..bytes.len() {
                assert!(Request::decode(Op::Stage, &bytes[..cut], 0).is_err(), "cut at {cut}");
            }
        }
        let mut bad = Request::Stage { bytes: 1, timeout: None, give_back: Some(1) }.encode();
        bad[9] = 2; // not an option tag
        assert!(Request::decode(Op::Stage, &bad, 0).is_err());
    }

    #[test]
    fn a_claim_round_trips_with_or_without_its_cells_asked_for() {
        for read in [false, true] {
            let spec = ClaimSpec {
                task: "t".into(),
                fields: vec!["x".into()],
                batch_size: 4,
                partition: None,
                min_version: None,
                whole_groups: false,
                share: None,
                partial_after: Some(Duration::from_millis(20)),
            };
            let req = Request::Claim { spec, allow_partial: true, timeout: None, read };
            let bytes = req.encode();
            let back = Request::decode(Op::Claim, &bytes, 0).unwrap();
            assert_eq!(format!("{back:?}"), format!("{req:?}"));
            for cut in 0..bytes.len() {
                assert!(Request::decode(Op::Claim, &bytes[..cut], 0).is_err(), "cut at {cut}");
            }
        }
    }

    #[test]
    fn a_request_without_payload_may_not_carry_one() {
        assert!(Request::decode(Op::Stats, &[], 1).is_err());
    }

    #[test]
    fn truncating_any_request_is_an_error() {
        let full = put(PayloadSource::Inline, 0).encode();
        for cut in 0..full.len() {
            assert!(Request::decode(Op::Put, &full[..cut], 8).is_err(), "cut at {cut}");
        }
    }
}
