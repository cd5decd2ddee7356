//! The shared-memory segments a process has mapped, shared by all its links to one daemon.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::{Arc, LazyLock, Weak};

use asyncflow_shm::Segment;
use parking_lot::Mutex;

use crate::error::Result;

/// The segments this process has mapped, by daemon instance and segment id. Every link to one
/// daemon uses the same mapping of a segment, so a process holds one descriptor and one mapping
/// per segment, not one per link: a process with a hundred links would otherwise run out of
/// descriptors, and the kernel drops those it cannot install in a process out of them.
static MAPPED: LazyLock<Mutex<HashMap<SegmentKey, Weak<Segment>>>> = LazyLock::new(Mutex::default);

/// A daemon's instance and one of its segments' ids.
type SegmentKey = (u64, u64);

/// The mapping of segment `id` of daemon `instance`, which came with the descriptor `fd`: the
/// process's own if it has one (then `fd` is closed), else a new one.
pub(super) fn mapped(instance: u64, id: u64, len: usize, fd: OwnedFd) -> Result<Arc<Segment>> {
    // A daemon too old to name its instance cannot be told from another one.
    if instance == 0 {
        return Ok(Arc::new(Segment::open(id, fd, len)?));
    }
    let mut all = MAPPED.lock();
    if let Some(segment) = all.get(&(instance, id)).and_then(Weak::upgrade)
        && segment.len() == len
    {
        return Ok(segment);
    }
    let segment = Arc::new(Segment::open(id, fd, len)?);
    all.retain(|_, s| s.strong_count() > 0);
    all.insert((instance, id), Arc::downgrade(&segment));
    Ok(segment)
}
