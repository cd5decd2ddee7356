//! Shared claims: the data-parallel ranks of a step each receive a balanced part of one claimed
//! batch, and the peers of a replica group receive the same part and must all ack it. The index
//! runs under a clock the tests move by hand; the last tests run ranks as threads on a store.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use asyncflow_core::index::ColumnSpec;
use asyncflow_core::scheduler::CostModel;
use asyncflow_core::{
    ClaimSpec, Claimed, DType, FieldSchema, Index, NewRows, PutTarget, Share, Store, StoreConfig,
    StoreError, Wait,
};

const LEASE: Duration = Duration::from_secs(10);

/// An index whose rows carry a token length in field "ids", measured from a map.
struct Harness {
    index: Index,
    lengths: HashMap<u64, u64>,
    now: Instant,
}

impl Harness {
    fn new() -> Self {
        let mut index = Index::new();
        index.register_task("train", None).unwrap();
        Self { index, lengths: HashMap::new(), now: Instant::now() }
    }

    fn put(&mut self, lengths: &[u64], groups: Option<Vec<u64>>) -> Vec<u64> {
        let schema = FieldSchema::ragged(DType::I64, vec![]);
        let spec = [ColumnSpec { name: "ids", schema: &schema, rows: lengths.len() }];
        let target = PutTarget::New(NewRows {
            partition: "p".into(),
            groups,
            versions: vec![0],
            ..NewRows::default()
        });
        let admitted = self.index.admit_put(&spec, &target).unwrap();
        self.index.commit_ready(&admitted.rows, &admitted.fields);
        for (&row, &len) in admitted.rows.iter().zip(lengths) {
            self.lengths.insert(row, len);
        }
        admitted.rows
    }

    fn claim(&mut self, spec: &ClaimSpec) -> Result<Claimed, StoreError> {
        let lengths = &self.lengths;
        let measure = |rows: &[u64], _field| Ok(rows.iter().map(|r| lengths[r]).collect());
        self.index
            .try_claim_with(spec, self.now, LEASE, true, &measure)
            .map(|c| c.expect("a partial claim always answers"))
    }

    fn advance(&mut self, by: Duration) {
        self.now += by;
        self.index.expire_leases(self.now);
    }

    fn ack(&mut self, claimed: &Claimed) -> Result<Vec<u64>, StoreError> {
        self.index.ack(claimed.lease.unwrap(), None, self.now)
    }

    fn tokens(&self, rows: &[u64]) -> u64 {
        rows.iter().map(|r| self.lengths[r]).sum()
    }

    /// Rows a plain claim of `task` can take now.
    fn claimable(&mut self) -> Vec<u64> {
        let spec = plain(1000);
        let c = self.index.try_claim(&spec, self.now, LEASE, true).unwrap().unwrap();
        if let Some(lease) = c.lease {
            self.index.release(lease, None, self.now).unwrap();
        }
        c.rows
    }
}

fn plain(batch_size: usize) -> ClaimSpec {
    ClaimSpec {
        task: "train".into(),
        fields: vec!["ids".into()],
        batch_size,
        ..ClaimSpec::default()
    }
}

fn shared(batch_size: usize, share: Share) -> ClaimSpec {
    ClaimSpec { share: Some(share), ..plain(batch_size) }
}

fn rank(step: u64, dp_rank: u32, dp_size: u32) -> Share {
    Share { step, dp_rank, dp_size, ..Share::default() }
}

fn peer(step: u64, replica_rank: u32, replica_size: u32) -> Share {
    Share { step, replica_rank, replica_size, ..Share::default() }
}

fn sorted(mut rows: Vec<u64>) -> Vec<u64> {
    rows.sort_unstable();
    rows
}

#[test]
fn every_rank_gets_a_disjoint_part_and_together_they_are_one_batch() {
    let mut h = Harness::new();
    let rows = h.put(&[5, 9, 2, 7, 3, 8, 1, 6, 4, 10], None);
    let parts: Vec<Claimed> = (0..4).map(|r| h.claim(&shared(8, rank(0, r, 4))).unwrap()).collect();
    let mut all: Vec<u64> = parts.iter().flat_map(|c| c.rows.clone()).collect();
    assert_eq!(all.len(), 8, "no row is delivered to two ranks");
    all.sort_unstable();
    assert_eq!(all, rows[..8], "the step's batch is its oldest eight ready rows");
    assert_eq!(h.claimable(), rows[8..], "the batch is leased as soon as it is claimed");
}

