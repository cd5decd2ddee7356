//! Descriptors per connection. A process maps each shared-memory segment of a daemon once,
//! whatever the number of its connections to that daemon: descriptors and mappings per link would
//! run a process with many clients out of descriptors (the kernel then drops those a reply
//! carries). A connection's rings cost the daemon their bells and nothing more. Its own test
//! binary, so that no other test's descriptors are counted; its tests take turns.

mod support;

use std::sync::Mutex;

use asyncflow_server::client::Preference;
use support::{Daemon, NOW, put_ints, read_ints};

/// Held by each test while it counts.
static COUNTING: Mutex<()> = Mutex::new(());

/// Descriptors this process holds whose target names `what` (the in-process daemon's included).
fn descriptors(what: &str) -> usize {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|target| target.to_string_lossy().contains(what))
        .count()
}

fn segment_descriptors() -> usize {
    descriptors("asyncflow-segment")
}

#[test]
fn every_link_to_a_daemon_shares_one_mapping_of_each_segment() {
    let _turn = COUNTING.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let daemon = Daemon::start(&[]);
    let writer = daemon.connect(Preference::Shm);
    assert_eq!(writer.transport(), "shm");
    // 32 KiB: a put of a few KiB travels in its request, not in a segment.
    let values: Vec<i64> = (0..4096).collect();
    let rows = put_ints(&writer, "x", &values);
    let first = daemon.connect(Preference::Shm);
    assert_eq!(read_ints(&first, &rows, "x"), values);
    let with_one_reader = segment_descriptors();
    assert!(with_one_reader > 0, "the read used no segment");
    let readers: Vec<_> = (0..8).map(|_| daemon.connect(Preference::Shm)).collect();
    for reader in &readers {
        assert_eq!(read_ints(reader, &rows, "x"), values);
    }
    assert_eq!(segment_descriptors(), with_one_reader, "eight more links mapped their own copies");
}

#[test]
fn a_connection_in_rings_keeps_no_descriptor_of_their_memory_and_no_duplicate_bell() {
    let _turn = COUNTING.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let daemon = Daemon::start(&[]);
    let first = daemon.connect(Preference::Shm);
    assert_eq!(first.transport(), "shm");
    // Counted once the first connection has been served (its thread and event loop are up).
    first.register_task("t", None, NOW).unwrap();
    let bells = descriptors("eventfd");
    let more: Vec<_> = (0..8).map(|_| daemon.connect(Preference::Shm)).collect();
    for client in &more {
        assert_eq!(client.transport(), "shm");
        client.register_task("t", None, NOW).unwrap();
    }
    assert_eq!(descriptors("asyncflow-ring"), 0, "a ring's memfd stayed open once mapped");
    // Each side's four bells, the client's watcher's copy of the one it waits on, and the
    // daemon's connection thread's own waker. A connection being set up holds a descriptor or
    // two for a moment (seen either side of a count: the totals of eight connections varied by
    // one), so the count per connection is rounded, not floored: one descriptor more or less
    // per connection still moves the total by eight.
    let added = descriptors("eventfd") - bells;
    let per_connection = (added + more.len() / 2) / more.len();
    assert_eq!(per_connection, 4 + 1 + 4 + 1, "eventfds per connection, both sides");
}
