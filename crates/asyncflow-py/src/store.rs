//! The store as one Python class over either backend: the store embedded in this process, or a
//! connection to a daemon. Each method converts its arguments once, then runs the backend's call
//! through the blocking helper (GIL released, Ctrl-C honoured). Conversions only: every rule
//! lives in the core.

use std::sync::Arc;
use std::time::Instant;

use asyncflow_core::{self as core, Column, StoreConfig, StoreError};
use asyncflow_server::client::{Client, Policy, PutColumn};
use numpy::{IntoPyArray, PyArray1, PyReadonlyArray1};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::arrays::PendingColumn;
use crate::blocking::{deadline, detached, timeout as duration};
use crate::convert::{
    ClaimResult, ClaimedCells, PutField, RowsResult, claim_result, columns_dict, inspect_fields,
    rows_result, seconds, stats_dict,
};
use crate::errors::IntoPy;
use crate::options::{PutOptions, SeenClaimOptions};
use crate::remote::{Remote, preference};

enum Backend {
    Embedded(Arc<core::Store>),
    Remote(Remote),
}

/// A backend ready for one call: the embedded store, or the daemon's client.
enum Conn<'a> {
    Embedded(&'a core::Store),
    Remote(Arc<Client>),
}

/// The sample store: embedded (`Store(...)`) or a daemon connection (`Store.connect(...)`).
#[pyclass(module = "asyncflow._native", frozen)]
pub struct Store {
    backend: Backend,
    claim_options: SeenClaimOptions,
}

/// How a lease ends.
#[derive(Clone, Copy)]
enum Settle {
    Ack,
    Release,
}

impl Store {
    fn conn(&self, py: Python<'_>) -> PyResult<Conn<'_>> {
        Ok(match &self.backend {
            Backend::Embedded(store) => Conn::Embedded(store),
            Backend::Remote(remote) => Conn::Remote(remote.client(py)?),
        })
    }

    /// Acks or releases a lease, or only `indexes` of it.
    fn settle(
        &self,
        py: Python<'_>,
        lease: u64,
        indexes: Option<PyReadonlyArray1<'_, u64>>,
        how: Settle,
    ) -> PyResult<()> {
        let subset = indexes.as_ref().map(PyReadonlyArray1::as_slice).transpose()?;
        match (self.conn(py)?, how) {
            (Conn::Embedded(store), Settle::Ack) => {
                detached(py, None, |_| store.ack(lease, subset))
            }
            (Conn::Embedded(store), Settle::Release) => {
                detached(py, None, |_| store.release(lease, subset))
            }
            (Conn::Remote(client), Settle::Ack) => {
                detached(py, None, |wait| client.ack(lease, subset, wait))
            }
            (Conn::Remote(client), Settle::Release) => {
                detached(py, None, |wait| client.release(lease, subset, wait))
            }
        }
    }
}

#[pymethods]
impl Store {
    /// An embedded store.
    #[new]
    #[pyo3(signature = (shards = 8, memory_limit = None, lease_timeout = 30.0))]
    fn new(shards: usize, memory_limit: Option<u64>, lease_timeout: f64) -> PyResult<Self> {
        let config = StoreConfig {
            shards,
            memory_limit,
            lease_timeout: seconds(lease_timeout, "lease_timeout")?,
        };
        let store = core::Store::new(config).py_err()?;
        Ok(Self {
            backend: Backend::Embedded(Arc::new(store)),
            claim_options: SeenClaimOptions::default(),
        })
    }

    /// Connects to a daemon at `url` (`tcp://HOST:PORT`). `transport`: `"auto"` (shared memory
    /// when the daemon is on this machine, else TCP), `"tcp"` or `"shm"`. `request_timeout`:
    /// seconds a request waits for its reply beyond its own timeout, and a silent daemon may go
    /// unanswered before the connection is given up; `reconnect_timeout`: seconds a broken
    /// connection is tried again before requests fail.
    #[staticmethod]
    #[pyo3(signature = (url, *, token = None, transport = "auto", request_timeout = 60.0, reconnect_timeout = 30.0))]
    fn connect(
        py: Python<'_>,
        url: String,
        token: Option<String>,
        transport: &str,
        request_timeout: f64,
        reconnect_timeout: f64,
    ) -> PyResult<Self> {
        let policy = Policy {
            request_timeout: seconds(request_timeout, "request_timeout")?,
            reconnect_timeout: seconds(reconnect_timeout, "reconnect_timeout")?,
        };
        let remote = Remote::connect(py, url, token, preference(transport)?, policy)?;
        Ok(Self { backend: Backend::Remote(remote), claim_options: SeenClaimOptions::default() })
    }

