//! Why shared memory could not be set up.

#[derive(Debug, thiserror::Error)]
pub enum ShmError {
    #[error("cannot create a shared-memory segment of {len} bytes: {source}")]
    Create { len: usize, source: std::io::Error },

    #[error("cannot map a shared-memory segment of {len} bytes: {source}")]
    Map { len: usize, source: std::io::Error },

    #[error("segment descriptor holds {actual} bytes, {expected} were announced")]
    SizeMismatch { expected: usize, actual: u64 },

    #[error("{0}")]
    Ring(String),
}
