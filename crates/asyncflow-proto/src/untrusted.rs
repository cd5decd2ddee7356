//! Everything a peer's bytes can reach in this crate, in one call: the fuzz target and the
//! corpus replay test both run it, so "no input panics" is checked on exactly this surface.

use crate::frame::{Limits, Op, decode_frame};
use crate::record::{Record, decode_record};
use crate::reply::{Failure, Reply, decode_answer};
use crate::request::Request;

/// Decodes `data` every way a daemon or client might: as a stream of frames (each body as a
/// request and as an answer), as the metadata of every operation, and as a write-ahead log (a
/// daemon reads its data directory back after a crash). Returns how many frames were found;
/// errors are expected and ignored, panics are bugs.
pub fn decode_everything(data: &[u8]) -> usize {
    let limits = Limits { max_meta: 1 << 20, max_payload: 1 << 20 };
    let mut rest = data;
    let mut frames = 0;
    while let Ok(Some((frame, used))) = decode_frame(rest, limits) {
        let payload = frame.payload.len() as u64;
        let _ = Request::decode(frame.header.op, frame.meta, payload);
        let _ = decode_answer(frame.header.op, frame.meta, payload);
        rest = &rest[used..];
        frames += 1;
    }
    for code in 0..=u8::MAX {
        if let Ok(op) = Op::from_code(code) {
            let _ = Request::decode(op, data, 0);
            let _ = Request::decode(op, data, u64::MAX);
        }
    }
    let _ = Reply::decode(data, 0);
    let _ = Reply::decode(data, u64::MAX);
    let _ = Failure::decode(data);
    let mut log = data;
    while let Ok(Some((_, used))) = decode_record(log) {
        log = &log[used..];
    }
    let _ = Record::decode_body(data);
    frames
}
