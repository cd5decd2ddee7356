//! `--data-dir`: a daemon started again on its data directory has every put that completed and
//! every row not yet acked, with their payloads, and nothing that was acked; leases are gone, so
//! rows that were leased are delivered again. Holds for a standalone daemon, a controller and
//! its storage daemons, across snapshots, and with a log whose tail was torn by a crash.
//! (SIGKILL of real daemon processes is tested from Python, in `tests/test_faults.py`.)

mod support;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use asyncflow_core::ClaimSpec;
use asyncflow_server::client::{Client, Preference};
use support::{Daemon, NOW, put_ints, put_row, read_ints, read_row};

fn data_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("af-persist-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn spec(batch_size: usize) -> ClaimSpec {
    ClaimSpec { task: "t".into(), fields: vec!["x".into()], batch_size, ..ClaimSpec::default() }
}

/// The values of the row `work` puts last, of 32 KiB: over shared memory it is written into a
/// segment, where the others travel in their request.
fn wide() -> Vec<i64> {
    (0..4096).map(|v| v * 3).collect()
}

/// Puts 10 rows; acks the first 4, leaves 3 leased and 3 untouched; then, if `wide`, puts one
/// wide row (in field `w`, which no claim asks for). Returns the rows, the wide one last. (A
/// snapshot is taken only once the log outgrows twice the live bytes: not with a wide row.)
fn work(client: &Client, wide_row: bool) -> Vec<u64> {
    client.register_task("t", None, NOW).unwrap();
    let mut rows = put_ints(client, "x", &(0..10).collect::<Vec<_>>());
    let acked = client.claim(spec(4), false, Some(Duration::from_secs(5)), NOW).unwrap().0;
    client.ack(acked.lease.unwrap(), None, NOW).unwrap();
    let leased = client.claim(spec(3), false, Some(Duration::from_secs(5)), NOW).unwrap().0;
    assert_eq!(leased.rows, rows[4..7]);
    if wide_row {
        rows.push(put_row(client, "w", &wide()));
    }
    rows
}

/// What a restart must show: rows 4..10 with their values, all claimable again, none of 0..4,
/// and the wide row whole if there is one.
fn check_restored(client: &Client, rows: &[u64]) {
    let live: Vec<u64> = client.rows(None, None, NOW).unwrap().iter().map(|r| r.index).collect();
    assert_eq!(live, rows[4..], "acked rows stay gone, the others come back");
    assert_eq!(read_ints(client, &rows[4..10], "x"), (4..10).collect::<Vec<i64>>());
    if let Some(&row) = rows.get(10) {
        assert_eq!(read_row(client, row, "w"), wide());
    }
    let again = client.claim(spec(6), false, Some(Duration::from_secs(5)), NOW).unwrap().0;
    assert_eq!(again.rows, rows[4..10], "rows that were leased are delivered again");
    client.ack(again.lease.unwrap(), None, NOW).unwrap();
    let more = put_ints(client, "x", &[99]);
    assert!(more[0] > *rows.last().unwrap(), "new rows come after the restored ones");
}

fn flags(dir: &Path, extra: &[&str]) -> Vec<String> {
    let mut out = vec!["--data-dir".to_owned(), dir.display().to_string()];
    out.extend(extra.iter().map(|s| (*s).to_owned()));
    out
}

fn start(flags: &[String]) -> Daemon {
    Daemon::start(&flags.iter().map(String::as_str).collect::<Vec<_>>())
}

fn newest_log(dir: &Path) -> PathBuf {
    let mut logs: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "meta"))
        .filter(|p| p.file_name().unwrap().to_str().unwrap().starts_with("log-"))
        .collect();
    logs.sort();
    logs.pop().unwrap()
}

