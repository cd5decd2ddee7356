//! A controller with three storage daemons on loopback: payload bytes go to the daemon that owns
//! each row, metadata to the controller, and freed rows are dropped where they live.

mod support;

use std::time::{Duration, Instant};

use asyncflow_core::{ClaimSpec, DType, FieldSchema};
use asyncflow_proto::{CellMeta, ColumnMeta, PayloadSource, PutRequest, Reply, Request};
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
    let claimed = client.claim(spec(12), false, Some(Duration::from_secs(1)), NOW).unwrap().0;
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

#[test]
fn a_controller_refuses_a_put_that_acks_a_lease_and_admits_nothing() {
    let c = cluster(1);
    let client =
        Client::connect_with(&c.controller.url(), None, Preference::Tcp, support::POLICY).unwrap();
    client.register_task("t", None, NOW).unwrap();
    put_ints(&client, "x", &[1]);
    let claimed = client.claim(spec(1), false, Some(Duration::from_secs(1)), NOW).unwrap().0;
    let lease = claimed.lease.unwrap();
    // As a client of an older build might send it: the admission and the ack in one request.
    let conn = Connection::open(
        &c.controller.address.to_string(),
        None,
        Preference::Tcp,
        Policy::default(),
    )
    .unwrap();
    let put = Request::Put(PutRequest {
        columns: vec![ColumnMeta {
            name: "x".into(),
            schema: FieldSchema::ragged(DType::I64, vec![]),
            cells: vec![CellMeta { offset: 0, len: 8, first_dim: 1 }],
        }],
        target: support::new_rows(),
        timeout: None,
        source: PayloadSource::Elsewhere,
        ack: Some(lease),
    });
    let err = conn.call(&put, &[], NOW).err().unwrap();
    assert!(err.to_string().contains("ack the lease after the put's commit"), "{err}");
    assert_eq!(client.stats(NOW).unwrap().index.live_rows, 1, "nothing admitted");
    // Nothing acked either: the lease still holds its row, and its ack goes through.
    client.ack(lease, None, NOW).unwrap();
}
