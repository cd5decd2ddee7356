//! The scheduler as Python functions and a `Router` class. Conversions only: the algorithms live
//! in `asyncflow_core::scheduler`.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use asyncflow_core::StoreError;
use asyncflow_core::scheduler::{
    self as core, CostModel, EngineLoad, Method, MicroBatchOptions, PartitionOptions,
};
use numpy::{IntoPyArray, PyArray1, PyReadonlyArray1};
use pyo3::prelude::*;

use crate::blocking::without_gil;
use crate::errors::{IntoPy, to_py};

/// Group ids from Python are labels: any int64, reinterpreted so that distinct ids stay distinct.
fn group_labels(groups: &[i64]) -> Vec<Option<u64>> {
    groups.iter().map(|&g| Some(g as u64)).collect()
}

/// A cost model by name; the attention model's linear weight defaults to the core's.
pub fn cost_model(name: &str, linear_weight: Option<f64>) -> PyResult<CostModel> {
    CostModel::from_name(name, linear_weight.unwrap_or(CostModel::DEFAULT_LINEAR_WEIGHT)).py_err()
}

/// The cost of each row: `tokens`, or `tokens² + linear_weight · tokens` for `attention`.
#[pyfunction]
#[pyo3(signature = (lengths, cost = "tokens", linear_weight = None))]
pub fn costs<'py>(
    py: Python<'py>,
    lengths: PyReadonlyArray1<'py, u64>,
    cost: &str,
    linear_weight: Option<f64>,
) -> PyResult<Bound<'py, PyArray1<f64>>> {
    let model = cost_model(cost, linear_weight)?;
    Ok(model.costs(lengths.as_slice()?).into_pyarray(py))
}

/// Splits rows into `k` parts minimising the costliest; returns each part's row positions.
#[pyfunction]
#[pyo3(signature = (lengths, k, cost = "tokens", linear_weight = None, groups = None, equal_count = false, method = "balanced"))]
#[allow(clippy::too_many_arguments)]
pub fn partition(
    py: Python<'_>,
    lengths: PyReadonlyArray1<'_, u64>,
    k: usize,
    cost: &str,
    linear_weight: Option<f64>,
    groups: Option<PyReadonlyArray1<'_, i64>>,
    equal_count: bool,
    method: &str,
) -> PyResult<Vec<Vec<usize>>> {
    let model = cost_model(cost, linear_weight)?;
    let method = Method::from_name(method).py_err()?;
    let groups = groups.map(|g| g.as_slice().map(group_labels)).transpose()?;
    let lengths = lengths.as_slice()?;
    without_gil(py, || {
        let options = PartitionOptions { groups: groups.as_deref(), equal_count, method };
        core::partition(&model.costs(lengths), k, &options)
    })
    .py_err()
}

/// Splits rows into micro-batches of at most `max_tokens` tokens with even costs.
#[pyfunction]
#[pyo3(signature = (lengths, max_tokens, cost = "tokens", linear_weight = None, min_count = 1))]
pub fn micro_batches(
    py: Python<'_>,
    lengths: PyReadonlyArray1<'_, u64>,
    max_tokens: u64,
    cost: &str,
    linear_weight: Option<f64>,
    min_count: usize,
) -> PyResult<Vec<Vec<usize>>> {
    let cost = cost_model(cost, linear_weight)?;
    let lengths = lengths.as_slice()?;
    let options = MicroBatchOptions { max_tokens, cost, min_count };
    without_gil(py, || core::micro_batches(lengths, &options)).py_err()
}

/// An engine as Python sees it: `(name, tokens, requests, in rotation, work assigned)`.
type EngineRow = (String, u64, u64, bool, usize);

/// Routes prompt groups to the least-loaded rollout engine. Times are seconds on any one
/// monotonic clock (the Python wrapper passes `time.monotonic()`).
#[pyclass(module = "asyncflow._native", frozen)]
pub struct Router {
    inner: Mutex<core::Router>,
    /// The instant that time 0.0 stands for.
    origin: Instant,
}

impl Router {
    fn at(&self, now: f64) -> PyResult<Instant> {
        if now.is_finite() && now >= 0.0 {
            Ok(self.origin + Duration::from_secs_f64(now))
        } else {
            Err(to_py(StoreError::bad_request(format!(
                "now must be a finite number of seconds >= 0, not {now}"
            ))))
        }
    }

    fn with<T>(&self, f: impl FnOnce(&mut core::Router) -> Result<T, StoreError>) -> PyResult<T> {
        let mut router = self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        f(&mut router).py_err()
    }
}

#[pymethods]
impl Router {
    #[new]
    fn new(heartbeat_timeout: f64) -> PyResult<Self> {
        if !(heartbeat_timeout.is_finite() && heartbeat_timeout > 0.0) {
            return Err(to_py(StoreError::bad_request(format!(
                "heartbeat_timeout must be a positive number of seconds, not {heartbeat_timeout}"
            ))));
        }
        let inner = core::Router::new(Duration::from_secs_f64(heartbeat_timeout)).py_err()?;
        Ok(Self { inner: Mutex::new(inner), origin: Instant::now() })
    }

    fn add_engine(&self, name: &str, now: f64) -> PyResult<()> {
        let now = self.at(now)?;
        self.with(|r| r.add_engine(name, now))
    }

    fn report(&self, engine: &str, tokens: u64, requests: u64, now: f64) -> PyResult<()> {
        let now = self.at(now)?;
        self.with(|r| r.report(engine, EngineLoad { tokens, requests }, now))
    }

    fn route(&self, work: u64, tokens: u64, requests: u64, now: f64) -> PyResult<Option<String>> {
        let now = self.at(now)?;
        self.with(|r| Ok(r.route(work, EngineLoad { tokens, requests }, now)?.map(str::to_owned)))
    }

    fn complete(&self, work: u64) -> PyResult<String> {
        self.with(|r| r.complete(work).map(str::to_owned))
    }

    /// `(work, from engine, to engine or None)` for each unit of work moved.
    fn expire(&self, now: f64) -> PyResult<Vec<(u64, String, Option<String>)>> {
        let now = self.at(now)?;
        self.with(|r| Ok(r.expire(now).into_iter().map(|m| (m.work, m.from, m.to)).collect()))
    }

    /// `(name, estimated tokens, estimated requests, in rotation, work assigned)` per engine.
    fn engines(&self) -> PyResult<Vec<EngineRow>> {
        self.with(|r| {
            Ok(r.engines()
                .into_iter()
                .map(|e| {
                    (e.name, e.estimated.tokens, e.estimated.requests, e.in_rotation, e.assigned)
                })
                .collect())
        })
    }

    fn assigned_to(&self, work: u64) -> PyResult<Option<String>> {
        self.with(|r| Ok(r.assigned_to(work).map(str::to_owned)))
    }
}
