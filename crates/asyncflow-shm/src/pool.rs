//! The daemon's segments, recycled: a region is a whole segment whose size is the request
//! rounded up to a power of two, handed back to the pool when the last cell in it is dropped.
//! Steady workloads therefore reuse segments that are already mapped by their clients and
//! already backed by pages, which is what makes the shared-memory path near memcpy speed.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use asyncflow_core::payload::ByteStorage;
use parking_lot::Mutex;

use crate::error::ShmError;
use crate::segment::Segment;

/// The smallest segment the pool makes: smaller requests share its size class.
pub const MIN_SEGMENT: usize = 64 << 10;

/// The size of the segment that holds a region of `len` bytes.
pub fn size_class(len: usize) -> usize {
    len.max(MIN_SEGMENT).next_power_of_two()
}

#[derive(Debug)]
struct Free {
    by_size: BTreeMap<usize, Vec<Arc<Segment>>>,
    bytes: usize,
}

#[derive(Debug)]
struct PoolInner {
    next_id: AtomicU64,
    free: Mutex<Free>,
    /// Every live segment by the address it is mapped at, to find the segment of a cell.
    live: Mutex<BTreeMap<usize, Weak<Segment>>>,
    /// Free segments beyond this many bytes are destroyed rather than kept.
    max_cached: usize,
}

#[derive(Debug, Clone)]
pub struct SegmentPool {
    inner: Arc<PoolInner>,
}

/// `len` bytes at the start of a segment that belongs to whoever holds this value.
#[derive(Debug)]
pub struct Region {
    segment: Option<Arc<Segment>>,
    len: usize,
    pool: Weak<PoolInner>,
}

impl SegmentPool {
    pub fn new(max_cached: usize) -> Self {
        Self {
            inner: Arc::new(PoolInner {
                next_id: AtomicU64::new(1),
                free: Mutex::new(Free { by_size: BTreeMap::new(), bytes: 0 }),
                live: Mutex::new(BTreeMap::new()),
                max_cached,
            }),
        }
    }

    /// A region of `len` bytes: a recycled segment of the right size class, or a new one.
    pub fn allocate(&self, len: usize) -> Result<Region, ShmError> {
        if let Some(region) = self.reuse(len) {
            return Ok(region);
        }
        let size = size_class(len);
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        let segment = Arc::new(Segment::create(id, size)?);
        self.inner.live.lock().insert(segment.as_ptr() as usize, Arc::downgrade(&segment));
        Ok(Region { segment: Some(segment), len, pool: Arc::downgrade(&self.inner) })
    }

    /// A region of `len` bytes in a recycled segment — the one freed last, whose pages are the
    /// likeliest to be warm — if one of the right size class is free.
    pub fn reuse(&self, len: usize) -> Option<Region> {
        let size = size_class(len);
        let segment = {
            let mut free = self.inner.free.lock();
            let seg = free.by_size.get_mut(&size).and_then(Vec::pop)?;
            free.bytes -= size;
            seg
        };
        Some(Region { segment: Some(segment), len, pool: Arc::downgrade(&self.inner) })
    }

    /// The pool's segment that holds the byte at `ptr`, and the byte's offset in it.
    pub fn locate(&self, ptr: *const u8) -> Option<(Arc<Segment>, usize)> {
        let addr = ptr as usize;
        let live = self.inner.live.lock();
        let (&base, weak) = live.range(..=addr).next_back()?;
        let segment = weak.upgrade()?;
        (addr < base + segment.len()).then_some((segment, addr - base))
    }

    /// Bytes of free segments kept for reuse.
    pub fn cached_bytes(&self) -> usize {
        self.inner.free.lock().bytes
    }
}

impl Region {
    pub fn segment(&self) -> &Arc<Segment> {
        self.segment.as_ref().expect("present until drop")
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The most bytes the region can hold: its whole segment.
    pub fn capacity(&self) -> usize {
        self.segment().len()
    }

    /// Makes the region `len` bytes long; false (and unchanged) beyond its capacity.
    pub fn set_len(&mut self, len: usize) -> bool {
        let fits = len <= self.capacity();
        if fits {
            self.len = len;
        }
        fits
    }
}

impl ByteStorage for Region {
    fn as_bytes(&self) -> &[u8] {
        &self.segment().bytes()[..self.len]
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        let (Some(segment), Some(pool)) = (self.segment.take(), self.pool.upgrade()) else {
            return;
        };
        let mut free = pool.free.lock();
        if free.bytes + segment.len() <= pool.max_cached {
            free.bytes += segment.len();
            free.by_size.entry(segment.len()).or_default().push(segment);
        } else {
            pool.live.lock().remove(&(segment.as_ptr() as usize));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dropped_region_is_reused_for_the_same_size_class() {
        let pool = SegmentPool::new(1 << 30);
        let first = pool.allocate(100_000).unwrap();
        let id = first.segment().id();
        assert_eq!(first.segment().len(), 128 << 10);
        drop(first);
        assert_eq!(pool.cached_bytes(), 128 << 10);
        let again = pool.allocate(120_000).unwrap();
        assert_eq!(again.segment().id(), id);
        assert_eq!(pool.cached_bytes(), 0);
        assert!(pool.reuse(120_000).is_none(), "reuse makes no segment");
        drop(again);
        assert_eq!(pool.reuse(70_000).unwrap().segment().id(), id);
    }

    #[test]
    fn a_cell_pointer_leads_back_to_its_segment_and_offset() {
        let pool = SegmentPool::new(1 << 30);
        let region = pool.allocate(1000).unwrap();
        let inside = region.as_bytes()[100..].as_ptr();
        let (segment, offset) = pool.locate(inside).unwrap();
        assert_eq!((segment.id(), offset), (region.segment().id(), 100));
        assert!(pool.locate([0u8; 4].as_ptr()).is_none());
    }

    #[test]
    fn a_region_grows_to_its_segment_and_no_further() {
        let pool = SegmentPool::new(1 << 30);
        let mut region = pool.allocate(1000).unwrap();
        assert_eq!(region.capacity(), MIN_SEGMENT);
        assert!(region.set_len(MIN_SEGMENT));
        assert_eq!(region.as_bytes().len(), MIN_SEGMENT);
        assert!(!region.set_len(MIN_SEGMENT + 1));
        assert_eq!(region.len(), MIN_SEGMENT);
        assert!(region.set_len(10));
        assert_eq!(region.as_bytes().len(), 10);
    }

    #[test]
    fn segments_beyond_the_cache_limit_are_destroyed() {
        let pool = SegmentPool::new(MIN_SEGMENT);
        let (a, b) = (pool.allocate(10).unwrap(), pool.allocate(10).unwrap());
        drop(a);
        drop(b);
        assert_eq!(pool.cached_bytes(), MIN_SEGMENT);
    }
}
