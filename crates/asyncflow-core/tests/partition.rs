//! The data-parallel partitioner and the micro-batcher, as specifications:
//! - every partition is a permutation of its input split into exactly k parts;
//! - rows of one group share a part, and equal-count parts differ in size by at most one;
//! - the default method is never worse than greedy LPT under the same constraints;
//! - micro-batches respect the token budget and never use more micro-batches than first-fit.

// Costs here are sums of small integers, which f64 holds exactly.
#![allow(clippy::float_cmp)]

use std::collections::HashMap;

use asyncflow_core::StoreError;
use asyncflow_core::scheduler::{
    CostModel, Method, MicroBatchOptions, PartitionOptions, micro_batches, part_costs, partition,
};
use proptest::prelude::*;

fn max_cost(costs: &[f64], parts: &[Vec<usize>]) -> f64 {
    part_costs(costs, parts).into_iter().fold(0.0, f64::max)
}

fn as_costs(lengths: &[u64]) -> Vec<f64> {
    CostModel::Tokens.costs(lengths)
}

fn with(method: Method, equal_count: bool) -> PartitionOptions<'static> {
    PartitionOptions { method, equal_count, groups: None }
}

fn assert_permutation(parts: &[Vec<usize>], n: usize) {
    let mut seen: Vec<usize> = parts.iter().flatten().copied().collect();
    seen.sort_unstable();
    assert_eq!(seen, (0..n).collect::<Vec<_>>());
}

/// Lengths shaped like reasoning traces: mostly short, a long tail.
fn lengths() -> impl Strategy<Value = Vec<u64>> {
    prop::collection::vec(
        prop_oneof![4 => 1..2_000u64, 1 => 2_000..30_000u64, 1 => Just(0u64)],
        0..300,
    )
}

#[test]
fn a_perfect_split_is_found_when_one_exists() {
    let costs = as_costs(&[8, 7, 6, 5, 4]);
    let parts = partition(&costs, 2, &PartitionOptions::default()).unwrap();
    assert_eq!(part_costs(&costs, &parts), vec![15.0, 15.0]);
}

#[test]
fn parts_ascend_and_come_in_order_of_their_first_row_with_empty_parts_last() {
    let parts = partition(&as_costs(&[5, 1, 1, 1, 1, 1]), 4, &PartitionOptions::default()).unwrap();
    assert_eq!(parts[0], vec![0]);
    assert!(parts.iter().all(|p| p.windows(2).all(|w| w[0] < w[1])));
    let firsts: Vec<usize> = parts.iter().filter_map(|p| p.first().copied()).collect();
    assert!(firsts.windows(2).all(|w| w[0] < w[1]));
}

#[test]
fn fewer_rows_than_parts_leaves_parts_empty() {
    let parts = partition(&as_costs(&[3, 2]), 4, &PartitionOptions::default()).unwrap();
    assert_eq!(parts.len(), 4);
    assert_eq!(parts.iter().filter(|p| p.is_empty()).count(), 2);
}

#[test]
fn zero_parts_and_negative_costs_are_bad_requests() {
    assert!(matches!(
        partition(&[1.0], 0, &PartitionOptions::default()),
        Err(StoreError::BadRequest(_))
    ));
    assert!(matches!(
        partition(&[-1.0], 2, &PartitionOptions::default()),
        Err(StoreError::BadRequest(_))
    ));
    assert!(matches!(
        partition(&[f64::NAN], 2, &PartitionOptions::default()),
        Err(StoreError::BadRequest(_))
    ));
}

#[test]
fn equal_count_with_groups_of_different_sizes_is_a_bad_request() {
    let groups = [Some(1), Some(1), Some(2)];
    let options = PartitionOptions {
        groups: Some(&groups),
        equal_count: true,
        ..PartitionOptions::default()
    };
    assert!(matches!(partition(&[1.0, 1.0, 1.0], 2, &options), Err(StoreError::BadRequest(_))));
}