#[test]
fn parts_are_balanced_by_the_token_length_of_the_balance_field() {
    let mut h = Harness::new();
    // One long trace and many short ones: by count, rank 0 would get the long one plus half.
    let mut lengths = vec![60];
    lengths.extend([10; 12]);
    h.put(&lengths, None);
    let parts: Vec<Claimed> =
        (0..2).map(|r| h.claim(&shared(13, rank(0, r, 2))).unwrap()).collect();
    let tokens: Vec<u64> = parts.iter().map(|c| h.tokens(&c.rows)).collect();
    assert_eq!(sorted(tokens), vec![90, 90]);
}

#[test]
fn the_attention_cost_model_spreads_long_rows_by_their_squares() {
    let mut h = Harness::new();
    h.put(&[6, 3, 3, 2, 2, 2], None);
    let share = |r| Share { cost: CostModel::Attention { linear_weight: 0.0 }, ..rank(0, r, 2) };
    let first = h.claim(&shared(6, share(0))).unwrap();
    let second = h.claim(&shared(6, share(1))).unwrap();
    let alone = if h.tokens(&first.rows) == 6 { &first } else { &second };
    assert_eq!(alone.rows.len(), 1, "the 6-token row is worth a rank of its own");
}

#[test]
fn a_rank_claiming_again_gets_the_same_part() {
    let mut h = Harness::new();
    h.put(&[1, 2, 3, 4], None);
    let once = h.claim(&shared(4, rank(0, 1, 2))).unwrap();
    let again = h.claim(&shared(4, rank(0, 1, 2))).unwrap();
    assert_eq!(once, again);
}

#[test]
fn ranks_commit_their_parts_independently() {
    let mut h = Harness::new();
    let rows = h.put(&[4, 4, 4, 4], None);
    let r0 = h.claim(&shared(4, rank(0, 0, 2))).unwrap();
    let r1 = h.claim(&shared(4, rank(0, 1, 2))).unwrap();
    assert_eq!(sorted(h.ack(&r0).unwrap()), sorted(r0.rows.clone()), "rank 0's rows are freed");
    assert!(r1.rows.iter().all(|&r| h.index.is_live(r)));
    h.ack(&r1).unwrap();
    assert!(rows.iter().all(|&r| !h.index.is_live(r)));
}

#[test]
fn replica_peers_receive_identical_rows() {
    let mut h = Harness::new();
    h.put(&[1, 2, 3], None);
    let p0 = h.claim(&shared(3, peer(0, 0, 2))).unwrap();
    let p1 = h.claim(&shared(3, peer(0, 1, 2))).unwrap();
    assert_eq!(p0.rows, p1.rows);
    assert_ne!(p0.lease, p1.lease, "each peer holds a seat of its own");
}

#[test]
fn a_row_is_committed_only_once_every_peer_has_acked_it() {
    let mut h = Harness::new();
    let rows = h.put(&[1, 2, 3], None);
    let p0 = h.claim(&shared(3, peer(0, 0, 2))).unwrap();
    let p1 = h.claim(&shared(3, peer(0, 1, 2))).unwrap();
    assert!(h.ack(&p0).unwrap().is_empty());
    assert!(rows.iter().all(|&r| h.index.is_live(r)), "one peer's ack commits nothing");
    assert_eq!(sorted(h.ack(&p1).unwrap()), rows);
}

#[test]
fn peers_may_ack_rows_piecemeal() {
    let mut h = Harness::new();
    let rows = h.put(&[1, 2, 3], None);
    let p0 = h.claim(&shared(3, peer(0, 0, 2))).unwrap();
    let p1 = h.claim(&shared(3, peer(0, 1, 2))).unwrap();
    h.index.ack(p0.lease.unwrap(), Some(&rows[..1]), h.now).unwrap();
    assert_eq!(h.index.ack(p1.lease.unwrap(), Some(&rows[..2]), h.now).unwrap(), rows[..1]);
    assert_eq!(h.index.ack(p0.lease.unwrap(), None, h.now).unwrap(), rows[1..2]);
    // Claiming again returns only what this peer has not acked.
    assert_eq!(h.claim(&shared(3, peer(0, 1, 2))).unwrap().rows, rows[2..]);
}

