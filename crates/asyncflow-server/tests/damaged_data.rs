//! A damaged data directory is refused, never silently cut: only a record that is incomplete at
//! the end of the last log is a torn write. `--recover` starts anyway, keeps a copy of the
//! damaged log, and restores a prefix of the history. Damage at random places of real data
//! directories either is refused (with every file left as it was) or restores a prefix.

mod support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use asyncflow_server::client::{Client, Preference};
use support::{Daemon, NOW, put_ints, read_ints};

fn data_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("af-damaged-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn start(dir: &Path, extra: &[&str]) -> asyncflow_server::Result<Daemon> {
    let dir = dir.display().to_string();
    let mut flags = vec!["--data-dir", &dir];
    flags.extend_from_slice(extra);
    Daemon::try_start(&flags)
}

/// A data directory holding `n` rows put one at a time (values 0..n); returns the rows.
fn write_rows(dir: &Path, n: i64) -> Vec<u64> {
    let daemon = start(dir, &[]).unwrap();
    let client = daemon.connect(Preference::Tcp);
    let rows: Vec<u64> = (0..n).flat_map(|v| put_ints(&client, "x", &[v])).collect();
    drop(client);
    daemon.stop().unwrap();
    rows
}

/// Like `write_rows`, with a snapshot of the first half and a log of the second.
fn write_rows_with_snapshot(dir: &Path, n: i64) -> Vec<u64> {
    let daemon = start(dir, &["--compact-after", "1"]).unwrap();
    let client = daemon.connect(Preference::Tcp);
    let mut rows: Vec<u64> = (0..n / 2).flat_map(|v| put_ints(&client, "x", &[v])).collect();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let snapshot = |n: &String| {
        n.starts_with("snap-") && Path::new(n).extension().is_some_and(|e| e == "meta")
    };
    while !files(dir).keys().any(snapshot) {
        assert!(std::time::Instant::now() < deadline, "a snapshot is written");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    rows.extend((n / 2..n).flat_map(|v| put_ints(&client, "x", &[v])));
    drop(client);
    daemon.stop().unwrap();
    rows
}

/// The live rows must be the first `k` rows put, with their values: a prefix of the history.
fn live_prefix(client: &Client, rows: &[u64]) -> usize {
    let live: Vec<u64> = client.rows(None, None, NOW).unwrap().iter().map(|r| r.index).collect();
    let k = live.len();
    assert_eq!(live, rows[..k], "the restored rows are a prefix of those put");
    if k > 0 {
        assert_eq!(read_ints(client, &live, "x"), (0..k as i64).collect::<Vec<_>>());
    }
    k
}

fn files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap())
        .filter(|e| e.file_name() != "LOCK")
        .map(|e| (e.file_name().into_string().unwrap(), std::fs::read(e.path()).unwrap()))
        .collect()
}

fn named(dir: &Path, prefix: &str, suffix: &str) -> PathBuf {
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            let name = p.file_name().unwrap().to_str().unwrap();
            name.starts_with(prefix) && name.ends_with(suffix)
        })
        .collect();
    found.sort();
    found.pop().unwrap()
}

/// One flipped byte at `at` of `file`.
fn flip(file: &Path, at: usize) {
    let mut bytes = std::fs::read(file).unwrap();
    bytes[at] ^= 0x5a;
    std::fs::write(file, bytes).unwrap();
}

/// Flips a byte in the middle of `which` file and checks: refused, naming the file and offset,
/// with nothing changed on disk; with `--recover`, a prefix, and the damaged log kept.
fn damage_is_refused_then_recovered(name: &str, suffix: &str) {
    let dir = data_dir(name);
    let rows = write_rows(&dir, 100);
    let target = named(&dir, "log-", suffix);
    let len = std::fs::metadata(&target).unwrap().len() as usize;
    // A payload chunk starts every 64 bytes (8 of them data); a record anywhere in the log.
    flip(&target, len / 2 / 64 * 64 + 3);
    let log = named(&dir, "log-", ".meta");
    let damaged = std::fs::read(&log).unwrap();
    let before = files(&dir);

    let err = start(&dir, &[]).err().expect("a damaged log is refused").to_string();
    assert!(err.contains(log.file_name().unwrap().to_str().unwrap()), "{err}");
    assert!(err.contains("at offset") && err.contains("--recover"), "{err}");
    assert_eq!(files(&dir), before, "a refused start changes nothing on disk");

    let daemon = start(&dir, &["--recover"]).expect("--recover starts");
    let client = daemon.connect(Preference::Tcp);
    let k = live_prefix(&client, &rows);
    assert!(0 < k && k < 100, "the records before the damage are kept, those after it not: {k}");
    let mut copy = log.clone().into_os_string();
    copy.push(".damaged-1");
    assert_eq!(std::fs::read(&copy).unwrap(), damaged, "the damaged log is kept whole");
    assert!(std::fs::metadata(&log).unwrap().len() < damaged.len() as u64);
    let more = put_ints(&client, "x", &[k as i64]);
    drop(client);
    daemon.stop().unwrap();

    // Recovered, the directory starts without --recover, with the new row after the prefix.
    let again = start(&dir, &[]).expect("a recovered directory starts");
    let client = again.connect(Preference::Tcp);
    let mut expected = rows[..k].to_vec();
    expected.extend(&more);
    assert_eq!(live_prefix(&client, &expected), k + 1);
    drop((client, again));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_flipped_byte_in_the_log_is_refused_not_truncated() {
    damage_is_refused_then_recovered("meta", ".meta");
}

#[test]
fn a_flipped_payload_byte_is_refused_not_truncated() {
    damage_is_refused_then_recovered("payload", ".payload");
}

#[test]
fn a_torn_last_record_is_still_cut_off_without_recover() {
    let dir = data_dir("torn");
    let rows = write_rows(&dir, 10);
    let log = named(&dir, "log-", ".meta");
    let whole = std::fs::read(&log).unwrap();
    std::fs::write(&log, &whole[..whole.len() - 5]).unwrap();
    let daemon = start(&dir, &[]).expect("a torn tail is not damage");
    assert_eq!(live_prefix(&daemon.connect(Preference::Tcp), &rows), 9);
    drop(daemon);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// xorshift64*: the damage is random but the same on every run.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % n.max(1)
    }
}