#[test]
fn a_group_count_that_disagrees_with_the_rows_is_a_bad_request() {
    let groups = [Some(1)];
    let options = PartitionOptions { groups: Some(&groups), ..PartitionOptions::default() };
    assert!(matches!(partition(&[1.0, 1.0], 2, &options), Err(StoreError::BadRequest(_))));
}

#[test]
fn the_attention_model_isolates_a_long_row_that_token_balance_would_pair() {
    let lengths = [6, 3, 3, 2, 2, 2];
    // By tokens, 6 + 3 against 3 + 2 + 2 + 2 is a perfect 9 / 9.
    let by_tokens = partition(&as_costs(&lengths), 2, &PartitionOptions::default()).unwrap();
    assert_eq!(part_costs(&as_costs(&lengths), &by_tokens), vec![9.0, 9.0]);
    // By squares that split costs 45 against 21; the 6-token row alone (36 against 30) is best.
    let squares = CostModel::Attention { linear_weight: 0.0 }.costs(&lengths);
    let parts = partition(&squares, 2, &PartitionOptions::default()).unwrap();
    assert_eq!(max_cost(&squares, &parts), 36.0);
    assert!(parts.contains(&vec![0]));
}

#[test]
fn micro_batches_fit_the_budget_and_come_heaviest_first() {
    let lengths = [900, 100, 500, 500, 300, 700, 200, 800];
    let options = MicroBatchOptions { max_tokens: 1000, cost: CostModel::Tokens, min_count: 1 };
    let batches = micro_batches(&lengths, &options).unwrap();
    assert_eq!(batches.len(), 4, "4000 tokens need four micro-batches of 1000");
    assert_permutation(&batches, lengths.len());
    let tokens: Vec<u64> = batches.iter().map(|b| b.iter().map(|&r| lengths[r]).sum()).collect();
    assert!(tokens.iter().all(|&t| t <= 1000));
    assert!(tokens.windows(2).all(|w| w[0] >= w[1]));
}

#[test]
fn min_count_pads_micro_batches_so_every_rank_runs_the_same_number() {
    let options = MicroBatchOptions { max_tokens: 1000, cost: CostModel::Tokens, min_count: 3 };
    let batches = micro_batches(&[10, 20], &options).unwrap();
    assert_eq!(batches.len(), 3);
    assert_permutation(&batches, 2);
}

