//! Every call that can wait goes through here: it releases the GIL so other Python threads run,
//! and wakes regularly to check for signals so Ctrl-C interrupts a blocked claim or put. This is
//! the one module allowed to release or take the GIL (`clippy.toml` forbids it elsewhere): any
//! call that takes a store lock or does I/O runs through `detached`, long computations through
//! `without_gil`.

use std::cell::Cell;
use std::time::{Duration, Instant};

use asyncflow_core::{StoreError, Wait};
use pyo3::prelude::*;

use crate::errors::{BlockingError, to_py};

/// Turns a Python timeout in seconds (`None`: for ever) into a duration.
pub fn timeout(timeout: Option<f64>) -> PyResult<Option<Duration>> {
    wait_seconds(timeout, "timeout")
}

/// Turns the seconds of a wait named `what` (`None` kept) into a duration.
pub fn wait_seconds(seconds: Option<f64>, what: &str) -> PyResult<Option<Duration>> {
    match seconds {
        None => Ok(None),
        Some(t) if (0.0..=crate::convert::MAX_SECONDS).contains(&t) => {
            Ok(Some(Duration::try_from_secs_f64(t).unwrap_or(Duration::ZERO)))
        }
        Some(t) => Err(to_py(StoreError::bad_request(format!(
            "{what} must be a number of seconds from 0 to {} or None, not {t}",
            crate::convert::MAX_SECONDS
        )))),
    }
}

/// The deadline `timeout` from now (`None`: for ever).
pub fn deadline(timeout: Option<Duration>) -> Option<Instant> {
    timeout.map(|t| Instant::now() + t)
}

thread_local! {
    /// Whether this thread is Python's main thread, the only one its signal handlers run in;
    /// learnt at the thread's first blocking call, as `threading.main_thread()` says (before
    /// Python 3.13: the thread that imported `threading` first). A child forked from another
    /// thread keeps what its parent thread learnt, though Python makes that thread the child's
    /// main thread: its blocking calls there run no signal handler until they return.
    static MAIN_THREAD: Cell<Option<bool>> = const { Cell::new(None) };
}

/// Whether signal handlers can run in this thread: only Python's main thread runs them
/// (elsewhere `check_signals` never raises), so a wait in any other thread need not take the GIL
/// back to ask. An exception raised while finding out (a handler's, run meanwhile) is the
/// caller's.
fn runs_signal_handlers(py: Python<'_>) -> PyResult<bool> {
    if let Some(main) = MAIN_THREAD.get() {
        return Ok(main);
    }
    let threading = py.import("threading")?;
    let here = threading.call_method0("get_ident")?;
    let main = here.eq(threading.call_method0("main_thread")?.getattr("ident")?)?;
    MAIN_THREAD.set(Some(main));
    Ok(main)
}

/// Runs `f` without the GIL, giving it a `Wait` that ends at `deadline` or when a signal handler
/// raises; the handler's exception (e.g. `KeyboardInterrupt`) is what the caller sees then. Only
/// in Python's main thread does the wait take the GIL back now and then to run the handlers: in
/// another thread they never run, so its wait sleeps until its answer or deadline, with no
/// wake-up in between (a worker's idle claim would otherwise wake every `INTERRUPT_POLL`).
#[allow(clippy::disallowed_methods)]
pub fn detached<T: Send, E: BlockingError>(
    py: Python<'_>,
    deadline: Option<Instant>,
    f: impl FnOnce(Wait<'_>) -> Result<T, E> + Send,
) -> PyResult<T> {
    let raised: std::sync::Mutex<Option<PyErr>> = std::sync::Mutex::new(None);
    let main = runs_signal_handlers(py)?;
    let check_signals = || {
        Python::attach(|py| match py.check_signals() {
            Ok(()) => false,
            Err(e) => {
                *raised.lock().expect("signal slot poisoned") = Some(e);
                true
            }
        })
    };
    let interrupted = main.then_some(&check_signals as &(dyn Fn() -> bool + Sync));
    let result = py.detach(|| f(Wait { deadline, interrupted }));
    match result {
        Ok(v) => Ok(v),
        Err(e) if e.is_interrupted() => {
            Err(raised.into_inner().ok().flatten().unwrap_or_else(|| e.into_py()))
        }
        Err(e) => Err(e.into_py()),
    }
}

/// Runs `f`, which neither waits on a lock nor can be interrupted (a computation, or a server
/// that handles its own signals), without the GIL.
#[allow(clippy::disallowed_methods)]
pub fn without_gil<T: Send>(py: Python<'_>, f: impl FnOnce() -> T + Send) -> T {
    py.detach(f)
}
