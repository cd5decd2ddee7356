//! Rollout routing, one behaviour per test, under a clock the test moves by hand.

use std::time::{Duration, Instant};

use asyncflow_core::StoreError;
use asyncflow_core::scheduler::{EngineLoad, Rerouted, Router};

const HEARTBEAT: Duration = Duration::from_secs(5);

fn load(tokens: u64, requests: u64) -> EngineLoad {
    EngineLoad { tokens, requests }
}

fn router(names: &[&str], now: Instant) -> Router {
    let mut r = Router::new(HEARTBEAT).unwrap();
    for name in names {
        r.add_engine(name, now).unwrap();
    }
    r
}

#[test]
fn work_goes_to_the_engine_reporting_the_fewest_outstanding_tokens() {
    let t0 = Instant::now();
    let mut r = router(&["a", "b", "c"], t0);
    r.report("a", load(900, 3), t0).unwrap();
    r.report("b", load(100, 9), t0).unwrap();
    r.report("c", load(500, 1), t0).unwrap();
    assert_eq!(r.route(1, load(50, 1), t0).unwrap(), Some("b"));
}

#[test]
fn equal_tokens_are_broken_by_fewer_requests() {
    let t0 = Instant::now();
    let mut r = router(&["a", "b"], t0);
    r.report("a", load(100, 4), t0).unwrap();
    r.report("b", load(100, 2), t0).unwrap();
    assert_eq!(r.route(1, load(10, 1), t0).unwrap(), Some("b"));
}

#[test]
fn work_routed_since_the_last_report_counts_toward_an_engines_load() {
    let t0 = Instant::now();
    let mut r = router(&["a", "b"], t0);
    // A burst between reports alternates instead of piling onto the engine that looked idle.
    let routed: Vec<String> =
        (0..4).map(|w| r.route(w, load(100, 1), t0).unwrap().unwrap().to_owned()).collect();
    assert_eq!(routed, ["a", "b", "a", "b"]);
}

#[test]
fn a_report_replaces_the_estimate_of_work_routed_before_it() {
    let t0 = Instant::now();
    let mut r = router(&["a", "b"], t0);
    r.route(1, load(1000, 1), t0).unwrap();
    assert_eq!(r.engines()[0].estimated, load(1000, 1));
    r.report("a", load(10, 1), t0).unwrap();
    assert_eq!(r.engines()[0].estimated, load(10, 1));
    // Completing work the report already covered leaves the estimate to the next report.
    assert_eq!(r.complete(1).unwrap(), "a");
    assert_eq!(r.engines()[0].estimated, load(10, 1));
}

#[test]
fn completing_work_routed_since_the_last_report_lowers_the_estimate() {
    let t0 = Instant::now();
    let mut r = router(&["a"], t0);
    r.route(1, load(300, 2), t0).unwrap();
    r.complete(1).unwrap();
    assert_eq!(r.engines()[0].estimated, load(0, 0));
}

#[test]
fn an_engine_that_stops_reporting_is_taken_out_and_its_work_rerouted() {
    let t0 = Instant::now();
    let mut r = router(&["a", "b", "c"], t0);
    r.report("a", load(0, 0), t0).unwrap();
    r.report("b", load(500, 1), t0).unwrap();
    r.report("c", load(800, 1), t0).unwrap();
    assert_eq!(r.route(7, load(100, 1), t0).unwrap(), Some("a"));
    assert_eq!(r.route(8, load(100, 1), t0).unwrap(), Some("a"));
    let t1 = t0 + Duration::from_secs(3);
    r.report("b", load(500, 1), t1).unwrap();
    r.report("c", load(800, 1), t1).unwrap();
    let t2 = t0 + HEARTBEAT;
    let moved = r.expire(t2);
    assert_eq!(
        moved,
        vec![
            Rerouted { work: 7, from: "a".into(), to: Some("b".into()) },
            Rerouted { work: 8, from: "a".into(), to: Some("b".into()) },
        ]
    );
    assert!(!r.engines()[0].in_rotation);
    assert_eq!(r.assigned_to(7), Some("b"));
    assert_eq!(r.route(9, load(1, 1), t2).unwrap(), Some("b"), "a is out of rotation");
}

#[test]
fn a_silent_engine_gets_no_new_work_even_before_expire_runs() {
    let t0 = Instant::now();
    let mut r = router(&["a", "b"], t0);
    r.report("b", load(10_000, 50), t0 + Duration::from_secs(4)).unwrap();
    assert_eq!(r.route(1, load(1, 1), t0 + HEARTBEAT).unwrap(), Some("b"));
}

#[test]
fn a_returning_engine_rejoins_the_rotation_when_it_reports() {
    let t0 = Instant::now();
    let mut r = router(&["a"], t0);
    let late = t0 + 2 * HEARTBEAT;
    assert!(r.expire(late).is_empty());
    assert_eq!(r.route(1, load(1, 1), late).unwrap(), None);
    r.report("a", load(0, 0), late).unwrap();
    assert_eq!(r.route(1, load(1, 1), late).unwrap(), Some("a"));
}

