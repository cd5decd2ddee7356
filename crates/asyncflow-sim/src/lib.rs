//! A discrete-event simulator of an AsyncFlow cluster in virtual time. It drives the real store
//! index and scheduler of `asyncflow-core` (the index takes `now` as an argument, so it runs
//! under a virtual clock) with the roles of the RL pipeline modelled by a cost model: rollout
//! devices batching decode steps, a training pool of data-parallel ranks, reward workers, weight
//! publication. It answers what the real pipeline would do on hundreds of devices, with the same
//! cost model the Python emulation runs in real time on a few.

mod cluster;
pub mod costs;
pub mod decode;
mod error;
mod index;
mod lengths;
mod ranks;
mod scenario;

pub use costs::CostModel;
pub use error::{Result, SimError};
pub use lengths::group_lengths;
pub use scenario::{Mode, Outcome, Partial, Scenario};

/// Runs a scenario to its last training step.
pub fn simulate(scenario: &Scenario) -> Result<Outcome> {
    cluster::Cluster::new(scenario)?.run()
}
