//! Misbehaving clients against a live daemon: garbage, frames over --max-frame, truncated frames,
//! frames before hello and wrong tokens each get an error reply or a closed connection, and a
//! well-behaved client on the side keeps being served throughout.

mod support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use asyncflow_proto::{FrameHeader, HEADER_LEN, Hello, Limits, Op, Request, decode_answer};
use asyncflow_server::client::{Client, Preference};
use support::{Daemon, put_ints, read_ints};

fn raw(daemon: &Daemon) -> TcpStream {
    let s = TcpStream::connect(daemon.address).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s
}

fn frame(op: Op, id: u64, meta: &[u8], payload: &[u8]) -> Vec<u8> {
    let mut out = FrameHeader::new(op, id, meta.len(), payload.len()).encode().to_vec();
    out.extend_from_slice(meta);
    out.extend_from_slice(payload);
    out
}

fn hello(token: Option<&str>) -> Vec<u8> {
    let req = Request::Hello(Hello {
        token: token.map(str::to_owned),
        host: String::new(),
        leases: Vec::new(),
        ring: 0,
        probe: false,
    });
    frame(Op::Hello, 1, &req.encode(), &[])
}

/// Reads one answer: `Some(Ok(()))` for a reply, `Some(Err(message))` for a failure, `None` if
/// the daemon closed the connection.
fn answer(s: &mut TcpStream) -> Option<Result<(), String>> {
    let mut head = [0u8; HEADER_LEN];
    s.read_exact(&mut head).ok()?;
    let header = FrameHeader::decode(&head, Limits::DEFAULT).unwrap();
    let mut body = vec![0u8; header.body_len()];
    s.read_exact(&mut body).unwrap();
    let (meta, payload) = body.split_at(header.meta_len as usize);
    match decode_answer(header.op, meta, payload.len() as u64).unwrap() {
        Ok(_) => Some(Ok(())),
        Err(failure) => Some(Err(failure.to_string())),
    }
}

fn closed(s: &mut TcpStream) -> bool {
    let mut byte = [0u8; 1];
    matches!(s.read(&mut byte), Ok(0) | Err(_))
}

/// A well-behaved client does a full round trip.
fn still_serves(good: &Client, value: i64) {
    let rows = put_ints(good, "x", &[value]);
    assert_eq!(read_ints(good, &rows, "x"), vec![value]);
}

fn daemon_and_good_client(flags: &[&str], token: Option<&str>) -> (Daemon, Client) {
    let daemon = Daemon::start(flags);
    let good = Client::connect(&daemon.url(), token, Preference::Tcp).unwrap();
    (daemon, good)
}

#[test]
fn random_bytes_close_only_that_connection() {
    let (daemon, good) = daemon_and_good_client(&[], None);
    let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
    for round in 0..20_i32 {
        let garbage: Vec<u8> = (0..64 + round * 37)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                seed as u8
            })
            .collect();
        let mut bad = raw(&daemon);
        let _ = bad.write_all(&garbage);
        assert!(matches!(answer(&mut bad), None | Some(Err(_))));
        assert!(closed(&mut bad));
        still_serves(&good, i64::from(round));
    }
}

#[test]
fn a_frame_over_max_frame_is_refused_and_skipped_and_the_connection_goes_on() {
    // Its sender learns the put did not run (a cut connection would leave it guessing), and the
    // daemon holds none of its bytes.
    let (daemon, good) = daemon_and_good_client(&["--max-frame", "64KiB"], None);
    let mut bad = raw(&daemon);
    bad.write_all(&hello(None)).unwrap();
    assert_eq!(answer(&mut bad), Some(Ok(())));
    bad.write_all(&frame(Op::Put, 2, b"not even a put", &vec![7u8; 100 << 10])).unwrap();
    let reply = answer(&mut bad).unwrap().unwrap_err();
    assert!(
        reply.contains("a put of 102400 bytes exceeds") && reply.contains("max-frame"),
        "{reply}"
    );
    bad.write_all(&frame(Op::Ping, 3, &Request::Ping.encode(), &[])).unwrap();
    assert_eq!(answer(&mut bad), Some(Ok(())));
    still_serves(&good, 1);
}

#[test]
fn a_request_other_than_a_put_over_max_frame_breaks_the_protocol() {
    // Only a put carries a payload that large: the connection is closed, as before.
    let (daemon, good) = daemon_and_good_client(&["--max-frame", "64KiB"], None);
    let mut bad = raw(&daemon);
    bad.write_all(&hello(None)).unwrap();
    assert_eq!(answer(&mut bad), Some(Ok(())));
    let _ = bad.write_all(&frame(Op::Ping, 2, &Request::Ping.encode(), &vec![0u8; 100 << 10]));
    let reply = answer(&mut bad).unwrap().unwrap_err();
    assert!(reply.contains("exceeds the limit"), "{reply}");
    assert!(closed(&mut bad));
    still_serves(&good, 1);
}

