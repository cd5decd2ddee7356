//! Payload cells in and out of the daemon. Coming in, a put's bytes become one chunk — the frame's
//! payload buffer itself, or the shared-memory region the client wrote — and its cells are slices
//! of it, so the daemon copies nothing. Going out, a cell in shared memory is named by segment and
//! offset (and pinned until the client lets go), any other cell is sent inline.

use std::collections::HashMap;
use std::sync::Arc;

use asyncflow_core::{Cell, Chunk, FieldSchema, MemoryGuard, StoreError};
use asyncflow_proto::{
    CellMeta, CellPlace, PayloadSource, Reply, Segments, SharedCell, WireCell, WireColumn,
    align_payload,
};
use asyncflow_shm::{MAX_FDS, MIN_SEGMENT, Region, Segment};

use super::outgoing::{Part, ReplyBody};
use super::session::{Session, Stage};

/// The chunk a put's cells live in: its inline payload (paid for by `guard`) or its staged
/// region — paid for when it was staged, or, for the connection's spare, now (`extent` bytes, as
/// far as the put's cells reach).
/// A frame's payload section, with the store memory granted to it before it was read (under
/// `--memory-limit`, an inline put's bytes are paid for before they are received).
#[derive(Default)]
pub struct Payload {
    pub bytes: Vec<u8>,
    pub paid: Option<MemoryGuard>,
}

pub fn incoming_chunk(
    session: &Session,
    source: PayloadSource,
    payload: Payload,
    extent: u64,
    reserve: impl FnOnce(u64) -> Result<MemoryGuard, StoreError>,
) -> Result<Arc<Chunk>, StoreError> {
    match source {
        PayloadSource::Inline => {
            let guard = match payload.paid {
                Some(paid) => paid,
                None => reserve(payload.bytes.len() as u64)?,
            };
            Ok(crate::received::into_chunk(payload.bytes, Some(guard)))
        }
        PayloadSource::Staged(id) => {
            let missing =
                || StoreError::bad_request(format!("no staged region {id} on this connection"));
            let shm = session.shm.as_ref().ok_or_else(missing)?;
            let Stage { mut region, guard } = shm.take_stage(id).ok_or_else(missing)?;
            let capacity = region.capacity();
            shm.staged_put(capacity);
            let guard = if let Some(guard) = guard {
                guard
            } else {
                reserve(spare_charge(&mut region, extent)?)?
            };
            Ok(Chunk::new(Box::new(region), Some(guard)))
        }
        PayloadSource::Elsewhere => {
            Err(StoreError::bad_request("this daemon keeps payloads; send the bytes with the put"))
        }
    }
}

/// What a put of `extent` bytes into the connection's spare `region` is charged, the region cut
/// to that length; an error if it does not fit. A put of the spare's size class is charged what
/// it uses; a smaller one (which the client is meant to stage instead) at least half the
/// segment it keeps, as a staged region of this size would be.
pub fn spare_charge(region: &mut Region, extent: u64) -> Result<u64, StoreError> {
    let capacity = region.capacity();
    if !usize::try_from(extent).is_ok_and(|e| region.set_len(e)) {
        return Err(StoreError::bad_request(format!(
            "a put of {extent} bytes does not fit the {capacity}-byte spare region"
        )));
    }
    let floor = if capacity > MIN_SEGMENT { capacity as u64 / 2 + 1 } else { 0 };
    Ok(extent.max(floor))
}

/// How far into its payload a put's cells reach.
pub fn extent<'a>(metas: impl IntoIterator<Item = &'a CellMeta>) -> u64 {
    metas.into_iter().map(|m| m.offset.saturating_add(m.len)).max().unwrap_or(0)
}

/// Cells of `chunk` at the places `metas` name; every one must lie inside the chunk.
pub fn cells_in(chunk: &Arc<Chunk>, metas: &[CellMeta]) -> Result<Vec<Cell>, StoreError> {
    metas
        .iter()
        .map(|m| {
            let end = m.offset.checked_add(m.len);
            if end.is_none_or(|e| e > chunk.len() as u64) {
                return Err(StoreError::bad_request(format!(
                    "cell at {}+{} lies outside the {}-byte payload",
                    m.offset,
                    m.len,
                    chunk.len()
                )));
            }
            Ok(Cell {
                chunk: Arc::clone(chunk),
                offset: m.offset as usize,
                len: m.len as usize,
                first_dim: m.first_dim,
            })
        })
        .collect()
}

/// Cells on their way to a client, and what it needs to view them.
pub struct Outgoing {
    pub columns: Vec<WireColumn>,
    pub pin: Option<u64>,
    pub segments: Segments,
    pub answer: ReplyBody,
}

impl Outgoing {
    /// The reply to a read.
    pub fn read_reply(self) -> (Reply, ReplyBody) {
        let Self { columns, pin, segments, answer } = self;
        (Reply::Cells { columns, pin, segments }, answer)
    }
}

/// Sends cells: shared cells where the session maps shared memory and the cell lives in it,
/// inline cells otherwise. One reply introduces at most `MAX_FDS` segments the client has not
/// mapped yet (the descriptors one message can carry); cells in further new segments go inline,
/// and a later read maps them.
pub fn outgoing_cells(
    session: &Session,
    columns: Vec<(String, FieldSchema, Vec<Cell>)>,
) -> Outgoing {
    let mut answer = ReplyBody::default();
    let mut cursor = 0u64;
    // Where each chunk is: the segment it fills, or nowhere the client can map (sent inline).
    // The cells of one put share a chunk, so this is looked up once per put, not per cell.
    let mut chunks: HashMap<*const Chunk, Option<Arc<Segment>>> = HashMap::new();
    let mut pinned = Vec::new();
    let mut segments = Vec::new();
    let mut introduced = 0;
    let mut wire = Vec::with_capacity(columns.len());
    for (name, schema, cells) in columns {
        let mut out = Vec::with_capacity(cells.len());
        for cell in cells {
            let shared = match &session.shm {
                Some(shm) if cell.len > 0 => chunks
                    .entry(Arc::as_ptr(&cell.chunk))
                    .or_insert_with(|| {
                        let (segment, _) = shm.pool.locate(cell.bytes().as_ptr())?;
                        let new = !shm.knows(segment.id());
                        if new && introduced >= MAX_FDS {
                            return None;
                        }
                        introduced += usize::from(new);
                        pinned.push(Arc::clone(&cell.chunk));
                        segments.push(Arc::clone(&segment));
                        Some(segment)
                    })
                    .clone(),
                _ => None,
            };
            let place = if let Some(segment) = shared {
                let offset = cell.bytes().as_ptr() as u64 - segment.as_ptr() as u64;
                CellPlace::Shared(SharedCell { segment: segment.id(), offset })
            } else {
                let at = align_payload(cursor);
                if at > cursor {
                    answer.payload.push(Part::Zeros((at - cursor) as usize));
                }
                cursor = at + cell.len as u64;
                answer.payload.push(Part::Cell(cell.clone()));
                CellPlace::Inline(at)
            };
            out.push(WireCell { place, len: cell.len as u64, first_dim: cell.first_dim });
        }
        wire.push(WireColumn { name, schema, cells: out });
    }
    let (pin, segments) = match &session.shm {
        Some(shm) if !pinned.is_empty() => {
            segments.sort_by_key(|s| s.id());
            segments.dedup_by_key(|s| s.id());
            let (intro, fds) = shm.introduce(&segments);
            answer.fds = fds;
            (Some(shm.pin(pinned)), intro)
        }
        _ => (None, Segments::default()),
    };
    Outgoing { columns: wire, pin, segments, answer }
}