#[test]
fn a_peer_that_went_away_done_leaves_its_part_to_the_others_and_one_mid_work_hands_it_back() {
    // The daemon gives back the leases of a closed connection. A peer that had acked all its
    // rows in pieces (as the trainer does) then handed the part back for every peer: the
    // others' lease ended under them and their rows were trained again.
    let mut h = Harness::new();
    let rows = h.put(&[1, 2, 3], None);
    let p0 = h.claim(&shared(3, peer(0, 0, 2))).unwrap();
    let p1 = h.claim(&shared(3, peer(0, 1, 2))).unwrap();
    h.index.ack(p0.lease.unwrap(), Some(&rows[..1]), h.now).unwrap();
    h.index.ack(p0.lease.unwrap(), Some(&rows[1..]), h.now).unwrap();
    assert_eq!(h.index.give_back(p0.lease.unwrap(), h.now), Ok(false));
    assert_eq!(sorted(h.ack(&p1).unwrap()), rows);

    let rows = h.put(&[1, 2, 3], None);
    let p0 = h.claim(&shared(3, peer(1, 0, 2))).unwrap();
    let p1 = h.claim(&shared(3, peer(1, 1, 2))).unwrap();
    h.index.ack(p0.lease.unwrap(), Some(&rows[..1]), h.now).unwrap();
    assert_eq!(h.index.give_back(p0.lease.unwrap(), h.now), Ok(true));
    assert!(matches!(h.ack(&p1), Err(StoreError::Lease { .. })));
    assert_eq!(h.claimable(), rows);
}

#[test]
fn a_peer_acking_twice_gets_a_lease_error() {
    let mut h = Harness::new();
    h.put(&[1, 2], None);
    let p0 = h.claim(&shared(2, peer(0, 0, 2))).unwrap();
    h.ack(&p0).unwrap();
    assert!(matches!(h.ack(&p0), Err(StoreError::Lease { id, .. }) if Some(id) == p0.lease));
    assert!(matches!(h.claim(&shared(2, peer(0, 0, 2))), Err(StoreError::Lease { .. })));
}

#[test]
fn a_release_by_one_peer_hands_the_part_back_for_every_peer() {
    let mut h = Harness::new();
    let rows = h.put(&[1, 2], None);
    let p0 = h.claim(&shared(2, peer(0, 0, 2))).unwrap();
    let p1 = h.claim(&shared(2, peer(0, 1, 2))).unwrap();
    h.index.release(p0.lease.unwrap(), None, h.now).unwrap();
    assert!(matches!(h.ack(&p1), Err(StoreError::Lease { .. })));
    assert_eq!(h.claimable(), rows, "the rows are delivered again by a later claim");
}

#[test]
fn an_expired_part_is_handed_back_while_committed_parts_stay_committed() {
    let mut h = Harness::new();
    h.put(&[5, 5, 5, 5], None);
    let r0 = h.claim(&shared(4, rank(0, 0, 2))).unwrap();
    let r1 = h.claim(&shared(4, rank(0, 1, 2))).unwrap();
    h.ack(&r0).unwrap();
    h.advance(LEASE);
    let late = h.ack(&r1);
    assert!(matches!(&late, Err(StoreError::Lease { reason, .. }) if reason.contains("expired")));
    assert_eq!(h.claimable(), r1.rows, "only the expired part is delivered again");
}

#[test]
fn acks_of_some_peers_are_void_when_their_part_expires() {
    let mut h = Harness::new();
    let rows = h.put(&[1, 1], None);
    let p0 = h.claim(&shared(2, peer(0, 0, 2))).unwrap();
    h.ack(&p0).unwrap();
    h.advance(LEASE);
    assert_eq!(h.claimable(), rows);
}

#[test]
fn a_renew_by_one_peer_extends_the_part_for_all() {
    let mut h = Harness::new();
    h.put(&[1, 1], None);
    let p0 = h.claim(&shared(2, peer(0, 0, 2))).unwrap();
    let p1 = h.claim(&shared(2, peer(0, 1, 2))).unwrap();
    h.advance(LEASE / 2);
    h.index.renew(p0.lease.unwrap(), h.now, LEASE).unwrap();
    h.advance(LEASE * 3 / 4);
    h.ack(&p0).unwrap();
    h.ack(&p1).unwrap();
}

