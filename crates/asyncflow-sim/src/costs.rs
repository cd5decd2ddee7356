//! The cost model: what each role's work costs on one device, the workload, and the network.
//! Its parameters are named as in the YAML files of the Python harness
//! (`python/asyncflow/bench/costs/`), section and key joined by a dot.

use std::collections::HashMap;

use crate::error::{Result, SimError};

#[derive(Debug, Clone, PartialEq)]
pub struct Workload {
    pub prompts_per_step: u64,
    pub group_size: u64,
    pub prompt_tokens: u64,
    pub response_median_tokens: f64,
    pub response_sigma: f64,
    pub response_max_tokens: u64,
    pub seed: u64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Rollout {
    pub max_batch: usize,
    pub decode_step_s: f64,
    pub decode_per_sequence_s: f64,
    pub prefill_tokens_per_s: f64,
    pub weight_load_s: f64,
}

impl Rollout {
    /// Seconds of one decode step with `batch` sequences in flight.
    pub fn decode_step(&self, batch: usize) -> f64 {
        self.decode_step_s + self.decode_per_sequence_s * batch as f64
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Network {
    pub weights_gib: f64,
    pub bandwidth_gib_s: f64,
    pub hop_latency_s: f64,
}

impl Network {
    fn transfer_s(&self) -> f64 {
        self.weights_gib / self.bandwidth_gib_s
    }

    /// Gathering the trained weights, then a pipelined tree broadcast to `receivers`.
    pub fn publish_s(&self, receivers: usize) -> f64 {
        2.0 * self.transfer_s() + ((receivers + 1) as f64).log2().ceil() * self.hop_latency_s
    }

    /// A ring all-reduce of the gradients over `ranks` data-parallel ranks.
    pub fn all_reduce_s(&self, ranks: usize) -> f64 {
        if ranks <= 1 {
            return 0.0;
        }
        let r = ranks as f64;
        2.0 * (r - 1.0) / r * self.transfer_s() + 2.0 * r.log2().ceil() * self.hop_latency_s
    }
}

/// Every parameter of a run. `calls_per_device`, `groups_per_call` and `micro_batch_groups` are
/// the workers' settings at `devices`; [`CostModel::scaled`] grows the batch sizes with the
/// cluster.
#[derive(Debug, Clone, PartialEq)]
pub struct CostModel {
    pub devices: usize,
    pub rollout_devices: Option<usize>,
    pub workload: Workload,
    pub rollout: Rollout,
    pub reference_tokens_per_s: f64,
    pub trainer_tokens_per_s: f64,
    pub optimizer_step_s: f64,
    pub network: Network,
    pub reward_workers: usize,
    pub reward_per_sample_s: f64,
    pub to_train_s: f64,
    pub to_generate_s: f64,
    pub calls_per_device: usize,
    pub groups_per_call: u64,
    pub micro_batch_groups: u64,
}

/// Reads named parameters, remembering which were used so that unknown names can be reported.
struct Params<'a> {
    values: &'a HashMap<String, f64>,
}

impl Params<'_> {
    fn get(&self, name: &str) -> Result<f64> {
        let v = *self.values.get(name).ok_or_else(|| SimError::Missing(name.to_owned()))?;
        if !v.is_finite() || v < 0.0 {
            return Err(SimError::Invalid(format!(
                "{name} must be a non-negative number, not {v}"
            )));
        }
        Ok(v)
    }

    fn positive(&self, name: &str) -> Result<f64> {
        let v = self.get(name)?;
        if v == 0.0 {
            return Err(SimError::Invalid(format!("{name} must be positive")));
        }
        Ok(v)
    }

