//! A frame's payload section kept, as received, as the storage of the cells it carries — on the
//! daemon for inline puts, on the client for inline reads — so neither side copies it again.

use std::sync::Arc;

use asyncflow_core::payload::ByteStorage;
use asyncflow_core::{Chunk, ChunkLayout, MemoryGuard, copy_into_chunk};

struct Received(Vec<u8>);

impl ByteStorage for Received {
    fn as_bytes(&self) -> &[u8] {
        &self.0
    }
}

/// Wraps `payload` in a chunk. Cells sit at offsets aligned for any dtype provided the buffer
/// itself is; the allocator gives at least 16-byte alignment, and a buffer that somehow lacks
/// 8 is copied into an aligned chunk rather than viewed misaligned.
pub fn into_chunk(payload: Vec<u8>, accounting: Option<MemoryGuard>) -> Arc<Chunk> {
    if (payload.as_ptr() as usize).is_multiple_of(8) {
        return Chunk::new(Box::new(Received(payload)), accounting);
    }
    copy_into_chunk(&ChunkLayout::contiguous([payload.len()]), &[&payload], accounting)
}
