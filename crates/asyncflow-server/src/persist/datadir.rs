//! The data directory: which files make up a daemon's durable state, and the rules that keep
//! it whole. History is cut into generations. Generation `g` has a log (`log-g.meta`, records;
//! `log-g.payload`, the bytes they point into) and may start with a snapshot (`snap-g.meta`,
//! `snap-g.payload`) of everything before it. A snapshot is written under a temporary name and
//! renamed when complete, so the state is always: the newest complete snapshot, then the logs of
//! its generation and every later one. One daemon at a time holds the directory's lock.
//!
//! The files hold every payload put, so the daemon creates them readable and writable by its
//! own user only (0600), and the directories it creates searchable by that user only (0700).

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use asyncflow_proto::{FileId, Role};

use crate::error::{Error, Result};

/// What a data directory holds, as found at start-up.
#[derive(Debug, Default)]
pub struct Contents {
    /// The newest complete snapshot's generation.
    pub snapshot: Option<u64>,
    /// Generations that have a log, ascending.
    pub logs: Vec<u64>,
}

#[derive(Debug)]
pub struct DataDir {
    path: PathBuf,
    /// Held (with its lock) for as long as the daemon runs.
    _lock: File,
}

fn io(path: &Path, what: &str, e: &std::io::Error) -> Error {
    Error::Config(format!("data directory {}: cannot {what}: {e}", path.display()))
}

/// Opens `path` for writing, creating it if need be with mode 0600 (the owner's alone). Every
/// file of a data directory is made through here.
pub fn private_file(path: &Path, truncate: bool) -> std::io::Result<File> {
    OpenOptions::new().create(true).truncate(truncate).write(true).mode(0o600).open(path)
}

/// A file named as the daemon names its logs and snapshots:
/// `{log,snap}-NNNNNNNNNNNN.{meta,payload}`, with `.tmp` added while a snapshot is written.
struct OwnFile {
    generation: u64,
    snapshot: bool,
    meta: bool,
    unfinished: bool,
}

/// `name` as one of the daemon's files; `None` for any other name.
fn own_file(name: &str) -> Option<OwnFile> {
    let (name, unfinished) = match name.strip_suffix(".tmp") {
        Some(name) => (name, true),
        None => (name, false),
    };
    let (snapshot, rest) = match name.strip_prefix("snap-") {
        Some(rest) => (true, rest),
        None => (false, name.strip_prefix("log-")?),
    };
    let (digits, kind) = rest.split_once('.')?;
    if digits.len() != 12 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let meta = match kind {
        "meta" => true,
        "payload" => false,
        _ => return None,
    };
    Some(OwnFile { generation: digits.parse().ok()?, snapshot, meta, unfinished })
}

impl DataDir {
    /// Opens (creating it if need be) the data directory of a daemon of `role`, and locks it.
    pub fn open(path: &Path, role: Role) -> Result<Self> {
        // Directories made here (parents too) are 0700; one that exists keeps its mode.
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(path)
            .map_err(|e| io(path, "create it", &e))?;
        let lock =
            private_file(&path.join("LOCK"), false).map_err(|e| io(path, "open its lock", &e))?;
        if lock.try_lock().is_err() {
            return Err(Error::Config(format!(
                "data directory {} is in use by another daemon",
                path.display()
            )));
        }
        let dir = Self { path: path.to_owned(), _lock: lock };
        dir.check_role(role)?;
        // A snapshot the last run did not finish (killed, or out of disk space) is no state.
        dir.remove_own(|f| f.unfinished)?;
        Ok(dir)
    }

