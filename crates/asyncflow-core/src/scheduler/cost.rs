//! Cost models: how much work a row of a given token length makes for the rank that trains on
//! it. Balancing tokens is right when the linear layers dominate; long reasoning traces make
//! self-attention's quadratic term matter, and the attention-aware model accounts for it.

use crate::error::{Result, StoreError};

/// The work one row costs, as a function of its token count.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum CostModel {
    /// Work proportional to tokens.
    #[default]
    Tokens,
    /// `tokens² + linear_weight · tokens`: attention's pairwise term plus the per-token work of
    /// the linear layers, in units of one token pair.
    ///
    /// Per layer, a dense transformer of hidden size d spends about 24·d² FLOPs per token in its
    /// projections and MLP and about 4·d FLOPs per token pair in attention, so the ratio is
    /// `linear_weight ≈ 6·d` (twice that for causal kernels that skip masked blocks).
    Attention { linear_weight: f64 },
}

impl CostModel {
    /// `linear_weight` of the attention model for a hidden size of 4096 (6 · 4096).
    pub const DEFAULT_LINEAR_WEIGHT: f64 = 24_576.0;

    /// Parses the names the Python API uses: `tokens` or `attention`.
    pub fn from_name(name: &str, linear_weight: f64) -> Result<Self> {
        let model = match name {
            "tokens" => Self::Tokens,
            "attention" => Self::Attention { linear_weight },
            other => {
                return Err(StoreError::bad_request(format!(
                    "unknown cost model {other:?}; use \"tokens\" or \"attention\""
                )));
            }
        };
        model.validate()?;
        Ok(model)
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Tokens => "tokens",
            Self::Attention { .. } => "attention",
        }
    }

    /// The linear weight of the attention model; 0 for the tokens model.
    pub fn linear_weight(self) -> f64 {
        match self {
            Self::Tokens => 0.0,
            Self::Attention { linear_weight } => linear_weight,
        }
    }

    pub fn validate(self) -> Result<()> {
        match self {
            Self::Attention { linear_weight }
                if !(linear_weight.is_finite() && linear_weight >= 0.0) =>
            {
                Err(StoreError::bad_request(format!(
                    "linear_weight must be a finite number >= 0, not {linear_weight}"
                )))
            }
            _ => Ok(()),
        }
    }

    pub fn cost(self, tokens: u64) -> f64 {
        let t = tokens as f64;
        match self {
            Self::Tokens => t,
            Self::Attention { linear_weight } => t * t + linear_weight * t,
        }
    }

    pub fn costs(self, lengths: &[u64]) -> Vec<f64> {
        lengths.iter().map(|&l| self.cost(l)).collect()
    }
}

#[cfg(test)]
mod tests {
    // Costs of small integer lengths are exact in f64.
    #![allow(clippy::float_cmp)]

    use super::*;

    #[test]
    fn attention_cost_is_quadratic_plus_linear() {
        let model = CostModel::Attention { linear_weight: 10.0 };
        assert_eq!(model.cost(3), 9.0 + 30.0);
        assert_eq!(CostModel::Tokens.cost(3), 3.0);
    }

    #[test]
    fn names_round_trip_and_unknown_names_are_bad_requests() {
        let model = CostModel::from_name("attention", 2.0).unwrap();
        assert_eq!((model.name(), model.linear_weight()), ("attention", 2.0));
        assert!(matches!(CostModel::from_name("flops", 0.0), Err(StoreError::BadRequest(_))));
        assert!(CostModel::from_name("attention", f64::NAN).is_err());
    }
}
