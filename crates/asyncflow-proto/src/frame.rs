//! The frame envelope: a fixed 24-byte header that says what follows and how long it is, checked
//! against the receiver's limits before a single byte of the body is read or allocated.
//!
//! ```text
//! 0      2        3    4        8            16         20            24
//! | "AF" | version | op | flags | request id | meta len | payload len |  meta ... | payload ... |
//! ```

use crate::error::ProtoError;

pub const MAGIC: [u8; 2] = *b"AF";
pub const VERSION: u8 = 3;
pub const HEADER_LEN: usize = 24;

/// Payload cells sit at offsets that are multiples of this inside a frame's payload section, so
/// a receiver that reads the section into an aligned buffer can view every cell in place.
pub const PAYLOAD_ALIGN: u64 = 64;

macro_rules! ops {
    ($($name:ident = $code:literal),* $(,)?) => {
        /// What a frame carries. Requests go to the daemon; `Reply` and `Failure` come back with
        /// the request's id.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[repr(u8)]
        pub enum Op { $($name = $code),* }

        impl Op {
            pub fn from_code(code: u8) -> Result<Self, ProtoError> {
                match code {
                    $($code => Ok(Op::$name),)*
                    other => Err(ProtoError::UnknownOp(other)),
                }
            }
        }
    };
}

ops! {
    Hello = 1,
    RegisterTask = 2,
    Put = 3,
    Claim = 4,
    Ack = 5,
    Release = 6,
    Renew = 7,
    Read = 8,
    Rows = 9,
    Clear = 10,
    Delete = 11,
    Schema = 12,
    Stats = 13,
    Stage = 14,
    Unpin = 15,
    Cancel = 16,
    Commit = 17,
    Locate = 18,
    StoreCells = 19,
    FetchCells = 20,
    DropRows = 21,
    ReadyFields = 22,
    Ping = 23,
    Reply = 128,
    Failure = 129,
}

impl Op {
    /// Requests that get no reply (notices).
    pub fn is_notice(self) -> bool {
        matches!(self, Op::Unpin | Op::Cancel | Op::DropRows)
    }
}

/// How much a receiver accepts in one frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub max_meta: u32,
    pub max_payload: u32,
}

impl Limits {
    /// The daemon's default: 64 MiB of metadata (about 8 M row indexes), 1 GiB of payload.
    pub const DEFAULT: Limits = Limits { max_meta: 64 << 20, max_payload: 1 << 30 };
}

impl Default for Limits {
    fn default() -> Self {
        Self::DEFAULT
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    pub op: Op,
    pub request_id: u64,
    pub meta_len: u32,
    pub payload_len: u32,
}

impl FrameHeader {
    pub fn new(op: Op, request_id: u64, meta_len: usize, payload_len: usize) -> Self {
        Self {
            op,
            request_id,
            meta_len: u32::try_from(meta_len).expect("metadata over 4 GiB"),
            payload_len: u32::try_from(payload_len).expect("payload over 4 GiB"),
        }
    }

    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut out = [0u8; HEADER_LEN];
        out[0..2].copy_from_slice(&MAGIC);
        out[2] = VERSION;
        out[3] = self.op as u8;
        out[8..16].copy_from_slice(&self.request_id.to_le_bytes());
        out[16..20].copy_from_slice(&self.meta_len.to_le_bytes());
        out[20..24].copy_from_slice(&self.payload_len.to_le_bytes());
        out
    }

    /// Checks magic, version, operation and both lengths; the body has not been read yet.
    pub fn decode(bytes: &[u8; HEADER_LEN], limits: Limits) -> Result<Self, ProtoError> {
        let word = |r: std::ops::Range<usize>| u32::from_le_bytes(bytes[r].try_into().expect("4"));
        if bytes[0..2] != MAGIC {
            return Err(ProtoError::BadMagic([bytes[0], bytes[1]]));
        }
        if bytes[2] != VERSION {
            return Err(ProtoError::UnsupportedVersion(bytes[2]));
        }
        let op = Op::from_code(bytes[3])?;
        if word(4..8) != 0 {
            return Err(ProtoError::malformed("reserved flags are set"));
        }
        let request_id = u64::from_le_bytes(bytes[8..16].try_into().expect("8"));
        let (meta_len, payload_len) = (word(16..20), word(20..24));
        if meta_len > limits.max_meta {
            return Err(ProtoError::TooLarge {
                what: "metadata",
                len: meta_len.into(),
                max: limits.max_meta.into(),
            });
        }
        if payload_len > limits.max_payload {
            return Err(ProtoError::TooLarge {
                what: "payload",
                len: payload_len.into(),
                max: limits.max_payload.into(),
            });
        }
        Ok(Self { op, request_id, meta_len, payload_len })
    }

