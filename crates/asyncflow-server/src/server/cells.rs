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
use super::session::{Session, ShmSession, Stage};

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
    let mut placer = Placer::new(session);
    let wire = columns
        .into_iter()
        .map(|(name, schema, cells)| WireColumn {
            cells: cells.iter().map(|c| placer.place(c)).collect(),
            name,
            schema,
        })
        .collect();
    placer.finish(wire)
}

/// Places the cells of one reply one at a time, in any order (see [`outgoing_cells`]).
pub struct Placer<'s> {
    session: &'s Session,
    answer: ReplyBody,
    /// Where the next inline cell may start in the reply's payload.
    cursor: u64,
    /// Where each chunk is: the segment it lies in and its offset there, or nowhere the client
    /// can map (sent inline). The cells of one put share a chunk and mostly come one after
    /// another, so the last chunk's place is kept at hand and the map is asked once per chunk.
    chunks: HashMap<*const Chunk, Option<SharedCell>>,
    last: Option<(*const Chunk, Option<SharedCell>)>,
    pinned: Vec<Arc<Chunk>>,
    segments: Vec<Arc<Segment>>,
    introduced: usize,
}

impl<'s> Placer<'s> {
    pub fn new(session: &'s Session) -> Self {
        Self {
            session,
            answer: ReplyBody::default(),
            cursor: 0,
            chunks: HashMap::new(),
            last: None,
            pinned: Vec::new(),
            segments: Vec::new(),
            introduced: 0,
        }
    }

    /// Where `cell` goes: its place in shared memory, or the reply's payload.
    pub fn place(&mut self, cell: &Cell) -> WireCell {
        let (len, first_dim) = (cell.len as u64, cell.first_dim);
        let shared = match &self.session.shm {
            Some(shm) if len > 0 => self.chunk_place(shm, &cell.chunk),
            _ => None,
        };
        let place = if let Some(chunk_at) = shared {
            let offset = chunk_at.offset + cell.offset as u64;
            CellPlace::Shared(SharedCell { segment: chunk_at.segment, offset })
        } else {
            let at = align_payload(self.cursor);
            if at > self.cursor {
                self.answer.payload.push(Part::Zeros((at - self.cursor) as usize));
            }
            self.cursor = at + len;
            self.answer.payload.push(Part::Cell(cell.clone()));
            CellPlace::Inline(at)
        };
        WireCell { place, len, first_dim }
    }

    /// Where `chunk` starts in a segment the client can map by this reply; `None` if nowhere.
    fn chunk_place(&mut self, shm: &ShmSession, chunk: &Arc<Chunk>) -> Option<SharedCell> {
        let key = Arc::as_ptr(chunk);
        if let Some((at, place)) = self.last
            && at == key
        {
            return place;
        }
        let place = *self.chunks.entry(key).or_insert_with(|| {
            let (segment, offset) = shm.pool.locate(chunk.as_bytes().as_ptr())?;
            let new = !shm.knows(segment.id());
            if new && self.introduced >= MAX_FDS {
                return None;
            }
            self.introduced += usize::from(new);
            self.pinned.push(Arc::clone(chunk));
            let id = segment.id();
            self.segments.push(segment);
            Some(SharedCell { segment: id, offset: offset as u64 })
        });
        self.last = Some((key, place));
        place
    }

    /// The reply's columns with what the client needs to view them: the segments it has not
    /// mapped, and a pin on the chunks its shared cells lie in.
    pub fn finish(self, columns: Vec<WireColumn>) -> Outgoing {
        let Self { session, mut answer, pinned, mut segments, .. } = self;
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
        Outgoing { columns, pin, segments, answer }
    }
}
