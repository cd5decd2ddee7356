//! The daemon and client together: every store operation over TCP and over shared memory,
//! multiplexed requests, and an orderly stop.

mod support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use asyncflow_core::{ClaimSpec, StoreError, Wait};
use asyncflow_server::Error;
use asyncflow_server::client::Preference;
use support::{Daemon, NOW, ints, put_ints, put_row, read_ints, read_row};

fn spec(task: &str, field: &str, batch_size: usize) -> ClaimSpec {
    ClaimSpec {
        task: task.into(),
        fields: vec![field.into()],
        batch_size,
        partition: None,
        min_version: None,
        whole_groups: false,
        share: None,
        partial_after: None,
    }
}

fn round_trip(prefer: Preference, transport: &str) {
    let daemon = Daemon::start(&[]);
    let client = daemon.connect(prefer);
    assert_eq!(client.transport(), transport);
    client.register_task("t", None, NOW).unwrap();
    let rows = put_ints(&client, "x", &[10, 20, 30]);
    let (claimed, sent) =
        client.claim(spec("t", "x", 3), false, Some(Duration::from_secs(1)), NOW).unwrap();
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
    // Those puts travel in their requests; one of 32 KiB is written into shared memory.
    let wide: Vec<i64> = (0..4096).collect();
    let row = put_row(&client, "w", &wide);
    assert_eq!(read_row(&client, row, "w"), wide);
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
    let err = client.claim(spec("nobody", "x", 1), false, Some(Duration::ZERO), NOW).unwrap_err();
    assert!(matches!(err, Error::Store(StoreError::UnknownTask(t)) if t == "nobody"));
    client.register_task("t", None, NOW).unwrap();
    let err =
        client.claim(spec("t", "x", 1), false, Some(Duration::from_millis(50)), NOW).unwrap_err();
    assert!(matches!(err, Error::Store(StoreError::Timeout { .. })));
}