#[test]
fn a_rank_arriving_after_its_part_expired_gets_a_lease_error() {
    let mut h = Harness::new();
    h.put(&[1, 1, 1, 1], None);
    h.claim(&shared(4, rank(0, 0, 2))).unwrap();
    h.advance(LEASE);
    assert!(matches!(h.claim(&shared(4, rank(0, 1, 2))), Err(StoreError::Lease { .. })));
}

#[test]
fn an_ended_step_is_never_claimed_afresh() {
    let mut h = Harness::new();
    h.put(&[1, 1, 1, 1], None);
    let c = h.claim(&shared(2, rank(0, 0, 1))).unwrap();
    h.ack(&c).unwrap();
    assert!(matches!(h.claim(&shared(2, rank(0, 0, 1))), Err(StoreError::Lease { .. })));
    assert_eq!(h.claim(&shared(2, rank(1, 0, 1))).unwrap().rows.len(), 2, "the next step is fine");
}

#[test]
fn callers_of_one_step_must_repeat_its_options() {
    let mut h = Harness::new();
    h.put(&[1, 1, 1, 1], None);
    h.claim(&shared(4, rank(0, 0, 2))).unwrap();
    // The message names the options that differ, by their Python names, and no others.
    let mut message = |spec| match h.claim(&spec) {
        Err(StoreError::BadRequest(m)) => m,
        other => panic!("{other:?}"),
    };
    let m = message(shared(4, rank(0, 1, 4)));
    assert!(m.ends_with("differs in dp_size 2 (asked: 4)"), "{m}");
    let m = message(shared(3, rank(0, 1, 2)));
    assert!(m.ends_with("differs in batch_size 4 (asked: 3)"), "{m}");
    let cost = CostModel::Attention { linear_weight: 6.0 };
    let m = message(ClaimSpec { whole_groups: true, ..shared(4, Share { cost, ..rank(0, 1, 2) }) });
    assert!(
        m.ends_with(
            "whole_groups false (asked: true), cost tokens (asked: attention, linear_weight 6)"
        ),
        "{m}"
    );
}

#[test]
fn different_replica_groups_claim_different_batches() {
    let mut h = Harness::new();
    h.put(&[1, 1, 1, 1], None);
    let a = h.claim(&shared(2, Share { replica: 0, ..peer(0, 0, 1) })).unwrap();
    let b = h.claim(&shared(2, Share { replica: 1, ..peer(0, 0, 1) })).unwrap();
    assert!(a.rows.iter().all(|r| !b.rows.contains(r)));
}

#[test]
fn with_whole_groups_a_group_stays_on_one_rank() {
    let mut h = Harness::new();
    let groups = vec![1, 2, 1, 3, 2, 3, 4, 4];
    h.put(&[9, 1, 9, 2, 1, 2, 5, 5], Some(groups.clone()));
    let spec = |r| ClaimSpec { whole_groups: true, ..shared(8, rank(0, r, 2)) };
    let c0 = h.claim(&spec(0)).unwrap();
    let c1 = h.claim(&spec(1)).unwrap();
    let g0: HashSet<_> = c0.groups.iter().collect();
    assert!(c1.groups.iter().all(|g| !g0.contains(g)));
    assert_eq!(c0.rows.len() + c1.rows.len(), 8);
}

#[test]
fn equal_count_gives_every_rank_the_same_number_of_rows() {
    let mut h = Harness::new();
    h.put(&[100, 1, 1, 1, 1, 1, 1, 1], None);
    let share = |r| Share { equal_count: true, ..rank(0, r, 2) };
    assert_eq!(h.claim(&shared(8, share(0))).unwrap().rows.len(), 4);
    assert_eq!(h.claim(&shared(8, share(1))).unwrap().rows.len(), 4);
}

#[test]
fn a_partial_batch_can_leave_a_rank_with_an_empty_claim() {
    let mut h = Harness::new();
    h.put(&[3], None);
    let parts: Vec<Claimed> = (0..2).map(|r| h.claim(&shared(8, rank(0, r, 2))).unwrap()).collect();
    assert_eq!(parts.iter().filter(|c| c.lease.is_none() && c.rows.is_empty()).count(), 1);
}

