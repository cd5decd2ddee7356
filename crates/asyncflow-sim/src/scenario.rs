//! What one simulation runs: a cost model, a mode, and how many training steps.

use crate::costs::CostModel;
use crate::error::{Result, SimError};

/// How the roles are placed and paced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mode {
    /// One pool time-shares generation and training.
    pub colocated: bool,
    /// Policy versions the trainer may run ahead of the samples it trains on.
    pub staleness: u64,
    /// The trainer trains micro-batches as they arrive (else it waits for the whole step).
    pub streaming: bool,
}

impl Mode {
    /// `colocated-sync`, `separated-sync`, `streaming`, or `async-<k>`.
    pub fn from_name(name: &str) -> Result<Self> {
        let mode = |colocated, staleness, streaming| Ok(Self { colocated, staleness, streaming });
        match name {
            "colocated-sync" => mode(true, 0, false),
            "separated-sync" => mode(false, 0, false),
            "streaming" => mode(false, 0, true),
            _ => match name.strip_prefix("async-").and_then(|k| k.parse().ok()) {
                Some(k) => mode(false, k, true),
                None => Err(SimError::UnknownMode(name.to_owned())),
            },
        }
    }
}

#[derive(Debug, Clone)]
pub struct Scenario {
    pub costs: CostModel,
    pub mode: Mode,
    /// Steps run before measuring, while the pipeline fills.
    pub warmup_steps: u64,
    /// Steps measured.
    pub steps: u64,
}

/// What a simulation measured over its measured steps.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    pub samples_per_s: f64,
    /// The placement's bound: its bottleneck busy all the time on useful work.
    pub ideal_samples_per_s: f64,
    pub step_time_s: f64,
    /// Per role, the fraction of its devices' time it kept them busy.
    pub busy: Vec<(&'static str, f64)>,
    /// Mean fill of the rollout devices' batches while they decode.
    pub decode_fill: f64,
    /// Mean policy age of the trained samples.
    pub staleness: f64,
    pub rollout_devices: usize,
    pub train_devices: usize,
    /// Samples trained in the whole run, warm-up included.
    pub trained_samples: u64,
    /// Calls into the store index in the whole run, and the real seconds they took.
    pub index_calls: u64,
    pub index_seconds: f64,
    pub events: u64,
}
