//! A claim's and a put's options as Python passes them: one frozen dataclass each
//! (`asyncflow.options.ClaimOptions` and `PutOptions`), read here attribute by attribute and
//! turned into the core's types once, whichever backend then serves the call. The claim
//! options' defaults are the core's: `claim_defaults()` hands them to the Python class.

use std::collections::VecDeque;
use std::sync::Arc;

use asyncflow_core::scheduler::CostModel;
use asyncflow_core::{ClaimSpec, NewRows, PutTarget, Share, StoreError};
use numpy::PyReadonlyArray1;
use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::to_py;
use crate::scheduler::cost_model;

/// Seconds a claim or put waits by default before raising `TimeoutError` / `MemoryLimitError`.
pub const DEFAULT_TIMEOUT: f64 = 60.0;

/// How a claim is made (see `asyncflow.options.ClaimOptions` for each option's meaning).
#[derive(Debug, Clone, PartialEq, FromPyObject, IntoPyObject)]
pub struct ClaimOptions {
    pub timeout: Option<f64>,
    pub partition: Option<String>,
    pub min_version: Option<u64>,
    pub whole_groups: bool,
    pub allow_partial: bool,
    pub partial_after: Option<f64>,
    pub step: Option<u64>,
    pub replica: u64,
    pub dp_rank: u32,
    pub dp_size: u32,
    pub replica_rank: u32,
    pub replica_size: u32,
    pub balance_field: Option<String>,
    pub cost: String,
    pub linear_weight: Option<f64>,
    pub equal_count: bool,
}

impl Default for ClaimOptions {
    /// An unshared claim as the core's `ClaimSpec` and `Share` default to, waiting
    /// `DEFAULT_TIMEOUT` seconds for a full batch.
    fn default() -> Self {
        let spec = ClaimSpec::default();
        let share = Share::default();
        Self {
            timeout: Some(DEFAULT_TIMEOUT),
            partition: spec.partition,
            min_version: spec.min_version,
            whole_groups: spec.whole_groups,
            allow_partial: false,
            partial_after: spec.partial_after.map(|d| d.as_secs_f64()),
            step: None,
            replica: share.replica,
            dp_rank: share.dp_rank,
            dp_size: share.dp_size,
            replica_rank: share.replica_rank,
            replica_size: share.replica_size,
            balance_field: share.balance_field,
            cost: share.cost.name().to_owned(),
            linear_weight: Some(CostModel::DEFAULT_LINEAR_WEIGHT),
            equal_count: share.equal_count,
        }
    }
}

/// A claim as a backend takes it.
pub struct Claim {
    pub spec: ClaimSpec,
    /// Return what is ready when the timeout passes instead of raising.
    pub allow_partial: bool,
    /// Seconds to wait for a full batch; `None`: for ever.
    pub timeout: Option<f64>,
}

impl ClaimOptions {
    /// The claim of up to `batch_size` rows ready for `fields` and free for `task`, checked.
    pub fn into_claim(self, task: String, fields: Vec<String>, batch_size: i64) -> PyResult<Claim> {
        let batch_size = usize::try_from(batch_size).map_err(|_| {
            to_py(StoreError::bad_request(format!(
                "batch_size must be at least 1, not {batch_size}"
            )))
        })?;
        let share = self.share()?;
        let partial_after = crate::blocking::wait_seconds(self.partial_after, "partial_after")?;
        Ok(Claim {
            spec: ClaimSpec {
                task,
                fields,
                batch_size,
                partition: self.partition,
                min_version: self.min_version,
                whole_groups: self.whole_groups,
                share,
                partial_after,
            },
            allow_partial: self.allow_partial,
            timeout: self.timeout,
        })
    }

    /// How the claim is shared: `None` without `step`, when every sharing option must keep the
    /// core's default (the cost model included: it is only read with `step`).
    fn share(&self) -> PyResult<Option<Share>> {
        let cost = cost_model(&self.cost, self.linear_weight)?;
        let Some(step) = self.step else {
            let weighed = self.linear_weight.is_some_and(|w| w != CostModel::DEFAULT_LINEAR_WEIGHT);
            if self.share_with(0, cost) != Share::default() || weighed {
                return Err(to_py(StoreError::bad_request(
                    "replica, dp_*, replica_*, balance_field, equal_count, cost and \
                     linear_weight share a step's batch; they need step",
                )));
            }
            return Ok(None);
        };
        Ok(Some(self.share_with(step, cost)))
    }

    fn share_with(&self, step: u64, cost: CostModel) -> Share {
        Share {
            step,
            replica: self.replica,
            dp_rank: self.dp_rank,
            dp_size: self.dp_size,
            replica_rank: self.replica_rank,
            replica_size: self.replica_size,
            balance_field: self.balance_field.clone(),
            cost,
            equal_count: self.equal_count,
        }
    }
}

/// Claim options already read, by the Python object they were read from. The options are a
/// frozen dataclass and `Store.claim` passes one object per set of keywords, so a claim that
/// passes an object seen lately takes what was read then instead of reading every attribute
/// again (about a fifth of an embedded claim's time). The lock is never held across a call
/// into Python.
#[derive(Default)]
pub struct SeenClaimOptions {
    seen: Mutex<VecDeque<(Py<PyAny>, ClaimOptions)>>,
}

impl SeenClaimOptions {
    /// How many objects are remembered (one per distinct set of keywords in use at once).
    const KEPT: usize = 8;

