//! Every call that can wait goes through here: it releases the GIL so other Python threads run,
//! and wakes regularly to check for signals so Ctrl-C interrupts a blocked claim or put.

use std::time::{Duration, Instant};

use asyncflow_core::{StoreError, Wait};
use pyo3::prelude::*;

use crate::errors::to_py;

/// Turns a Python timeout in seconds (`None`: for ever) into a deadline.
pub fn deadline(timeout: Option<f64>) -> PyResult<Option<Instant>> {
    match timeout {
        None => Ok(None),
        Some(t) if t.is_finite() && t >= 0.0 => {
            Ok(Some(Instant::now() + Duration::from_secs_f64(t)))
        }
        Some(t) => Err(to_py(StoreError::bad_request(format!(
            "timeout must be a non-negative number of seconds or None, not {t}"
        )))),
    }
}

/// Runs `f` without the GIL, giving it a `Wait` that ends at `deadline` or when a signal handler
/// raises; the handler's exception (e.g. `KeyboardInterrupt`) is what the caller sees then.
pub fn detached<T: Send>(
    py: Python<'_>,
    deadline: Option<Instant>,
    f: impl FnOnce(Wait<'_>) -> Result<T, StoreError> + Send,
) -> PyResult<T> {
    let raised: std::sync::Mutex<Option<PyErr>> = std::sync::Mutex::new(None);
    let interrupted = || {
        Python::attach(|py| match py.check_signals() {
            Ok(()) => false,
            Err(e) => {
                *raised.lock().expect("signal slot poisoned") = Some(e);
                true
            }
        })
    };
    let result = py.detach(|| f(Wait { deadline, interrupted: &interrupted }));
    match result {
        Ok(v) => Ok(v),
        Err(StoreError::Interrupted) => Err(raised
            .into_inner()
            .ok()
            .flatten()
            .unwrap_or_else(|| to_py(StoreError::Interrupted))),
        Err(e) => Err(to_py(e)),
    }
}
