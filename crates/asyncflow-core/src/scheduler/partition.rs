//! Splitting rows into k data-parallel parts so that the costliest part, which every other rank
//! waits for, is as cheap as possible. Rows that must stay together (a GRPO group) are placed as
//! one unit. The default method runs largest differencing and greedy LPT, keeps the better, and
//! improves it by local search, so it is never worse than LPT on the same input.

use std::collections::HashMap;

use super::differencing::differencing;
use super::greedy::{greedy, round_robin};
use super::refine::{DEFAULT_PROBES, refine};
use crate::error::{Result, StoreError};

/// The most parts a partition makes: each costs memory up front, whatever the row count.
const MAX_PARTS: usize = 1 << 20;

/// How to place units into parts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Method {
    /// The better of largest differencing and LPT, then local search.
    #[default]
    Balanced,
    /// Largest differencing (Karmarkar–Karp) alone.
    Differencing,
    /// Greedy longest-processing-time-first alone.
    Greedy,
    /// Row (or group) i to part i mod k, ignoring costs: the baseline without balancing.
    RoundRobin,
}

impl Method {
    /// Parses the names the Python API uses.
    pub fn from_name(name: &str) -> Result<Self> {
        Ok(match name {
            "balanced" => Self::Balanced,
            "kk" => Self::Differencing,
            "lpt" => Self::Greedy,
            "round_robin" => Self::RoundRobin,
            other => {
                return Err(StoreError::bad_request(format!(
                    "unknown partition method {other:?}; use balanced, kk, lpt or round_robin"
                )));
            }
        })
    }
}

/// Constraints and method of a partition.
#[derive(Debug, Clone, Copy, Default)]
pub struct PartitionOptions<'a> {
    /// One entry per row: rows with the same `Some(group)` land in the same part; `None` rows
    /// are placed alone.
    pub groups: Option<&'a [Option<u64>]>,
    /// Parts get `⌊n/k⌋` or `⌈n/k⌉` rows. With groups, every group must have the same size, and
    /// parts get equally many groups (±1).
    pub equal_count: bool,
    pub method: Method,
}

/// Rows gathered into the units that are placed whole.
struct Units {
    cost: Vec<f64>,
    /// Unit of each row; `None` when every row is its own unit.
    of_row: Option<Vec<u32>>,
    /// Whether units differ in their number of rows.
    uneven_sizes: bool,
}

impl Units {
    fn new(costs: &[f64], groups: Option<&[Option<u64>]>) -> Self {
        let Some(groups) = groups else {
            return Self { cost: costs.to_vec(), of_row: None, uneven_sizes: false };
        };
        let mut cost = Vec::new();
        let mut size: Vec<u32> = Vec::new();
        let mut of_row = Vec::with_capacity(costs.len());
        let mut unit_of_group: HashMap<u64, u32> = HashMap::new();
        for (&c, g) in costs.iter().zip(groups) {
            let u = match g {
                Some(g) => *unit_of_group.entry(*g).or_insert(cost.len() as u32),
                None => cost.len() as u32,
            };
            if u as usize == cost.len() {
                cost.push(0.0);
                size.push(0);
            }
            cost[u as usize] += c;
            size[u as usize] += 1;
            of_row.push(u);
        }
        let uneven_sizes = size.windows(2).any(|w| w[0] != w[1]);
        Self { cost, of_row: Some(of_row), uneven_sizes }
    }

    fn unit_of(&self, row: usize) -> usize {
        self.of_row.as_ref().map_or(row, |of_row| of_row[row] as usize)
    }

    fn rows(&self) -> usize {
        self.of_row.as_ref().map_or(self.cost.len(), Vec::len)
    }
}

