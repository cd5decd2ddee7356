//! A controller with three storage daemons on loopback: payload bytes go to the daemon that owns
//! each row, metadata to the controller, and freed rows are dropped where they live.

mod support;

use std::time::{Duration, Instant};

use asyncflow_core::ClaimSpec;
use asyncflow_proto::{Reply, Request};
use asyncflow_server::client::{Client, Connection, Policy, Preference};
use support::{Daemon, NOW, put_ints, put_row, read_ints, read_row};

struct Cluster {
    storage: Vec<Daemon>,
    controller: Daemon,
}

fn cluster(n: usize) -> Cluster {
    let storage: Vec<Daemon> = (0..n).map(|_| Daemon::start(&["--role", "storage"])).collect();
    let addresses: Vec<String> = storage.iter().map(|d| d.address.to_string()).collect();
    let controller = Daemon::start(&["--role", "controller", "--storage", &addresses.join(",")]);
    Cluster { storage, controller }
}

/// Payload rows a storage daemon holds (asked directly: clients normally never talk to it alone).
fn payload_rows(daemon: &Daemon) -> u64 {
    let conn =
        Connection::open(&daemon.address.to_string(), None, Preference::Tcp, Policy::default())
            .unwrap();
    match conn.call(&Request::Stats, &[], NOW).unwrap().reply {
        Reply::Stats(s) => s.payload_rows,
        other => panic!("unexpected {other:?}"),
    }
}

fn spec(batch_size: usize) -> ClaimSpec {
    ClaimSpec {
        task: "t".into(),
        fields: vec!["x".into()],
        batch_size,
        partition: None,
        min_version: None,
        whole_groups: false,
        share: None,
        partial_after: None,
    }
}

fn rows_spread_over_storage_daemons_and_come_back_in_order(prefer: Preference, transport: &str) {
    let c = cluster(3);
    let client = Client::connect_with(&c.controller.url(), None, prefer, support::POLICY).unwrap();
    assert_eq!((client.storage_daemons(), client.transport()), (3, transport));
    client.register_task("t", None, NOW).unwrap();
    let values: Vec<i64> = (0..12).map(|v| v * 100).collect();
    let rows = put_ints(&client, "x", &values);
    for (owner, daemon) in c.storage.iter().enumerate() {
        let owned = rows.iter().filter(|&&r| r % 3 == owner as u64).count() as u64;
        assert_eq!(payload_rows(daemon), owned, "storage daemon {owner} holds its rows only");
    }
    let claimed = client.claim(&spec(12), false, Some(Duration::from_secs(1)), NOW).unwrap().0;
    assert_eq!(read_ints(&client, &claimed.rows, "x"), values);
    // Those cells travel in their requests; 32 KiB rows are written into each storage daemon's
    // shared memory (over TCP, in the request too).
    let wide: Vec<Vec<i64>> = (0..3).map(|k| (k..k + 4096).collect()).collect();
    for w in &wide {
        let row = put_row(&client, "w", w);
        assert_eq!(&read_row(&client, row, "w"), w);
        client.delete(&[row], NOW).unwrap();
    }
    client.ack(claimed.lease.unwrap(), None, NOW).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while c.storage.iter().map(payload_rows).sum::<u64>() > 0 {
        assert!(Instant::now() < deadline, "freed rows are dropped by their storage daemons");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(client.stats(NOW).unwrap().memory_used, 0);
}

#[test]
fn rows_spread_over_storage_daemons_over_tcp() {
    rows_spread_over_storage_daemons_and_come_back_in_order(Preference::Tcp, "tcp");
}

#[test]
fn rows_spread_over_storage_daemons_over_shared_memory() {
    rows_spread_over_storage_daemons_and_come_back_in_order(Preference::Shm, "shm");
}

#[test]
fn nothing_is_claimable_until_every_storage_daemon_holds_its_part() {
    let c = cluster(3);
    let client =
        Client::connect_with(&c.controller.url(), None, Preference::Auto, support::POLICY).unwrap();
    client.register_task("t", None, NOW).unwrap();
    drop(c.storage.into_iter().nth(1));
    let err = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        put_ints(&client, "x", &[1, 2, 3])
    }));
    assert!(err.is_err(), "a put fails when a storage daemon is gone");
    let stats = client.stats(NOW);
    assert!(stats.is_err() || stats.unwrap().index.live_rows == 0, "and leaves no rows behind");
}

#[test]
fn a_storage_daemon_refuses_metadata_operations() {
    let daemon = Daemon::start(&["--role", "storage"]);
    let err = Client::connect(&daemon.url(), None, Preference::Auto).err().unwrap();
    assert!(err.to_string().contains("storage daemon"), "{err}");
}