#[test]
fn a_long_claim_does_not_hold_up_other_requests_of_the_same_client() {
    let daemon = Daemon::start(&[]);
    let client = daemon.connect(Preference::Auto);
    client.register_task("t", None, NOW).unwrap();
    std::thread::scope(|s| {
        let waiting =
            s.spawn(|| client.claim(spec("t", "x", 1), false, Some(Duration::from_secs(30)), NOW));
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
    let err = client.put(&[column], support::new_rows(), None, None, NOW).unwrap_err();
    assert!(matches!(err, Error::Store(StoreError::BadRequest(m)) if m.contains("max-frame")));
    put_ints(&client, "y", &[1]);
}

#[test]
fn a_put_over_max_frame_on_tcp_is_refused_and_its_bytes_counted() {
    let metrics = free_address();
    let daemon = Daemon::start(&["--max-frame", "64KiB", "--metrics", &metrics]);
    let client = daemon.connect(Preference::Tcp);
    let bytes = vec![7u8; 100 << 10];
    let column = asyncflow_server::client::PutColumn {
        name: "x".into(),
        schema: asyncflow_core::FieldSchema::ragged(asyncflow_core::DType::U8, vec![]),
        cells: vec![(&bytes, 100 << 10)],
    };
    let err = client.put(&[column], support::new_rows(), None, None, NOW).unwrap_err();
    assert!(matches!(&err, Error::Store(StoreError::BadRequest(m)) if m.contains("max-frame")));
    assert_eq!(metric(&metrics, "request_errors_total"), 1);
    // Read and dropped, but received: the byte count says so.
    assert!(metric(&metrics, "received_bytes_total") > 100 << 10);
    put_ints(&client, "y", &[1]); // on the same connection
}

#[test]
fn a_put_larger_than_any_frame_is_refused_over_tcp_before_it_is_sent() {
    // Its length does not fit a frame's length field: the client refuses it with an error
    // (it once panicked), and the connection goes on. The 1 GiB of zeros is never touched.
    let daemon = Daemon::start(&[]);
    let client = daemon.connect(Preference::Tcp);
    let gib = vec![0u8; 1 << 30];
    let column = asyncflow_server::client::PutColumn {
        name: "x".into(),
        schema: asyncflow_core::FieldSchema::ragged(asyncflow_core::DType::U8, vec![]),
        cells: (0..5).map(|_| (gib.as_slice(), 1 << 30)).collect(),
    };
    let err = client.put(&[column], support::new_rows(), None, None, NOW).unwrap_err();
    assert!(
        matches!(&err, Error::Store(StoreError::BadRequest(m)) if m.contains("larger than any frame")),
        "{err}"
    );
    put_ints(&client, "y", &[1]);
}

/// A gauge or counter from the metrics page of a daemon started with `--metrics address`.
fn metric(address: &str, name: &str) -> u64 {
    use std::io::{Read as _, Write as _};
    let mut page = std::net::TcpStream::connect(address).unwrap();
    page.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
    let mut text = String::new();
    page.read_to_string(&mut text).unwrap();
    let prefix = format!("asyncflow_{name} ");
    let line = text.lines().find(|l| l.starts_with(&prefix)).expect("the metric is served");
    line[prefix.len()..].parse().unwrap()
}

/// A loopback address nothing listens on now.
fn free_address() -> String {
    let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    probe.local_addr().unwrap().to_string()
}

/// Polls `condition` every 10 ms, failing after a minute.
fn wait_until(what: &str, condition: impl Fn() -> bool) {
    let give_up = Instant::now() + Duration::from_secs(60);
    while !condition() {
        assert!(Instant::now() < give_up, "gave up waiting until {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn a_claim_is_served_while_more_claims_wait_than_the_daemon_has_threads() {
    // Tokio's blocking pool, which once held every waiting claim, has 512 threads.
    const IDLE: usize = 600;
    let metrics = free_address();
    let daemon = Daemon::start(&["--metrics", &metrics]);
    let client = daemon.connect(Preference::Tcp);
    client.register_task("idle", None, NOW).unwrap();
    client.register_task("t", None, NOW).unwrap();
    let done = AtomicBool::new(false);
    let interrupted = || done.load(Ordering::Relaxed);
    let idle_wait = Wait { deadline: None, interrupted: Some(&interrupted) };
    std::thread::scope(|s| {
        let idle: Vec<_> = (0..IDLE)
            .map(|_| s.spawn(|| client.claim(spec("idle", "never", 1), false, None, idle_wait)))
            .collect();
        wait_until("every idle claim waits", || metric(&metrics, "waiting_claims") == IDLE as u64);
        let claim = s.spawn(|| client.claim(spec("t", "x", 1), false, None, NOW));
        wait_until("the claim waits too", || metric(&metrics, "waiting_claims") == IDLE as u64 + 1);
        let rows = put_ints(&client, "x", &[7]);
        let (claimed, _) = claim.join().unwrap().unwrap();
        assert_eq!(claimed.rows, rows, "served while {IDLE} other claims still wait");
        assert_eq!(metric(&metrics, "waiting_claims"), IDLE as u64);
        done.store(true, Ordering::Relaxed);
        for waiting in idle {
            let err = waiting.join().unwrap().unwrap_err();
            assert!(matches!(err, Error::Store(StoreError::Interrupted)), "{err}");
        }
    });
    wait_until("the daemon drops the cancelled claims", || metric(&metrics, "waiting_claims") == 0);
}

#[test]
fn a_waiting_claim_gets_the_rows_of_a_lease_that_runs_out() {
    let daemon = Daemon::start(&["--lease-timeout", "1"]);
    let (holder, waiter) = (daemon.connect(Preference::Auto), daemon.connect(Preference::Auto));
    holder.register_task("t", None, NOW).unwrap();
    let rows = put_ints(&holder, "x", &[5]);
    let (held, _) = holder.claim(spec("t", "x", 1), false, Some(Duration::ZERO), NOW).unwrap();
    assert_eq!(held.rows, rows);
    // Nothing else happens in the store: only the lease's deadline can wake this claim.
    let (again, _) =
        waiter.claim(spec("t", "x", 1), false, Some(Duration::from_secs(600)), NOW).unwrap();
    assert_eq!(again.rows, rows);
    assert_ne!(again.lease, held.lease);
}

#[test]
fn a_waiting_claim_gets_the_rows_of_a_lease_renewed_shorter_that_runs_out() {
    let metrics = free_address();
    let daemon = Daemon::start(&["--lease-timeout", "3600", "--metrics", &metrics]);
    let (holder, waiter) = (daemon.connect(Preference::Auto), daemon.connect(Preference::Auto));
    holder.register_task("t", None, NOW).unwrap();
    let rows = put_ints(&holder, "x", &[5]);
    let (held, _) = holder.claim(spec("t", "x", 1), false, Some(Duration::ZERO), NOW).unwrap();
    std::thread::scope(|s| {
        let claim =
            s.spawn(|| waiter.claim(spec("t", "x", 1), false, Some(Duration::from_secs(600)), NOW));
        // Waiting, it has seen the lease's hour-long deadline as the earliest.
        wait_until("the claim waits", || metric(&metrics, "waiting_claims") == 1);
        holder.renew(held.lease.unwrap(), Some(Duration::from_secs(1)), NOW).unwrap();
        let (again, _) = claim.join().unwrap().unwrap();
        assert_eq!(again.rows, rows, "the rows come again once the shortened lease runs out");
    });
}

#[test]
fn a_cancelled_claim_stops_waiting_and_its_connection_serves_on() {
    let metrics = free_address();
    let daemon = Daemon::start(&["--metrics", &metrics]);
    let client = daemon.connect(Preference::Auto);
    client.register_task("t", None, NOW).unwrap();
    let cancel = AtomicBool::new(false);
    std::thread::scope(|s| {
        let waiting = s.spawn(|| {
            let interrupted = || cancel.load(Ordering::Relaxed);
            client.claim(
                spec("t", "x", 1),
                false,
                None,
                Wait { deadline: None, interrupted: Some(&interrupted) },
            )
        });
        wait_until("the claim waits", || metric(&metrics, "waiting_claims") == 1);
        cancel.store(true, Ordering::Relaxed);
        let err = waiting.join().unwrap().unwrap_err();
        assert!(matches!(err, Error::Store(StoreError::Interrupted)), "{err}");
    });
    // The daemon dropped the waiting claim: the row goes to the next claim, not to it.
    wait_until("the daemon drops the cancelled claim", || metric(&metrics, "waiting_claims") == 0);
    let rows = put_ints(&client, "x", &[1]);
    let (claimed, _) = client.claim(spec("t", "x", 1), false, Some(Duration::ZERO), NOW).unwrap();
    assert_eq!(claimed.rows, rows);
}
