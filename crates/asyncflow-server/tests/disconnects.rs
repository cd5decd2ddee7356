//! A consumer whose connection closes: its leases come back after `--reconnect-grace`, not at
//! the end of the lease timeout; a client that reconnects within the grace keeps them.
//!
//! Leases here last an hour, so a row delivered again within a test came back because its
//! connection closed, never because its lease ran out.

mod support;

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use asyncflow_core::{ClaimSpec, StoreError};
use asyncflow_server::Error;
use asyncflow_server::client::{Client, Preference};
use support::{Daemon, NOW, POLICY, put_ints};

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

/// Claims `n` rows, waiting up to `secs` for them; the rows, or none if none came in time.
fn claim_within(client: &Client, n: usize, secs: u64) -> Vec<u64> {
    match client.claim(spec(n), false, Some(Duration::from_secs(secs)), NOW) {
        Ok((claimed, _)) => claimed.rows,
        Err(Error::Store(StoreError::Timeout { .. })) => Vec::new(),
        Err(e) => panic!("claim failed: {e}"),
    }
}

#[test]
fn a_closed_connections_leases_come_back_after_the_grace_not_the_lease_timeout() {
    for prefer in [Preference::Tcp, Preference::Auto] {
        let daemon = Daemon::start(&["--lease-timeout", "3600", "--reconnect-grace", "0.2"]);
        let producer = daemon.connect(prefer);
        producer.register_task("t", None, NOW).unwrap();
        let mut rows = put_ints(&producer, "x", &[1, 2, 3, 4]);
        let crashed = daemon.connect(prefer);
        let (claimed, _) = crashed.claim(spec(4), false, Some(Duration::ZERO), NOW).unwrap();
        assert_eq!(claimed.rows.len(), 4);
        drop(crashed);
        // Before the grace existed this waited out the hour-long lease and timed out.
        let mut again = claim_within(&producer, 4, 60);
        again.sort_unstable();
        rows.sort_unstable();
        assert_eq!(again, rows, "{prefer:?}: the closed connection's rows come again");
    }
}

/// A TCP relay to `upstream` whose connections can all be cut at once, as a network outage
/// would; it goes on accepting new ones.
struct Relay {
    address: String,
    open: Arc<Mutex<Vec<TcpStream>>>,
}

impl Relay {
    fn to(upstream: std::net::SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let address = listener.local_addr().unwrap().to_string();
        let open = Arc::new(Mutex::new(Vec::new()));
        let kept = Arc::clone(&open);
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { return };
                let Ok(server) = TcpStream::connect(upstream) else { return };
                let mut kept = kept.lock().unwrap();
                kept.push(client.try_clone().unwrap());
                kept.push(server.try_clone().unwrap());
                for (mut from, mut to) in
                    [(client.try_clone().unwrap(), server.try_clone().unwrap()), (server, client)]
                {
                    std::thread::spawn(move || {
                        let mut buf = vec![0u8; 64 << 10];
                        while let Ok(n @ 1..) = from.read(&mut buf) {
                            if to.write_all(&buf[..n]).is_err() {
                                break;
                            }
                        }
                        let _ = to.shutdown(Shutdown::Both);
                        let _ = from.shutdown(Shutdown::Both);
                    });
                }
            }
        });
        Self { address, open }
    }

    fn cut(&self) {
        for s in self.open.lock().unwrap().drain(..) {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

#[test]
fn a_client_that_reconnects_within_the_grace_keeps_its_leases() {
    let daemon = Daemon::start(&["--lease-timeout", "3600", "--reconnect-grace", "0.5"]);
    let other = daemon.connect(Preference::Tcp);
    other.register_task("t", None, NOW).unwrap();
    put_ints(&other, "x", &[1, 2, 3, 4]);
    let relay = Relay::to(daemon.address);
    let url = format!("tcp://{}", relay.address);
    let client = Client::connect_with(&url, None, Preference::Tcp, POLICY).unwrap();
    let (claimed, _) = client.claim(spec(2), false, Some(Duration::ZERO), NOW).unwrap();
    let lease = claimed.lease.unwrap();
    relay.cut();
    // The next call finds the link broken and connects again, naming the lease in its hello.
    client.stats(NOW).unwrap();
    // Six times the grace: had the lease been given back, these rows would come here.
    let taken = claim_within(&other, 4, 3);
    assert!(taken.is_empty(), "another consumer got {taken:?} while the client held them");
    let more = claim_within(&other, 2, 0);
    assert!(more.iter().all(|r| !claimed.rows.contains(r)), "{more:?} includes a held row");
    client.ack(lease, None, NOW).unwrap();
    // Acked on the new link: they are never delivered again, even once that link closes.
    drop(client);
    let after = claim_within(&other, 1, 2);
    assert!(after.iter().all(|r| !claimed.rows.contains(r)), "{after:?} came again after the ack");
}
