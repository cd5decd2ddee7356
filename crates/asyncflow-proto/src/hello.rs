//! The greeting that opens every connection: the client's [`Hello`] and the daemon's
//! [`ServerHello`], which says what the daemon is ([`Role`]) and where its shared memory is.
//! Their encoding is with the other requests and replies.

use crate::error::ProtoError;

/// What a daemon is: the whole store, or one half of a sharded deployment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Role {
    /// Metadata and payloads in one process.
    Standalone = 0,
    /// Metadata, readiness and leases; payloads live on storage daemons.
    Controller = 1,
    /// Payloads only, addressed by the controller's row indexes and field ids.
    Storage = 2,
}

impl Role {
    pub fn from_code(code: u8) -> Result<Self, ProtoError> {
        match code {
            0 => Ok(Role::Standalone),
            1 => Ok(Role::Controller),
            2 => Ok(Role::Storage),
            c => Err(ProtoError::malformed(format!("unknown role {c}"))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Role::Standalone => "standalone",
            Role::Controller => "controller",
            Role::Storage => "storage",
        }
    }
}

/// The first frame on every connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    pub token: Option<String>,
    /// Identifies the client's machine; equal to the daemon's, shared memory is possible.
    pub host: String,
    /// Leases the client still holds from an earlier connection that broke: the daemon keeps
    /// them for this connection instead of giving them back once its reconnect grace is over.
    /// Left out of the frame when empty (and `ring` is 0).
    pub leases: Vec<u64>,
    /// On the daemon's Unix socket: the capacity of each ring the client asks its requests and
    /// replies to travel in (see `asyncflow_shm::ring`); 0 for none. Left out when 0 (and
    /// `probe` is false).
    pub ring: u64,
    /// Only looking: the daemon answers and closes the connection, which takes no place under
    /// `--max-connections` (a client learning over TCP where the daemon's Unix socket is, before
    /// it connects there). Left out when false.
    pub probe: bool,
}

/// The daemon's answer to a [`Hello`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerHello {
    pub version: String,
    pub role: Role,
    /// The daemon's machine (see [`Hello::host`]).
    pub host: String,
    /// A Unix socket on the daemon's machine that offers the shared-memory data path.
    pub shm_socket: Option<String>,
    /// For a controller: its storage daemons, in shard order (row `i` lives on `i % len`).
    pub storage: Vec<String>,
    /// Drawn at random when the daemon starts: a client that reaches it over TCP and over its
    /// Unix socket checks that both are the same daemon. 0 from a daemon that sends none.
    pub instance: u64,
    /// The capacity of each ring the daemon set up for this connection (its descriptors come
    /// with this reply); 0 for none: requests and replies stay on the socket.
    pub ring: u64,
}