#[test]
fn a_full_batch_is_awaited_unless_partial_is_accepted() {
    let mut h = Harness::new();
    h.put(&[3], None);
    let never =
        |_: &[u64], _| -> Result<Vec<u64>, StoreError> { unreachable!("nothing to measure") };
    let spec = shared(2, rank(0, 0, 2));
    assert_eq!(h.index.try_claim_with(&spec, h.now, LEASE, false, &never).unwrap(), None);
}

#[test]
fn bad_ranks_and_a_balance_field_outside_the_claim_are_bad_requests() {
    let mut h = Harness::new();
    h.put(&[1], None);
    for bad in [
        shared(1, rank(0, 2, 2)),
        shared(1, peer(0, 1, 1)),
        shared(1, Share { balance_field: Some("other".into()), ..rank(0, 0, 1) }),
        shared(1, Share { cost: CostModel::Attention { linear_weight: -1.0 }, ..rank(0, 0, 1) }),
    ] {
        assert!(matches!(h.claim(&bad), Err(StoreError::BadRequest(_))), "{bad:?}");
    }
}

#[test]
fn an_index_without_payloads_cannot_balance_by_tokens() {
    let mut h = Harness::new();
    h.put(&[1], None);
    let result = h.index.try_claim(&shared(1, rank(0, 0, 1)), h.now, LEASE, true);
    assert!(matches!(result, Err(StoreError::BadRequest(_))));
    assert_eq!(h.claimable().len(), 1, "the failed claim leased nothing");
}

// ---- ranks as threads on a store ------------------------------------------------------------

const STEPS: u64 = 12;
const BATCH: usize = 24;
const DP: u32 = 3;
const PEERS: u32 = 2;

/// (step, dp rank, peer) -> rows delivered.
type Deliveries = HashMap<(u64, u32, u32), Vec<u64>>;

fn put_sequences(store: &Store, lengths: &[usize]) -> Vec<u64> {
    let bytes: Vec<Vec<u8>> = lengths.iter().map(|&l| vec![1u8; l * 8]).collect();
    let cells: Vec<(&[u8], u64)> =
        bytes.iter().zip(lengths).map(|(b, &l)| (b.as_slice(), l as u64)).collect();
    let wait = Wait::timeout(None);
    let col =
        store.pack_column("ids", FieldSchema::ragged(DType::I64, vec![]), &cells, wait).unwrap();
    let target =
        PutTarget::New(NewRows { partition: "p".into(), versions: vec![0], ..NewRows::default() });
    store.put(vec![col], &target).unwrap()
}

#[test]
fn ranks_and_peers_in_threads_share_every_step_and_lose_nothing() {
    let store = Arc::new(Store::new(StoreConfig::default()).unwrap());
    store.register_task("train", None).unwrap();
    let seen: Arc<Mutex<Deliveries>> = Arc::default();
    let mut workers = Vec::new();
    for dp_rank in 0..DP {
        for replica_rank in 0..PEERS {
            let (store, seen) = (Arc::clone(&store), Arc::clone(&seen));
            workers.push(thread::spawn(move || {
                for step in 0..STEPS {
                    let share = Share {
                        step,
                        dp_rank,
                        dp_size: DP,
                        replica: 0,
                        replica_rank,
                        replica_size: PEERS,
                        ..Share::default()
                    };
                    let spec = ClaimSpec { share: Some(share), ..plain(BATCH) };
                    let c = store
                        .claim(&spec, false, Wait::timeout(Some(Duration::from_secs(30))))
                        .unwrap();
                    seen.lock().unwrap().insert((step, dp_rank, replica_rank), c.rows.clone());
                    store.ack(c.lease.unwrap(), None).unwrap();
                }
            }));
        }
    }
    // Rows arrive while the ranks wait, with long-tailed lengths.
    let lengths: Vec<usize> =
        (0..BATCH * STEPS as usize).map(|i| 1 + (i * 37 % 11).pow(3)).collect();
    for chunk in lengths.chunks(7) {
        put_sequences(&store, chunk);
        thread::sleep(Duration::from_millis(1));
    }
    for w in workers {
        w.join().unwrap();
    }

    let seen = seen.lock().unwrap();
    let mut delivered = HashSet::new();
    for step in 0..STEPS {
        let mut step_rows = 0;
        for dp_rank in 0..DP {
            let rows = &seen[&(step, dp_rank, 0)];
            assert_eq!(rows, &seen[&(step, dp_rank, 1)], "peers see identical rows");
            step_rows += rows.len();
            for &r in rows {
                assert!(delivered.insert(r), "row {r} delivered to two ranks or steps");
            }
        }
        assert_eq!(step_rows, BATCH);
    }
    let stats = store.stats();
    assert_eq!((stats.index.live_rows, stats.memory_used), (0, 0), "every row committed");
}