    fn count(&self, name: &str) -> Result<u64> {
        let v = self.positive(name)?;
        if v.fract() != 0.0 {
            return Err(SimError::Invalid(format!("{name} must be a whole number, not {v}")));
        }
        Ok(v as u64)
    }
}

/// Parameters of the real-time emulation only, which the simulator accepts and ignores.
pub const EMULATION_ONLY: [&str; 4] =
    ["emulation.compression", "emulation.warmup_steps", "emulation.steps", "emulation.weights_mib"];

/// Every parameter name [`CostModel::from_params`] reads.
pub const PARAMETERS: [&str; 27] = [
    "devices",
    "workload.prompts_per_step",
    "workload.group_size",
    "workload.prompt_tokens",
    "workload.response_median_tokens",
    "workload.response_sigma",
    "workload.response_max_tokens",
    "workload.seed",
    "rollout.max_batch",
    "rollout.decode_step_s",
    "rollout.decode_per_sequence_s",
    "rollout.prefill_tokens_per_s",
    "rollout.weight_load_s",
    "reference.tokens_per_s",
    "trainer.tokens_per_s",
    "trainer.optimizer_step_s",
    "network.weights_gib",
    "network.bandwidth_gib_s",
    "network.hop_latency_s",
    "reward.workers",
    "reward.per_sample_s",
    "colocated.to_train_s",
    "colocated.to_generate_s",
    "emulation.calls_per_device",
    "emulation.groups_per_call",
    "emulation.micro_batch_groups",
    "rollout_devices",
];

impl CostModel {
    /// Builds the model from `section.key` parameters (`rollout_devices` is optional). Unknown
    /// names are an error, so that a misspelt parameter is not silently ignored.
    pub fn from_params(values: &HashMap<String, f64>) -> Result<Self> {
        let known = |k: &str| PARAMETERS.contains(&k) || EMULATION_ONLY.contains(&k);
        if let Some(unknown) = values.keys().find(|k| !known(k)) {
            return Err(SimError::Invalid(format!("unknown cost model parameter {unknown:?}")));
        }
        let p = Params { values };
        let devices = p.count("devices")? as usize;
        let rollout_devices = match values.get("rollout_devices") {
            None => None,
            Some(_) => Some(p.count("rollout_devices")? as usize),
        };
        if rollout_devices.is_some_and(|r| r >= devices) {
            return Err(SimError::Invalid("rollout_devices must leave devices to train".into()));
        }
        Ok(Self {
            devices,
            rollout_devices,
            workload: Workload {
                prompts_per_step: p.count("workload.prompts_per_step")?,
                group_size: p.count("workload.group_size")?,
                prompt_tokens: p.get("workload.prompt_tokens")? as u64,
                response_median_tokens: p.positive("workload.response_median_tokens")?,
                response_sigma: p.get("workload.response_sigma")?,
                response_max_tokens: p.count("workload.response_max_tokens")?,
                seed: p.get("workload.seed")? as u64,
            },
            rollout: Rollout {
                max_batch: p.count("rollout.max_batch")? as usize,
                decode_step_s: p.positive("rollout.decode_step_s")?,
                decode_per_sequence_s: p.get("rollout.decode_per_sequence_s")?,
                prefill_tokens_per_s: p.positive("rollout.prefill_tokens_per_s")?,
                weight_load_s: p.get("rollout.weight_load_s")?,
            },
            reference_tokens_per_s: p.positive("reference.tokens_per_s")?,
            trainer_tokens_per_s: p.positive("trainer.tokens_per_s")?,
            optimizer_step_s: p.get("trainer.optimizer_step_s")?,
            network: Network {
                weights_gib: p.get("network.weights_gib")?,
                bandwidth_gib_s: p.positive("network.bandwidth_gib_s")?,
                hop_latency_s: p.get("network.hop_latency_s")?,
            },
            reward_workers: p.count("reward.workers")? as usize,
            reward_per_sample_s: p.get("reward.per_sample_s")?,
            to_train_s: p.get("colocated.to_train_s")?,
            to_generate_s: p.get("colocated.to_generate_s")?,
            calls_per_device: p.count("emulation.calls_per_device")? as usize,
            groups_per_call: p.count("emulation.groups_per_call")?,
            micro_batch_groups: p.count("emulation.micro_batch_groups")?,
        })
    }

