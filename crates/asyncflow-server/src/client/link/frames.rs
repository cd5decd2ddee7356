//! Whole frames on a link's socket: one written from a request, one read with the descriptors
//! that came with it.

use std::io::Write;
use std::os::fd::OwnedFd;

use asyncflow_proto::{FrameHeader, HEADER_LEN, Limits, Request};

use super::stream::Stream;
use crate::error::Result;

pub(super) fn write_frame(
    w: &mut impl Write,
    id: u64,
    req: &Request,
    payload: &[&[u8]],
) -> std::io::Result<()> {
    let meta = req.encode();
    let payload_len: usize = payload.iter().map(|p| p.len()).sum();
    w.write_all(&FrameHeader::new(req.op(), id, meta.len(), payload_len).encode())?;
    w.write_all(&meta)?;
    for part in payload {
        w.write_all(part)?;
    }
    Ok(())
}

pub(super) struct RawFrame {
    pub(super) header: FrameHeader,
    pub(super) meta: Vec<u8>,
    pub(super) payload: Vec<u8>,
    pub(super) fds: Vec<OwnedFd>,
}

/// The first bytes of a frame, read before it was known whether one had come.
#[derive(Default)]
pub(super) struct Started {
    pub(super) head: [u8; HEADER_LEN],
    pub(super) have: usize,
    pub(super) fds: Vec<OwnedFd>,
}

pub(super) fn read_frame(
    stream: &mut Stream,
    limits: Limits,
    idle: &mut dyn FnMut() -> std::io::Result<()>,
) -> Result<RawFrame> {
    read_rest_of_frame(stream, Started::default(), limits, idle)
}

pub(super) fn read_rest_of_frame(
    stream: &mut Stream,
    started: Started,
    limits: Limits,
    idle: &mut dyn FnMut() -> std::io::Result<()>,
) -> Result<RawFrame> {
    let Started { mut head, have, mut fds } = started;
    stream.read_exact_patiently(&mut head, have, &mut fds, idle)?;
    let header = FrameHeader::decode(&head, limits)?;
    let mut meta = vec![0u8; header.meta_len as usize];
    stream.read_exact_patiently(&mut meta, 0, &mut fds, idle)?;
    let mut payload = vec![0u8; header.payload_len as usize];
    stream.read_exact_patiently(&mut payload, 0, &mut fds, idle)?;
    Ok(RawFrame { header, meta, payload, fds })
}
