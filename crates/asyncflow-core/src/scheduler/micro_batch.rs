//! Token-budget micro-batching: cut one rank's rows into as few micro-batches as the token budget
//! allows, each holding at most `max_tokens` tokens, with their costs as even as the partitioner
//! can make them (an uneven split leaves the rank's later micro-batches short, and in pipeline
//! parallelism every stage waits for the longest one).

use super::cost::CostModel;
use super::partition::{Method, PartitionOptions, partition};
use crate::error::{Result, StoreError};

/// Partitions tried above the lower bound before falling back to first-fit packing.
const TRIES: usize = 8;

#[derive(Debug, Clone, Copy)]
pub struct MicroBatchOptions {
    /// Tokens one micro-batch may hold (the sum of its rows' lengths).
    pub max_tokens: u64,
    /// What is balanced across micro-batches.
    pub cost: CostModel,
    /// At least this many micro-batches, e.g. the most any data-parallel rank needs, so that
    /// all ranks run the same number (some may then be empty).
    pub min_count: usize,
}

/// Splits rows of the given token `lengths` into micro-batches; returns row positions, each
/// micro-batch ascending, the costliest micro-batch first (a rank that runs out of memory then
/// does so at once, not at the end of its step).
pub fn micro_batches(lengths: &[u64], options: &MicroBatchOptions) -> Result<Vec<Vec<usize>>> {
    let max = options.max_tokens;
    options.cost.validate()?;
    if max == 0 {
        return Err(StoreError::bad_request("max_tokens must be at least 1"));
    }
    if let Some((i, &l)) = lengths.iter().enumerate().find(|&(_, &l)| l > max) {
        return Err(StoreError::bad_request(format!(
            "row {i} has {l} tokens, more than max_tokens = {max}; no micro-batch can hold it"
        )));
    }
    let costs = options.cost.costs(lengths);
    let packed = first_fit_decreasing(lengths, max);
    let total: u64 = lengths.iter().sum();
    // Two rows longer than half the budget never share a micro-batch.
    let long = lengths.iter().filter(|&&l| 2 * l > max).count();
    let lower = (total.div_ceil(max) as usize).max(long).max(options.min_count);
    let upper = packed.len().max(options.min_count);

    let options_for = PartitionOptions { method: Method::Balanced, ..PartitionOptions::default() };
    let fits = |part: &Vec<usize>| part.iter().map(|&r| lengths[r]).sum::<u64>() <= max;
    for count in (lower..=upper).take(TRIES) {
        if count == 0 {
            break;
        }
        let parts = partition(&costs, count, &options_for)?;
        if parts.iter().all(fits) {
            return Ok(heaviest_first(parts, &costs));
        }
    }
    let mut parts = packed;
    parts.resize_with(upper, Vec::new);
    for part in &mut parts {
        part.sort_unstable();
    }
    Ok(heaviest_first(parts, &costs))
}

/// Bins of at most `max` tokens, filled longest row first into the first bin with room.
fn first_fit_decreasing(lengths: &[u64], max: u64) -> Vec<Vec<usize>> {
    let mut order: Vec<usize> = (0..lengths.len()).collect();
    order.sort_by_key(|&r| std::cmp::Reverse(lengths[r]));
    let mut bins: Vec<(u64, Vec<usize>)> = Vec::new();
    for r in order {
        match bins.iter_mut().find(|(used, _)| used + lengths[r] <= max) {
            Some((used, rows)) => {
                *used += lengths[r];
                rows.push(r);
            }
            None => bins.push((lengths[r], vec![r])),
        }
    }
    bins.into_iter().map(|(_, rows)| rows).collect()
}

fn heaviest_first(mut parts: Vec<Vec<usize>>, costs: &[f64]) -> Vec<Vec<usize>> {
    let cost = |p: &Vec<usize>| p.iter().map(|&r| costs[r]).sum::<f64>();
    // Stable: equally costly micro-batches keep the partition's order (by first row).
    parts.sort_by(|a, b| cost(b).total_cmp(&cost(a)));
    parts
}
