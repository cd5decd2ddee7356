//! Shared memory between a daemon and the clients on its machine: payload bytes live in memfd
//! segments (mode 0600, never linked into a file system, gone when the last process unmaps
//! them) that both sides map, so only metadata crosses the socket. The daemon owns the segments
//! and recycles them through a pool; descriptors travel as `SCM_RIGHTS` on a Unix socket.

pub mod error;
pub mod fd_passing;
pub mod pool;
pub mod ring;
pub mod segment;
pub mod view;

pub use error::ShmError;
pub use fd_passing::{MAX_FDS, recv_with_fds, send_with_fds};
pub use pool::{MIN_SEGMENT, Region, SegmentPool, size_class};
pub use ring::{CHANNEL_FDS, ClientEnds, Consumer, DaemonEnds, Producer, Watcher};
pub use segment::Segment;
pub use view::SegmentView;
