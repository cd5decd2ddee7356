//! The store's one error type. Every variant maps to exactly one Python exception class, and every
//! operation that returns an error has left the store as it found it.

use std::time::Duration;

pub type Result<T, E = StoreError> = std::result::Result<T, E>;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// A blocking call ran out of time; the message says what it waited for.
    #[error("timed out after {:.3}s waiting for {what}", waited.as_secs_f64())]
    Timeout { what: String, waited: Duration },

    /// A put does not fit in the memory limit (now, or ever).
    #[error("memory limit: {0}")]
    MemoryLimit(String),

    /// Data disagrees with a field's fixed schema, or a put is internally inconsistent.
    #[error("schema mismatch: {0}")]
    Schema(String),

    #[error("unknown field {0:?}")]
    UnknownField(String),

    #[error("unknown row index {0}")]
    UnknownIndex(u64),

    #[error("unknown task {0:?}; register it with register_task first")]
    UnknownTask(String),

    /// The lease was never granted, was already acked or released, or expired.
    #[error("lease {id}: {reason}")]
    Lease { id: u64, reason: String },

    /// The request itself is malformed (bad sizes, bad options, bad names).
    #[error("bad request: {0}")]
    BadRequest(String),

    /// A blocking call was interrupted by its caller (e.g. Ctrl-C in Python).
    #[error("interrupted")]
    Interrupted,

    /// A change could not be made durable (the daemon's write-ahead log failed); the daemon
    /// refuses further changes until it is restarted.
    #[error("persistence: {0}")]
    Persistence(String),
}

impl StoreError {
    pub fn bad_request(msg: impl Into<String>) -> Self {
        Self::BadRequest(msg.into())
    }

    pub fn schema(msg: impl Into<String>) -> Self {
        Self::Schema(msg.into())
    }
}
