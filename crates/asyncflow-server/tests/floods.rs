//! Memory floods: clients that announce large puts and stall part-way, and a client that
//! pipelines claims without reading a reply, must not grow the daemon's memory beyond
//! `--memory-limit` plus `--max-transit-bytes` (plus socket buffers).
//!
//! The daemon runs in this process, so its memory is this process's resident set: the floods
//! share one test, so no other test of this file runs beside them.

mod support;

use std::io::Write;
use std::net::TcpStream;
use std::time::Duration;

use asyncflow_core::{ClaimSpec, DType, FieldSchema};
use asyncflow_proto::{
    CellMeta, ColumnMeta, FrameHeader, Hello, PayloadSource, PutRequest, Request,
};
use support::{Daemon, new_rows};

const MIB: u64 = 1 << 20;

fn rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 1024
}

/// Waits (up to 30 s) for the memory of closed connections to be given back, until the
/// resident set is back near `start` or stops falling, then returns it to measure the next
/// flood from.
fn settled(start: u64) -> u64 {
    let mut last = rss();
    for _ in 0..150 {
        std::thread::sleep(Duration::from_millis(200));
        let now = rss();
        if now < start + 8 * MIB || now + MIB > last {
            return now;
        }
        last = now;
    }
    last
}

fn frame(id: u64, req: &Request, payload_len: usize) -> Vec<u8> {
    let meta = req.encode();
    let mut out = FrameHeader::new(req.op(), id, meta.len(), payload_len).encode().to_vec();
    out.extend_from_slice(&meta);
    out
}

/// A socket that said hello (its answer left unread) and writes for at most 2 s at a time.
fn greeted(daemon: &Daemon) -> TcpStream {
    let mut s = TcpStream::connect(daemon.address).unwrap();
    s.set_write_timeout(Some(Duration::from_secs(2))).unwrap();
    let hello = Request::Hello(Hello {
        token: None,
        host: String::new(),
        leases: Vec::new(),
        ring: 0,
        probe: false,
    });
    s.write_all(&frame(0, &hello, 0)).unwrap();
    s
}

fn put_of(bytes: u64) -> Request {
    Request::Put(PutRequest {
        columns: vec![ColumnMeta {
            name: "blob".into(),
            schema: FieldSchema::ragged(DType::U8, vec![]),
            cells: vec![CellMeta { offset: 0, len: bytes, first_dim: bytes }],
        }],
        target: new_rows(),
        timeout: Some(Duration::from_secs(600)),
        source: PayloadSource::Inline,
        ack: None,
    })
}

/// Writes `bytes` of zeros until done or a write makes no progress for 2 s (the daemon stopped
/// reading); returns how many were written.
fn write_zeros(s: &mut TcpStream, bytes: u64) -> u64 {
    let chunk = vec![0u8; 1 << 20];
    let mut sent = 0;
    while sent < bytes {
        let n = chunk.len().min((bytes - sent) as usize);
        match s.write(&chunk[..n]) {
            Ok(k) => sent += k as u64,
            Err(_) => break,
        }
    }
    sent
}

/// Four connections announce puts of `announced` bytes and send `sent` of them, at once.
fn stalled_puts(daemon: &Daemon, announced: u64, sent: u64) -> Vec<TcpStream> {
    let threads: Vec<_> = (0..4)
        .map(|k| {
            let mut s = greeted(daemon);
            std::thread::spawn(move || {
                s.write_all(&frame(k + 1, &put_of(announced), announced as usize)).unwrap();
                write_zeros(&mut s, sent);
                s
            })
        })
        .collect();
    threads.into_iter().map(|t| t.join().unwrap()).collect()
}

#[test]
fn floods_stay_within_the_memory_limit_and_the_transit_pool() {
    let limit = 32 * MIB;
    let transit = 16 * MIB;
    // Socket buffers, allocator slack and the runtime's threads.
    let slack = 48 * MIB;
    let daemon = Daemon::start(&[
        "--memory-limit",
        "32MiB",
        "--max-transit-bytes",
        "16MiB",
        "--no-shm",
        "--max-connection-bytes",
        "2GiB",
    ]);
    let start = rss();
    let before = start;

    // Puts that can never fit are refused, their bytes read and dropped as they come. Before,
    // each connection's buffer grew by the 96 MiB it was sent.
    let held = stalled_puts(&daemon, 512 * MIB, 96 * MIB);
    let grew = rss().saturating_sub(before);
    assert!(grew < limit + transit + slack, "grew {} MiB", grew / MIB);
    drop(held);

    // Puts that fit: one is paid from the store, the rest wait unread for room.
    let before = settled(start);
    let held = stalled_puts(&daemon, 30 * MIB, 28 * MIB);
    let grew = rss().saturating_sub(before);
    assert!(grew < limit + transit + slack, "grew {} MiB", grew / MIB);
    drop(held);

    // Claims pipelined without reading a reply: each waits a microsecond for rows that never
    // come, and its failure is queued for a client that never reads. Before, the queue grew
    // by every reply.
    let before = settled(start);
    let mut s = greeted(&daemon);
    s.set_write_timeout(Some(Duration::from_secs(3))).unwrap();
    let claim = |id: u64| {
        let spec = ClaimSpec {
            task: "nobody".into(),
            fields: vec!["blob".into()],
            batch_size: 1,
            partition: None,
            min_version: None,
            whole_groups: false,
            share: None,
            partial_after: None,
        };
        let req = Request::Claim {
            spec,
            allow_partial: true,
            timeout: Some(Duration::from_micros(1)),
            read: false,
        };
        frame(id, &req, 0)
    };
    let batch: Vec<u8> = (1..=10_000).flat_map(claim).collect();
    let mut claims = 0u64;
    for _ in 0..100 {
        if s.write_all(&batch).is_err() {
            break;
        }
        claims += 10_000;
    }
    let grew = rss().saturating_sub(before);
    // Replies held to the connection's 4 MiB share; the rest is requests running and the
    // blocking pool's threads, of which a loaded machine starts more.
    assert!(grew < transit + slack, "grew {} MiB after {claims} claims", grew / MIB);
    drop(s);
}