fn copy_dir(from: &Path, to: &Path) {
    let _ = std::fs::remove_dir_all(to);
    std::fs::create_dir_all(to).unwrap();
    for (name, bytes) in files(from) {
        std::fs::write(to.join(name), bytes).unwrap();
    }
}

#[test]
fn random_damage_of_a_log_is_refused_or_restores_a_prefix_and_never_panics() {
    let base = data_dir("base");
    let rows = write_rows(&base, 24);
    random_damage(&base, &rows, 0x00c0_ffee_1234_5678, 30);
}

#[test]
fn random_damage_of_a_snapshot_and_log_is_refused_or_restores_a_prefix() {
    let base = data_dir("base-snap");
    let rows = write_rows_with_snapshot(&base, 24);
    random_damage(&base, &rows, 0x5eed_0000_0bad_f00d, 20);
}

/// `cases` copies of `base`, each with one random byte flipped or one file cut short.
fn random_damage(base: &Path, rows: &[u64], seed: u64, cases: u32) {
    let case_dir = data_dir(&format!("case-{seed:x}"));
    let mut rng = Rng(seed);
    let (mut refused, mut started) = (0, 0);
    for case in 0..cases {
        copy_dir(base, &case_dir);
        let targets: Vec<String> = files(&case_dir)
            .into_keys()
            .filter(|n| Path::new(n).extension().is_some_and(|e| e == "meta" || e == "payload"))
            .collect();
        let target = case_dir.join(&targets[rng.below(targets.len() as u64) as usize]);
        let mut bytes = std::fs::read(&target).unwrap();
        let truncate = rng.below(4) == 0;
        if truncate {
            bytes.truncate(rng.below(bytes.len() as u64) as usize);
        } else if !bytes.is_empty() {
            let at = rng.below(bytes.len() as u64) as usize;
            bytes[at] ^= 1 + rng.below(255) as u8;
        }
        std::fs::write(&target, &bytes).unwrap();
        let before = files(&case_dir);
        let what = format!(
            "case {case}: {} of {}",
            if truncate { "cut" } else { "flip" },
            targets.iter().find(|n| target.ends_with(n)).unwrap()
        );

        match start(&case_dir, &[]) {
            Err(e) => {
                refused += 1;
                let e = e.to_string();
                assert!(e.contains("is damaged") && e.contains("at offset"), "{what}: {e}");
                assert_eq!(files(&case_dir), before, "{what}: refused, yet changed on disk");
            }
            Ok(daemon) => {
                started += 1;
                live_prefix(&daemon.connect(Preference::Tcp), rows);
                drop(daemon);
                // Only a torn tail of the log may go, and only bytes that were no whole record.
                for (name, old) in &before {
                    let now = std::fs::read(case_dir.join(name)).unwrap();
                    if now != *old {
                        let meta = Path::new(name).extension().is_some_and(|e| e == "meta");
                        assert!(name.starts_with("log-") && meta, "{what}");
                        assert!(old.starts_with(&now), "{what}: {name} changed, not cut");
                        // A torn write is one record cut short: no whole record went with it.
                        let tail = &old[now.len()..];
                        let whole = (0..tail.len())
                            .find(|&at| asyncflow_proto::is_whole_record(&tail[at..]));
                        assert_eq!(whole, None, "{what}: a whole record was cut off {name}");
                    }
                }
                continue;
            }
        }
        let daemon = match start(&case_dir, &["--recover"]) {
            Ok(daemon) => daemon,
            // A damaged snapshot is the one thing --recover does not repair.
            Err(e) if what.contains(": flip of snap-") || what.contains(": cut of snap-") => {
                let e = e.to_string();
                assert!(e.contains("snapshot"), "{what}: {e}");
                assert_eq!(files(&case_dir), before, "{what}: refused, yet changed on disk");
                continue;
            }
            Err(e) => panic!("{what}: --recover refused: {e}"),
        };
        live_prefix(&daemon.connect(Preference::Tcp), rows);
        drop(daemon);
        assert!(
            files(&case_dir).keys().any(|n| n.contains(".damaged-")),
            "{what}: --recover keeps a copy"
        );
    }
    assert!(refused > 0 && started > 0, "the cases cover both: {refused} refused, {started} ok");
    std::fs::remove_dir_all(base).unwrap();
    std::fs::remove_dir_all(&case_dir).unwrap();
}
