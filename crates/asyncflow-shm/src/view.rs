//! A client's view of a daemon segment as chunk storage: cells read over shared memory are
//! slices of the mapped segment, and the view holds whatever keeps the daemon from reusing the
//! bytes (a pin that is released when the last view is dropped).

use std::any::Any;
use std::sync::Arc;

use asyncflow_core::payload::ByteStorage;

use crate::segment::Segment;

pub struct SegmentView {
    segment: Arc<Segment>,
    _keep: Box<dyn Any + Send + Sync>,
}

impl SegmentView {
    pub fn new(segment: Arc<Segment>, keep: Box<dyn Any + Send + Sync>) -> Self {
        Self { segment, _keep: keep }
    }
}

impl ByteStorage for SegmentView {
    fn as_bytes(&self) -> &[u8] {
        self.segment.bytes()
    }
}
