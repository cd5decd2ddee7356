//! Connection places: sockets that never say hello cannot take the places of clients that do,
//! and a client idle for `--evict-idle-after` gives its place to a new one.

mod support;

use std::io::Read;
use std::net::TcpStream;
use std::time::Duration;

use asyncflow_proto::{Failure, FrameHeader, HEADER_LEN, Limits, Op};
use asyncflow_server::client::{Client, Preference};
use support::{Daemon, NOW, POLICY, put_ints, read_ints};

/// Everything the daemon sends on `socket` until it closes it (within 30 s, or the test fails).
fn read_until_closed(mut socket: &TcpStream) -> Vec<u8> {
    socket.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut got = Vec::new();
    socket.read_to_end(&mut got).expect("the daemon closed the socket within 30 s");
    got
}

/// The message of the failure frame in `bytes`.
fn failure(bytes: &[u8]) -> String {
    let header = FrameHeader::decode(bytes[..HEADER_LEN].try_into().unwrap(), Limits::DEFAULT)
        .expect("a frame");
    assert_eq!(header.op, Op::Failure);
    let meta = &bytes[HEADER_LEN..HEADER_LEN + header.meta_len as usize];
    Failure::decode(meta).unwrap().to_string()
}

#[test]
fn sockets_that_never_say_hello_cannot_take_the_places_of_clients() {
    let daemon = Daemon::start(&["--max-connections", "2", "--hello-timeout", "600"]);
    let idle: Vec<TcpStream> =
        (0..10).map(|_| TcpStream::connect(daemon.address).unwrap()).collect();
    // Before sockets that had not said hello were kept apart, these ten took both places.
    let a = daemon.connect(Preference::Tcp);
    let b = daemon.connect(Preference::Tcp);
    let rows = put_ints(&a, "x", &[5]);
    assert_eq!(read_ints(&b, &rows, "x"), vec![5]);
    drop(idle);
}

#[test]
fn a_socket_silent_past_the_hello_timeout_is_closed_and_the_oldest_gives_way_to_a_new_one() {
    let daemon =
        Daemon::start(&["--max-unauthenticated", "1", "--hello-timeout", "0.3", "--no-shm"]);
    let oldest = TcpStream::connect(daemon.address).unwrap();
    let newer = TcpStream::connect(daemon.address).unwrap();
    let why = failure(&read_until_closed(&oldest));
    assert!(why.contains("had not said hello"), "{why}");
    // Closed at the hello timeout, with nothing said.
    assert!(read_until_closed(&newer).is_empty());
    let client = daemon.connect(Preference::Tcp);
    client.stats(NOW).unwrap();
}

#[test]
fn a_client_gets_in_while_silent_sockets_keep_coming() {
    let daemon = Daemon::start(&["--max-unauthenticated", "4", "--hello-timeout", "600"]);
    let mut silent: Vec<TcpStream> = Vec::new();
    for round in 0..3 {
        silent.extend((0..8).map(|_| TcpStream::connect(daemon.address).unwrap()));
        let client = daemon.connect(Preference::Tcp);
        assert_eq!(read_ints(&client, &put_ints(&client, "x", &[round]), "x"), vec![round]);
    }
}

#[test]
fn an_idle_client_gives_its_place_to_a_new_one_and_gets_one_back_when_it_returns() {
    let daemon = Daemon::start(&["--max-connections", "2", "--evict-idle-after", "0.2"]);
    let a = daemon.connect(Preference::Tcp);
    let b = daemon.connect(Preference::Tcp);
    let rows = put_ints(&a, "x", &[7]);
    // Both idle for more than --evict-idle-after.
    std::thread::sleep(Duration::from_millis(600));
    // Before, every place stayed taken by the idle two and this was refused.
    let c = Client::connect_with(&daemon.url(), None, Preference::Tcp, POLICY)
        .expect("an idle client gives way");
    assert_eq!(read_ints(&c, &rows, "x"), vec![7]);
    // The client closed for being idle connects again on its next call.
    std::thread::sleep(Duration::from_millis(600));
    assert_eq!(read_ints(&a, &rows, "x"), vec![7]);
    assert_eq!(read_ints(&b, &rows, "x"), vec![7]);
}

#[test]
fn with_no_client_idle_long_enough_a_new_one_is_refused_with_the_reason() {
    let daemon = Daemon::start(&["--max-connections", "1", "--evict-idle-after", "3600"]);
    let a = daemon.connect(Preference::Tcp);
    let err = Client::connect_with(&daemon.url(), None, Preference::Tcp, POLICY).err().unwrap();
    assert!(err.to_string().contains("at most 1 connections"), "{err}");
    a.stats(NOW).unwrap();
}
