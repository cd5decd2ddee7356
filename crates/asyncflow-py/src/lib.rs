//! `asyncflow._native`: the Python face of the Rust store. This crate only converts — values,
//! errors, blocking — and holds no store logic of its own.

// PyO3 hands #[pymethods] their arguments by value; borrowing them is not an option there.
#![allow(clippy::needless_pass_by_value)]

mod arrays;
mod blocking;
mod convert;
mod echo;
mod errors;
mod options;
mod remote;
mod scheduler;
mod sim;
mod store;

use pyo3::prelude::*;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("DEFAULT_LINEAR_WEIGHT", asyncflow_core::scheduler::CostModel::DEFAULT_LINEAR_WEIGHT)?;
    m.add("DEFAULT_TIMEOUT", options::DEFAULT_TIMEOUT)?;
    m.add_class::<store::Store>()?;
    m.add_class::<arrays::ChunkOwner>()?;
    m.add_class::<convert::ClaimedCells>()?;
    m.add_class::<scheduler::Router>()?;
    m.add_class::<echo::EchoClient>()?;
    m.add_function(wrap_pyfunction!(scheduler::costs, m)?)?;
    m.add_function(wrap_pyfunction!(scheduler::partition, m)?)?;
    m.add_function(wrap_pyfunction!(scheduler::micro_batches, m)?)?;
    m.add_function(wrap_pyfunction!(options::claim_defaults, m)?)?;
    m.add_function(wrap_pyfunction!(remote::serve, m)?)?;
    m.add_function(wrap_pyfunction!(echo::echo_serve, m)?)?;
    m.add_function(wrap_pyfunction!(sim::simulate, m)?)?;
    Ok(())
}
