//! What the simulator guarantees about the pipelines it runs, on a small version of the
//! paper-like cost model (`python/asyncflow/bench/costs/paper-7b.yaml`).

use std::collections::HashMap;

use asyncflow_sim::{CostModel, Mode, Outcome, Scenario, SimError, simulate};

fn params() -> HashMap<String, f64> {
    [
        ("devices", 8.0),
        ("workload.prompts_per_step", 32.0),
        ("workload.group_size", 16.0),
        ("workload.prompt_tokens", 320.0),
        ("workload.response_median_tokens", 1500.0),
        ("workload.response_sigma", 1.0),
        ("workload.response_max_tokens", 16384.0),
        ("workload.seed", 0.0),
        ("rollout.max_batch", 128.0),
        ("rollout.decode_step_s", 0.008),
        ("rollout.decode_per_sequence_s", 0.000_035),
        ("rollout.prefill_tokens_per_s", 40000.0),
        ("rollout.weight_load_s", 1.0),
        ("reference.tokens_per_s", 18000.0),
        ("trainer.tokens_per_s", 6000.0),
        ("trainer.optimizer_step_s", 1.0),
        ("network.weights_gib", 14.2),
        ("network.bandwidth_gib_s", 20.0),
        ("network.hop_latency_s", 0.002),
        ("reward.workers", 1.0),
        ("reward.per_sample_s", 0.01),
        ("colocated.to_train_s", 3.0),
        ("colocated.to_generate_s", 6.0),
        ("emulation.calls_per_device", 32.0),
        ("emulation.groups_per_call", 1.0),
        ("emulation.micro_batch_groups", 4.0),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect()
}

fn costs() -> CostModel {
    CostModel::from_params(&params()).unwrap()
}

fn run(costs: &CostModel, mode: &str) -> Outcome {
    let mode = Mode::from_name(mode).unwrap();
    simulate(&Scenario { costs: costs.clone(), mode, warmup_steps: 3, steps: 4 }).unwrap()
}

fn busy(outcome: &Outcome, role: &str) -> f64 {
    outcome.busy.iter().find(|(r, _)| *r == role).unwrap().1
}

#[test]
fn the_same_scenario_gives_the_same_figures() {
    let (a, b) = (run(&costs(), "async-1"), run(&costs(), "async-1"));
    assert_eq!(a.samples_per_s.to_bits(), b.samples_per_s.to_bits());
    assert_eq!(a.busy, b.busy);
    assert_eq!(a.index_calls, b.index_calls);
}

#[test]
fn trained_samples_are_at_most_as_stale_as_the_mode_allows() {
    let c = costs();
    for (mode, k) in
        [("colocated-sync", 0.0), ("streaming", 0.0), ("async-1", 1.0), ("async-2", 2.0)]
    {
        let staleness = run(&c, mode).staleness;
        assert!((0.0..=k).contains(&staleness), "{mode}: mean staleness {staleness}");
    }
    assert!(run(&c, "async-1").staleness > 0.0, "async-1 trains on older samples");
}

#[test]
fn overlap_and_asynchrony_raise_throughput_on_separated_devices() {
    let c = costs();
    let rate = |mode| run(&c, mode).samples_per_s;
    let (sync, streaming, async1) = (rate("separated-sync"), rate("streaming"), rate("async-1"));
    assert!(streaming >= sync, "streaming {streaming} < separated-sync {sync}");
    assert!(async1 > streaming, "async-1 {async1} <= streaming {streaming}");
}

#[test]
fn no_run_beats_its_placements_bound() {
    let c = costs();
    for mode in ["colocated-sync", "separated-sync", "streaming", "async-1"] {
        let o = run(&c, mode);
        assert!(o.samples_per_s <= o.ideal_samples_per_s * 1.02, "{mode}: {o:?}");
    }
}

#[test]
fn a_colocated_pool_does_one_thing_at_a_time() {
    let o = run(&costs(), "colocated-sync");
    let total: f64 =
        ["rollout", "reference", "trainer", "switch"].iter().map(|r| busy(&o, r)).sum();
    assert!(total <= 1.0 + 1e-9, "{o:?}");
    assert!(busy(&o, "switch") > 0.0);
    assert!(busy(&o, "publish") < 1e-12, "colocated weights are resharded, not sent");
}

#[test]
fn throughput_per_device_holds_as_the_cluster_grows() {
    let small = run(&costs(), "async-1");
    let large = run(&costs().scaled(32), "async-1");
    let efficiency = large.samples_per_s / 32.0 / (small.samples_per_s / 8.0);
    assert!(efficiency > 0.9, "efficiency {efficiency}: {small:?} vs {large:?}");
}

#[test]
fn misspelt_or_missing_parameters_are_refused() {
    let mut p = params();
    p.insert("rollout.max_bacth".into(), 64.0);
    assert!(matches!(CostModel::from_params(&p), Err(SimError::Invalid(_))));
    let mut p = params();
    p.remove("trainer.tokens_per_s");
    assert!(matches!(CostModel::from_params(&p), Err(SimError::Missing(_))));
}

#[test]
fn mode_names_say_placement_staleness_and_streaming() {
    let m = Mode::from_name("async-3").unwrap();
    assert_eq!((m.colocated, m.staleness, m.streaming), (false, 3, true));
    assert!(Mode::from_name("colocated-sync").unwrap().colocated);
    assert!(!Mode::from_name("separated-sync").unwrap().streaming);
    assert!(matches!(Mode::from_name("async"), Err(SimError::UnknownMode(_))));
}
