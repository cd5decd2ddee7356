//! What a store journals is enough to rebuild it: after any sequence of operations, replaying the
//! journal on a fresh store — or restoring a snapshot of it, or a snapshot followed by the rest
//! of the journal — gives a store with the same rows, metadata, ready fields, payload bytes and
//! per-task commits. Leases are the one thing a restart forgets: their rows are free again.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use asyncflow_core::{
    Cell, Change, ClaimSpec, DType, FieldId, FieldSchema, Journal, NewRows, Position, PutTarget,
    Receipt, Snapshot, Store, StoreConfig, Wait,
};
use parking_lot::Mutex;
use proptest::prelude::*;

const NOW: Wait<'static> = Wait { deadline: None, interrupted: None };
const TASKS: [&str; 2] = ["reward", "train"];
const PARTITIONS: [&str; 3] = ["p0", "p1", "__pinned"];

/// Changes appended so far, each with the payload its receipt named.
type Entry = (Vec<Change>, Option<Vec<Vec<Cell>>>);
type Entries = Vec<Entry>;

/// A journal that keeps everything in memory, as a log on disk would.
#[derive(Default)]
struct Recorder {
    entries: Mutex<Entries>,
    payloads: Mutex<HashMap<u64, Vec<Vec<Cell>>>>,
    next: Mutex<u64>,
    /// How many entries have been made durable: what a crash would leave.
    synced: Mutex<Position>,
}

impl Journal for Recorder {
    fn write_payload(&self, columns: &[(FieldId, &[Cell])]) -> asyncflow_core::Result<Receipt> {
        let mut next = self.next.lock();
        *next += 1;
        self.payloads.lock().insert(*next, columns.iter().map(|(_, c)| c.to_vec()).collect());
        Ok(Receipt(*next))
    }

    fn append(&self, changes: Vec<Change>, receipt: Option<Receipt>) -> Position {
        let cells = receipt.map(|r| self.payloads.lock().remove(&r.0).expect("receipt"));
        let mut entries = self.entries.lock();
        entries.push((changes, cells));
        entries.len() as Position
    }

    fn sync(&self, at: Position) -> asyncflow_core::Result<()> {
        let mut synced = self.synced.lock();
        *synced = (*synced).max(at);
        Ok(())
    }

    fn discard(&self, receipt: Receipt) {
        self.payloads.lock().remove(&receipt.0);
    }
}

fn config() -> StoreConfig {
    StoreConfig { shards: 3, memory_limit: None, lease_timeout: Duration::from_secs(60) }
}

fn journaled() -> (Store, Arc<Recorder>) {
    let store = Store::new(config()).unwrap();
    let recorder = Arc::new(Recorder::default());
    store.set_journal(Arc::clone(&recorder) as Arc<dyn Journal>);
    (store, recorder)
}

fn replay(into: &Store, entries: &[Entry]) {
    for (changes, cells) in entries {
        let mut cells = cells.clone();
        for change in changes {
            let payload = match change {
                Change::Ready { .. } => cells.take(),
                _ => None,
            };
            into.restore(change, payload).unwrap();
        }
    }
}

fn restore_snapshot(into: &Store, snapshot: Snapshot) {
    let mut cells = snapshot.cells.into_iter();
    for change in &snapshot.changes {
        let payload = match change {
            Change::Ready { .. } => cells.next(),
            _ => None,
        };
        into.restore(change, payload).unwrap();
    }
}

/// A row's index, partition, group, version and tags.
type RowMeta = (u64, String, Option<u64>, u64, Vec<(String, String)>);

/// Everything a restart must keep, in a comparable form.
#[derive(Debug, PartialEq)]
struct Observed {
    rows: Vec<RowMeta>,
    ready: Vec<Vec<String>>,
    bytes: Vec<Vec<Vec<u8>>>,
    /// Per task, the rows it could claim now (leases forgotten).
    claimable: Vec<Vec<u64>>,
}

