//! Behaviour of the embedded store, one behaviour per test.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use asyncflow_core::{
    ClaimSpec, Claimable, Clock, Column, DType, FieldSchema, NewRows, PutTarget, Store,
    StoreConfig, StoreError, Wait,
};

const NOW: Wait<'static> = Wait { deadline: None, interrupted: None };

fn store() -> Store {
    Store::new(StoreConfig::default()).unwrap()
}

fn no_wait() -> Wait<'static> {
    Wait::timeout(Some(Duration::ZERO))
}

fn within(ms: u64) -> Wait<'static> {
    Wait::timeout(Some(Duration::from_millis(ms)))
}

/// A store whose leases run on a clock the test moves by hand, and the hand that moves it: leases
/// expire exactly when the test says, however slowly the machine runs it.
fn store_on_a_driven_clock(lease_timeout: Duration) -> (Store, impl Fn(Duration)) {
    let now = Arc::new(Mutex::new(Instant::now()));
    let read = Arc::clone(&now);
    let clock = Clock::new(move || *read.lock().unwrap());
    let config = StoreConfig { lease_timeout, ..StoreConfig::default() };
    let advance = move |by: Duration| *now.lock().unwrap() += by;
    (Store::with_clock(config, clock).unwrap(), advance)
}

/// A column of i64 cells, one ragged array per row.
fn ints(store: &Store, name: &str, rows: &[&[i64]]) -> Column {
    let bytes: Vec<Vec<u8>> =
        rows.iter().map(|r| r.iter().flat_map(|v| v.to_le_bytes()).collect()).collect();
    let cells: Vec<(&[u8], u64)> =
        bytes.iter().zip(rows).map(|(b, r)| (b.as_slice(), r.len() as u64)).collect();
    store.pack_column(name, FieldSchema::ragged(DType::I64, vec![]), &cells, NOW).unwrap()
}

/// A column of f32 scalars.
fn scalars(store: &Store, name: &str, values: &[f32]) -> Column {
    let bytes: Vec<[u8; 4]> = values.iter().map(|v| v.to_le_bytes()).collect();
    let cells: Vec<(&[u8], u64)> = bytes.iter().map(|b| (b.as_slice(), 1)).collect();
    store.pack_column(name, FieldSchema::scalar(DType::F32), &cells, NOW).unwrap()
}

fn new_rows(partition: &str) -> PutTarget {
    PutTarget::New(NewRows { partition: partition.into(), versions: vec![0], ..NewRows::default() })
}

fn put_prompts(store: &Store, n: i64, partition: &str) -> Vec<u64> {
    let rows: Vec<Vec<i64>> = (0..n).map(|i| vec![i, i + 1]).collect();
    let refs: Vec<&[i64]> = rows.iter().map(Vec::as_slice).collect();
    store.put(vec![ints(store, "prompt", &refs)], &new_rows(partition)).unwrap()
}

fn spec(task: &str, fields: &[&str], batch_size: usize) -> ClaimSpec {
    ClaimSpec {
        task: task.into(),
        fields: fields.iter().map(|f| (*f).to_string()).collect(),
        batch_size,
        ..ClaimSpec::default()
    }
}

fn read_ints(store: &Store, rows: &[u64], field: &str) -> Vec<Vec<i64>> {
    let cols = store.read(rows, &[field.to_string()]).unwrap();
    cols[0]
        .cells
        .iter()
        .map(|c| c.bytes().chunks(8).map(|b| i64::from_le_bytes(b.try_into().unwrap())).collect())
        .collect()
}

#[test]
fn claim_delivers_ready_rows_oldest_first_and_reads_back_the_bytes() {
    let s = store();
    s.register_task("gen", None).unwrap();
    let idx = put_prompts(&s, 5, "p");
    let c = s.claim(&spec("gen", &["prompt"], 3), false, no_wait()).unwrap();
    assert_eq!(c.rows, idx[..3]);
    assert_eq!(read_ints(&s, &c.rows, "prompt"), vec![vec![0, 1], vec![1, 2], vec![2, 3]]);
    let c2 = s.claim(&spec("gen", &["prompt"], 2), false, no_wait()).unwrap();
    assert_eq!(c2.rows, idx[3..]);
}