    pub fn body_len(&self) -> usize {
        self.meta_len as usize + self.payload_len as usize
    }
}

/// A whole frame found at the start of a buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawFrame<'a> {
    pub header: FrameHeader,
    pub meta: &'a [u8],
    pub payload: &'a [u8],
}

/// Finds the first frame in `buf`: `Ok(None)` if more bytes are needed, otherwise the frame and
/// the number of bytes it took. The header is validated before the body length is trusted.
pub fn decode_frame(
    buf: &[u8],
    limits: Limits,
) -> Result<Option<(RawFrame<'_>, usize)>, ProtoError> {
    let Some(head) = buf.first_chunk::<HEADER_LEN>() else {
        return Ok(None);
    };
    let header = FrameHeader::decode(head, limits)?;
    let end = HEADER_LEN + header.body_len();
    if buf.len() < end {
        return Ok(None);
    }
    let meta_end = HEADER_LEN + header.meta_len as usize;
    let frame = RawFrame { header, meta: &buf[HEADER_LEN..meta_end], payload: &buf[meta_end..end] };
    Ok(Some((frame, end)))
}

/// Rounds a payload offset up to the next cell boundary.
pub fn align_payload(offset: u64) -> u64 {
    offset.next_multiple_of(PAYLOAD_ALIGN)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(meta: u32, payload: u32) -> [u8; HEADER_LEN] {
        FrameHeader { op: Op::Stats, request_id: 7, meta_len: meta, payload_len: payload }.encode()
    }

    #[test]
    fn a_header_round_trips() {
        let h = FrameHeader { op: Op::Put, request_id: 42, meta_len: 10, payload_len: 99 };
        assert_eq!(FrameHeader::decode(&h.encode(), Limits::DEFAULT).unwrap(), h);
    }

    #[test]
    fn oversized_lengths_are_refused_from_the_header_alone() {
        let limits = Limits { max_meta: 100, max_payload: 1000 };
        let err = FrameHeader::decode(&header(101, 0), limits).unwrap_err();
        assert!(matches!(err, ProtoError::TooLarge { what: "metadata", .. }));
        let err = FrameHeader::decode(&header(0, u32::MAX), limits).unwrap_err();
        assert!(matches!(err, ProtoError::TooLarge { what: "payload", .. }));
    }

    #[test]
    fn wrong_magic_version_and_op_are_errors() {
        let mut h = header(0, 0);
        h[0] = b'X';
        assert!(matches!(FrameHeader::decode(&h, Limits::DEFAULT), Err(ProtoError::BadMagic(_))));
        let mut h = header(0, 0);
        h[2] = 9;
        assert_eq!(
            FrameHeader::decode(&h, Limits::DEFAULT),
            Err(ProtoError::UnsupportedVersion(9))
        );
        let mut h = header(0, 0);
        h[3] = 77;
        assert_eq!(FrameHeader::decode(&h, Limits::DEFAULT), Err(ProtoError::UnknownOp(77)));
    }

    #[test]
    fn a_partial_frame_asks_for_more_bytes() {
        let mut buf = header(3, 2).to_vec();
        assert_eq!(decode_frame(&buf[..10], Limits::DEFAULT), Ok(None));
        buf.extend_from_slice(&[1, 2, 3, 4]);
        assert_eq!(decode_frame(&buf, Limits::DEFAULT), Ok(None));
        buf.push(5);
        let (frame, used) = decode_frame(&buf, Limits::DEFAULT).unwrap().unwrap();
        assert_eq!((frame.meta, frame.payload, used), (&[1, 2, 3][..], &[4, 5][..], 29));
    }
}
