//! What one simulation runs: a cost model, a mode, and how many training steps.

use crate::costs::CostModel;
use crate::error::{Result, SimError};

/// Whether rollout devices load new weights while sequences are in flight (`rollout.partial`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Partial {
    /// Weights load between rollout calls; a call's samples carry the version it began with.
    #[default]
    Off,
    /// A request-level device loads a newly published version at its next decode-step boundary
    /// and goes on with every sequence in flight.
    Continue,
    /// As `Continue`, but the sequences in flight are cut and admitted again with their prefix,
    /// whose prompt and generated tokens are prefilled anew under the new weights.
    Abort,
}

/// How the roles are placed and paced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mode {
    /// One pool time-shares generation and training.
    pub colocated: bool,
    /// Policy versions the trainer may run ahead of the samples it trains on.
    pub staleness: u64,
    /// The trainer trains micro-batches as they arrive (else it waits for the whole step).
    pub streaming: bool,
    /// Partial rollout (only with `async-<k>`).
    pub partial: Partial,
}

impl Mode {
    /// `colocated-sync`, `separated-sync`, `streaming`, `async-<k>`, or `async-<k>+continue` and
    /// `async-<k>+abort` (partial rollout, as `benches/partial_rollout.py` names the modes).
    pub fn from_name(name: &str) -> Result<Self> {
        if let Some((base, partial)) = name.split_once('+') {
            let partial = match partial {
                "continue" => Partial::Continue,
                "abort" => Partial::Abort,
                _ => return Err(SimError::UnknownMode(name.to_owned())),
            };
            if !base.starts_with("async-") {
                return Err(SimError::UnknownMode(name.to_owned()));
            }
            return Ok(Self { partial, ..Self::from_name(base)? });
        }
        let mode = |colocated, staleness, streaming| {
            Ok(Self { colocated, staleness, streaming, partial: Partial::Off })
        };
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
    /// Mean policy age of the trained samples (the age of a sample's oldest token).
    pub staleness: f64,
    /// Largest policy age of a trained sample.
    pub max_staleness: u64,
    pub rollout_devices: usize,
    pub train_devices: usize,
    /// Samples trained in the whole run, warm-up included.
    pub trained_samples: u64,
    /// Calls into the store index in the whole run, and the real seconds they took.
    pub index_calls: u64,
    pub index_seconds: f64,
    pub events: u64,
}