    /// A directory belongs to one role: a controller's log means nothing to a storage daemon.
    fn check_role(&self, role: Role) -> Result<()> {
        let file = self.path.join("ROLE");
        match std::fs::read_to_string(&file) {
            Ok(found) if found.trim() == role.name() => Ok(()),
            // Written whole by a rename since; an empty one is a first start killed mid-write.
            Ok(found) if found.trim().is_empty() => self.write_role(role),
            Ok(found) => Err(Error::Config(format!(
                "data directory {} belongs to a {} daemon, not a {}",
                self.path.display(),
                found.trim(),
                role.name()
            ))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => self.write_role(role),
            Err(e) => Err(io(&self.path, "read ROLE", &e)),
        }
    }

    fn write_role(&self, role: Role) -> Result<()> {
        self.write_whole("ROLE", &format!("{}\n", role.name()))
    }

    /// A controller's row `i` lives on storage daemon `i % n` of its `--storage` list: a
    /// restart over another number of them would look for every row on the wrong daemon. The
    /// first start records the number in `STORAGE`; later ones must give as many (they may
    /// have moved to other addresses, in the same order).
    pub fn check_storage(&self, storage: &[String]) -> Result<()> {
        let file = self.path.join("STORAGE");
        match std::fs::read_to_string(&file) {
            Ok(found) if found.trim() == storage.len().to_string() => Ok(()),
            Ok(found) => Err(Error::Config(format!(
                "data directory {} belongs to a controller over {} storage daemons, not {}: a \
                 row's daemon is its index modulo their number, so its rows would be looked for \
                 on the wrong ones; give as many, in the same order",
                self.path.display(),
                found.trim(),
                storage.len()
            ))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                self.write_whole("STORAGE", &format!("{}\n", storage.len()))
            }
            Err(e) => Err(io(&self.path, "read STORAGE", &e)),
        }
    }

    /// Writes the file `name` whole: into a file of its own, synced, then renamed over.
    fn write_whole(&self, name: &str, text: &str) -> Result<()> {
        let file = self.path.join(name);
        let partial = self.path.join(format!("{name}.partial"));
        private_file(&partial, true)
            .and_then(|mut f| {
                f.write_all(text.as_bytes())?;
                f.sync_all()
            })
            .and_then(|()| std::fs::rename(&partial, &file))
            .map_err(|e| io(&self.path, &format!("write {name}"), &e))?;
        self.sync()
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn meta(&self, generation: u64, snapshot: bool) -> PathBuf {
        let kind = if snapshot { "snap" } else { "log" };
        self.path.join(format!("{kind}-{generation:012}.meta"))
    }

    pub fn payload(&self, file: FileId) -> PathBuf {
        let kind = if file.snapshot { "snap" } else { "log" };
        self.path.join(format!("{kind}-{:012}.payload", file.generation))
    }

    /// Where a snapshot is written before it is complete (see [`own_file`]).
    pub fn unfinished(path: &Path) -> PathBuf {
        let mut name = path.as_os_str().to_owned();
        name.push(".tmp");
        PathBuf::from(name)
    }

    /// The snapshot and logs in the directory.
    pub fn contents(&self) -> Result<Contents> {
        let mut contents = Contents::default();
        let entries = std::fs::read_dir(&self.path).map_err(|e| io(&self.path, "list it", &e))?;
        for entry in entries {
            let entry = entry.map_err(|e| io(&self.path, "list it", &e))?;
            let name = entry.file_name();
            let Some(file) = name.to_str().and_then(own_file) else { continue };
            if !file.meta || file.unfinished {
                continue;
            }
            if file.snapshot {
                contents.snapshot = contents.snapshot.max(Some(file.generation));
            } else {
                contents.logs.push(file.generation);
            }
        }
        contents.logs.sort_unstable();
        Ok(contents)
    }

    /// Removes everything the snapshot of generation `keep_from` made obsolete, and leftovers of
    /// snapshots that never completed (never the copies `--recover` keeps).
    pub fn remove_before(&self, keep_from: u64) -> Result<()> {
        self.remove_own(|f| f.generation < keep_from || f.unfinished)
    }

    /// Removes the daemon's own files that `gone` picks. Only files of its own naming: the
    /// directory may hold others' (and the copies of damaged files `--recover` kept stay until
    /// someone removes them).
    fn remove_own(&self, gone: impl Fn(&OwnFile) -> bool) -> Result<()> {
        let entries = std::fs::read_dir(&self.path).map_err(|e| io(&self.path, "list it", &e))?;
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(file) = name.to_str().and_then(own_file) else { continue };
            if gone(&file) {
                let _ = std::fs::remove_file(entry.path());
            }
        }
        self.sync()
    }

    /// Makes renames and removals in the directory durable.
    pub fn sync(&self) -> Result<()> {
        File::open(&self.path).and_then(|d| d.sync_all()).map_err(|e| io(&self.path, "sync it", &e))
    }
}

/// A data directory's path for a test, empty (this process's own).
#[cfg(test)]
pub(super) fn temp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("af-datadir-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_daemon_at_a_time_and_of_one_role() {
        let path = temp("lock");
        let first = DataDir::open(&path, Role::Standalone).unwrap();
        let err = DataDir::open(&path, Role::Standalone).unwrap_err();
        assert!(err.to_string().contains("in use"), "{err}");
        drop(first);
        let err = DataDir::open(&path, Role::Storage).unwrap_err();
        assert!(err.to_string().contains("belongs to a standalone"), "{err}");
        assert!(DataDir::open(&path, Role::Standalone).is_ok());
        std::fs::remove_dir_all(&path).unwrap();
    }

