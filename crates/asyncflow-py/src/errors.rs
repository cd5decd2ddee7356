//! The one place where Rust errors become Python exceptions, variant by variant. The exception
//! classes live in `asyncflow/errors.py` so they can also derive from the matching builtins
//! (`TimeoutError`, `ValueError`, `LookupError`, `ConnectionError`).

use asyncflow_core::StoreError;
use asyncflow_server::Error as ClientError;
use asyncflow_sim::SimError;
use pyo3::PyErr;
use pyo3::exceptions::{PyKeyboardInterrupt, PyRuntimeError};

pyo3::import_exception!(asyncflow.errors, StoreTimeoutError);
pyo3::import_exception!(asyncflow.errors, MemoryLimitError);
pyo3::import_exception!(asyncflow.errors, SchemaError);
pyo3::import_exception!(asyncflow.errors, UnknownFieldError);
pyo3::import_exception!(asyncflow.errors, UnknownIndexError);
pyo3::import_exception!(asyncflow.errors, UnknownTaskError);
pyo3::import_exception!(asyncflow.errors, LeaseError);
pyo3::import_exception!(asyncflow.errors, BadRequestError);
pyo3::import_exception!(asyncflow.errors, ConnectionError);
pyo3::import_exception!(asyncflow.errors, AuthError);
pyo3::import_exception!(asyncflow.errors, PersistenceError);

pub fn to_py(err: StoreError) -> PyErr {
    let msg = err.to_string();
    match err {
        StoreError::Timeout { .. } => StoreTimeoutError::new_err(msg),
        StoreError::MemoryLimit(_) => MemoryLimitError::new_err(msg),
        StoreError::Schema(_) => SchemaError::new_err(msg),
        StoreError::UnknownField(_) => UnknownFieldError::new_err(msg),
        StoreError::UnknownIndex(_) => UnknownIndexError::new_err(msg),
        StoreError::UnknownTask(_) => UnknownTaskError::new_err(msg),
        StoreError::Lease { .. } => LeaseError::new_err(msg),
        StoreError::BadRequest(_) => BadRequestError::new_err(msg),
        StoreError::Interrupted => PyKeyboardInterrupt::new_err(msg),
        StoreError::Persistence(_) => PersistenceError::new_err(msg),
    }
}

/// Errors of a daemon connection: store errors exactly as the embedded store raises them,
/// everything about reaching the daemon as `ConnectionError` (or `AuthError`).
pub fn client_to_py(err: ClientError) -> PyErr {
    match err {
        ClientError::Store(e) => to_py(e),
        ClientError::Auth(_) => AuthError::new_err(err.to_string()),
        ClientError::Config(m) => BadRequestError::new_err(m),
        ClientError::Connection(_)
        | ClientError::Protocol(_)
        | ClientError::Shm(_)
        | ClientError::Io(_) => ConnectionError::new_err(err.to_string()),
    }
}

/// Errors of the simulator: a bad scenario is a bad request; a simulation that stalls is a bug
/// in the simulated pipeline, raised as `RuntimeError`.
pub fn sim_to_py(err: SimError) -> PyErr {
    match err {
        SimError::Store(e) => to_py(e),
        SimError::Missing(_) | SimError::Invalid(_) | SimError::UnknownMode(_) => {
            BadRequestError::new_err(err.to_string())
        }
        SimError::Stalled { .. } => PyRuntimeError::new_err(err.to_string()),
    }
}

/// An error a blocking call can end with: whether it means "interrupted", and its exception.
pub trait BlockingError: Send {
    fn is_interrupted(&self) -> bool;
    fn into_py(self) -> PyErr;
}

impl BlockingError for StoreError {
    fn is_interrupted(&self) -> bool {
        matches!(self, StoreError::Interrupted)
    }

    fn into_py(self) -> PyErr {
        to_py(self)
    }
}

impl BlockingError for ClientError {
    fn is_interrupted(&self) -> bool {
        matches!(self, ClientError::Store(StoreError::Interrupted))
    }

    fn into_py(self) -> PyErr {
        client_to_py(self)
    }
}

/// `?`-friendly conversion for results of core calls.
pub trait IntoPy<T> {
    fn py_err(self) -> pyo3::PyResult<T>;
}

impl<T, E: BlockingError> IntoPy<T> for Result<T, E> {
    fn py_err(self) -> pyo3::PyResult<T> {
        self.map_err(BlockingError::into_py)
    }
}
