//! The daemon backend of `Store`: a connection that a process forked after connecting opens
//! afresh on first use, and the daemon itself (`serve`).

use std::sync::Arc;

use asyncflow_server::client::{Client, Policy, Preference};
use parking_lot::Mutex;
use pyo3::prelude::*;

use crate::blocking::{detached, without_gil};
use crate::errors::BadRequestError;

/// A connection to a store daemon (standalone, or a controller with storage daemons).
pub struct Remote {
    url: String,
    token: Option<String>,
    prefer: Preference,
    policy: Policy,
    /// The client and the process that opened it.
    client: Mutex<(u32, Arc<Client>)>,
}

impl Remote {
    /// Connects to `url` (see `Store.connect`).
    pub fn connect(
        py: Python<'_>,
        url: String,
        token: Option<String>,
        prefer: Preference,
        policy: Policy,
    ) -> PyResult<Self> {
        let client =
            detached(py, None, |_| Client::connect_with(&url, token.as_deref(), prefer, policy))?;
        let client = Mutex::new((asyncflow_server::client::process_id(), Arc::new(client)));
        Ok(Self { url, token, prefer, policy, client })
    }

    /// The connection, reopened if this process is a fork of the one that opened it. The slot's
    /// lock is never held across the reconnection: threads racing to reconnect each connect
    /// (without the GIL), and the first to finish is kept.
    pub fn client(&self, py: Python<'_>) -> PyResult<Arc<Client>> {
        let pid = asyncflow_server::client::process_id();
        {
            let slot = self.client.lock();
            if slot.0 == pid {
                return Ok(Arc::clone(&slot.1));
            }
        }
        let fresh = detached(py, None, |_| {
            Client::connect_with(&self.url, self.token.as_deref(), self.prefer, self.policy)
        })?;
        let mut slot = self.client.lock();
        if slot.0 != pid {
            *slot = (pid, Arc::new(fresh));
        }
        Ok(Arc::clone(&slot.1))
    }
}

/// The data path a `transport` name asks for.
pub fn preference(transport: &str) -> PyResult<Preference> {
    match transport {
        "auto" => Ok(Preference::Auto),
        "tcp" => Ok(Preference::Tcp),
        "shm" => Ok(Preference::Shm),
        "shm-socket" => Ok(Preference::ShmSocket),
        other => Err(BadRequestError::new_err(format!(
            "transport must be 'auto', 'tcp', 'shm' or 'shm-socket', not {other:?}"
        ))),
    }
}

/// Runs the store daemon with these command-line arguments until SIGTERM or SIGINT; returns its
/// exit code. This is the very code of the `asyncflow-store` binary; `program` is the command
/// its usage and errors name.
#[pyfunction]
#[pyo3(signature = (args, program = "asyncflow-store"))]
pub fn serve(py: Python<'_>, args: Vec<String>, program: &str) -> i32 {
    let program = program.to_owned();
    without_gil(py, move || asyncflow_server::run_as(&program, args))
}