#[test]
fn a_notice_refused_as_it_is_read_gets_no_reply() {
    // A notice's sender waits for no answer: a refusal sent to it would be read as the answer
    // to whatever it asks next.
    let (daemon, good) = daemon_and_good_client(&["--max-transit-bytes", "64KiB"], None);
    let mut bad = raw(&daemon);
    bad.write_all(&hello(None)).unwrap();
    assert_eq!(answer(&mut bad), Some(Ok(())));
    let pins: Vec<u64> = (0..10_000).collect(); // metadata over the transit pool
    bad.write_all(&frame(Op::Unpin, 0, &Request::Unpin { pins }.encode(), &[])).unwrap();
    bad.write_all(&frame(Op::Ping, 7, &Request::Ping.encode(), &[])).unwrap();
    let mut head = [0u8; HEADER_LEN];
    bad.read_exact(&mut head).unwrap();
    assert_eq!(FrameHeader::decode(&head, Limits::DEFAULT).unwrap().request_id, 7);
    still_serves(&good, 1);
}

#[test]
fn a_huge_length_prefix_then_hang_up_leaves_the_daemon_serving() {
    let (daemon, good) = daemon_and_good_client(&[], None);
    let mut bad = raw(&daemon);
    bad.write_all(&hello(None)).unwrap();
    assert_eq!(answer(&mut bad), Some(Ok(())));
    let mut head = FrameHeader::new(Op::Put, 2, 0, 0).encode();
    head[20..24].copy_from_slice(&u32::MAX.to_le_bytes());
    bad.write_all(&head).unwrap();
    bad.write_all(&[0u8; 4096]).unwrap();
    drop(bad);
    still_serves(&good, 1);
}

#[test]
fn a_truncated_frame_then_hang_up_leaves_the_daemon_serving() {
    let (daemon, good) = daemon_and_good_client(&[], None);
    let full = frame(Op::Stats, 2, &[], &[]);
    for cut in [1, HEADER_LEN - 1, HEADER_LEN / 2] {
        let mut bad = raw(&daemon);
        bad.write_all(&hello(None)).unwrap();
        assert_eq!(answer(&mut bad), Some(Ok(())));
        bad.write_all(&full[..cut]).unwrap();
        drop(bad);
        still_serves(&good, cut as i64);
    }
}

#[test]
fn malformed_metadata_gets_an_error_reply_and_the_connection_goes_on() {
    let (daemon, good) = daemon_and_good_client(&[], None);
    let mut bad = raw(&daemon);
    bad.write_all(&hello(None)).unwrap();
    assert_eq!(answer(&mut bad), Some(Ok(())));
    bad.write_all(&frame(Op::Claim, 2, &[0xff; 7], &[])).unwrap();
    let reply = answer(&mut bad).unwrap().unwrap_err();
    assert!(reply.starts_with("protocol error"), "{reply}");
    bad.write_all(&frame(Op::Stats, 3, &[], &[])).unwrap();
    assert_eq!(answer(&mut bad), Some(Ok(())), "the frame boundaries were intact");
    still_serves(&good, 1);
}

#[test]
fn an_operation_before_hello_is_refused_and_the_connection_closed() {
    let (daemon, good) = daemon_and_good_client(&[], None);
    let mut bad = raw(&daemon);
    bad.write_all(&frame(Op::Stats, 1, &[], &[])).unwrap();
    let reply = answer(&mut bad).unwrap().unwrap_err();
    assert!(reply.contains("hello"), "{reply}");
    assert!(closed(&mut bad));
    still_serves(&good, 1);
}

#[test]
fn wrong_tokens_are_refused_before_any_operation() {
    let (daemon, good) = daemon_and_good_client(&["--token", "s3cret"], Some("s3cret"));
    for token in [None, Some(""), Some("s3cre"), Some("s3cret-and-more"), Some("S3CRET")] {
        let mut bad = raw(&daemon);
        bad.write_all(&hello(token)).unwrap();
        bad.write_all(&frame(Op::Stats, 2, &[], &[])).unwrap();
        let reply = answer(&mut bad).unwrap().unwrap_err();
        assert!(reply.starts_with("authentication failed"), "{reply}");
        assert!(closed(&mut bad), "nothing after the refused hello was served");
        still_serves(&good, 1);
    }
}

/// Puts whose sizes overflow 64 bits — `(2^62 + 1) * 4` wraps to 4 bytes, `2^32 * 2^32` to 0 —
/// are refused with a schema error over either data path, and the store is unchanged.
#[test]
fn puts_whose_sizes_overflow_are_schema_errors() {
    use asyncflow_core::{DType, FieldSchema, StoreError};
    use asyncflow_server::Error;
    use asyncflow_server::client::PutColumn;

    let daemon = Daemon::start(&[]);
    for prefer in [Preference::Tcp, Preference::Shm] {
        let client = daemon.connect(prefer);
        let four = [0u8; 4];
        let crafted = [
            ("wide", FieldSchema::ragged(DType::F32, vec![1]), &four[..], (1u64 << 62) + 1),
            ("square", FieldSchema::ragged(DType::U8, vec![1 << 32, 1 << 32]), &four[..0], 1),
            ("empty", FieldSchema::ragged(DType::F32, vec![0]), &four[..0], u64::MAX),
        ];
        for (name, schema, bytes, first_dim) in crafted {
            let column = PutColumn { name: name.into(), schema, cells: vec![(bytes, first_dim)] };
            let put = client.put(&[column], support::new_rows(), None, None, support::NOW);
            assert!(
                matches!(put, Err(Error::Store(StoreError::Schema(_)))),
                "{prefer:?} {name}: {put:?}"
            );
        }
        let stats = client.stats(support::NOW).unwrap();
        assert_eq!(stats.index.live_rows, 0, "{prefer:?}: nothing was stored");
    }
}