fn observe(store: &Store) -> Observed {
    let infos = store.rows(None);
    let indexes: Vec<u64> = infos.iter().map(|i| i.index).collect();
    let ready = store.ready_fields(&indexes).unwrap();
    let bytes = indexes
        .iter()
        .zip(&ready)
        .map(|(&i, fields)| {
            let cols = store.read(&[i], fields).unwrap();
            cols.iter().map(|c| c.cells[0].bytes().to_vec()).collect()
        })
        .collect();
    let claimable = TASKS
        .iter()
        .map(|task| {
            let spec = ClaimSpec {
                task: (*task).into(),
                fields: vec!["a".into()],
                batch_size: 1 << 20,
                ..ClaimSpec::default()
            };
            let wait = Wait::timeout(Some(Duration::ZERO));
            match store.claim(&spec, true, wait) {
                Ok(claimed) => {
                    if let Some(lease) = claimed.lease {
                        store.release(lease, None).unwrap();
                    }
                    claimed.rows
                }
                Err(_) => Vec::new(),
            }
        })
        .collect();
    Observed {
        rows: infos
            .into_iter()
            .map(|i| (i.index, i.partition, i.group, i.version, i.tags.to_vec()))
            .collect(),
        ready,
        bytes,
        claimable,
    }
}

#[derive(Debug, Clone)]
enum Op {
    Register(usize),
    Put { rows: usize, partition: usize, grouped: bool, tagged: bool },
    Fill { pick: usize },
    ClaimAck { task: usize, batch: usize, ack: bool },
    Clear(usize),
    Delete { pick: usize },
    Snapshot,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        1 => (0..2usize).prop_map(Op::Register),
        4 => (1..6usize, 0..3usize, any::<bool>(), any::<bool>())
            .prop_map(|(rows, partition, grouped, tagged)| Op::Put { rows, partition, grouped, tagged }),
        2 => any::<usize>().prop_map(|pick| Op::Fill { pick }),
        4 => (0..2usize, 1..8usize, any::<bool>())
            .prop_map(|(task, batch, ack)| Op::ClaimAck { task, batch, ack }),
        1 => (0..3usize).prop_map(Op::Clear),
        1 => any::<usize>().prop_map(|pick| Op::Delete { pick }),
        1 => Just(Op::Snapshot),
    ]
}

fn ints(store: &Store, name: &str, values: &[i64]) -> asyncflow_core::Column {
    let bytes: Vec<Vec<u8>> =
        values.iter().map(|v| (0..(v % 4)).flat_map(|k| (v + k).to_le_bytes()).collect()).collect();
    let cells: Vec<(&[u8], u64)> =
        bytes.iter().map(|b| (b.as_slice(), b.len() as u64 / 8)).collect();
    store.pack_column(name, FieldSchema::ragged(DType::I64, vec![]), &cells, NOW).unwrap()
}

/// Runs `ops`, returning the journal's entries and, if one was asked for, the last snapshot
/// with the entries that followed it.
fn run(store: &Store, recorder: &Recorder, ops: &[Op]) -> Option<(Snapshot, usize)> {
    let mut counter = 0i64;
    let mut last_snapshot = None;
    for op in ops {
        match *op {
            Op::Register(t) => store.register_task(TASKS[t], None).unwrap(),
            Op::Put { rows, partition, grouped, tagged } => {
                let values: Vec<i64> = (0..rows as i64).map(|k| counter + k).collect();
                counter += rows as i64;
                let target = PutTarget::New(NewRows {
                    partition: PARTITIONS[partition].into(),
                    groups: grouped.then(|| vec![counter as u64; rows]),
                    group_size: None,
                    versions: vec![counter as u64],
                    tags: if tagged {
                        vec![Arc::new(vec![("k".into(), format!("{counter}"))])]
                    } else {
                        Vec::new()
                    },
                });
                store.put(vec![ints(store, "a", &values)], &target).unwrap();
            }
            Op::Fill { pick } => {
                let live = store.rows(None);
                if !live.is_empty() {
                    let row = live[pick % live.len()].index;
                    let column = ints(store, "b", &[pick as i64 % 97]);
                    store.put(vec![column], &PutTarget::Existing(vec![row])).unwrap();
                }
            }
            Op::ClaimAck { task, batch, ack } => {
                let spec = ClaimSpec {
                    task: TASKS[task].into(),
                    fields: vec!["a".into()],
                    batch_size: batch,
                    ..ClaimSpec::default()
                };
                if let Ok(claimed) = store.claim(&spec, true, Wait::timeout(Some(Duration::ZERO)))
                    && let Some(lease) = claimed.lease
                    && ack
                {
                    store.ack(lease, None).unwrap();
                }
            }
            Op::Clear(p) => {
                store.clear(PARTITIONS[p]).unwrap();
            }
            Op::Delete { pick } => {
                let live = store.rows(None);
                if !live.is_empty() {
                    store.delete(&[live[pick % live.len()].index]).unwrap();
                }
            }
            Op::Snapshot => {
                let mut at = 0;
                let snapshot = store.snapshot(true, || at = recorder.entries.lock().len()).unwrap();
                last_snapshot = Some((snapshot, at));
            }
        }
    }
    last_snapshot
}