    #[test]
    fn contents_list_the_newest_snapshot_and_every_log() {
        let path = temp("contents");
        let dir = DataDir::open(&path, Role::Standalone).unwrap();
        for name in ["log-000000000003.meta", "log-000000000001.meta", "snap-000000000002.meta"] {
            std::fs::write(path.join(name), b"").unwrap();
        }
        std::fs::write(path.join("snap-000000000004.meta.tmp"), b"").unwrap();
        let c = dir.contents().unwrap();
        assert_eq!((c.snapshot, c.logs), (Some(2), vec![1, 3]));
        dir.remove_before(2).unwrap();
        let c = dir.contents().unwrap();
        assert_eq!((c.snapshot, c.logs), (Some(2), vec![3]));
        assert!(!path.join("snap-000000000004.meta.tmp").exists());
        std::fs::remove_dir_all(&path).unwrap();
    }

    #[test]
    fn a_snapshot_left_unfinished_is_removed_at_start() {
        // One that ran out of disk space stayed, holding the space, until a later one finished.
        let path = temp("unfinished");
        drop(DataDir::open(&path, Role::Standalone).unwrap());
        let left = ["snap-000000000002.meta.tmp", "snap-000000000002.payload.tmp"];
        for name in left.iter().chain(&["log-000000000001.meta", "notes.tmp"]) {
            std::fs::write(path.join(name), b"").unwrap();
        }
        drop(DataDir::open(&path, Role::Standalone).unwrap());
        assert!(left.iter().all(|name| !path.join(name).exists()));
        assert!(path.join("log-000000000001.meta").exists() && path.join("notes.tmp").exists());
        std::fs::remove_dir_all(&path).unwrap();
    }

    #[test]
    fn a_controller_restarts_over_as_many_storage_daemons_only() {
        let path = temp("storage");
        let at = |ports: &[u16]| ports.iter().map(|p| format!("127.0.0.1:{p}")).collect::<Vec<_>>();
        let dir = DataDir::open(&path, Role::Controller).unwrap();
        dir.check_storage(&at(&[1, 2])).unwrap();
        dir.check_storage(&at(&[3, 4])).unwrap(); // moved
        for other in [at(&[1]), at(&[1, 2, 3])] {
            let err = dir.check_storage(&other).unwrap_err().to_string();
            assert!(err.contains("over 2 storage daemons"), "{err}");
        }
        std::fs::remove_dir_all(&path).unwrap();
    }

    #[test]
    fn compaction_removes_only_the_daemons_own_files() {
        let path = temp("foreign");
        let dir = DataDir::open(&path, Role::Standalone).unwrap();
        let foreign = ["draft.tmp", "log-0.txt", "notes.md", "snap-1.csv", "log-000000000001.csv"];
        let own = ["log-000000000001.meta", "log-000000000001.payload", "snap-000000000001.meta"];
        for name in foreign.iter().chain(&own) {
            std::fs::write(path.join(name), b"").unwrap();
        }
        dir.remove_before(2).unwrap();
        for name in foreign {
            assert!(path.join(name).exists(), "{name} was removed");
        }
        for name in own {
            assert!(!path.join(name).exists(), "{name} was kept");
        }
        std::fs::remove_dir_all(&path).unwrap();
    }

    #[test]
    fn an_empty_role_file_left_by_a_first_start_killed_mid_write_is_written_again() {
        let path = temp("empty-role");
        drop(DataDir::open(&path, Role::Storage).unwrap());
        std::fs::write(path.join("ROLE"), b"").unwrap();
        drop(DataDir::open(&path, Role::Storage).unwrap());
        assert_eq!(std::fs::read_to_string(path.join("ROLE")).unwrap(), "storage\n");
        std::fs::remove_dir_all(&path).unwrap();
    }
}