    /// Mean response length: the lognormal's mean below the cap plus the cap's share.
    pub fn mean_response_tokens(&self) -> f64 {
        let w = &self.workload;
        let (mu, sigma, cap) =
            (w.response_median_tokens.ln(), w.response_sigma, w.response_max_tokens as f64);
        if sigma == 0.0 {
            return w.response_median_tokens.min(cap);
        }
        let z = (cap.ln() - mu) / sigma;
        (mu + sigma * sigma / 2.0).exp() * normal_cdf(z - sigma) + cap * (1.0 - normal_cdf(z))
    }

    /// Device-seconds to generate one response with the device's batch full.
    pub fn generate_s(&self) -> f64 {
        let r = &self.rollout;
        self.mean_response_tokens() * r.decode_step(r.max_batch) / r.max_batch as f64
            + self.workload.prompt_tokens as f64 / r.prefill_tokens_per_s
    }

    /// Device-seconds to train on one sample and compute its reference log-probs.
    pub fn train_s(&self) -> f64 {
        let tokens = self.workload.prompt_tokens as f64 + self.mean_response_tokens();
        tokens / self.trainer_tokens_per_s + tokens / self.reference_tokens_per_s
    }

    /// Samples/s if the slower side of a separated placement were always busy.
    pub fn separated_bound(&self, rollout_devices: usize) -> f64 {
        let train = (self.devices - rollout_devices) as f64;
        (rollout_devices as f64 / self.generate_s()).min(train / self.train_s())
    }

    /// Samples/s if one pool did nothing but generate and train, one after the other.
    pub fn colocated_bound(&self) -> f64 {
        self.devices as f64 / (self.generate_s() + self.train_s())
    }

    /// (rollout devices, training devices) of the separated modes.
    pub fn split(&self) -> (usize, usize) {
        let rollout = self.rollout_devices.unwrap_or_else(|| {
            (1..self.devices)
                .max_by(|&a, &b| self.separated_bound(a).total_cmp(&self.separated_bound(b)))
                .unwrap_or(1)
        });
        (rollout, self.devices - rollout)
    }

    /// The same model on `devices` accelerators with prompts per step, the trainer's micro-batch,
    /// the reward workers and an explicit rollout split grown alike (weak scaling).
    #[must_use]
    pub fn scaled(&self, devices: usize) -> Self {
        let factor = devices as f64 / self.devices as f64;
        let grow = |x: u64| ((x as f64 * factor).round() as u64).max(1);
        let mut scaled = self.clone();
        scaled.devices = devices;
        scaled.workload.prompts_per_step = grow(self.workload.prompts_per_step);
        scaled.micro_batch_groups = grow(self.micro_batch_groups);
        scaled.reward_workers = grow(self.reward_workers as u64) as usize;
        scaled.rollout_devices =
            self.rollout_devices.map(|r| (grow(r as u64) as usize).min(devices - 1));
        scaled
    }
}

/// Φ(x), from the complementary error function (Abramowitz and Stegun 7.1.26, |error| < 1.5e-7).
fn normal_cdf(x: f64) -> f64 {
    let z = x.abs() / std::f64::consts::SQRT_2;
    let t = 1.0 / (1.0 + 0.327_591_1 * z);
    let poly = t
        * (0.254_829_592
            + t * (-0.284_496_736
                + t * (1.421_413_741 + t * (-1.453_152_027 + t * 1.061_405_429))));
    let erfc = poly * (-z * z).exp();
    if x >= 0.0 { 1.0 - erfc / 2.0 } else { erfc / 2.0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_normal_cdf_matches_known_values() {
        assert!((normal_cdf(0.0) - 0.5).abs() < 1e-7);
        assert!((normal_cdf(1.96) - 0.975).abs() < 1e-4);
        assert!((normal_cdf(-1.0) - 0.158_655).abs() < 1e-5);
    }
}