#[test]
fn a_restarted_daemon_has_every_completed_put_and_unacked_row() {
    for fsync in ["always", "never", "20ms"] {
        let dir = data_dir(&format!("standalone-{fsync}"));
        let flags = flags(&dir, &["--fsync", fsync]);
        let daemon = start(&flags);
        let rows = work(&daemon.connect(Preference::Shm), true);
        daemon.stop().unwrap();
        let again = start(&flags);
        check_restored(&again.connect(Preference::Tcp), &rows);
        drop(again);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[test]
fn a_torn_log_tail_is_cut_off_and_the_rest_restored() {
    let dir = data_dir("torn");
    let flags = flags(&dir, &[]);
    let daemon = start(&flags);
    let rows = work(&daemon.connect(Preference::Tcp), true);
    daemon.stop().unwrap();
    let log = newest_log(&dir);
    let whole = std::fs::metadata(&log).unwrap().len();
    let mut bytes = std::fs::read(&log).unwrap();
    bytes.extend_from_slice(&[0x40, 0, 0, 0, 1, 2, 3, 4, 5, 6]);
    std::fs::write(&log, bytes).unwrap();
    let again = start(&flags);
    check_restored(&again.connect(Preference::Tcp), &rows);
    assert_eq!(std::fs::metadata(&log).unwrap().len(), whole, "the torn tail was cut off");
    drop(again);
    std::fs::remove_dir_all(&dir).unwrap();
}

fn wait_for_snapshot(dir: &Path) {
    let deadline = Instant::now() + Duration::from_secs(60);
    let has_snapshot = || {
        std::fs::read_dir(dir).unwrap().any(|e| {
            let name = e.unwrap().file_name();
            let name = name.to_str().unwrap();
            name.starts_with("snap-") && Path::new(name).extension().is_some_and(|e| e == "meta")
        })
    };
    while !has_snapshot() {
        assert!(Instant::now() < deadline, "a snapshot is written once the log has grown");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_snapshot_replaces_the_log_and_restores_the_same_store() {
    let dir = data_dir("snapshot");
    let flags = flags(&dir, &["--compact-after", "1"]);
    let daemon = start(&flags);
    let rows = work(&daemon.connect(Preference::Shm), false);
    wait_for_snapshot(&dir);
    daemon.stop().unwrap();
    let again = start(&flags);
    check_restored(&again.connect(Preference::Tcp), &rows);
    drop(again);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_controller_and_its_storage_daemons_restart_from_their_directories() {
    let dirs: Vec<PathBuf> = (0..4).map(|k| data_dir(&format!("cluster-{k}"))).collect();
    let storage_flags: Vec<Vec<String>> =
        dirs[..3].iter().map(|d| flags(d, &["--role", "storage"])).collect();
    let storage: Vec<Daemon> = storage_flags.iter().map(|f| start(f)).collect();
    let addresses: Vec<String> = storage.iter().map(|d| d.address.to_string()).collect();
    let joined = addresses.join(",");
    let controller_flags = flags(&dirs[3], &["--role", "controller", "--storage", &joined]);
    let controller = start(&controller_flags);
    let client = Client::connect(&controller.url(), None, Preference::Tcp).unwrap();
    let rows = work(&client, true);
    drop(client);
    controller.stop().unwrap();
    for d in storage {
        d.stop().unwrap();
    }
    // Storage daemons come back on new ports; the controller is told where.
    let storage: Vec<Daemon> = storage_flags.iter().map(|f| start(f)).collect();
    let addresses: Vec<String> = storage.iter().map(|d| d.address.to_string()).collect();
    let joined = addresses.join(",");
    let controller_flags = flags(&dirs[3], &["--role", "controller", "--storage", &joined]);
    let controller = start(&controller_flags);
    let client = Client::connect(&controller.url(), None, Preference::Tcp).unwrap();
    check_restored(&client, &rows);
    drop((client, controller, storage));
    for d in dirs {
        std::fs::remove_dir_all(&d).unwrap();
    }
}

#[test]
fn two_daemons_never_share_a_data_directory() {
    let dir = data_dir("shared");
    let flags = flags(&dir, &[]);
    let daemon = start(&flags);
    let config = asyncflow_server::config::Flags::parse_args(
        ["--listen", "127.0.0.1:0"].iter().map(|s| (*s).to_owned()).chain(flags.iter().cloned()),
    )
    .unwrap()
    .resolve()
    .unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let second =
        runtime.block_on(asyncflow_server::server::serve(config, |_| {}, async { "never" }));
    let err = second.unwrap_err().to_string();
    assert!(err.contains("in use by another daemon"), "{err}");
    drop(daemon);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_data_directory_and_its_files_are_the_owners_alone() {
    use std::os::unix::fs::PermissionsExt;
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    let root = data_dir("modes");
    let dir = root.join("nested");
    let daemon = start(&flags(&dir, &["--compact-after", "1"]));
    work(&daemon.connect(Preference::Shm), false);
    wait_for_snapshot(&dir);
    daemon.stop().unwrap();
    // Every directory the daemon made, parents included, and every file it wrote: payloads,
    // logs, the snapshot, LOCK and ROLE.
    assert_eq!((mode(&root), mode(&dir)), (0o700, 0o700));
    let mut names = Vec::new();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        assert_eq!(mode(&path), 0o600, "{}", path.display());
        names.push(path.file_name().unwrap().to_str().unwrap().to_owned());
    }
    for kind in ["LOCK", "ROLE", "log-", "snap-", ".payload", ".meta"] {
        assert!(names.iter().any(|n| n.contains(kind)), "{kind} in {names:?}");
    }
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn acking_a_lease_from_before_a_restart_says_the_daemon_restarted() {
    let dir = data_dir("old-lease");
    let flags = flags(&dir, &[]);
    let daemon = start(&flags);
    let client = daemon.connect(Preference::Tcp);
    client.register_task("t", None, NOW).unwrap();
    put_ints(&client, "x", &[1]);
    let claimed = client.claim(spec(1), false, Some(Duration::from_secs(5)), NOW).unwrap().0;
    drop(client);
    daemon.stop().unwrap();
    // Lease ids of a run start above its start time in seconds: the next run must start in a
    // later second to tell an old id from one of its own.
    let second = || std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap();
    let stopped = second().as_secs();
    while second().as_secs() == stopped {
        std::thread::sleep(Duration::from_millis(20));
    }
    let again = start(&flags);
    let client = again.connect(Preference::Tcp);
    let err = client.ack(claimed.lease.unwrap(), None, NOW).unwrap_err().to_string();
    assert!(err.contains("daemon restarted"), "{err}");
    drop((client, again));
    std::fs::remove_dir_all(&dir).unwrap();
}
