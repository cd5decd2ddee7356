//! Property tests of the index and store invariants under random operation sequences:
//! - a row is never leased to two holders for the same task at once;
//! - every acked row was delivered, and is committed exactly once per task;
//! - a row is never freed while a registered task has not acked it (unless its partition is
//!   cleared), and is freed as soon as every task has;
//! - memory accounting returns to zero once everything is acked.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use asyncflow_core::index::ColumnSpec;
use asyncflow_core::{
    ClaimSpec, DType, FieldSchema, Index, NewRows, PutTarget, Store, StoreConfig, StoreError, Wait,
};
use proptest::prelude::*;

const TASKS: [&str; 2] = ["reward", "train"];
/// Partition prefixes each task consumes (`None`: all).
const SCOPES: [Option<&str>; 2] = [None, Some("p0")];
const PARTITIONS: [&str; 3] = ["p0", "p1", "__pinned"];

fn covers(task: usize, partition: usize) -> bool {
    SCOPES[task].is_none_or(|prefix| PARTITIONS[partition].starts_with(prefix))
}
const LEASE: Duration = Duration::from_millis(100);

#[derive(Debug, Clone)]
enum Op {
    Put { rows: usize, partition: usize, grouped: bool },
    Fill { pick: usize },
    Claim { task: usize, both_fields: bool, batch: usize, whole_groups: bool },
    Ack { pick: usize, partial: bool },
    Release { pick: usize },
    Advance { ms: u64 },
    Clear { partition: usize },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (1..6usize, 0..3usize, any::<bool>())
            .prop_map(|(rows, partition, grouped)| Op::Put { rows, partition, grouped }),
        2 => any::<usize>().prop_map(|pick| Op::Fill { pick }),
        4 => (0..2usize, any::<bool>(), 1..8usize, any::<bool>()).prop_map(
            |(task, both_fields, batch, whole_groups)| Op::Claim { task, both_fields, batch, whole_groups }
        ),
        3 => (any::<usize>(), any::<bool>()).prop_map(|(pick, partial)| Op::Ack { pick, partial }),
        1 => any::<usize>().prop_map(|pick| Op::Release { pick }),
        1 => (1..150u64).prop_map(|ms| Op::Advance { ms }),
        1 => (0..3usize).prop_map(|partition| Op::Clear { partition }),
    ]
}

/// What the test knows independently of the index.
#[derive(Default)]
struct Model {
    rows: Vec<(u64, usize)>,
    /// `(task, lease id, rows, deadline)` of leases still active.
    leases: Vec<(usize, u64, Vec<u64>, Instant)>,
    acked: HashSet<(usize, u64)>,
    cleared: HashSet<u64>,
    next_group: u64,
}

struct Harness {
    index: Index,
    model: Model,
    now: Instant,
}

impl Harness {
    fn new() -> Self {
        let mut index = Index::new();
        for (t, scope) in TASKS.iter().zip(SCOPES) {
            index.register_task(t, scope.map(|p| vec![p.to_owned()])).unwrap();
        }
        Self { index, model: Model::default(), now: Instant::now() }
    }

    fn put(&mut self, fields: &[&str], target: &PutTarget, rows: usize) -> Vec<u64> {
        let schema = FieldSchema::scalar(DType::F32);
        let specs: Vec<ColumnSpec<'_>> =
            fields.iter().map(|&name| ColumnSpec { name, schema: &schema, rows }).collect();
        let admitted = self.index.admit_put(&specs, target).unwrap();
        assert!(self.index.commit_ready(&admitted.rows, &admitted.fields).is_empty());
        admitted.rows
    }

    fn apply(&mut self, op: &Op) {
        match *op {
            Op::Put { rows, partition, grouped } => {
                let groups = grouped.then(|| {
                    self.model.next_group += 1;
                    vec![self.model.next_group; rows]
                });
                let target = PutTarget::New(NewRows {
                    partition: PARTITIONS[partition].into(),
                    groups,
                    versions: vec![0],
                    ..NewRows::default()
                });
                for index in self.put(&["a"], &target, rows) {
                    self.model.rows.push((index, partition));
                }
            }
            Op::Fill { pick } => {
                let live: Vec<u64> = self
                    .model
                    .rows
                    .iter()
                    .map(|r| r.0)
                    .filter(|&i| self.index.is_live(i))
                    .collect();
                if !live.is_empty() {
                    let row = live[pick % live.len()];
                    self.put(&["b"], &PutTarget::Existing(vec![row]), 1);
                }
            }
            Op::Claim { task, both_fields, batch, whole_groups } => {
                self.claim(task, both_fields, batch, whole_groups);
            }
            Op::Ack { pick, partial } => self.ack(pick, partial),
            Op::Release { pick } => {
                if self.model.leases.is_empty() {
                    return;
                }
                let (_, id, _, _) = self.model.leases.remove(pick % self.model.leases.len());
                self.index.release(id, None, self.now).unwrap();
            }
            Op::Advance { ms } => {
                self.now += Duration::from_millis(ms);
                self.index.expire_leases(self.now);
                let now = self.now;
                self.model.leases.retain(|lease| lease.3 > now);
            }
            Op::Clear { partition } => {
                for index in self.index.clear_partition(PARTITIONS[partition]) {
                    self.model.cleared.insert(index);
                }
            }
        }
    }