// ---- invariants under any sequence of operations ---------------------------------------------

mod invariants {
    use std::collections::{BTreeSet, HashMap, HashSet};
    use std::time::Duration;

    use asyncflow_core::{Share, StoreError};
    use proptest::prelude::*;

    use super::{Harness, LEASE, shared};

    const DP: u32 = 2;
    const PEERS: u32 = 2;

    /// A part: (step, dp rank).
    type PartKey = (u64, u32);

    #[derive(Debug, Clone)]
    enum Op {
        Put { lengths: Vec<u64> },
        Claim { step: u64, dp_rank: u32, peer: u32, partial: bool },
        Ack { pick: usize, half: bool },
        Release { pick: usize },
        Advance { ms: u64 },
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            2 => prop::collection::vec(1..50u64, 1..5).prop_map(|lengths| Op::Put { lengths }),
            5 => (0..3u64, 0..DP, 0..PEERS, any::<bool>())
                .prop_map(|(step, dp_rank, peer, partial)| Op::Claim { step, dp_rank, peer, partial }),
            5 => (any::<usize>(), any::<bool>()).prop_map(|(pick, half)| Op::Ack { pick, half }),
            1 => any::<usize>().prop_map(|pick| Op::Release { pick }),
            1 => (1..4_000u64).prop_map(|ms| Op::Advance { ms }),
        ]
    }

    /// What the test knows of a part once one of its peers has seen it.
    #[derive(Debug, Default)]
    struct PartModel {
        /// Rows the part still holds: delivered, not committed, not handed back.
        held: BTreeSet<u64>,
        acked: HashMap<u32, HashSet<u64>>,
        seats: HashMap<u32, u64>,
        deadline: Option<std::time::Instant>,
        ended: bool,
    }

    #[derive(Default)]
    struct Model {
        rows: Vec<u64>,
        parts: HashMap<PartKey, PartModel>,
        /// The part holding each leased row the test knows of.
        held_by: HashMap<u64, PartKey>,
        committed: HashSet<u64>,
    }

    struct Run {
        h: Harness,
        m: Model,
    }

    impl Run {
        fn claim(&mut self, step: u64, dp_rank: u32, peer: u32, partial: bool) {
            let share = Share {
                step,
                dp_rank,
                dp_size: DP,
                replica_rank: peer,
                replica_size: PEERS,
                ..Share::default()
            };
            let lengths = &self.h.lengths;
            let measure = |rows: &[u64], _| Ok(rows.iter().map(|r| lengths[r]).collect());
            let spec = shared(4, share);
            let claimed =
                match self.h.index.try_claim_with(&spec, self.h.now, LEASE, partial, &measure) {
                    Ok(Some(claimed)) => claimed,
                    Ok(None) | Err(StoreError::Lease { .. }) => return,
                    Err(e) => panic!("unexpected claim error {e}"),
                };
            let Some(seat) = claimed.lease else { return };
            let key = (step, dp_rank);
            let part = self.m.parts.entry(key).or_default();
            if part.deadline.is_some() {
                let mut expected: Vec<u64> = part.held.iter().copied().collect();
                let mine = part.acked.entry(peer).or_default();
                expected.retain(|r| !mine.contains(r));
                assert_eq!(claimed.rows, expected, "a peer sees the part's rows less its own acks");
            } else {
                part.held = claimed.rows.iter().copied().collect();
                part.deadline = claimed.deadline;
            }
            part.seats.insert(peer, seat);
            for &row in &claimed.rows {
                let holder = *self.m.held_by.entry(row).or_insert(key);
                assert_eq!(holder, key, "row {row} leased to two parts at once");
            }
        }

        fn seat(&self, pick: usize) -> Option<(PartKey, u32, u64)> {
            let mut seats: Vec<(PartKey, u32, u64)> = self
                .m
                .parts
                .iter()
                .flat_map(|(&key, p)| p.seats.iter().map(move |(&peer, &id)| (key, peer, id)))
                .collect();
            seats.sort_unstable();
            (!seats.is_empty()).then(|| seats[pick % seats.len()])
        }

        fn alive(&self, key: PartKey) -> bool {
            // A part ends when handed back, when it expires, or once every row is committed.
            let part = &self.m.parts[&key];
            !part.ended && !part.held.is_empty() && part.deadline.is_some_and(|d| d > self.h.now)
        }

        fn ack(&mut self, pick: usize, half: bool) {
            let Some((key, peer, seat)) = self.seat(pick) else { return };
            let alive = self.alive(key);
            let part = self.m.parts.get_mut(&key).unwrap();
            let mine = part.acked.entry(peer).or_default();
            let mut pending: Vec<u64> =
                part.held.iter().copied().filter(|r| !mine.contains(r)).collect();
            if half {
                pending.truncate(pending.len().div_ceil(2));
            }
            let result = self.h.index.ack(seat, Some(&pending), self.h.now);
            if !alive || pending.is_empty() {
                assert!(matches!(result, Err(StoreError::Lease { .. })), "{result:?}");
                return;
            }
            let freed: HashSet<u64> =
                result.expect("a live part accepts a fresh ack").into_iter().collect();
            mine.extend(&pending);
            for row in pending {
                let everyone =
                    part.acked.values().filter(|a| a.contains(&row)).count() == PEERS as usize;
                assert_eq!(
                    freed.contains(&row),
                    everyone,
                    "row {row} commits exactly when every peer has acked it"
                );
                if everyone {
                    part.held.remove(&row);
                    self.m.held_by.remove(&row);
                    assert!(self.m.committed.insert(row), "row {row} committed twice");
                }
            }
        }

        fn release(&mut self, pick: usize) {
            let Some((key, _, seat)) = self.seat(pick) else { return };
            let alive = self.alive(key);
            let result = self.h.index.release(seat, None, self.h.now);
            if !alive {
                assert!(result.is_err());
                return;
            }
            result.unwrap();
            self.end(key);
        }

        fn end(&mut self, key: PartKey) {
            let part = self.m.parts.get_mut(&key).unwrap();
            part.ended = true;
            for row in std::mem::take(&mut part.held) {
                self.m.held_by.remove(&row);
            }
        }

        fn advance(&mut self, ms: u64) {
            self.h.advance(Duration::from_millis(ms));
            let expired: Vec<PartKey> =
                self.m.parts.keys().copied().filter(|&k| !self.alive(k)).collect();
            for key in expired {
                self.end(key);
            }
        }

        fn check_retention(&self) {
            for &row in &self.m.rows {
                assert_eq!(
                    !self.h.index.is_live(row),
                    self.m.committed.contains(&row),
                    "row {row} is freed exactly when committed"
                );
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

        #[test]
        fn shared_claims_keep_their_promises_under_any_operation_sequence(
            ops in prop::collection::vec(op(), 1..60)
        ) {
            let mut run = Run { h: Harness::new(), m: Model::default() };
            for op in ops {
                match op {
                    Op::Put { lengths } => {
                        let rows = run.h.put(&lengths, None);
                        run.m.rows.extend(rows);
                    }
                    Op::Claim { step, dp_rank, peer, partial } => run.claim(step, dp_rank, peer, partial),
                    Op::Ack { pick, half } => run.ack(pick, half),
                    Op::Release { pick } => run.release(pick),
                    Op::Advance { ms } => run.advance(ms),
                }
                run.check_retention();
            }
        }
    }
}

#[test]
fn a_share_too_large_to_lay_out_is_a_bad_request_not_an_abort() {
    // Every part and seat cost memory up front: dp_size 2^32 - 1 aborted the process holding
    // the store (a failed allocation of 64 GiB).
    let mut h = Harness::new();
    h.put(&[3, 4, 5, 6], None);
    for share in [rank(0, 0, u32::MAX), peer(0, 0, u32::MAX), rank(0, 0, (1 << 16) + 1)] {
        let e = h.claim(&shared(4, share)).unwrap_err();
        assert!(matches!(&e, StoreError::BadRequest(m) if m.contains("at most 65536")), "{e}");
    }
    assert_eq!(h.claim(&shared(4, rank(0, 0, 1 << 16))).unwrap().rows.len(), 1);
}