    #[pyo3(signature = (name, partitions = None))]
    fn register_task(
        &self,
        py: Python<'_>,
        name: &str,
        partitions: Option<Vec<String>>,
    ) -> PyResult<()> {
        match self.conn(py)? {
            Conn::Embedded(store) => detached(py, None, |_| store.register_task(name, partitions)),
            Conn::Remote(client) => {
                detached(py, None, |wait| client.register_task(name, partitions, wait))
            }
        }
    }

    /// Writes new rows or fields of existing rows (`options.indexes`). `fields` holds
    /// `(name, value, dtype or None, row lengths or None)`, the lengths given for a ragged column
    /// passed as one array. With `ack`, then acks that lease whole (in the same request to a
    /// daemon); nothing is acked if the put fails. Returns the rows' indexes.
    #[pyo3(signature = (fields, options = None, ack = None))]
    fn put<'py>(
        &self,
        py: Python<'py>,
        fields: Vec<PutField<'py>>,
        options: Option<PutOptions<'py>>,
        ack: Option<u64>,
    ) -> PyResult<Bound<'py, PyArray1<u64>>> {
        let pending = inspect_fields(&fields)?;
        let (target, timeout) = options.unwrap_or_default().into_target()?;
        let timeout = duration(timeout)?;
        let rows = match self.conn(py)? {
            Conn::Embedded(store) => {
                let total: u64 = pending.iter().map(PendingColumn::bytes_needed).sum();
                detached(py, deadline(timeout), |wait| {
                    let mut reservation = store.reserve(total, wait)?;
                    let columns: Vec<Column> = pending
                        .into_iter()
                        .map(|p| {
                            let guard = reservation.split(p.bytes_needed())?;
                            // SAFETY: `fields` (the inspected Python objects) outlives this
                            // closure.
                            Ok(unsafe { p.into_column(guard) })
                        })
                        .collect::<Result<_, StoreError>>()?;
                    let rows = store.put(columns, &target)?;
                    ack.map_or(Ok(()), |lease| store.ack(lease, None)).map(|()| rows)
                })?
            }
            Conn::Remote(client) => detached(py, None, |wait| {
                // SAFETY: `fields` (the inspected Python objects) outlives this closure.
                let columns: Vec<PutColumn<'_>> =
                    pending.iter().map(|p| unsafe { p.as_put_column() }).collect();
                client.put(&columns, target, timeout, ack, wait)
            })?,
        };
        Ok(rows.into_pyarray(py))
    }

    /// Leases up to `batch_size` rows ready for all `fields` and free for `task`, as `options`
    /// say (a shared claim with `options.step`).
    #[pyo3(signature = (task, fields, batch_size, options = None))]
    fn claim<'py>(
        &self,
        py: Python<'py>,
        task: String,
        fields: Vec<String>,
        batch_size: i64,
        options: Option<Bound<'py, PyAny>>,
    ) -> PyResult<ClaimResult<'py>> {
        let options = self.claim_options.read(options.as_ref())?;
        let claim = options.into_claim(task, fields, batch_size)?;
        let (spec, partial) = (claim.spec, claim.allow_partial);
        let timeout = duration(claim.timeout)?;
        match self.conn(py)? {
            Conn::Embedded(store) => {
                let c = detached(py, deadline(timeout), |wait| store.claim(&spec, partial, wait))?;
                let left = c.deadline.map(|d| d.saturating_duration_since(Instant::now()));
                Ok(claim_result(py, c.lease, c.rows, c.versions, &c.groups, left, None))
            }
            Conn::Remote(client) => {
                let (c, cells) =
                    detached(py, None, |wait| client.claim(spec, partial, timeout, wait))?;
                let cells = cells.map(ClaimedCells::new);
                Ok(claim_result(py, c.lease, c.rows, c.versions, &c.groups, c.expires_in, cells))
            }
        }
    }

    /// Commits a lease, or only `indexes` of it.
    #[pyo3(signature = (lease, indexes = None))]
    fn ack(
        &self,
        py: Python<'_>,
        lease: u64,
        indexes: Option<PyReadonlyArray1<'_, u64>>,
    ) -> PyResult<()> {
        self.settle(py, lease, indexes, Settle::Ack)
    }

    /// Hands a lease's rows (or `indexes` of them) back for immediate redelivery.
    #[pyo3(signature = (lease, indexes = None))]
    fn release(
        &self,
        py: Python<'_>,
        lease: u64,
        indexes: Option<PyReadonlyArray1<'_, u64>>,
    ) -> PyResult<()> {
        self.settle(py, lease, indexes, Settle::Release)
    }

    /// Extends a lease to `timeout` seconds from now (default: the store's lease timeout);
    /// returns the seconds granted.
    #[pyo3(signature = (lease, timeout = None))]
    fn renew(&self, py: Python<'_>, lease: u64, timeout: Option<f64>) -> PyResult<f64> {
        let timeout = timeout.map(|t| seconds(t, "timeout")).transpose()?;
        let left = match self.conn(py)? {
            Conn::Embedded(store) => {
                let until = detached(py, None, |_| store.renew(lease, timeout))?;
                until.saturating_duration_since(Instant::now())
            }
            Conn::Remote(client) => detached(py, None, |wait| client.renew(lease, timeout, wait))?,
        };
        Ok(left.as_secs_f64())
    }

    /// `{field: [one value per row]}`: read-only NumPy views (no copy), or `bytes` for bytes
    /// fields. Embedded and over shared memory they view the store's memory (the views keep it
    /// alive while referenced); over TCP they view the received message.
    fn read<'py>(
        &self,
        py: Python<'py>,
        indexes: PyReadonlyArray1<'py, u64>,
        fields: Vec<String>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let rows = indexes.as_slice()?;
        match self.conn(py)? {
            Conn::Embedded(store) => {
                let columns = detached(py, None, |_| store.read(rows, &fields))?;
                columns_dict(
                    py,
                    columns.iter().map(|c| (c.name.as_str(), &c.schema, c.cells.as_slice())),
                )
            }
            Conn::Remote(client) => {
                let columns = detached(py, None, |wait| client.read(rows, &fields, wait))?;
                columns_dict(
                    py,
                    columns.iter().map(|(n, s, cells)| (n.as_str(), s, cells.as_slice())),
                )
            }
        }
    }

    /// Metadata of rows: `(indexes, partitions, groups, versions, tags)`; all live rows (of one
    /// partition) when `indexes` is None.
    #[pyo3(signature = (indexes = None, *, partition = None))]
    fn rows<'py>(
        &self,
        py: Python<'py>,
        indexes: Option<PyReadonlyArray1<'py, u64>>,
        partition: Option<String>,
    ) -> PyResult<RowsResult<'py>> {
        let rows = indexes.as_ref().map(PyReadonlyArray1::as_slice).transpose()?;
        let partition = partition.as_deref();
        let infos = match self.conn(py)? {
            Conn::Embedded(store) => detached(py, None, |_| match rows {
                Some(rows) => store.row_info(rows),
                None => Ok::<_, StoreError>(store.rows(partition)),
            })?,
            Conn::Remote(client) => detached(py, None, |wait| client.rows(rows, partition, wait))?,
        };
        Ok(rows_result(py, &infos))
    }

    /// Names of the fields ready on each of `indexes`.
    fn ready_fields(
        &self,
        py: Python<'_>,
        indexes: PyReadonlyArray1<'_, u64>,
    ) -> PyResult<Vec<Vec<String>>> {
        let rows = indexes.as_slice()?;
        match self.conn(py)? {
            Conn::Embedded(store) => detached(py, None, |_| store.ready_fields(rows)),
            Conn::Remote(client) => detached(py, None, |wait| client.ready_fields(rows, wait)),
        }
    }

    /// Frees every row of a partition; returns how many were freed.
    fn clear(&self, py: Python<'_>, partition: &str) -> PyResult<u64> {
        match self.conn(py)? {
            Conn::Embedded(store) => detached(py, None, |_| store.clear(partition)),
            Conn::Remote(client) => detached(py, None, |wait| client.clear(partition, wait)),
        }
    }

    /// Frees the given rows (all or none).
    fn delete(&self, py: Python<'_>, indexes: PyReadonlyArray1<'_, u64>) -> PyResult<()> {
        let rows = indexes.as_slice()?;
        match self.conn(py)? {
            Conn::Embedded(store) => detached(py, None, |_| store.delete(rows)),
            Conn::Remote(client) => detached(py, None, |wait| client.delete(rows, wait)),
        }
    }

    /// `(dtype name, trailing shape or None for scalars)` of a field.
    fn schema(&self, py: Python<'_>, field: &str) -> PyResult<(String, Option<Vec<u64>>)> {
        let s = match self.conn(py)? {
            Conn::Embedded(store) => detached(py, None, |_| store.field_schema(field))?,
            Conn::Remote(client) => detached(py, None, |wait| client.schema(field, wait))?,
        };
        Ok((s.dtype.name().to_owned(), s.trailing))
    }

    /// Counters and gauges of the store, with `transport`: `"inproc"`, `"shm"` or `"tcp"`. A
    /// daemon's are summed over its storage daemons when sharded, with `storage_daemons`.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        match self.conn(py)? {
            Conn::Embedded(store) => {
                let s = detached(py, None, |_| Ok::<_, StoreError>(store.stats()))?;
                stats_dict(py, &s, "inproc")
            }
            Conn::Remote(client) => {
                let s = detached(py, None, |wait| client.stats(wait))?;
                let d = stats_dict(py, &s, client.transport())?;
                d.set_item("storage_daemons", client.storage_daemons())?;
                Ok(d)
            }
        }
    }
}