/// Forgets every lease, as a restart does, so stores can be compared.
fn release_all(store: &Store) -> Observed {
    let fresh = Store::new(config()).unwrap();
    restore_snapshot(&fresh, store.snapshot(true, || {}).unwrap());
    observe(&fresh)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn replaying_the_journal_rebuilds_the_store(ops in proptest::collection::vec(op(), 1..40)) {
        let (store, recorder) = journaled();
        let snapshot = run(&store, &recorder, &ops);
        let expected = release_all(&store);

        let replayed = Store::new(config()).unwrap();
        replay(&replayed, &recorder.entries.lock());
        prop_assert_eq!(&observe(&replayed), &expected);

        if let Some((snapshot, at)) = snapshot {
            let restored = Store::new(config()).unwrap();
            restore_snapshot(&restored, snapshot);
            replay(&restored, &recorder.entries.lock()[at..]);
            prop_assert_eq!(&observe(&restored), &expected);
        }
    }
}

#[test]
fn a_restored_store_hands_out_new_rows_after_the_old_ones() {
    let (store, recorder) = journaled();
    store.register_task("t", None).unwrap();
    let first = store.put(vec![ints(&store, "a", &[1, 2, 3])], &new_rows()).unwrap();
    store.delete(&first[1..]).unwrap();
    let restored = Store::new(config()).unwrap();
    restore_snapshot(&restored, store.snapshot(true, || {}).unwrap());
    let again = restored.put(vec![ints(&restored, "a", &[4])], &new_rows()).unwrap();
    assert_eq!(again, vec![3], "freed indexes are never reused");
    drop(recorder);
}

#[test]
fn lease_ids_start_at_the_floor() {
    let store = Store::new(config()).unwrap();
    store.set_lease_floor(1 << 40);
    store.register_task("t", None).unwrap();
    store.put(vec![ints(&store, "a", &[1])], &new_rows()).unwrap();
    let spec = ClaimSpec {
        task: "t".into(),
        fields: vec!["a".into()],
        batch_size: 1,
        ..ClaimSpec::default()
    };
    let claimed = store.claim(&spec, false, NOW).unwrap();
    assert!(claimed.lease.unwrap() >= 1 << 40);
}

#[test]
fn rows_whose_put_never_committed_are_unfinished() {
    let store = Store::new(config()).unwrap();
    let schema = FieldSchema::scalar(DType::I64);
    let spec = asyncflow_core::ColumnSpec { name: "a", schema: &schema, rows: 2 };
    let admitted = store.admit(&[spec], &new_rows()).unwrap();
    assert_eq!(store.unfinished_rows(), admitted.rows);
    store.commit(&admitted.rows, &admitted.fields).unwrap();
    assert!(store.unfinished_rows().is_empty());
}