/// Splits rows with the given costs into `k` parts; returns each part's row positions,
/// ascending. Parts are listed in order of their first row; empty parts come last.
pub fn partition(
    costs: &[f64],
    k: usize,
    options: &PartitionOptions<'_>,
) -> Result<Vec<Vec<usize>>> {
    check(costs, k, options)?;
    let units = Units::new(costs, options.groups);
    if options.equal_count && units.uneven_sizes {
        return Err(StoreError::bad_request(
            "equal_count with groups needs every group to have the same number of rows",
        ));
    }
    let assignment = place(&units.cost, k, options.equal_count, options.method);
    Ok(expand(&units, &assignment, k))
}

fn check(costs: &[f64], k: usize, options: &PartitionOptions<'_>) -> Result<()> {
    if k == 0 {
        return Err(StoreError::bad_request("a partition needs at least one part (k >= 1)"));
    }
    if k > MAX_PARTS {
        return Err(StoreError::bad_request(format!(
            "k = {k} parts is more than the {MAX_PARTS} supported"
        )));
    }
    if let Some(bad) = costs.iter().find(|c| !(c.is_finite() && **c >= 0.0)) {
        return Err(StoreError::bad_request(format!("costs must be finite and >= 0, not {bad}")));
    }
    if let Some(groups) = options.groups
        && groups.len() != costs.len()
    {
        return Err(StoreError::bad_request(format!(
            "{} groups given for {} rows",
            groups.len(),
            costs.len()
        )));
    }
    Ok(())
}

/// Unit → part.
fn place(costs: &[f64], k: usize, balanced: bool, method: Method) -> Vec<u32> {
    if method == Method::RoundRobin {
        return round_robin(costs.len(), k);
    }
    // Heaviest first, ties by unit; loads are never negative, so their bits order like them.
    // Packed into one integer (inverted load bits, then unit) so the sort compares plain words.
    let mut keys: Vec<u128> = costs
        .iter()
        .enumerate()
        .map(|(u, c)| (u128::from(!c.to_bits()) << 32) | u as u128)
        .collect();
    keys.sort_unstable();
    let order: Vec<u32> = keys.into_iter().map(|key| key as u32).collect();
    match method {
        Method::RoundRobin => unreachable!("handled above"),
        Method::Greedy => greedy(costs, &order, k, balanced),
        Method::Differencing => differencing(costs, &order, k, balanced),
        Method::Balanced => {
            let kk = differencing(costs, &order, k, balanced);
            let lpt = greedy(costs, &order, k, balanced);
            let mut best =
                if max_load(costs, &lpt, k) < max_load(costs, &kk, k) { lpt } else { kk };
            refine(costs, k, &mut best, !balanced, DEFAULT_PROBES);
            best
        }
    }
}

/// The load of the heaviest part of an assignment.
fn max_load(costs: &[f64], assignment: &[u32], k: usize) -> f64 {
    let mut loads = vec![0.0f64; k];
    for (c, &p) in costs.iter().zip(assignment) {
        loads[p as usize] += c;
    }
    loads.into_iter().fold(0.0, f64::max)
}

/// Rows of each part, ascending; parts in order of their first row.
fn expand(units: &Units, assignment: &[u32], k: usize) -> Vec<Vec<usize>> {
    let part_of = |row: usize| assignment[units.unit_of(row)] as usize;
    let mut sizes = vec![0usize; k];
    for row in 0..units.rows() {
        sizes[part_of(row)] += 1;
    }
    let mut slot_of_part = vec![usize::MAX; k];
    let mut parts: Vec<Vec<usize>> = Vec::with_capacity(k);
    for row in 0..units.rows() {
        let part = part_of(row);
        if slot_of_part[part] == usize::MAX {
            slot_of_part[part] = parts.len();
            parts.push(Vec::with_capacity(sizes[part]));
        }
        parts[slot_of_part[part]].push(row);
    }
    parts.resize_with(k, Vec::new);
    parts
}

/// The cost of each part.
pub fn part_costs(costs: &[f64], parts: &[Vec<usize>]) -> Vec<f64> {
    parts.iter().map(|p| p.iter().map(|&r| costs[r]).sum()).collect()
}
