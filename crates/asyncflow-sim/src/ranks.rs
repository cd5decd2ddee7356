//! Token loads of a pool's data-parallel ranks. Each batch's rows are split into one
//! token-balanced part per rank by the real scheduler's `partition`, the heaviest part going to
//! the least-loaded rank; ranks run independently until they synchronise, so a batch costs what
//! it adds to the busiest rank.

use asyncflow_core::scheduler::{PartitionOptions, partition};

pub struct RankLoads(Vec<f64>);

impl RankLoads {
    pub fn new(ranks: usize) -> Self {
        Self(vec![0.0; ranks.max(1)])
    }

    /// Adds a batch of rows with these token counts; returns the growth of the busiest rank.
    pub fn add(&mut self, tokens: &[u64]) -> f64 {
        let busiest = |loads: &[f64]| loads.iter().copied().fold(0.0, f64::max);
        let before = busiest(&self.0);
        let costs: Vec<f64> = tokens.iter().map(|&t| t as f64).collect();
        let parts = partition(&costs, self.0.len(), &PartitionOptions::default())
            .expect("at least one rank and finite costs");
        let mut sizes: Vec<f64> = parts.iter().map(|p| p.iter().map(|&i| costs[i]).sum()).collect();
        sizes.sort_by(|a, b| b.total_cmp(a));
        let mut order: Vec<usize> = (0..self.0.len()).collect();
        order.sort_by(|&a, &b| self.0[a].total_cmp(&self.0[b]));
        for (rank, size) in order.into_iter().zip(sizes) {
            self.0[rank] += size;
        }
        busiest(&self.0) - before
    }

    /// The ranks have synchronised (an optimizer step).
    pub fn reset(&mut self) {
        self.0.iter_mut().for_each(|l| *l = 0.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn balanced_batches_cost_their_share() {
        let mut ranks = RankLoads::new(4);
        assert!((ranks.add(&[100; 8]) - 200.0).abs() < 1e-9);
        assert!((ranks.add(&[100; 4]) - 100.0).abs() < 1e-9);
    }

    #[test]
    fn the_heaviest_part_goes_to_the_least_loaded_rank() {
        let mut ranks = RankLoads::new(2);
        assert!((ranks.add(&[300]) - 300.0).abs() < 1e-9);
        // 100 joins the idle rank, 50 the busy one: the busiest grows by 50 only.
        assert!((ranks.add(&[100, 50]) - 50.0).abs() < 1e-9);
    }
}
