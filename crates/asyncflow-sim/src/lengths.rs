//! Response lengths: lognormal, cut at the cap, drawn from a small seeded generator so that a
//! group's lengths depend only on the seed and the group, whatever the mode or cluster size.

/// `SplitMix64`: tiny, fast, and good enough for drawing workloads.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in (0, 1].
    fn unit(&mut self) -> f64 {
        ((self.next() >> 11) + 1) as f64 / (1u64 << 53) as f64
    }

    /// Standard normal (Box–Muller).
    fn normal(&mut self) -> f64 {
        let (u, v) = (self.unit(), self.unit());
        (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
    }
}

/// The `n` response lengths (tokens, at least 1) of prompt group `group`.
pub fn group_lengths(seed: u64, group: u64, n: u64, median: f64, sigma: f64, cap: u64) -> Vec<u64> {
    let mut rng = SplitMix64(seed ^ group.wrapping_mul(0xD1B5_4A32_D192_ED03));
    (0..n)
        .map(|_| {
            let x = (median.ln() + sigma * rng.normal()).exp().round();
            (x as u64).clamp(1, cap)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lengths_depend_only_on_seed_and_group() {
        let a = group_lengths(7, 3, 16, 1500.0, 1.0, 16384);
        assert_eq!(a, group_lengths(7, 3, 16, 1500.0, 1.0, 16384));
        assert_ne!(a, group_lengths(7, 4, 16, 1500.0, 1.0, 16384));
    }

    #[test]
    fn lengths_follow_the_lognormal_and_respect_the_cap() {
        let all: Vec<u64> =
            (0..4000).flat_map(|g| group_lengths(1, g, 16, 1500.0, 1.0, 16384)).collect();
        let mut sorted = all.clone();
        sorted.sort_unstable();
        let median = sorted[sorted.len() / 2] as f64;
        assert!((median / 1500.0 - 1.0).abs() < 0.05, "median {median}");
        assert!(all.iter().all(|&l| (1..=16384).contains(&l)));
        let capped = all.iter().filter(|&&l| l == 16384).count() as f64 / all.len() as f64;
        assert!((0.005..0.02).contains(&capped), "share at the cap {capped}");
    }
}
