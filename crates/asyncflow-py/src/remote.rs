//! A daemon connection as a Python class with exactly the methods of the embedded `Store`, so
//! the Python `Store` wrapper speaks to either. Every call releases the GIL and can be
//! interrupted with Ctrl-C; a process forked after connecting reconnects on first use.

use std::sync::Arc;

use asyncflow_core::Wait;
use asyncflow_server::client::{Client, Policy, Preference, PutColumn};
use numpy::{IntoPyArray, PyArray1, PyReadonlyArray1};
use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::blocking::{detached, timeout as duration};
use crate::convert::{
    ClaimResult, ClaimedCells, RowsResult, ShareArgs, claim_result, claim_spec, columns_dict,
    inspect_fields, put_target, rows_result, seconds, stats_dict,
};
use crate::errors::BadRequestError;

/// A connection to a store daemon (standalone, or a controller with storage daemons).
#[pyclass(module = "asyncflow._native", frozen)]
pub struct RemoteStore {
    url: String,
    token: Option<String>,
    prefer: Preference,
    policy: Policy,
    /// The client and the process that opened it.
    client: Mutex<(u32, Arc<Client>)>,
}

impl RemoteStore {
    /// The connection, reopened if this process is a fork of the one that opened it.
    fn client(&self, py: Python<'_>) -> PyResult<Arc<Client>> {
        let mut slot = self.client.lock();
        if slot.0 != std::process::id() {
            let fresh = detached(py, None, |_| {
                Client::connect_with(&self.url, self.token.as_deref(), self.prefer, self.policy)
            })?;
            *slot = (std::process::id(), Arc::new(fresh));
        }
        Ok(Arc::clone(&slot.1))
    }

    /// Acks or releases (`f`) a lease, or only `indexes` of it.
    fn settle(
        &self,
        py: Python<'_>,
        indexes: Option<PyReadonlyArray1<'_, u64>>,
        f: impl FnOnce(&Client, Option<&[u64]>, Wait<'_>) -> asyncflow_server::Result<()> + Send,
    ) -> PyResult<()> {
        let subset = indexes.as_ref().map(PyReadonlyArray1::as_slice).transpose()?;
        let client = self.client(py)?;
        detached(py, None, |wait| f(&client, subset, wait))
    }
}

#[pymethods]
impl RemoteStore {
    /// Connects to `url` (`tcp://HOST:PORT`). `transport`: `"auto"` (shared memory when the
    /// daemon is on this machine, else TCP), `"tcp"` or `"shm"`. `request_timeout`: seconds a
    /// request waits for its reply beyond its own timeout, and a silent daemon may go
    /// unanswered before the connection is given up; `reconnect_timeout`: seconds a broken
    /// connection is tried again before requests fail.
    #[new]
    #[pyo3(signature = (url, *, token = None, transport = "auto", request_timeout = 60.0, reconnect_timeout = 30.0))]
    fn new(
        py: Python<'_>,
        url: String,
        token: Option<String>,
        transport: &str,
        request_timeout: f64,
        reconnect_timeout: f64,
    ) -> PyResult<Self> {
        let prefer = match transport {
            "auto" => Preference::Auto,
            "tcp" => Preference::Tcp,
            "shm" => Preference::Shm,
            other => {
                return Err(BadRequestError::new_err(format!(
                    "transport must be 'auto', 'tcp' or 'shm', not {other:?}"
                )));
            }
        };
        let policy = Policy {
            request_timeout: seconds(request_timeout, "request_timeout")?,
            reconnect_timeout: seconds(reconnect_timeout, "reconnect_timeout")?,
        };
        let client =
            detached(py, None, |_| Client::connect_with(&url, token.as_deref(), prefer, policy))?;
        Ok(Self {
            url,
            token,
            prefer,
            policy,
            client: Mutex::new((std::process::id(), Arc::new(client))),
        })
    }

    #[pyo3(signature = (name, partitions = None))]
    fn register_task(
        &self,
        py: Python<'_>,
        name: &str,
        partitions: Option<Vec<String>>,
    ) -> PyResult<()> {
        let client = self.client(py)?;
        detached(py, None, |wait| client.register_task(name, partitions, wait))
    }

    #[pyo3(signature = (fields, *, partition = None, indexes = None, groups = None, group_size = None, versions = None, tags = None, timeout = None))]
    #[allow(clippy::too_many_arguments)]
    fn put<'py>(
        &self,
        py: Python<'py>,
        fields: Vec<(String, Bound<'py, PyAny>, Option<String>)>,
        partition: Option<String>,
        indexes: Option<PyReadonlyArray1<'py, u64>>,
        groups: Option<PyReadonlyArray1<'py, i64>>,
        group_size: Option<u32>,
        versions: Option<PyReadonlyArray1<'py, u64>>,
        tags: Option<Vec<Vec<(String, String)>>>,
        timeout: Option<f64>,
    ) -> PyResult<Bound<'py, PyArray1<u64>>> {
        let pending = inspect_fields(&fields)?;
        let target = put_target(partition, indexes, groups, group_size, versions, tags)?;
        let timeout = duration(timeout.or(Some(60.0)))?;
        let client = self.client(py)?;
        let rows = detached(py, None, |wait| {
            // SAFETY: `fields` (the inspected Python objects) outlives this closure.
            let columns: Vec<PutColumn<'_>> =
                pending.iter().map(|p| unsafe { p.as_put_column() }).collect();
            client.put(&columns, target, timeout, wait)
        })?;
        Ok(rows.into_pyarray(py))
    }

