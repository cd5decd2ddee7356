//! A client and a daemon that goes away: requests issued while it is down wait (backing off)
//! for it to come back and then go through; one that stays down, or that stops answering
//! without closing its sockets, ends every wait with an error that says what was waited for.

mod support;

use std::io::{Read, Write};
use std::net::TcpListener;
use std::time::Duration;

use asyncflow_core::StoreError;
use asyncflow_proto::{FrameHeader, HEADER_LEN, Limits, Op, Reply, Request, Role, ServerHello};
use asyncflow_server::Error;
use asyncflow_server::client::{Client, Policy, Preference};
use support::{Daemon, NOW, put_ints, read_ints};

const QUICK: Policy = Policy {
    request_timeout: Duration::from_secs(1),
    reconnect_timeout: Duration::from_millis(500),
};

#[test]
fn requests_after_a_restart_go_through_on_a_new_connection() {
    let first = Daemon::start(&[]);
    let address = first.address.to_string();
    let policy = Policy { reconnect_timeout: Duration::from_secs(30), ..Policy::default() };
    let client = Client::connect_with(&first.url(), None, Preference::Tcp, policy).unwrap();
    put_ints(&client, "x", &[1]);
    first.stop().unwrap();
    let again = Daemon::start_at(&address, &[]);
    let rows = put_ints(&client, "x", &[7]);
    assert_eq!(read_ints(&client, &rows, "x"), vec![7]);
    drop(again);
}

#[test]
fn a_daemon_that_stays_down_is_a_clear_error_after_the_reconnect_timeout() {
    let daemon = Daemon::start(&[]);
    let client = Client::connect_with(&daemon.url(), None, Preference::Shm, QUICK).unwrap();
    put_ints(&client, "x", &[1]);
    let address = daemon.address.to_string();
    daemon.stop().unwrap();
    let err = client.stats(NOW).unwrap_err().to_string();
    assert!(
        err.contains(&address) && err.contains("unreachable") && err.contains("tried"),
        "{err}"
    );
}

/// A daemon that answers hello, then never anything else (a frozen process keeps its sockets).
fn silent_daemon() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let address = listener.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut head = [0u8; HEADER_LEN];
        s.read_exact(&mut head).unwrap();
        let header = FrameHeader::decode(&head, Limits::DEFAULT).unwrap();
        let mut body = vec![0u8; header.body_len()];
        s.read_exact(&mut body).unwrap();
        let hello = Reply::Hello(ServerHello {
            version: "test".into(),
            role: Role::Standalone,
            host: String::new(),
            shm_socket: None,
            storage: Vec::new(),
            instance: 0,
            ring: 0,
        })
        .encode();
        s.write_all(&FrameHeader::new(Op::Reply, header.request_id, hello.len(), 0).encode())
            .unwrap();
        s.write_all(&hello).unwrap();
        let mut sink = [0u8; 4096];
        while matches!(s.read(&mut sink), Ok(n) if n > 0) {}
    });
    address
}

#[test]
fn a_daemon_that_stops_answering_fails_the_request_saying_so() {
    let address = silent_daemon();
    let client = Client::connect_with(&address, None, Preference::Tcp, QUICK).unwrap();
    let err = client.stats(NOW).unwrap_err();
    let text = err.to_string();
    assert!(
        matches!(err, Error::Store(StoreError::Timeout { .. }) | Error::Connection(_)),
        "{text}"
    );
    assert!(text.contains(&address), "{text}");
    assert!(
        text.contains("stats") || text.contains("ping"),
        "the error names what it waited for: {text}"
    );
}

#[test]
fn a_daemon_that_never_says_hello_is_a_timeout_not_a_hang() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let address = listener.local_addr().unwrap().to_string();
    let err = Client::connect_with(&address, None, Preference::Tcp, QUICK).err().unwrap();
    assert!(matches!(err, Error::Store(StoreError::Timeout { .. })), "{err}");
    assert!(err.to_string().contains("hello"), "{err}");
    drop(listener);
}

#[test]
fn a_ping_is_answered() {
    let daemon = Daemon::start(&[]);
    let conn = asyncflow_server::client::Connection::open(
        &daemon.address.to_string(),
        None,
        Preference::Tcp,
        Policy::default(),
    )
    .unwrap();
    assert!(matches!(conn.call(&Request::Ping, &[], NOW).unwrap().reply, Reply::Done));
}
