//! The daemon's and the client's one error type. Store errors pass through untouched so a remote
//! call fails exactly like an embedded one; the rest are about reaching the daemon.

use asyncflow_core::StoreError;
use asyncflow_proto::{Failure, ProtoError};

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Store(#[from] StoreError),

    /// The daemon cannot be reached, the connection broke, or it is shutting down.
    #[error("connection: {0}")]
    Connection(String),

    /// The daemon refused this connection's token.
    #[error("authentication failed: {0}")]
    Auth(String),

    /// A peer sent bytes that are not the protocol.
    #[error("protocol: {0}")]
    Protocol(#[from] ProtoError),

    #[error("shared memory: {0}")]
    Shm(#[from] asyncflow_shm::ShmError),

    /// Bad flags or configuration file.
    #[error("configuration: {0}")]
    Config(String),

    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
}

impl Error {
    pub fn connection(msg: impl Into<String>) -> Self {
        Self::Connection(msg.into())
    }
}

impl From<Failure> for Error {
    fn from(f: Failure) -> Self {
        match f {
            Failure::Store(e) => Error::Store(e),
            Failure::Auth(m) => Error::Auth(m),
            Failure::Protocol(m) => Error::Protocol(ProtoError::Malformed(m)),
            Failure::Unavailable(m) => Error::Connection(m),
        }
    }
}
