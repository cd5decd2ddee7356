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
