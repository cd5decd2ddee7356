//! The daemon and client together: every store operation over TCP and over shared memory,
//! multiplexed requests, and an orderly stop.

mod support;

use std::time::{Duration, Instant};

use asyncflow_core::{ClaimSpec, StoreError};
use asyncflow_server::Error;
use asyncflow_server::client::Preference;
use support::{Daemon, NOW, ints, put_ints, read_ints};

fn spec(task: &str, field: &str, batch_size: usize) -> ClaimSpec {
    ClaimSpec {
        task: task.into(),
        fields: vec![field.into()],
        batch_size,
        partition: None,
        min_version: None,
        whole_groups: false,
        share: None,
    }
}

fn round_trip(prefer: Preference, transport: &str) {
    let daemon = Daemon::start(&[]);
    let client = daemon.connect(prefer);
    assert_eq!(client.transport(), transport);
    client.register_task("t", None, NOW).unwrap();
    let rows = put_ints(&client, "x", &[10, 20, 30]);
    let (claimed, sent) =
        client.claim(&spec("t", "x", 3), false, Some(Duration::from_secs(1)), NOW).unwrap();
    assert_eq!(claimed.rows, rows);
    // On shared memory the claimed cells come with the claim; over TCP they are read after it.
    assert_eq!(
        sent.map(|columns| ints(&columns[0])),
        (transport == "shm").then(|| vec![10, 20, 30])
    );
    assert_eq!(read_ints(&client, &rows, "x"), vec![10, 20, 30]);
    client.ack(claimed.lease.unwrap(), None, NOW).unwrap();
    let stats = client.stats(NOW).unwrap();
    assert_eq!((stats.index.live_rows, stats.index.counters.rows_acked), (0, 3));
}

#[test]
fn every_operation_round_trips_over_tcp() {
    round_trip(Preference::Tcp, "tcp");
}

#[test]
fn every_operation_round_trips_over_shared_memory() {
    round_trip(Preference::Shm, "shm");
}

#[test]
fn store_errors_arrive_as_the_same_variant() {
    let daemon = Daemon::start(&[]);
    let client = daemon.connect(Preference::Auto);
    let err = client.claim(&spec("nobody", "x", 1), false, Some(Duration::ZERO), NOW).unwrap_err();
    assert!(matches!(err, Error::Store(StoreError::UnknownTask(t)) if t == "nobody"));
    client.register_task("t", None, NOW).unwrap();
    let err =
        client.claim(&spec("t", "x", 1), false, Some(Duration::from_millis(50)), NOW).unwrap_err();
    assert!(matches!(err, Error::Store(StoreError::Timeout { .. })));
}

#[test]
fn a_long_claim_does_not_hold_up_other_requests_of_the_same_client() {
    let daemon = Daemon::start(&[]);
    let client = daemon.connect(Preference::Auto);
    client.register_task("t", None, NOW).unwrap();
    std::thread::scope(|s| {
        let waiting =
            s.spawn(|| client.claim(&spec("t", "x", 1), false, Some(Duration::from_secs(30)), NOW));
        std::thread::sleep(Duration::from_millis(100));
        let started = Instant::now();
        client.stats(NOW).unwrap();
        put_ints(&client, "x", &[1]);
        assert!(started.elapsed() < Duration::from_secs(10), "requests were served meanwhile");
        assert_eq!(waiting.join().unwrap().unwrap().0.rows.len(), 1, "and the claim got the row");
    });
}

#[test]
fn a_stop_lets_in_flight_requests_finish_and_ends_cleanly() {
    let daemon = Daemon::start(&[]);
    let client = daemon.connect(Preference::Tcp);
    client.register_task("t", None, NOW).unwrap();
    put_ints(&client, "x", &[1]);
    assert!(daemon.stop().is_ok());
    assert!(matches!(client.stats(NOW), Err(Error::Connection(_))), "the connection is closed");
}

#[test]
fn a_wrong_or_missing_token_is_refused() {
    let daemon = Daemon::start(&["--token", "s3cret"]);
    for token in [None, Some("guess")] {
        let err = asyncflow_server::client::Client::connect(&daemon.url(), token, Preference::Auto)
            .err()
            .unwrap();
        assert!(matches!(err, Error::Auth(_)), "{err}");
    }
    let ok =
        asyncflow_server::client::Client::connect(&daemon.url(), Some("s3cret"), Preference::Auto)
            .unwrap();
    ok.register_task("t", None, NOW).unwrap();
}

#[test]
fn a_staged_put_larger_than_a_frame_is_refused() {
    let daemon = Daemon::start(&["--max-frame", "64KiB"]);
    let client = daemon.connect(Preference::Shm);
    let big: Vec<i64> = (0..10_000).collect();
    let bytes: Vec<u8> = big.iter().flat_map(|v| v.to_le_bytes()).collect();
    let column = asyncflow_server::client::PutColumn {
        name: "x".into(),
        schema: asyncflow_core::FieldSchema::ragged(asyncflow_core::DType::I64, vec![]),
        cells: vec![(&bytes, 10_000)],
    };
    let err = client.put(&[column], support::new_rows(), None, NOW).unwrap_err();
    assert!(matches!(err, Error::Store(StoreError::BadRequest(m)) if m.contains("max-frame")));
    put_ints(&client, "y", &[1]);
}