#[test]
fn a_row_longer_than_the_budget_is_a_bad_request() {
    let options = MicroBatchOptions { max_tokens: 100, cost: CostModel::Tokens, min_count: 1 };
    assert!(matches!(micro_batches(&[50, 101], &options), Err(StoreError::BadRequest(_))));
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn every_partition_is_a_permutation_of_its_input(
        lengths in lengths(), k in 1..40usize,
        method in prop_oneof![Just(Method::Balanced), Just(Method::Differencing), Just(Method::Greedy), Just(Method::RoundRobin)],
        equal_count: bool,
    ) {
        let parts = partition(&as_costs(&lengths), k, &with(method, equal_count)).unwrap();
        prop_assert_eq!(parts.len(), k);
        assert_permutation(&parts, lengths.len());
    }

    #[test]
    fn equal_count_parts_differ_in_size_by_at_most_one(
        lengths in lengths(), k in 1..40usize,
        method in prop_oneof![Just(Method::Balanced), Just(Method::Differencing), Just(Method::Greedy)],
    ) {
        let parts = partition(&as_costs(&lengths), k, &with(method, true)).unwrap();
        let sizes: Vec<usize> = parts.iter().map(Vec::len).collect();
        let (lo, hi) = (sizes.iter().min().unwrap(), sizes.iter().max().unwrap());
        prop_assert!(hi - lo <= 1, "sizes {sizes:?}");
    }

    #[test]
    fn rows_of_a_group_share_a_part(
        sizes in prop::collection::vec(1..9usize, 0..60), k in 1..20usize, equal_count: bool,
        seed in any::<u64>(),
    ) {
        // Equal-count groups must all be the same size; use the first size for all of them then.
        let sizes: Vec<usize> = if equal_count { sizes.iter().map(|_| sizes[0]).collect() } else { sizes };
        let groups: Vec<Option<u64>> = sizes.iter().enumerate()
            .flat_map(|(g, &s)| std::iter::repeat_n(Some(g as u64 * 7 + 3), s)).collect();
        let costs: Vec<f64> = (0..groups.len()).map(|i| ((seed >> (i % 60)) % 1000) as f64).collect();
        let options = PartitionOptions { groups: Some(&groups), equal_count, method: Method::Balanced };
        let parts = partition(&costs, k, &options).unwrap();
        assert_permutation(&parts, groups.len());
        let mut part_of: HashMap<u64, usize> = HashMap::new();
        for (p, rows) in parts.iter().enumerate() {
            for &r in rows {
                let g = groups[r].unwrap();
                prop_assert_eq!(*part_of.entry(g).or_insert(p), p, "group {} split", g);
            }
        }
        if equal_count {
            let counts: Vec<usize> = parts.iter().map(|p| p.len() / sizes.first().copied().unwrap_or(1)).collect();
            prop_assert!(counts.iter().max().unwrap_or(&0) - counts.iter().min().unwrap_or(&0) <= 1);
        }
    }

    #[test]
    fn the_default_method_is_never_worse_than_greedy_lpt(
        lengths in lengths(), k in 1..40usize, equal_count: bool, attention: bool,
    ) {
        let model = if attention { CostModel::Attention { linear_weight: 512.0 } } else { CostModel::Tokens };
        let costs = model.costs(&lengths);
        let ours = partition(&costs, k, &with(Method::Balanced, equal_count)).unwrap();
        let lpt = partition(&costs, k, &with(Method::Greedy, equal_count)).unwrap();
        let kk = partition(&costs, k, &with(Method::Differencing, equal_count)).unwrap();
        let best = max_cost(&costs, &ours);
        prop_assert!(best <= max_cost(&costs, &lpt), "{} > LPT {}", best, max_cost(&costs, &lpt));
        prop_assert!(best <= max_cost(&costs, &kk));
        // Nobody beats the largest row, or the mean part.
        let bound = costs.iter().copied().fold(costs.iter().sum::<f64>() / k as f64, f64::max);
        prop_assert!(best >= bound * (1.0 - 1e-12));
    }

    #[test]
    fn micro_batches_hold_at_most_max_tokens_and_no_more_batches_than_first_fit(
        lengths in prop::collection::vec(0..1_000u64, 0..200), max_tokens in 1_000..5_000u64,
        min_count in 0..6usize, attention: bool,
    ) {
        let cost = if attention { CostModel::Attention { linear_weight: 64.0 } } else { CostModel::Tokens };
        let batches = micro_batches(&lengths, &MicroBatchOptions { max_tokens, cost, min_count }).unwrap();
        assert_permutation(&batches, lengths.len());
        prop_assert!(batches.len() >= min_count);
        for b in &batches {
            prop_assert!(b.iter().map(|&r| lengths[r]).sum::<u64>() <= max_tokens);
        }
        let total: u64 = lengths.iter().sum();
        prop_assert!(batches.len() <= first_fit_bound(&lengths, max_tokens).max(min_count).max(usize::from(total > 0)));
    }
}

/// First-fit-decreasing's bin count: what a budget-only packer would use.
fn first_fit_bound(lengths: &[u64], max: u64) -> usize {
    let mut sorted = lengths.to_vec();
    sorted.sort_unstable_by(|a, b| b.cmp(a));
    let mut bins: Vec<u64> = Vec::new();
    for l in sorted {
        match bins.iter_mut().find(|used| **used + l <= max) {
            Some(used) => *used += l,
            None => bins.push(l),
        }
    }
    bins.len()
}
