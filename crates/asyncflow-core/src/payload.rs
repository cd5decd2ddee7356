//! Payload memory. A put copies each field's cells once into a chunk (one 64-byte-aligned
//! allocation, or a region some other crate provides, such as shared memory); cells are
//! reference-counted slices of chunks, so readers get views rather than copies and a chunk lives
//! exactly as long as someone can still see it.

use std::alloc::{self, Layout};
use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use crate::memory::MemoryGuard;

/// Alignment of chunks and of cells inside them: a cache line, which satisfies every dtype.
pub const CELL_ALIGN: usize = 64;

/// Bytes a chunk can be backed by.
pub trait ByteStorage: Send + Sync + 'static {
    fn as_bytes(&self) -> &[u8];
}

/// A heap allocation whose first byte is aligned to [`CELL_ALIGN`].
///
/// It asks the system allocator for `len + CELL_ALIGN` bytes at the allocator's natural
/// alignment and starts at the first aligned byte inside: glibc serves natural-alignment
/// requests from memory it recycles, whereas over-aligned requests of many megabytes get fresh
/// (page-faulting, kernel-zeroed) mappings every time, which halves put throughput.
pub struct AlignedBytes {
    raw: NonNull<u8>,
    offset: usize,
    len: usize,
}

// SAFETY: AlignedBytes owns its allocation exclusively; shared access is read-only.
unsafe impl Send for AlignedBytes {}
// SAFETY: as above; no interior mutability is exposed through `&self`.
unsafe impl Sync for AlignedBytes {}

impl AlignedBytes {
    fn layout(len: usize) -> Layout {
        Layout::from_size_align(len + CELL_ALIGN, 16).expect("chunk size overflows a Layout")
    }

    fn allocate(len: usize, zeroed: bool) -> Self {
        let layout = Self::layout(len);
        // SAFETY: the layout has non-zero size.
        let raw =
            unsafe { if zeroed { alloc::alloc_zeroed(layout) } else { alloc::alloc(layout) } };
        let raw = NonNull::new(raw).unwrap_or_else(|| alloc::handle_alloc_error(layout));
        let offset = raw.as_ptr().align_offset(CELL_ALIGN);
        debug_assert!(offset < CELL_ALIGN);
        Self { raw, offset, len }
    }

    fn start(&self) -> *mut u8 {
        // SAFETY: `offset < CELL_ALIGN`, inside the allocation of `len + CELL_ALIGN` bytes.
        unsafe { self.raw.as_ptr().add(self.offset) }
    }

    /// Allocates `len` zeroed bytes.
    pub fn zeroed(len: usize) -> Self {
        Self::allocate(len, true)
    }

    /// Allocates `len` bytes and lets `fill` initialise every one of them.
    ///
    /// # Safety
    /// `fill` must write all `len` bytes behind the pointer it is given before returning.
    pub unsafe fn filled_by(len: usize, fill: impl FnOnce(*mut u8)) -> Self {
        let bytes = Self::allocate(len, false);
        fill(bytes.start());
        bytes
    }
}

impl Drop for AlignedBytes {
    fn drop(&mut self) {
        // SAFETY: allocated in `allocate` with this same layout.
        unsafe { alloc::dealloc(self.raw.as_ptr(), Self::layout(self.len)) }
    }
}

impl ByteStorage for AlignedBytes {
    fn as_bytes(&self) -> &[u8] {
        // SAFETY: the `len` bytes from `start` were initialised at construction and live as long
        // as self.
        unsafe { std::slice::from_raw_parts(self.start(), self.len) }
    }
}

/// One allocation holding the cells of one field from one put.
pub struct Chunk {
    storage: Box<dyn ByteStorage>,
    /// Returns the chunk's bytes to the memory budget when the chunk is dropped.
    _accounting: Option<MemoryGuard>,
}

impl Chunk {
    pub fn new(storage: Box<dyn ByteStorage>, accounting: Option<MemoryGuard>) -> Arc<Self> {
        Arc::new(Self { storage, _accounting: accounting })
    }

    pub fn as_bytes(&self) -> &[u8] {
        self.storage.as_bytes()
    }

