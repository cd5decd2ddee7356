//! Why a frame could not be decoded. Every malformed input ends here, never in a panic.

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtoError {
    #[error("frame truncated: needed {needed} more bytes")]
    Truncated { needed: usize },

    #[error("not an AsyncFlow frame (bad magic {0:02x?})")]
    BadMagic([u8; 2]),

    #[error("unsupported protocol version {0} (this side speaks {version})", version = crate::VERSION)]
    UnsupportedVersion(u8),

    #[error("unknown operation code {0}")]
    UnknownOp(u8),

    #[error("{what} of {len} bytes exceeds the limit of {max}")]
    TooLarge { what: &'static str, len: u64, max: u64 },

    /// The bytes are complete but do not form a valid message.
    #[error("malformed frame: {0}")]
    Malformed(String),
}

impl ProtoError {
    pub fn malformed(msg: impl Into<String>) -> Self {
        Self::Malformed(msg.into())
    }
}