#[test]
fn work_with_no_engine_left_is_handed_back_unrouted() {
    let t0 = Instant::now();
    let mut r = router(&["a"], t0);
    r.route(3, load(1, 1), t0).unwrap();
    let moved = r.expire(t0 + HEARTBEAT);
    assert_eq!(moved, vec![Rerouted { work: 3, from: "a".into(), to: None }]);
    assert_eq!(r.assigned_to(3), None);
}

#[test]
fn routing_the_same_work_twice_or_completing_unknown_work_is_a_bad_request() {
    let t0 = Instant::now();
    let mut r = router(&["a"], t0);
    r.route(1, load(1, 1), t0).unwrap();
    assert!(matches!(r.route(1, load(1, 1), t0), Err(StoreError::BadRequest(_))));
    assert!(matches!(r.complete(2), Err(StoreError::BadRequest(_))));
    assert!(matches!(r.report("zz", load(0, 0), t0), Err(StoreError::BadRequest(_))));
    assert!(matches!(r.add_engine("a", t0), Err(StoreError::BadRequest(_))));
}

mod invariants {
    use std::collections::{HashMap, HashSet};
    use std::time::{Duration, Instant};

    use asyncflow_core::scheduler::{EngineLoad, Router};
    use proptest::prelude::*;

    use super::HEARTBEAT;

    const ENGINES: [&str; 3] = ["e0", "e1", "e2"];

    #[derive(Debug, Clone)]
    enum Op {
        Report { engine: usize, tokens: u64 },
        Route { tokens: u64 },
        Complete { pick: usize },
        Expire,
        Advance { ms: u64 },
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            2 => (0..3usize, 0..5_000u64).prop_map(|(engine, tokens)| Op::Report { engine, tokens }),
            4 => (1..2_000u64).prop_map(|tokens| Op::Route { tokens }),
            2 => any::<usize>().prop_map(|pick| Op::Complete { pick }),
            1 => Just(Op::Expire),
            1 => (1..4_000u64).prop_map(|ms| Op::Advance { ms }),
        ]
    }

    proptest! {
        #[test]
        fn routed_work_is_never_lost_and_only_goes_to_live_least_loaded_engines(
            ops in prop::collection::vec(op(), 1..80)
        ) {
            let mut now = Instant::now();
            let mut router = Router::new(HEARTBEAT).unwrap();
            let mut last_heard: HashMap<&str, Instant> = HashMap::new();
            for name in ENGINES {
                router.add_engine(name, now).unwrap();
                last_heard.insert(name, now);
            }
            let mut outstanding: HashSet<u64> = HashSet::new();
            let mut next_work = 0u64;
            for op in ops {
                match op {
                    Op::Report { engine, tokens } => {
                        router.report(ENGINES[engine], EngineLoad { tokens, requests: 1 }, now).unwrap();
                        last_heard.insert(ENGINES[engine], now);
                    }
                    Op::Route { tokens } => {
                        let live: Vec<_> = router.engines().into_iter()
                            .filter(|e| e.in_rotation && now < last_heard[e.name.as_str()] + HEARTBEAT)
                            .collect();
                        next_work += 1;
                        let chosen = router.route(next_work, EngineLoad { tokens, requests: 1 }, now).unwrap();
                        match chosen {
                            None => prop_assert!(live.is_empty()),
                            Some(name) => {
                                let least = live.iter().map(|e| e.estimated.tokens).min().unwrap();
                                let picked = live.iter().find(|e| e.name == name);
                                prop_assert_eq!(picked.map(|e| e.estimated.tokens), Some(least));
                                outstanding.insert(next_work);
                            }
                        }
                    }
                    Op::Complete { pick } => {
                        let mut work: Vec<u64> = outstanding.iter().copied().collect();
                        work.sort_unstable();
                        if let Some(&w) = work.get(pick % work.len().max(1)) {
                            router.complete(w).unwrap();
                            outstanding.remove(&w);
                        }
                    }
                    Op::Expire => {
                        for moved in router.expire(now) {
                            match moved.to {
                                None => prop_assert!(outstanding.remove(&moved.work)),
                                Some(to) => prop_assert!(now < last_heard[to.as_str()] + HEARTBEAT),
                            }
                        }
                        for e in router.engines().iter().filter(|e| !e.in_rotation) {
                            prop_assert_eq!(e.assigned, 0, "an engine out of rotation holds no work");
                        }
                    }
                    Op::Advance { ms } => now += Duration::from_millis(ms),
                }
                for w in 1..=next_work {
                    prop_assert_eq!(router.assigned_to(w).is_some(), outstanding.contains(&w));
                }
            }
        }
    }
}
