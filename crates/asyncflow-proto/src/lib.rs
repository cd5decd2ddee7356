//! The store's wire protocol as a pure codec: bytes in, messages out, and back. No sockets, no
//! async, no clock — so every rule about what a peer may send can be tested and fuzzed on plain
//! byte slices, and every transport (TCP, Unix socket with shared memory) shares one definition.
//!
//! A frame is a fixed [`FrameHeader`] (magic, version, operation, request id, two lengths), then
//! a metadata section (the message, encoded by [`Request`] / [`Reply`]), then a payload section
//! of raw cell bytes that the metadata points into. Payloads are bytes plus dtype and shape,
//! never serialised objects. The daemon's write-ahead log uses the same primitives for its
//! records (`record.rs`).

pub mod claim;
pub mod error;
pub mod frame;
pub mod hello;
pub mod record;
pub mod reply;
pub mod request;
pub mod untrusted;
pub mod wire;

pub use error::ProtoError;
pub use frame::{
    FrameHeader, HEADER_LEN, Limits, MAGIC, Op, PAYLOAD_ALIGN, RawFrame, VERSION, align_payload,
    decode_frame,
};
pub use hello::{Hello, Role, ServerHello};
pub use record::{CellLoc, ChunkRef, FileId, Record, Stored, decode_record, is_whole_record};
pub use reply::{
    CellPlace, Failure, Reply, Segments, SharedCell, Spare, WireCell, WireClaimed, WireColumn,
    decode_answer,
};
pub use request::{CellMeta, ColumnMeta, PayloadSource, PutRequest, Request, StoreCells};