    #[pyo3(signature = (task, fields, batch_size, *, timeout = None, partition = None, min_version = None, whole_groups = false, allow_partial = false, step = None, replica = 0, dp_rank = 0, dp_size = 1, replica_rank = 0, replica_size = 1, balance_field = None, cost = "tokens", linear_weight = None, equal_count = false))]
    #[allow(clippy::too_many_arguments)]
    fn claim<'py>(
        &self,
        py: Python<'py>,
        task: String,
        fields: Vec<String>,
        batch_size: i64,
        timeout: Option<f64>,
        partition: Option<String>,
        min_version: Option<u64>,
        whole_groups: bool,
        allow_partial: bool,
        step: Option<u64>,
        replica: u64,
        dp_rank: u32,
        dp_size: u32,
        replica_rank: u32,
        replica_size: u32,
        balance_field: Option<String>,
        cost: &str,
        linear_weight: Option<f64>,
        equal_count: bool,
    ) -> PyResult<ClaimResult<'py>> {
        let share = ShareArgs {
            step,
            replica,
            dp_rank,
            dp_size,
            replica_rank,
            replica_size,
            balance_field,
            cost,
            linear_weight,
            equal_count,
        };
        let spec =
            claim_spec(task, fields, batch_size, partition, min_version, whole_groups, share)?;
        let timeout = duration(timeout)?;
        let client = self.client(py)?;
        let (c, cells) =
            detached(py, None, |wait| client.claim(&spec, allow_partial, timeout, wait))?;
        let cells = cells.map(ClaimedCells::new);
        Ok(claim_result(py, c.lease, c.rows, c.versions, &c.groups, c.expires_in, cells))
    }

    #[pyo3(signature = (lease, indexes = None))]
    fn ack(
        &self,
        py: Python<'_>,
        lease: u64,
        indexes: Option<PyReadonlyArray1<'_, u64>>,
    ) -> PyResult<()> {
        self.settle(py, indexes, |client, subset, wait| client.ack(lease, subset, wait))
    }

    #[pyo3(signature = (lease, indexes = None))]
    fn release(
        &self,
        py: Python<'_>,
        lease: u64,
        indexes: Option<PyReadonlyArray1<'_, u64>>,
    ) -> PyResult<()> {
        self.settle(py, indexes, |client, subset, wait| client.release(lease, subset, wait))
    }

    #[pyo3(signature = (lease, timeout = None))]
    fn renew(&self, py: Python<'_>, lease: u64, timeout: Option<f64>) -> PyResult<f64> {
        let timeout = timeout.map(|t| seconds(t, "timeout")).transpose()?;
        let client = self.client(py)?;
        Ok(detached(py, None, |wait| client.renew(lease, timeout, wait))?.as_secs_f64())
    }

    /// `{field: [one value per row]}`. On the shared-memory path these are read-only views of
    /// the daemon's memory (no copy; the daemon keeps the bytes while a view exists); over TCP
    /// they view the received message (one copy, made by the socket).
    fn read<'py>(
        &self,
        py: Python<'py>,
        indexes: PyReadonlyArray1<'py, u64>,
        fields: Vec<String>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let rows = indexes.as_slice()?;
        let client = self.client(py)?;
        let columns = detached(py, None, |wait| client.read(rows, &fields, wait))?;
        columns_dict(
            py,
            columns.iter().map(|(name, schema, cells)| (name.as_str(), schema, cells.as_slice())),
        )
    }

    #[pyo3(signature = (indexes = None, *, partition = None))]
    fn rows<'py>(
        &self,
        py: Python<'py>,
        indexes: Option<PyReadonlyArray1<'py, u64>>,
        partition: Option<String>,
    ) -> PyResult<RowsResult<'py>> {
        let rows = indexes.as_ref().map(PyReadonlyArray1::as_slice).transpose()?;
        let client = self.client(py)?;
        let infos = detached(py, None, |wait| client.rows(rows, partition.as_deref(), wait))?;
        Ok(rows_result(py, &infos))
    }

    fn clear(&self, py: Python<'_>, partition: &str) -> PyResult<u64> {
        let client = self.client(py)?;
        detached(py, None, |wait| client.clear(partition, wait))
    }

    fn delete(&self, py: Python<'_>, indexes: PyReadonlyArray1<'_, u64>) -> PyResult<()> {
        let rows = indexes.as_slice()?;
        let client = self.client(py)?;
        detached(py, None, |wait| client.delete(rows, wait))
    }

    fn ready_fields(
        &self,
        py: Python<'_>,
        indexes: PyReadonlyArray1<'_, u64>,
    ) -> PyResult<Vec<Vec<String>>> {
        let rows = indexes.as_slice()?;
        let client = self.client(py)?;
        detached(py, None, |wait| client.ready_fields(rows, wait))
    }

    fn schema(&self, py: Python<'_>, field: &str) -> PyResult<(String, Option<Vec<u64>>)> {
        let client = self.client(py)?;
        let s = detached(py, None, |wait| client.schema(field, wait))?;
        Ok((s.dtype.name().to_owned(), s.trailing))
    }

    /// Counters and gauges of the daemon (summed over storage daemons when sharded), with
    /// `transport`: `"shm"` or `"tcp"`, and `storage_daemons`.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let client = self.client(py)?;
        let s = detached(py, None, |wait| client.stats(wait))?;
        let d = stats_dict(py, &s, client.transport())?;
        d.set_item("storage_daemons", client.storage_daemons())?;
        Ok(d)
    }
}

/// Runs the store daemon with these command-line arguments until SIGTERM or SIGINT; returns its
/// exit code. This is the very code of the `asyncflow-store` binary; `program` is the command
/// its usage and errors name.
#[pyfunction]
#[pyo3(signature = (args, program = "asyncflow-store"))]
pub fn serve(py: Python<'_>, args: Vec<String>, program: &str) -> i32 {
    let program = program.to_owned();
    py.detach(move || asyncflow_server::run_as(&program, args))
}
