//! The simulator's one error type.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum SimError {
    #[error("cost model parameter {0:?} is missing")]
    Missing(String),
    #[error("{0}")]
    Invalid(String),
    #[error("unknown mode {0:?}; use colocated-sync, separated-sync, streaming or async-<k>")]
    UnknownMode(String),
    #[error("the store index refused a simulated request: {0}")]
    Store(#[from] asyncflow_core::StoreError),
    #[error("the simulation stalled at {time:.1} s (virtual): {reason}")]
    Stalled { time: f64, reason: String },
}

pub type Result<T> = std::result::Result<T, SimError>;