#[test]
fn a_row_is_claimable_only_once_every_requested_field_is_ready() {
    let s = store();
    s.register_task("train", None).unwrap();
    let idx = put_prompts(&s, 2, "p");
    let err = s.claim(&spec("train", &["prompt", "reward"], 1), false, no_wait()).unwrap_err();
    assert!(matches!(err, StoreError::Timeout { ref what, .. } if what.contains("reward")));
    s.put(vec![scalars(&s, "reward", &[1.0])], &PutTarget::Existing(vec![idx[1]])).unwrap();
    let c = s.claim(&spec("train", &["prompt", "reward"], 1), false, no_wait()).unwrap();
    assert_eq!(c.rows, vec![idx[1]]);
}

#[test]
fn a_blocked_claim_wakes_when_a_put_makes_rows_ready() {
    let s = Arc::new(store());
    s.register_task("gen", None).unwrap();
    // A waiting claim asks its caller whether to stop after each sleep: once asked, it has
    // found no rows and gone to sleep, so the put below is what wakes it.
    let waiting = Arc::new(AtomicBool::new(false));
    let consumer = {
        let (s, waiting) = (Arc::clone(&s), Arc::clone(&waiting));
        thread::spawn(move || {
            let asked = || {
                waiting.store(true, Ordering::SeqCst);
                false
            };
            let deadline = Some(Instant::now() + Duration::from_secs(60));
            s.claim(
                &spec("gen", &["prompt"], 4),
                false,
                Wait { deadline, interrupted: Some(&asked) },
            )
        })
    };
    while !waiting.load(Ordering::SeqCst) {
        thread::yield_now();
    }
    let idx = put_prompts(&s, 4, "p");
    let c = consumer.join().unwrap().unwrap();
    assert_eq!(c.rows, idx);
}

#[test]
fn the_change_hook_names_the_fields_a_put_made_ready_and_anything_else_as_any() {
    let s = store();
    s.register_task("gen", None).unwrap();
    let heard: Arc<Mutex<Vec<Option<Vec<String>>>>> = Arc::default();
    let log = Arc::clone(&heard);
    s.on_change(move |what| {
        log.lock().unwrap().push(match what {
            Claimable::Fields(f) => Some(f.to_vec()),
            Claimable::Acked => Some(vec!["(acked)".into()]),
            Claimable::Any => None,
        });
    });
    let idx = put_prompts(&s, 2, "p");
    s.put(vec![scalars(&s, "reward", &[1.0])], &PutTarget::Existing(vec![idx[1]])).unwrap();
    let c = s.claim(&spec("gen", &["prompt"], 2), false, no_wait()).unwrap();
    s.release(c.lease.unwrap(), None).unwrap();
    let heard = heard.lock().unwrap().clone();
    assert_eq!(heard, vec![Some(vec!["prompt".into()]), Some(vec!["reward".into()]), None]);
    // A claim for rewards may have gained rows from the second put only.
    let reward = ["reward".to_string(), "prompt".to_string()];
    assert!(Claimable::Fields(&["reward".into()]).concerns(&reward, false));
    assert!(!Claimable::Fields(&["response".into()]).concerns(&reward, true));
    assert!(Claimable::Any.concerns(&reward, false));
}

#[test]
fn the_change_hook_hears_of_an_ack_which_concerns_claims_of_whole_groups_only() {
    let s = store();
    s.register_task("gen", None).unwrap();
    let heard: Arc<Mutex<Vec<bool>>> = Arc::default();
    let log = Arc::clone(&heard);
    s.on_change(move |what| log.lock().unwrap().push(matches!(what, Claimable::Acked)));
    put_prompts(&s, 2, "p");
    let c = s.claim(&spec("gen", &["prompt"], 2), false, no_wait()).unwrap();
    s.ack(c.lease.unwrap(), None).unwrap();
    assert_eq!(*heard.lock().unwrap(), vec![false, true]);
    let prompt = ["prompt".to_string()];
    assert!(Claimable::Acked.concerns(&prompt, true));
    assert!(!Claimable::Acked.concerns(&prompt, false));
}

#[test]
fn timeout_returns_partial_batches_only_when_allowed() {
    let s = store();
    s.register_task("gen", None).unwrap();
    let idx = put_prompts(&s, 2, "p");
    assert!(matches!(
        s.claim(&spec("gen", &["prompt"], 5), false, within(20)),
        Err(StoreError::Timeout { .. })
    ));
    let c = s.claim(&spec("gen", &["prompt"], 5), true, within(20)).unwrap();
    assert_eq!(c.rows, idx);
    let empty = s.claim(&spec("gen", &["prompt"], 5), true, no_wait()).unwrap();
    assert!(empty.rows.is_empty() && empty.lease.is_none());
}

