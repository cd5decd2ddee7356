//! Frames on their way out. A reply's payload is a list of parts written in order, so read cells
//! go from store memory to the socket without being gathered into one buffer first; shared-memory
//! segments the client has not mapped yet travel as descriptors with the frame's first bytes.

use asyncflow_core::Cell;
use asyncflow_proto::{Failure, FrameHeader, Op, Reply};

use super::session::Descriptor;

pub enum Part {
    Zeros(usize),
    Cell(Cell),
}

impl Part {
    pub fn len(&self) -> usize {
        match self {
            Part::Zeros(n) => *n,
            Part::Cell(c) => c.len,
        }
    }
}

pub struct Outgoing {
    pub header: FrameHeader,
    pub meta: Vec<u8>,
    pub payload: Vec<Part>,
    pub fds: Vec<Descriptor>,
}

/// A reply's metadata and what travels beside it.
#[derive(Default)]
pub struct ReplyBody {
    pub payload: Vec<Part>,
    pub fds: Vec<Descriptor>,
}

impl Outgoing {
    pub fn reply(request_id: u64, reply: &Reply, answer: ReplyBody) -> Self {
        let meta = reply.encode();
        let payload_len: usize = answer.payload.iter().map(Part::len).sum();
        Self {
            header: FrameHeader::new(Op::Reply, request_id, meta.len(), payload_len),
            meta,
            payload: answer.payload,
            fds: answer.fds,
        }
    }

    pub fn failure(request_id: u64, failure: &Failure) -> Self {
        let meta = failure.encode();
        Self {
            header: FrameHeader::new(Op::Failure, request_id, meta.len(), 0),
            meta,
            payload: Vec::new(),
            fds: Vec::new(),
        }
    }

    pub fn bytes(&self) -> usize {
        asyncflow_proto::HEADER_LEN + self.header.body_len()
    }
}
