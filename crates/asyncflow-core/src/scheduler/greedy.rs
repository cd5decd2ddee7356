//! Greedy longest-processing-time-first (LPT): units, heaviest first, each go to the part that is
//! lightest at that moment. A classic 4/3-approximation, and both a baseline and a starting point
//! for local search. Round-robin, the placement a scheduler without cost information makes, is
//! here too as the other baseline.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// LPT over units listed heaviest first in `order`; with `balanced`, part sizes differ by at
/// most one.
pub(super) fn greedy(costs: &[f64], order: &[u32], k: usize, balanced: bool) -> Vec<u32> {
    let n = costs.len();
    let (floor, mut extra) = (n / k, n % k);
    let mut counts = vec![0usize; k];
    let mut loads = vec![0.0f64; k];
    // Lightest part first (loads are never negative, so their bits order like them).
    let mut heap: BinaryHeap<Reverse<(u64, usize)>> =
        (0..k).map(|p| Reverse((0f64.to_bits(), p))).collect();
    let mut assignment = vec![0u32; n];
    for &u in order {
        let part = loop {
            let Reverse((_, p)) = heap.pop().expect("parts with room remain while units do");
            let open = !balanced || counts[p] < floor || (counts[p] == floor && extra > 0);
            if open {
                break p;
            }
        };
        assignment[u as usize] = part as u32;
        loads[part] += costs[u as usize];
        counts[part] += 1;
        if balanced && counts[part] == floor + 1 {
            extra -= 1;
        }
        heap.push(Reverse((loads[part].to_bits(), part)));
    }
    assignment
}

/// Unit `u` goes to part `u mod k`.
pub(super) fn round_robin(n: usize, k: usize) -> Vec<u32> {
    (0..n).map(|u| (u % k) as u32).collect()
}