#[test]
fn partition_and_min_version_filter_claims() {
    let s = store();
    s.register_task("t", None).unwrap();
    put_prompts(&s, 2, "step-0");
    let newer = s
        .put(
            vec![ints(&s, "prompt", &[&[7], &[8]])],
            &PutTarget::New(NewRows {
                partition: "step-1".into(),
                versions: vec![3, 4],
                ..NewRows::default()
            }),
        )
        .unwrap();
    let mut by_partition = spec("t", &["prompt"], 10);
    by_partition.partition = Some("step-1".into());
    assert_eq!(s.claim(&by_partition, true, no_wait()).unwrap().rows, newer);

    let s = store();
    s.register_task("t", None).unwrap();
    put_prompts(&s, 2, "p");
    let v4 = s
        .put(
            vec![ints(&s, "prompt", &[&[1]])],
            &PutTarget::New(NewRows {
                partition: "p".into(),
                versions: vec![4],
                ..NewRows::default()
            }),
        )
        .unwrap();
    let mut fresh = spec("t", &["prompt"], 10);
    fresh.min_version = Some(4);
    assert_eq!(s.claim(&fresh, true, no_wait()).unwrap().rows, v4);
}

#[test]
fn whole_groups_are_delivered_complete_or_not_at_all() {
    let s = store();
    s.register_task("adv", None).unwrap();
    let grouped = |groups: Vec<u64>, size| {
        PutTarget::New(NewRows {
            partition: "p".into(),
            groups: Some(groups),
            group_size: Some(size),
            versions: vec![0],
            ..NewRows::default()
        })
    };
    // Group 1 gets 2 of its 3 rows; group 2 is complete.
    let g1 = s.put(vec![ints(&s, "x", &[&[1], &[1]])], &grouped(vec![1, 1], 3)).unwrap();
    let g2 = s.put(vec![ints(&s, "x", &[&[2], &[2], &[2]])], &grouped(vec![2, 2, 2], 3)).unwrap();
    let mut whole = spec("adv", &["x"], 6);
    whole.whole_groups = true;
    let c = s.claim(&whole, true, no_wait()).unwrap();
    assert_eq!(c.rows, g2);
    let g1_last = s.put(vec![ints(&s, "x", &[&[1]])], &grouped(vec![1], 3)).unwrap();
    let c = s.claim(&whole, true, no_wait()).unwrap();
    assert_eq!(c.rows, [g1, g1_last].concat());
}

#[test]
fn whole_groups_never_split_a_group_to_fill_a_batch() {
    let s = store();
    s.register_task("adv", None).unwrap();
    let target = PutTarget::New(NewRows {
        partition: "p".into(),
        groups: Some(vec![1, 1, 2, 2]),
        versions: vec![0],
        ..NewRows::default()
    });
    let idx = s.put(vec![ints(&s, "x", &[&[1], &[1], &[2], &[2]])], &target).unwrap();
    let mut whole = spec("adv", &["x"], 3);
    whole.whole_groups = true;
    let c = s.claim(&whole, false, no_wait()).unwrap();
    assert_eq!(c.rows, idx[..2]);
    whole.batch_size = 1;
    assert!(matches!(s.claim(&whole, true, no_wait()), Err(StoreError::BadRequest(_))));
}

#[test]
fn the_rest_of_a_group_partly_acked_is_delivered_again_as_the_group() {
    // The rows a task committed are done with; the others, released, were never claimable
    // as a whole group again (a group with freed members looked incomplete for ever, and
    // the task's acked members looked busy), and stayed in the store for good.
    for other_task in [false, true] {
        let s = store();
        s.register_task("adv", None).unwrap();
        if other_task {
            s.register_task("ref", None).unwrap();
            let c = s.claim(&spec("ref", &["x"], 4), true, no_wait());
            assert!(c.unwrap().rows.is_empty());
        }
        let target = PutTarget::New(NewRows {
            partition: "p".into(),
            groups: Some(vec![7; 4]),
            versions: vec![0],
            ..NewRows::default()
        });
        let rows = s.put(vec![ints(&s, "x", &[&[1], &[2], &[3], &[4]])], &target).unwrap();
        if other_task {
            // The other task commits every row: those the first acks are then freed.
            let c = s.claim(&spec("ref", &["x"], 4), false, no_wait()).unwrap();
            s.ack(c.lease.unwrap(), None).unwrap();
        }
        let mut whole = spec("adv", &["x"], 4);
        whole.whole_groups = true;
        let c = s.claim(&whole, false, no_wait()).unwrap();
        s.ack(c.lease.unwrap(), Some(&rows[..2])).unwrap();
        s.release(c.lease.unwrap(), Some(&rows[2..])).unwrap();
        let again = s.claim(&whole, true, no_wait()).unwrap();
        assert_eq!(again.rows, rows[2..], "with another task: {other_task}");
    }
}