    pub fn len(&self) -> usize {
        self.as_bytes().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl fmt::Debug for Chunk {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Chunk").field("len", &self.len()).finish_non_exhaustive()
    }
}

/// Where each cell sits inside a chunk that packs several of them.
#[derive(Debug, Clone, Default)]
pub struct ChunkLayout {
    /// `(offset, len)` of each cell, in order.
    pub spans: Vec<(usize, usize)>,
    pub total: usize,
}

impl ChunkLayout {
    /// Packs cells of the given byte lengths, each starting on a [`CELL_ALIGN`] boundary.
    pub fn packed(lens: impl IntoIterator<Item = usize>) -> Self {
        let mut spans = Vec::new();
        let mut at = 0usize;
        for len in lens {
            at = at.next_multiple_of(CELL_ALIGN);
            spans.push((at, len));
            at += len;
        }
        Self { spans, total: at }
    }

    /// Cells laid end to end with no padding (rows of one contiguous array).
    pub fn contiguous(lens: impl IntoIterator<Item = usize>) -> Self {
        let mut spans = Vec::new();
        let mut at = 0usize;
        for len in lens {
            spans.push((at, len));
            at += len;
        }
        Self { spans, total: at }
    }
}

/// A view of one cell: a slice of a shared chunk plus the cell's first dimension.
#[derive(Clone)]
pub struct Cell {
    pub chunk: Arc<Chunk>,
    pub offset: usize,
    pub len: usize,
    /// First dimension of the cell (1 for scalars).
    pub first_dim: u64,
}

impl Cell {
    pub fn bytes(&self) -> &[u8] {
        &self.chunk.as_bytes()[self.offset..self.offset + self.len]
    }
}

impl fmt::Debug for Cell {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Cell")
            .field("offset", &self.offset)
            .field("len", &self.len)
            .field("first_dim", &self.first_dim)
            .finish_non_exhaustive()
    }
}

/// Copies `sources` into one fresh chunk laid out by `layout` (padding zeroed), returning the
/// chunk. This is the single copy a put makes.
pub fn copy_into_chunk(
    layout: &ChunkLayout,
    sources: &[&[u8]],
    accounting: Option<MemoryGuard>,
) -> Arc<Chunk> {
    assert_eq!(layout.spans.len(), sources.len(), "one source per cell");
    let fill = |base: *mut u8| {
        let mut at = 0usize;
        for (&(offset, len), src) in layout.spans.iter().zip(sources) {
            assert_eq!(len, src.len(), "source length differs from its span");
            // SAFETY: spans are ordered, non-overlapping and inside `layout.total` bytes;
            // `base` points at an allocation of that size.
            unsafe {
                std::ptr::write_bytes(base.add(at), 0, offset - at);
                std::ptr::copy_nonoverlapping(src.as_ptr(), base.add(offset), len);
            }
            at = offset + len;
        }
    };
    // SAFETY: `fill` writes every byte: each gap is zeroed and each span copied, in order, up to
    // `layout.total`, which is where the last span ends.
    let storage = unsafe { AlignedBytes::filled_by(layout.total, fill) };
    Chunk::new(Box::new(storage), accounting)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packed_layout_aligns_every_cell() {
        let layout = ChunkLayout::packed([3, 100, 0, 1]);
        let offsets: Vec<usize> = layout.spans.iter().map(|s| s.0).collect();
        assert_eq!(offsets, vec![0, 64, 192, 192]);
        assert!(offsets.iter().all(|o| o % CELL_ALIGN == 0));
        assert_eq!(layout.total, 193);
    }

    #[test]
    fn copy_into_chunk_places_each_source_at_its_span() {
        let layout = ChunkLayout::packed([2, 3]);
        let chunk = copy_into_chunk(&layout, &[&[1, 2], &[3, 4, 5]], None);
        assert_eq!(&chunk.as_bytes()[0..2], &[1, 2]);
        assert!(chunk.as_bytes()[2..64].iter().all(|&b| b == 0));
        assert_eq!(&chunk.as_bytes()[64..67], &[3, 4, 5]);
        assert_eq!(chunk.as_bytes().as_ptr() as usize % CELL_ALIGN, 0);
    }
}
