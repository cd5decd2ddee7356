//! Requests and replies in shared-memory rings: frames larger than a ring stream through it both
//! ways; a client that writes made-up indexes into its ring is cut off; a client that stops
//! reading its replies and dies does not keep the daemon's connection, stuck on a full ring.

mod support;

use std::io::{Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use asyncflow_core::ClaimSpec;
use asyncflow_proto::{
    FrameHeader, HEADER_LEN, Hello, Limits, Op, Reply, Request, ServerHello, decode_answer,
};
use asyncflow_server::client::{Client, Preference};
use asyncflow_shm::{ClientEnds, recv_with_fds};
use rustix::mm::{MapFlags, ProtFlags};
use rustix::net::RecvFlags;
use support::{Daemon, NOW, POLICY, put_ints, put_row, read_ints, read_row};

fn frame(op: Op, id: u64, meta: &[u8]) -> Vec<u8> {
    let mut out = FrameHeader::new(op, id, meta.len(), 0).encode().to_vec();
    out.extend_from_slice(meta);
    out
}

fn hello(ring: u64) -> Vec<u8> {
    let req = Request::Hello(Hello {
        token: None,
        host: String::new(),
        leases: vec![],
        ring,
        probe: false,
    });
    frame(Op::Hello, 1, &req.encode())
}

/// Reads a hello's answer and the descriptors that came with it.
fn server_hello(s: &mut UnixStream) -> (ServerHello, Vec<OwnedFd>) {
    let mut head = [0u8; HEADER_LEN];
    let mut fds = Vec::new();
    let mut at = 0;
    while at < HEADER_LEN {
        at += recv_with_fds(s.as_fd(), &mut head[at..], &mut fds, RecvFlags::empty()).unwrap();
    }
    let header = FrameHeader::decode(&head, Limits::DEFAULT).unwrap();
    let mut meta = vec![0u8; header.body_len()];
    s.read_exact(&mut meta).unwrap();
    match decode_answer(header.op, &meta, 0).unwrap() {
        Ok(Reply::Hello(h)) => (h, fds),
        other => panic!("not a hello: {other:?}"),
    }
}

/// A daemon whose shared-memory socket is at a path of its own, which it returns too.
fn daemon_with_socket(name: &str, flags: &[&str]) -> (Daemon, String) {
    let path = std::env::temp_dir().join(format!("af-rings-{}-{name}.sock", std::process::id()));
    let path = path.display().to_string();
    let mut all = vec!["--shm-socket", path.as_str()];
    all.extend_from_slice(flags);
    (Daemon::start(&all), path)
}

/// A client on the daemon's Unix socket with rings of `ring` bytes, speaking the protocol by
/// hand; with the channel's descriptors, to reach its memory behind the rings' backs.
fn raw_ring_client(socket: &str, ring: u64) -> (UnixStream, ClientEnds, Vec<OwnedFd>) {
    let mut unix = UnixStream::connect(socket).unwrap();
    unix.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    unix.write_all(&hello(ring)).unwrap();
    let (answer, fds) = server_hello(&mut unix);
    assert_eq!(answer.ring, ring, "the daemon made rings of the size asked");
    let kept: Vec<OwnedFd> = fds.iter().map(|f| f.try_clone().unwrap()).collect();
    let ends = ClientEnds::open(answer.ring as usize, fds).unwrap();
    (unix, ends, kept)
}

/// Whether the daemon closed `s` (its end reads as nothing) within 20 seconds.
fn closed(s: &mut UnixStream) -> bool {
    let mut byte = [0u8; 1];
    matches!(s.read(&mut byte), Ok(0))
}

#[test]
fn requests_and_replies_larger_than_a_ring_stream_through_it() {
    let daemon = Daemon::start(&[]);
    let client = daemon.connect(Preference::Shm);
    assert_eq!(client.transport(), "shm");
    // 300 K rows: the put's metadata (a length per cell) and the rows' listing are each over
    // 2 MiB, twice a 1 MiB ring; a claim of half of them, and its ack naming each, over 1 MiB.
    let values: Vec<i64> = (0..300_000).collect();
    let rows = put_ints(&client, "x", &values);
    assert_eq!(rows.len(), values.len());
    let listed = client.rows(None, Some("p"), NOW).unwrap();
    assert_eq!(listed.len(), values.len());
    assert_eq!(read_ints(&client, &rows[299_990..], "x"), values[299_990..]);
    client.register_task("t", None, NOW).unwrap();
    let spec = |batch_size| ClaimSpec {
        task: "t".into(),
        fields: vec!["x".into()],
        batch_size,
        ..ClaimSpec::default()
    };
    let spec_all = spec(150_000);
    let (claimed, _) = client.claim(spec_all, true, Some(Duration::from_millis(200)), NOW).unwrap();
    assert_eq!(claimed.rows.len(), 150_000);
    let every: Vec<u64> = (0..150_000).collect();
    client.ack(claimed.lease.unwrap(), Some(&every), NOW).unwrap();
    let (next, _) = client.claim(spec(10), true, None, NOW).unwrap();
    assert_eq!(next.rows, rows[150_000..150_010], "the acked half is not delivered again");
}

#[test]
fn the_path_before_rings_is_still_there_when_asked_for() {
    let daemon = Daemon::start(&[]);
    let client = Client::connect_with(&daemon.url(), None, Preference::ShmSocket, POLICY).unwrap();
    assert_eq!(client.transport(), "shm-socket");
    let rows = put_ints(&client, "x", &[4, 5, 6]);
    assert_eq!(read_ints(&client, &rows, "x"), vec![4, 5, 6]);
    let wide: Vec<i64> = (0..4096).collect(); // 32 KiB: written into shared memory
    let row = put_row(&client, "w", &wide);
    assert_eq!(read_row(&client, row, "w"), wide);
}

#[test]
fn a_client_that_makes_up_its_rings_indexes_is_cut_off_and_others_are_served() {
    let (daemon, socket) = daemon_with_socket("made-up", &[]);
    let good = daemon.connect(Preference::Shm);
    let (mut unix, mut ends, fds) = raw_ring_client(&socket, 4096);
    // A request that works first: the rings are live.
    ends.requests.push(&frame(Op::Stats, 2, &[])).unwrap();
    ends.requests.wake_consumer();
    let deadline = Instant::now() + Duration::from_secs(20);
    while ends.replies.available().unwrap() == 0 {
        assert!(Instant::now() < deadline, "no reply in the ring");
        std::thread::yield_now();
    }
    // Then a head far past what the requests' ring holds, written straight into the mapping.
    let len = 2 * (256 + 4096);
    // SAFETY: a fresh shared mapping of the channel's memfd, unmapped below.
    let map = unsafe {
        rustix::mm::mmap(
            std::ptr::null_mut(),
            len,
            ProtFlags::READ | ProtFlags::WRITE,
            MapFlags::SHARED,
            &fds[0],
            0,
        )
    }
    .unwrap();
    // SAFETY: offset 0 is the requests' ring's head, an aligned u64 inside the mapping.
    let head = unsafe { &*map.cast::<AtomicU64>() };
    head.fetch_add(1 << 40, Ordering::Release);
    ends.requests.wake_consumer();
    assert!(closed(&mut unix), "the daemon kept the connection");
    // SAFETY: mapped above with this length; `head` is not used after.
    unsafe { rustix::mm::munmap(map, len) }.unwrap();
    let rows = put_ints(&good, "x", &[7]);
    assert_eq!(read_ints(&good, &rows, "x"), vec![7]);
}

#[test]
fn a_client_that_dies_with_its_replies_unread_frees_its_connection() {
    // One connection at most, never taken from a connection that is busy or idle less than an
    // hour: the next client gets in only once the daemon has let go of the dead one's.
    let (daemon, socket) =
        daemon_with_socket("dies", &["--max-connections", "1", "--evict-idle-after", "3600"]);
    let (unix, mut ends, _fds) = raw_ring_client(&socket, 4096);
    // Replies until the 4 KiB ring is full, none of them read, and requests the daemon reads
    // but cannot answer.
    let stats = frame(Op::Stats, 2, &[]);
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut extra = 0;
    while extra < 20 {
        assert!(Instant::now() < deadline, "the replies' ring never filled");
        if ends.replies.available().unwrap() + 512 > 4096 {
            extra += 1;
        }
        ends.requests.push(&stats).unwrap();
        ends.requests.wake_consumer();
        std::thread::sleep(Duration::from_millis(1));
    }
    drop((unix, ends));
    let deadline = Instant::now() + Duration::from_secs(30);
    let next = loop {
        match Client::connect_with(&daemon.url(), None, Preference::Tcp, POLICY) {
            Ok(c) => break c,
            Err(e) => assert!(Instant::now() < deadline, "the dead client's place is held: {e}"),
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let rows = put_ints(&next, "x", &[8]);
    assert_eq!(read_ints(&next, &rows, "x"), vec![8]);
}