#[test]
fn an_ack_that_leaves_a_group_claimable_wakes_a_blocked_whole_groups_claim() {
    // A whole-groups claim skips the members its task acked: the ack of the member another claim
    // of the task held is what makes the rest claimable, and nothing else changes (the held
    // lease runs out long after the waiting claim's deadline).
    let config = StoreConfig { lease_timeout: Duration::from_secs(600), ..StoreConfig::default() };
    let s = Arc::new(Store::new(config).unwrap());
    s.register_task("adv", None).unwrap();
    let target = PutTarget::New(NewRows {
        partition: "p".into(),
        groups: Some(vec![7; 2]),
        group_size: Some(2),
        versions: vec![0],
        ..NewRows::default()
    });
    let rows = s.put(vec![ints(&s, "x", &[&[1], &[2]])], &target).unwrap();
    let one = s.claim(&spec("adv", &["x"], 1), false, no_wait()).unwrap();
    let waiter = {
        let s = Arc::clone(&s);
        thread::spawn(move || {
            let mut whole = spec("adv", &["x"], 1);
            whole.whole_groups = true;
            // Nothing can interrupt it, so it sleeps until its deadline unless woken.
            let deadline = Some(Instant::now() + Duration::from_secs(60));
            s.claim(&whole, false, Wait { deadline, interrupted: None })
        })
    };
    // Gives the claim time to find nothing and sleep; were it slower, it would find the rest
    // of the group at its first look, and the test would pass without showing the wake-up.
    thread::sleep(Duration::from_millis(300));
    s.ack(one.lease.unwrap(), None).unwrap();
    let acked = Instant::now();
    let rest: Vec<u64> = rows.iter().copied().filter(|r| !one.rows.contains(r)).collect();
    assert_eq!(waiter.join().unwrap().unwrap().rows, rest);
    // Unwoken, it would find the group only at its deadline's last look, a minute on.
    assert!(acked.elapsed() < Duration::from_secs(30), "the ack did not wake the claim");
}

#[test]
fn an_expired_lease_is_redelivered_and_its_ack_fails_without_effect() {
    let (s, advance) = store_on_a_driven_clock(Duration::from_secs(30));
    s.register_task("t", None).unwrap();
    let idx = put_prompts(&s, 2, "p");
    let first = s.claim(&spec("t", &["prompt"], 2), false, no_wait()).unwrap();
    advance(Duration::from_secs(29));
    assert!(
        matches!(
            s.claim(&spec("t", &["prompt"], 2), false, no_wait()),
            Err(StoreError::Timeout { .. })
        ),
        "the rows stay leased until the deadline"
    );
    advance(Duration::from_secs(1));
    let again = s.claim(&spec("t", &["prompt"], 2), false, no_wait()).unwrap();
    assert_eq!(again.rows, idx);
    let err = s.ack(first.lease.unwrap(), None).unwrap_err();
    assert!(matches!(err, StoreError::Lease { ref reason, .. } if reason.contains("expired")));
    assert_eq!(s.stats().index.counters.rows_acked, 0);
    s.ack(again.lease.unwrap(), None).unwrap();
    assert_eq!(s.stats().index.live_rows, 0);
}

#[test]
fn a_lease_can_be_acked_only_once() {
    let s = store();
    s.register_task("t", None).unwrap();
    put_prompts(&s, 1, "p");
    let c = s.claim(&spec("t", &["prompt"], 1), false, no_wait()).unwrap();
    s.ack(c.lease.unwrap(), None).unwrap();
    assert!(matches!(s.ack(c.lease.unwrap(), None), Err(StoreError::Lease { .. })));
    assert!(matches!(s.ack(999, None), Err(StoreError::Lease { .. })));
}

