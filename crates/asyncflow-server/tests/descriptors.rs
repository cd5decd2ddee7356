//! A process maps each shared-memory segment of a daemon once, whatever the number of its
//! connections to that daemon: descriptors and mappings per link would run a process with many
//! clients out of descriptors (the kernel then drops those a reply carries). Its own test binary,
//! so that no other test's segments are counted.

mod support;

use asyncflow_server::client::Preference;
use support::{Daemon, put_ints, read_ints};

/// Descriptors this process holds on shared-memory segments (the in-process daemon's included).
fn segment_descriptors() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|target| target.to_string_lossy().contains("asyncflow-segment"))
        .count()
}

#[test]
fn every_link_to_a_daemon_shares_one_mapping_of_each_segment() {
    let daemon = Daemon::start(&[]);
    let writer = daemon.connect(Preference::Shm);
    assert_eq!(writer.transport(), "shm");
    let values: Vec<i64> = (0..256).collect();
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
