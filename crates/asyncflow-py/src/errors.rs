//! The one place where Rust errors become Python exceptions, variant by variant. The exception
//! classes live in `asyncflow/errors.py` so they can also derive from the matching builtins
//! (`TimeoutError`, `ValueError`, `LookupError`).

use asyncflow_core::StoreError;
use pyo3::PyErr;
use pyo3::exceptions::PyKeyboardInterrupt;

pyo3::import_exception!(asyncflow.errors, StoreTimeoutError);
pyo3::import_exception!(asyncflow.errors, MemoryLimitError);
pyo3::import_exception!(asyncflow.errors, SchemaError);
pyo3::import_exception!(asyncflow.errors, UnknownFieldError);
pyo3::import_exception!(asyncflow.errors, UnknownIndexError);
pyo3::import_exception!(asyncflow.errors, UnknownTaskError);
pyo3::import_exception!(asyncflow.errors, LeaseError);
pyo3::import_exception!(asyncflow.errors, BadRequestError);

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
    }
}

/// `?`-friendly conversion for results of core calls.
pub trait IntoPy<T> {
    fn py_err(self) -> pyo3::PyResult<T>;
}

impl<T> IntoPy<T> for Result<T, StoreError> {
    fn py_err(self) -> pyo3::PyResult<T> {
        self.map_err(to_py)
    }
}