#[test]
fn release_hands_rows_back_at_once() {
    let s = store();
    s.register_task("t", None).unwrap();
    let idx = put_prompts(&s, 3, "p");
    let c = s.claim(&spec("t", &["prompt"], 3), false, no_wait()).unwrap();
    s.release(c.lease.unwrap(), Some(&idx[1..2])).unwrap();
    let again = s.claim(&spec("t", &["prompt"], 1), false, no_wait()).unwrap();
    assert_eq!(again.rows, vec![idx[1]]);
    s.ack(c.lease.unwrap(), None).unwrap();
}

#[test]
fn renew_keeps_a_lease_alive_past_its_first_deadline() {
    let (s, advance) = store_on_a_driven_clock(Duration::from_secs(10));
    s.register_task("t", None).unwrap();
    let idx = put_prompts(&s, 1, "p");
    let c = s.claim(&spec("t", &["prompt"], 1), false, no_wait()).unwrap();
    advance(Duration::from_secs(5));
    s.renew(c.lease.unwrap(), Some(Duration::from_secs(30))).unwrap();
    advance(Duration::from_secs(29)); // 24 s past the first deadline, 1 s before the new one
    assert!(s.claim(&spec("t", &["prompt"], 1), false, no_wait()).is_err());
    advance(Duration::from_secs(1));
    let again = s.claim(&spec("t", &["prompt"], 1), false, no_wait()).unwrap();
    assert_eq!(again.rows, idx, "the renewed lease ends at its new deadline");
    assert!(matches!(s.ack(c.lease.unwrap(), None), Err(StoreError::Lease { .. })));
    s.ack(again.lease.unwrap(), None).unwrap();
}

#[test]
fn rows_are_freed_once_every_registered_task_has_acked_them() {
    let s = store();
    s.register_task("reward", None).unwrap();
    s.register_task("train", None).unwrap();
    put_prompts(&s, 4, "p");
    assert!(s.stats().memory_used > 0);
    let r = s.claim(&spec("reward", &["prompt"], 4), false, no_wait()).unwrap();
    s.ack(r.lease.unwrap(), None).unwrap();
    assert_eq!(s.stats().index.live_rows, 4, "train has not acked yet");
    let t = s.claim(&spec("train", &["prompt"], 4), false, no_wait()).unwrap();
    s.ack(t.lease.unwrap(), None).unwrap();
    let stats = s.stats();
    assert_eq!(stats.index.live_rows, 0);
    assert_eq!(stats.payload_rows, 0);
    assert_eq!(stats.memory_used, 0);
}

#[test]
fn pinned_partitions_survive_acks_until_cleared() {
    let s = store();
    s.register_task("t", None).unwrap();
    let idx = put_prompts(&s, 2, "__weights__");
    let c = s.claim(&spec("t", &["prompt"], 2), false, no_wait()).unwrap();
    s.ack(c.lease.unwrap(), None).unwrap();
    assert_eq!(read_ints(&s, &idx, "prompt").len(), 2);
    assert_eq!(s.clear("__weights__"), Ok(2));
    assert!(matches!(s.read(&idx, &["prompt".into()]), Err(StoreError::UnknownIndex(_))));
    assert_eq!(s.stats().memory_used, 0);
}

#[test]
fn a_field_schema_is_fixed_by_its_first_write() {
    let s = store();
    let idx = put_prompts(&s, 1, "p");
    let before = s.stats();
    let wrong = scalars(&s, "prompt", &[1.0]);
    assert!(matches!(
        s.put(vec![wrong], &PutTarget::Existing(idx.clone())),
        Err(StoreError::Schema(_))
    ));
    let after = s.stats();
    assert_eq!(after.index.counters, before.index.counters);
    assert_eq!(after.memory_used, before.memory_used);
}

#[test]
fn unequal_row_counts_and_unknown_indexes_are_rejected_whole() {
    let s = store();
    let a = ints(&s, "a", &[&[1], &[2]]);
    let b = scalars(&s, "b", &[1.0]);
    assert!(matches!(s.put(vec![a, b], &new_rows("p")), Err(StoreError::Schema(_))));
    assert_eq!(s.stats().index.live_rows, 0);
    let idx = put_prompts(&s, 1, "p");
    let fill = scalars(&s, "r", &[1.0, 2.0]);
    let err = s.put(vec![fill], &PutTarget::Existing(vec![idx[0], 12345])).unwrap_err();
    assert_eq!(err, StoreError::UnknownIndex(12345));
    assert!(s.read(&idx, &["r".into()]).is_err(), "no cell of the failed put is visible");
}