    fn claim(&mut self, task: usize, both_fields: bool, batch: usize, whole_groups: bool) {
        let fields: Vec<String> =
            if both_fields { vec!["a".into(), "b".into()] } else { vec!["a".into()] };
        let spec = ClaimSpec {
            task: TASKS[task].into(),
            fields: fields.clone(),
            batch_size: batch,
            whole_groups,
            ..ClaimSpec::default()
        };
        let claimed = match self.index.try_claim(&spec, self.now, LEASE, true) {
            Ok(claimed) => claimed.expect("a partial claim always answers"),
            Err(StoreError::BadRequest(_)) => return, // a group larger than the batch
            Err(e) => panic!("unexpected claim error {e}"),
        };
        let Some(id) = claimed.lease else { return };
        assert!(claimed.rows.len() <= batch);
        for &row in &claimed.rows {
            let partition = self.model.rows.iter().find(|r| r.0 == row).expect("known row").1;
            assert!(covers(task, partition), "row {row} is outside task {task}'s scope");
            assert!(!self.model.acked.contains(&(task, row)), "row {row} redelivered after ack");
            assert!(self.index.check_readable(&[row], &fields).is_ok(), "row {row} not ready");
            for (t, _, rows, _) in &self.model.leases {
                assert!(
                    !(*t == task && rows.contains(&row)),
                    "row {row} leased twice to task {task}"
                );
            }
        }
        self.model.leases.push((task, id, claimed.rows, self.now + LEASE));
    }

    fn ack(&mut self, pick: usize, partial: bool) {
        if self.model.leases.is_empty() {
            return;
        }
        let at = pick % self.model.leases.len();
        let (task, id, rows, _) = self.model.leases[at].clone();
        let subset: Vec<u64> =
            if partial { rows[..rows.len().div_ceil(2)].to_vec() } else { rows.clone() };
        // The model drops leases as they expire, so every lease it holds must accept an ack.
        self.index.ack(id, Some(&subset), self.now).expect("an active lease accepts its ack");
        for &row in &subset {
            if !self.model.cleared.contains(&row) {
                assert!(self.model.acked.insert((task, row)), "row {row} committed twice");
            }
        }
        let left: Vec<u64> = rows.into_iter().filter(|r| !subset.contains(r)).collect();
        if left.is_empty() {
            self.model.leases.remove(at);
        } else {
            self.model.leases[at].2 = left;
        }
    }

    fn check_retention(&self) {
        for &(row, partition) in &self.model.rows {
            let all_acked = (0..TASKS.len())
                .filter(|&t| covers(t, partition))
                .all(|t| self.model.acked.contains(&(t, row)));
            let pinned = PARTITIONS[partition].starts_with("__");
            let cleared = self.model.cleared.contains(&row);
            if self.index.is_live(row) {
                assert!(pinned || !all_acked, "row {row} acked by every task but still held");
                assert!(!cleared, "row {row} cleared but still live");
            } else {
                assert!(
                    cleared || (all_acked && !pinned),
                    "row {row} freed before every task acked"
                );
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn index_invariants_hold_under_any_operation_sequence(ops in prop::collection::vec(op(), 1..80)) {
        let mut h = Harness::new();
        for op in &ops {
            h.apply(op);
            h.check_retention();
        }
    }

    #[test]
    fn memory_returns_to_zero_once_everything_is_acked(
        puts in prop::collection::vec((1..5usize, 1..200usize), 1..20),
        batch in 1..7usize,
    ) {
        let store = Store::new(StoreConfig { memory_limit: Some(1 << 20), ..StoreConfig::default() }).unwrap();
        for t in TASKS {
            store.register_task(t, None).unwrap();
        }
        for (rows, len) in puts {
            let payload = vec![7u8; len];
            let cells: Vec<(&[u8], u64)> = (0..rows).map(|_| (payload.as_slice(), len as u64)).collect();
            let col = store
                .pack_column("x", FieldSchema::ragged(DType::U8, vec![]), &cells, Wait::timeout(None))
                .unwrap();
            let target = PutTarget::New(NewRows { partition: "p".into(), versions: vec![0], ..NewRows::default() });
            store.put(vec![col], &target).unwrap();
        }
        prop_assert!(store.stats().memory_used > 0);
        let mut delivered: HashMap<&str, HashSet<u64>> = HashMap::new();
        for task in TASKS {
            let spec = ClaimSpec {
                task: task.into(), fields: vec!["x".into()], batch_size: batch,
                ..ClaimSpec::default()
            };
            loop {
                let c = store.claim(&spec, true, Wait::timeout(Some(Duration::ZERO))).unwrap();
                let Some(lease) = c.lease else { break };
                for row in &c.rows {
                    prop_assert!(delivered.entry(task).or_default().insert(*row));
                }
                store.ack(lease, None).unwrap();
            }
        }
        let stats = store.stats();
        prop_assert_eq!(stats.index.live_rows, 0);
        prop_assert_eq!(stats.payload_rows, 0);
        prop_assert_eq!(stats.memory_used, 0);
    }
}