    /// The options `options` holds (the defaults for `None`).
    pub fn read(&self, options: Option<&Bound<'_, PyAny>>) -> PyResult<ClaimOptions> {
        let Some(object) = options else {
            return Ok(ClaimOptions::default());
        };
        let seen = self.seen.lock();
        let hit = seen.iter().find(|(o, _)| o.as_ptr() == object.as_ptr()).map(|(_, r)| r.clone());
        drop(seen);
        if let Some(read) = hit {
            return Ok(read);
        }
        let read: ClaimOptions = object.extract()?;
        let evicted = {
            let mut seen = self.seen.lock();
            let evicted = if seen.len() == Self::KEPT { seen.pop_front() } else { None };
            seen.push_back((object.clone().unbind(), read.clone()));
            evicted
        };
        drop(evicted);
        Ok(read)
    }
}

/// The claim options' defaults, `{option: value}`: what `ClaimOptions` in Python starts from.
#[pyfunction]
pub fn claim_defaults(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    ClaimOptions::default().into_pyobject(py)
}

/// How a put writes (see `asyncflow.options.PutOptions`), with the per-row values already
/// made arrays and the tags one dict per row by the Python side.
#[derive(Default, FromPyObject)]
pub struct PutOptions<'py> {
    pub partition: Option<String>,
    pub indexes: Option<PyReadonlyArray1<'py, u64>>,
    pub groups: Option<PyReadonlyArray1<'py, i64>>,
    pub group_size: Option<u32>,
    pub version: Option<PyReadonlyArray1<'py, u64>>,
    pub tags: Option<Vec<Bound<'py, PyDict>>>,
    pub timeout: Option<f64>,
}

impl PutOptions<'_> {
    /// The rows the put writes (existing `indexes`, or new rows described by the rest) and the
    /// seconds it may wait for memory (`None` waits the default).
    pub fn into_target(self) -> PyResult<(PutTarget, Option<f64>)> {
        let timeout = self.timeout.or(Some(DEFAULT_TIMEOUT));
        if let Some(indexes) = self.indexes {
            if self.partition.is_some()
                || self.groups.is_some()
                || self.version.is_some()
                || self.tags.is_some()
            {
                return Err(to_py(StoreError::bad_request(
                    "partition, groups, versions and tags describe new rows; they cannot be given with indexes",
                )));
            }
            return Ok((PutTarget::Existing(indexes.as_slice()?.to_vec()), timeout));
        }
        let tags = self.tags.unwrap_or_default().iter().map(tag_pairs).collect::<PyResult<_>>()?;
        let rows = NewRows {
            partition: self.partition.unwrap_or_else(|| "default".to_owned()),
            groups: self.groups.map(|g| groups_to_core(g.as_slice()?)).transpose()?,
            group_size: self.group_size,
            versions: self
                .version
                .map_or_else(|| Ok(vec![0]), |v| v.as_slice().map(<[u64]>::to_vec))?,
            tags,
        };
        Ok((PutTarget::New(rows), timeout))
    }
}

/// One row's tags, in the dict's order.
fn tag_pairs(tags: &Bound<'_, PyDict>) -> PyResult<Arc<Vec<(String, String)>>> {
    let pairs = tags.iter().map(|(k, v)| Ok((k.extract()?, v.extract()?)));
    Ok(Arc::new(pairs.collect::<PyResult<_>>()?))
}

fn groups_to_core(groups: &[i64]) -> PyResult<Vec<u64>> {
    groups
        .iter()
        .map(|&g| {
            u64::try_from(g).map_err(|_| {
                to_py(StoreError::bad_request(format!("group ids must be >= 0, got {g}")))
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim(options: ClaimOptions) -> PyResult<Claim> {
        options.into_claim("t".into(), vec!["x".into()], 4)
    }

    #[test]
    fn the_default_options_make_the_cores_default_claim() {
        let c = claim(ClaimOptions::default()).unwrap();
        let core = ClaimSpec {
            task: "t".into(),
            fields: vec!["x".into()],
            batch_size: 4,
            ..ClaimSpec::default()
        };
        assert_eq!(c.spec, core);
        assert!(!c.allow_partial);
        assert_eq!(c.timeout, Some(DEFAULT_TIMEOUT));
    }

    #[test]
    fn a_step_shares_the_claim_as_asked_and_the_rest_stays_the_cores_default() {
        let options = ClaimOptions { step: Some(3), dp_rank: 1, dp_size: 2, ..Default::default() };
        let share = claim(options).unwrap().spec.share.unwrap();
        assert_eq!(share, Share { step: 3, dp_rank: 1, dp_size: 2, ..Share::default() });
    }

    #[test]
    fn sharing_options_and_the_cost_model_need_a_step() {
        let ranks = ClaimOptions { dp_size: 2, ..Default::default() };
        assert!(claim(ranks).is_err());
        let unknown = ClaimOptions { cost: "unknown".into(), ..Default::default() };
        assert!(claim(unknown.clone()).is_err());
        assert!(claim(ClaimOptions { step: Some(1), ..unknown }).is_err());
        let attention = ClaimOptions { cost: "attention".into(), ..Default::default() };
        assert!(claim(attention.clone()).is_err());
        assert!(claim(ClaimOptions { step: Some(1), ..attention }).unwrap().spec.share.is_some());
        let weighed = ClaimOptions { linear_weight: Some(5.0), ..Default::default() };
        assert!(claim(weighed).is_err());
        assert!(claim(ClaimOptions::default()).unwrap().spec.share.is_none());
    }
}