#[test]
fn a_put_waits_for_room_and_then_fails_cleanly() {
    let s = Arc::new(
        Store::new(StoreConfig { memory_limit: Some(1024), ..StoreConfig::default() }).unwrap(),
    );
    s.register_task("t", None).unwrap();
    let big = vec![0u8; 900];
    let col = s
        .pack_column("b", FieldSchema::ragged(DType::U8, vec![]), &[(&big, 900)], no_wait())
        .unwrap();
    s.put(vec![col], &new_rows("p")).unwrap();
    let err = s
        .pack_column("b", FieldSchema::ragged(DType::U8, vec![]), &[(&big, 900)], within(30))
        .unwrap_err();
    assert!(matches!(err, StoreError::MemoryLimit(_)));
    let too_big = vec![0u8; 2000];
    let err = s
        .pack_column("b", FieldSchema::ragged(DType::U8, vec![]), &[(&too_big, 2000)], NOW)
        .unwrap_err();
    assert!(matches!(err, StoreError::MemoryLimit(ref m) if m.contains("never")));
    // Room appears when the resident row is acked; a waiting put then proceeds.
    let waiter = {
        let s = Arc::clone(&s);
        thread::spawn(move || {
            let big = vec![1u8; 900];
            s.pack_column(
                "b",
                FieldSchema::ragged(DType::U8, vec![]),
                &[(&big, 900)],
                within(60_000),
            )
        })
    };
    let c = s.claim(&spec("t", &["b"], 1), false, no_wait()).unwrap();
    s.ack(c.lease.unwrap(), None).unwrap();
    assert!(waiter.join().unwrap().is_ok());
}

#[test]
fn tasks_progress_independently_over_the_same_rows() {
    let s = store();
    s.register_task("a", None).unwrap();
    s.register_task("b", None).unwrap();
    let idx = put_prompts(&s, 3, "p");
    let ca = s.claim(&spec("a", &["prompt"], 3), false, no_wait()).unwrap();
    let cb = s.claim(&spec("b", &["prompt"], 3), false, no_wait()).unwrap();
    assert_eq!(ca.rows, idx);
    assert_eq!(cb.rows, idx);
}

#[test]
fn acked_rows_are_forgotten_from_the_front_of_the_table() {
    let s = store();
    s.register_task("t", None).unwrap();
    put_prompts(&s, 1000, "p");
    loop {
        let c = s.claim(&spec("t", &["prompt"], 100), true, no_wait()).unwrap();
        let Some(lease) = c.lease else { break };
        s.ack(lease, None).unwrap();
    }
    let stats = s.stats();
    assert_eq!(stats.index.live_rows, 0);
    assert!(stats.index.resident_slots < 64, "resident {}", stats.index.resident_slots);
}

#[test]
fn bad_claims_are_rejected_before_waiting() {
    let s = store();
    assert!(matches!(
        s.claim(&spec("nobody", &["x"], 1), false, NOW),
        Err(StoreError::UnknownTask(_))
    ));
    s.register_task("t", None).unwrap();
    assert!(matches!(s.claim(&spec("t", &["x"], 0), false, NOW), Err(StoreError::BadRequest(_))));
    assert!(matches!(s.claim(&spec("t", &[], 1), false, NOW), Err(StoreError::BadRequest(_))));
}

#[test]
fn an_interrupted_claim_returns_promptly() {
    let s = store();
    s.register_task("t", None).unwrap();
    let started = Instant::now();
    let wait = Wait { deadline: None, interrupted: Some(&|| true) };
    assert_eq!(s.claim(&spec("t", &["x"], 1), false, wait), Err(StoreError::Interrupted));
    assert!(started.elapsed() < Duration::from_secs(2));
}

#[test]
fn a_scoped_task_sees_and_retains_only_its_partitions() {
    let s = store();
    s.register_task("rollout", Some(vec!["prompts".into()])).unwrap();
    s.register_task("train", Some(vec!["step-".into()])).unwrap();
    let prompts = put_prompts(&s, 2, "prompts");
    let samples = put_prompts(&s, 2, "step-0");
    let r = s.claim(&spec("rollout", &["prompt"], 4), true, no_wait()).unwrap();
    assert_eq!(r.rows, prompts, "rollout sees prompts only");
    let t = s.claim(&spec("train", &["prompt"], 4), true, no_wait()).unwrap();
    assert_eq!(t.rows, samples, "train sees step partitions only");
    s.ack(r.lease.unwrap(), None).unwrap();
    assert_eq!(s.stats().index.live_rows, 2, "prompts need only the rollout's ack");
    s.ack(t.lease.unwrap(), None).unwrap();
    assert_eq!(s.stats().index.live_rows, 0);
    assert!(matches!(s.register_task("train", None), Err(StoreError::BadRequest(_))));
}

