//! The embedded store as a Python class. Conversions only: every rule lives in the core.

use std::sync::Arc;
use std::time::Instant;

use asyncflow_core::{self as core, Column, StoreConfig, StoreError};
use numpy::{IntoPyArray, PyArray1, PyReadonlyArray1};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::arrays::PendingColumn;
use crate::blocking::{deadline, detached};
use crate::convert::{
    ClaimResult, RowsResult, ShareArgs, claim_result, claim_spec, columns_dict, inspect_fields,
    put_target, rows_result, seconds, stats_dict,
};
use crate::errors::IntoPy;

/// The in-process sample store.
#[pyclass(module = "asyncflow._native", frozen)]
pub struct Store {
    inner: Arc<core::Store>,
}

#[pymethods]
impl Store {
    #[new]
    #[pyo3(signature = (shards = 8, memory_limit = None, lease_timeout = 30.0))]
    fn new(shards: usize, memory_limit: Option<u64>, lease_timeout: f64) -> PyResult<Self> {
        let config = StoreConfig {
            shards,
            memory_limit,
            lease_timeout: seconds(lease_timeout, "lease_timeout")?,
        };
        Ok(Self { inner: Arc::new(core::Store::new(config).py_err()?) })
    }

    #[pyo3(signature = (name, partitions = None))]
    fn register_task(&self, name: &str, partitions: Option<Vec<String>>) -> PyResult<()> {
        self.inner.register_task(name, partitions).py_err()
    }

    /// Writes new rows (`indexes` is None) or fields of existing rows. `fields` holds
    /// `(name, value, dtype or None)`. Returns the rows' indexes.
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
        let total: u64 = pending.iter().map(PendingColumn::bytes_needed).sum();
        let store = &self.inner;
        let rows = detached(py, deadline(timeout.or(Some(60.0)))?, |wait| {
            let mut reservation = store.reserve(total, wait)?;
            let columns: Vec<Column> = pending
                .into_iter()
                .map(|p| {
                    let guard = reservation.split(p.bytes_needed())?;
                    // SAFETY: `fields` (the inspected Python objects) outlives this closure.
                    Ok(unsafe { p.into_column(guard) })
                })
                .collect::<Result<_, StoreError>>()?;
            store.put(columns, &target)
        })?;
        Ok(rows.into_pyarray(py))
    }

    /// Leases up to `batch_size` rows ready for all `fields` and free for `task`. With `step`,
    /// the claim is shared: this caller gets its part (`dp_rank` of `dp_size`) of the step's
    /// batch, the same part as the other `replica_size` peers of its replica group.
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
        let store = &self.inner;
        let c = detached(py, deadline(timeout)?, |wait| store.claim(&spec, allow_partial, wait))?;
        let left = c.deadline.map(|d| d.saturating_duration_since(Instant::now()));
        Ok(claim_result(py, c.lease, c.rows, c.versions, &c.groups, left, None))
    }

    /// Commits a lease, or only `indexes` of it.
    #[pyo3(signature = (lease, indexes = None))]
    fn ack(
        &self,
        py: Python<'_>,
        lease: u64,
        indexes: Option<PyReadonlyArray1<'_, u64>>,
    ) -> PyResult<()> {
        let subset = indexes.as_ref().map(PyReadonlyArray1::as_slice).transpose()?;
        let store = &self.inner;
        py.detach(|| store.ack(lease, subset)).py_err()
    }

    /// Hands a lease's rows (or `indexes` of them) back for immediate redelivery.
    #[pyo3(signature = (lease, indexes = None))]
    fn release(&self, lease: u64, indexes: Option<PyReadonlyArray1<'_, u64>>) -> PyResult<()> {
        let subset = indexes.as_ref().map(PyReadonlyArray1::as_slice).transpose()?;
        self.inner.release(lease, subset).py_err()
    }

    /// Extends a lease to `timeout` seconds from now (default: the store's lease timeout);
    /// returns the seconds granted.
    #[pyo3(signature = (lease, timeout = None))]
    fn renew(&self, lease: u64, timeout: Option<f64>) -> PyResult<f64> {
        let timeout = timeout.map(|t| seconds(t, "timeout")).transpose()?;
        let until = self.inner.renew(lease, timeout).py_err()?;
        Ok(until.saturating_duration_since(Instant::now()).as_secs_f64())
    }

    /// `{field: [one value per row]}`: read-only NumPy views into store memory (no copy), or
    /// `bytes` for bytes fields. The views keep the payload alive while referenced.
    fn read<'py>(
        &self,
        py: Python<'py>,
        indexes: PyReadonlyArray1<'py, u64>,
        fields: Vec<String>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let indexes = indexes.as_slice()?;
        let store = &self.inner;
        let columns = py.detach(|| store.read(indexes, &fields)).py_err()?;
        columns_dict(py, columns.iter().map(|c| (c.name.as_str(), &c.schema, c.cells.as_slice())))
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
        let infos = match indexes {
            Some(indexes) => self.inner.row_info(indexes.as_slice()?).py_err()?,
            None => self.inner.rows(partition.as_deref()),
        };
        Ok(rows_result(py, &infos))
    }

    /// Names of the fields ready on each of `indexes`.
    fn ready_fields(&self, indexes: PyReadonlyArray1<'_, u64>) -> PyResult<Vec<Vec<String>>> {
        self.inner.ready_fields(indexes.as_slice()?).py_err()
    }

    /// Frees every row of a partition; returns how many were freed.
    fn clear(&self, partition: &str) -> PyResult<u64> {
        self.inner.clear(partition).py_err()
    }

    /// Frees the given rows (all or none).
    fn delete(&self, indexes: PyReadonlyArray1<'_, u64>) -> PyResult<()> {
        self.inner.delete(indexes.as_slice()?).py_err()
    }

    /// `(dtype name, trailing shape or None for scalars)` of a field.
    fn schema(&self, field: &str) -> PyResult<(String, Option<Vec<u64>>)> {
        let s = self.inner.field_schema(field).py_err()?;
        Ok((s.dtype.name().to_owned(), s.trailing))
    }

    /// Counters and gauges of the store.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        stats_dict(py, &self.inner.stats(), "inproc")
    }
}
