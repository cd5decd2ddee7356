//! Conversions shared by every backend's Python class, so the embedded store and a daemon
//! connection take the same arguments and return the same shapes.

use std::time::Duration;

use asyncflow_core::{Cell, FieldSchema, RowInfo, StoreError, StoreStats};
use numpy::{IntoPyArray, PyArray1, PyReadonlyArray1};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::arrays::{CellViews, PendingColumn};
use crate::errors::to_py;

/// What one claim leased: the lease id (`None` when nothing was ready), the rows, their policy
/// versions and groups (-1: no group), seconds until the lease expires, and the claimed fields'
/// cells when they came with the claim.
pub type ClaimResult<'py> = (
    Option<u64>,
    Bound<'py, PyArray1<u64>>,
    Bound<'py, PyArray1<u64>>,
    Bound<'py, PyArray1<i64>>,
    Option<f64>,
    Option<ClaimedCells>,
);

/// The cells of a claim's fields, sent with the claim by a daemon on this machine: `Batch.read`
/// views them without asking the daemon again. Holding them keeps their memory in the daemon.
#[pyclass(module = "asyncflow._native", frozen)]
pub struct ClaimedCells {
    columns: Vec<(String, FieldSchema, Vec<Cell>)>,
}

impl ClaimedCells {
    pub fn new(columns: Vec<(String, FieldSchema, Vec<Cell>)>) -> Self {
        Self { columns }
    }
}

#[pymethods]
impl ClaimedCells {
    /// `{field: [one value per row]}` for `fields`, as a read returns it; `None` if one of them
    /// did not come with the claim.
    fn read<'py>(
        &self,
        py: Python<'py>,
        fields: Vec<String>,
    ) -> PyResult<Option<Bound<'py, PyDict>>> {
        let picked: Option<Vec<_>> =
            fields.iter().map(|f| self.columns.iter().find(|(name, ..)| name == f)).collect();
        picked
            .map(|columns| {
                columns_dict(py, columns.into_iter().map(|(n, s, c)| (n.as_str(), s, c.as_slice())))
            })
            .transpose()
    }
}

/// Row metadata: `(indexes, partitions, groups, versions, tags)`.
pub type RowsResult<'py> = (
    Bound<'py, PyArray1<u64>>,
    Vec<String>,
    Bound<'py, PyArray1<i64>>,
    Bound<'py, PyArray1<u64>>,
    Vec<Vec<(String, String)>>,
);

/// The longest duration a setting or wait may ask for: a year (a deadline that far out never
/// overflows a clock).
pub const MAX_SECONDS: f64 = 365.0 * 24.0 * 3600.0;

pub fn seconds(value: f64, what: &str) -> PyResult<Duration> {
    match Duration::try_from_secs_f64(value) {
        Ok(d) if value > 0.0 && value <= MAX_SECONDS && !d.is_zero() => Ok(d),
        _ => Err(to_py(StoreError::bad_request(format!(
            "{what} must be a positive number of seconds up to {MAX_SECONDS}, not {value}"
        )))),
    }
}

/// A put's field as the Python side hands it over: name, value, explicit dtype, and for a ragged
/// column given as one array, its rows' lengths.
pub type PutField<'py> =
    (String, Bound<'py, PyAny>, Option<String>, Option<PyReadonlyArray1<'py, u64>>);

/// Reads a put's fields off their Python values (GIL held).
pub fn inspect_fields(fields: &[PutField<'_>]) -> PyResult<Vec<PendingColumn>> {
    fields
        .iter()
        .map(|(name, value, dtype, lengths)| match lengths {
            None => PendingColumn::inspect(name, value, dtype.as_deref()),
            Some(lengths) => {
                PendingColumn::ragged(name, value, lengths.as_slice()?, dtype.as_deref())
            }
        })
        .collect()
}

fn group_to_py(group: Option<u64>) -> i64 {
    group.map_or(-1, |g| g as i64)
}

pub fn claim_result<'py>(
    py: Python<'py>,
    lease: Option<u64>,
    rows: Vec<u64>,
    versions: Vec<u64>,
    groups: &[Option<u64>],
    expires_in: Option<Duration>,
    cells: Option<ClaimedCells>,
) -> ClaimResult<'py> {
    let groups: Vec<i64> = groups.iter().map(|&g| group_to_py(g)).collect();
    (
        lease,
        rows.into_pyarray(py),
        versions.into_pyarray(py),
        groups.into_pyarray(py),
        expires_in.map(|d| d.as_secs_f64()),
        cells,
    )
}

pub fn rows_result<'py>(py: Python<'py>, infos: &[RowInfo]) -> RowsResult<'py> {
    (
        infos.iter().map(|i| i.index).collect::<Vec<_>>().into_pyarray(py),
        infos.iter().map(|i| i.partition.clone()).collect(),
        infos.iter().map(|i| group_to_py(i.group)).collect::<Vec<_>>().into_pyarray(py),
        infos.iter().map(|i| i.version).collect::<Vec<_>>().into_pyarray(py),
        infos.iter().map(|i| i.tags.as_ref().clone()).collect(),
    )
}

/// `{field: [one value per row]}`: read-only NumPy views of the cells, `bytes` for bytes fields.
pub fn columns_dict<'py, 'c>(
    py: Python<'py>,
    columns: impl IntoIterator<Item = (&'c str, &'c FieldSchema, &'c [Cell])>,
) -> PyResult<Bound<'py, PyDict>> {
    let out = PyDict::new(py);
    let mut views = CellViews::new(py);
    for (name, schema, cells) in columns {
        let values = cells.iter().map(|c| views.view(schema, c)).collect::<PyResult<Vec<_>>>()?;
        out.set_item(name, PyList::new(py, values)?)?;
    }
    Ok(out)
}

/// Counters and gauges of a store, as the Python `stats()` dict.
pub fn stats_dict<'py>(
    py: Python<'py>,
    s: &StoreStats,
    transport: &str,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("transport", transport)?;
    d.set_item("shards", s.shards)?;
    d.set_item("lease_timeout", s.lease_timeout.as_secs_f64())?;
    d.set_item("memory_used", s.memory_used)?;
    d.set_item("memory_limit", s.memory_limit)?;
    d.set_item("live_rows", s.index.live_rows)?;
    d.set_item("resident_slots", s.index.resident_slots)?;
    d.set_item("payload_rows", s.payload_rows)?;
    d.set_item("active_leases", s.index.active_leases)?;
    for (k, v) in s.index.counters.named() {
        d.set_item(k, v)?;
    }
    let fields = PyDict::new(py);
    for (name, schema, ready) in &s.index.fields {
        fields.set_item(name, (schema.to_string(), ready))?;
    }
    d.set_item("fields", fields)?;
    let tasks = PyDict::new(py);
    for (name, leased, acked) in &s.index.tasks {
        tasks.set_item(name, (leased, acked))?;
    }
    d.set_item("tasks", tasks)?;
    d.set_item(
        "partitions",
        PyDict::from_sequence(&PyList::new(py, &s.index.partitions)?.into_any())?,
    )?;
    Ok(d)
}