#[test]
fn an_admitted_put_is_durable_before_its_rows_are_named() {
    // A controller killed after admitting a put, before its commit synced the log, came back
    // without the admission and gave its row indexes to another put; the first put's commit
    // then completed that other put's rows, and its own data was lost.
    let (store, recorder) = journaled();
    let schema = FieldSchema::scalar(DType::I64);
    let spec = || asyncflow_core::ColumnSpec { name: "a", schema: &schema, rows: 2 };
    let first = store.admit(&[spec()], &new_rows()).unwrap();
    let synced = *recorder.synced.lock() as usize;
    let restored = Store::new(config()).unwrap();
    replay(&restored, &recorder.entries.lock()[..synced]);
    let second = restored.admit(&[spec()], &new_rows()).unwrap();
    assert!(second.rows.iter().all(|r| !first.rows.contains(r)), "{first:?} {second:?}");
}

fn new_rows() -> PutTarget {
    PutTarget::New(NewRows { partition: "p".into(), versions: vec![0], ..NewRows::default() })
}

fn tagged_rows(tags: Vec<Arc<Vec<(String, String)>>>) -> PutTarget {
    PutTarget::New(NewRows { partition: "p".into(), versions: vec![0], tags, ..NewRows::default() })
}

/// The dumped `Rows` changes of a snapshot, with the restored store's observation.
fn dumped_rows(store: &Store) -> Vec<NewRows> {
    let snapshot = store.snapshot(true, || {}).unwrap();
    let rows = snapshot
        .changes
        .iter()
        .filter_map(|c| match c {
            Change::Rows { new, .. } => Some(new.clone()),
            _ => None,
        })
        .collect();
    let restored = Store::new(config()).unwrap();
    restore_snapshot(&restored, snapshot);
    assert_eq!(observe(&restored), observe(store));
    rows
}

#[test]
fn a_snapshot_writes_the_tags_of_a_put_once() {
    // Repeated for each of a put's rows, 120 puts of 1000 rows with one 10 kB tag made a 1.2 GB
    // record, which the log's reader refuses: the data directory could not be opened again.
    let store = Store::new(config()).unwrap();
    for _ in 0..3 {
        let tag = Arc::new(vec![("k".to_string(), "x".repeat(10_000))]);
        let column = ints(&store, "a", &[7; 1000]);
        store.put(vec![column], &tagged_rows(vec![tag])).unwrap();
    }
    let dumped = dumped_rows(&store);
    assert_eq!(dumped.len(), 3, "one change per put");
    assert!(dumped.iter().all(|new| new.tags.len() == 1), "each put's tag set once");
}

#[test]
fn a_snapshot_cuts_rows_whose_own_tags_would_make_a_record_too_large() {
    let store = Store::new(config()).unwrap();
    let tags = (0..400).map(|i| Arc::new(vec![(format!("k{i}"), "x".repeat(100_000))])).collect();
    store.put(vec![ints(&store, "a", &[7; 400])], &tagged_rows(tags)).unwrap();
    let dumped = dumped_rows(&store);
    assert!(dumped.len() >= 3, "40 MB of tags in changes of about 16 MiB");
    for new in &dumped {
        let bytes: usize = new.tags.iter().map(|t| t[0].1.len()).sum();
        assert!(bytes <= (16 << 20) + 100_000, "{bytes}");
    }
}

#[test]
fn a_replayed_put_committed_after_its_rows_were_cleared_keeps_no_cells() {
    // A clear that landed between a put's admission and its commit: the live store freed the
    // put's cells, the replayed one kept them (and their memory) until the daemon stopped.
    let (store, recorder) = journaled();
    store.put(vec![ints(&store, "a", &[1, 2])], &new_rows()).unwrap();
    let mut entries = recorder.entries.lock().clone();
    let commit = entries.iter().position(|(_, cells)| cells.is_some()).unwrap();
    entries.insert(commit, (vec![Change::Cleared { partition: "p".into() }], None));
    let restored = Store::new(config()).unwrap();
    replay(&restored, &entries);
    assert!(restored.rows(None).is_empty());
    assert_eq!(restored.stats().payload_rows, 0);
}