#[test]
fn ready_fields_lists_what_each_row_has() {
    let s = store();
    let idx = put_prompts(&s, 2, "p");
    s.put(vec![scalars(&s, "reward", &[1.0])], &PutTarget::Existing(vec![idx[1]])).unwrap();
    let ready = s.ready_fields(&idx).unwrap();
    assert_eq!(ready, vec![vec!["prompt".to_string()], vec!["prompt".into(), "reward".into()]]);
    assert_eq!(s.ready_fields(&[999]), Err(StoreError::UnknownIndex(999)));
}

#[test]
fn group_ids_are_scoped_to_their_partition() {
    let s = store();
    s.register_task("t", None).unwrap();
    let in_partition = |partition: &str, size| {
        PutTarget::New(NewRows {
            partition: partition.into(),
            groups: Some(vec![7; size as usize]),
            group_size: Some(size),
            versions: vec![0],
            ..NewRows::default()
        })
    };
    let one = s.put(vec![ints(&s, "x", &[&[1]])], &in_partition("prompts", 1)).unwrap();
    let two = s.put(vec![ints(&s, "x", &[&[2], &[2]])], &in_partition("step-0", 2)).unwrap();
    let mut whole = spec("t", &["x"], 3);
    whole.whole_groups = true;
    assert_eq!(s.claim(&whole, false, no_wait()).unwrap().rows, [one, two].concat());
}

#[test]
fn an_admitted_put_is_claimable_only_after_commit_and_frees_are_reported() {
    let s = store();
    s.register_task("t", None).unwrap();
    let freed = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let sink = Arc::clone(&freed);
    s.on_free(move |rows| sink.lock().extend_from_slice(rows));
    let schema = FieldSchema::scalar(DType::F32);
    let column = asyncflow_core::ColumnSpec { name: "x", schema: &schema, rows: 2 };
    let admitted = s.admit(&[column], &new_rows("p")).unwrap();
    let claim = spec("t", &["x"], 2);
    assert!(s.claim(&claim, false, no_wait()).is_err(), "nothing is ready before commit");
    s.commit(&admitted.rows, &admitted.fields).unwrap();
    let claimed = s.claim(&claim, false, no_wait()).unwrap();
    assert_eq!(s.locate(&claimed.rows, &["x".into()]).unwrap(), vec![(0, schema)]);
    s.ack(claimed.lease.unwrap(), None).unwrap();
    assert_eq!(*freed.lock(), admitted.rows);
}

#[test]
fn puts_whose_sizes_overflow_are_schema_errors() {
    // (2^62 + 1) * 4 bytes wraps to 4 in 64 bits; 2^32 * 2^32 wraps to 0.
    let s = store();
    let crafted: [(FieldSchema, &[u8], u64); 2] = [
        (FieldSchema::ragged(DType::F32, vec![1]), &[0u8; 4], (1 << 62) + 1),
        (FieldSchema::ragged(DType::U8, vec![1 << 32, 1 << 32]), &[], 1),
    ];
    for (schema, bytes, first_dim) in crafted {
        let column = Column::pack("x", schema, &[(bytes, first_dim)], None);
        let put = s.put(vec![column], &new_rows("p"));
        assert!(matches!(put, Err(StoreError::Schema(_))), "{put:?}");
    }
    assert_eq!(s.stats().index.live_rows, 0, "nothing was stored");
}

#[test]
fn a_lease_from_before_a_restart_says_so() {
    // A daemon sets the floor of its lease ids at start; ids below it are an earlier run's.
    let s = store();
    s.set_lease_floor(1 << 40);
    put_prompts(&s, 1, "p");
    s.register_task("t", None).unwrap();
    let err = s.ack(5, None).unwrap_err().to_string();
    assert!(err.contains("restarted"), "{err}");
    let err = s.ack((1 << 40) + 77, None).unwrap_err().to_string();
    assert!(err.contains("unknown, or already acked"), "{err}");
}
