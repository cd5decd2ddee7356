//! The cluster simulator as one Python function. Conversions only: the simulation lives in
//! `asyncflow_sim`.

use std::collections::HashMap;

use asyncflow_sim::{CostModel, Mode, Scenario};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::blocking::without_gil;
use crate::errors::sim_to_py;

/// Simulates `steps` measured training steps (after `warmup_steps`) of the pipeline in `mode` on
/// the cost model `costs` (`section.key` -> value), grown to `devices` accelerators if given.
#[pyfunction]
#[pyo3(signature = (costs, mode, devices = None, warmup_steps = 4, steps = 8))]
pub fn simulate<'py>(
    py: Python<'py>,
    costs: HashMap<String, f64>,
    mode: &str,
    devices: Option<usize>,
    warmup_steps: u64,
    steps: u64,
) -> PyResult<Bound<'py, PyDict>> {
    let model = CostModel::from_params(&costs).map_err(sim_to_py)?;
    let costs = devices.map_or_else(|| model.clone(), |n| model.scaled(n));
    let mode = Mode::from_name(mode).map_err(sim_to_py)?;
    let scenario = Scenario { costs, mode, warmup_steps, steps };
    let outcome = without_gil(py, || asyncflow_sim::simulate(&scenario)).map_err(sim_to_py)?;
    let out = PyDict::new(py);
    out.set_item("samples_per_s", outcome.samples_per_s)?;
    out.set_item("ideal_samples_per_s", outcome.ideal_samples_per_s)?;
    out.set_item("step_time_s", outcome.step_time_s)?;
    out.set_item("busy", outcome.busy.into_iter().collect::<HashMap<_, _>>())?;
    out.set_item("decode_fill", outcome.decode_fill)?;
    out.set_item("staleness", outcome.staleness)?;
    out.set_item("staleness_max", outcome.max_staleness)?;
    out.set_item("rollout_devices", outcome.rollout_devices)?;
    out.set_item("train_devices", outcome.train_devices)?;
    out.set_item("trained_samples", outcome.trained_samples)?;
    out.set_item("index_calls", outcome.index_calls)?;
    out.set_item("index_seconds", outcome.index_seconds)?;
    out.set_item("events", outcome.events)?;
    Ok(out)
}
