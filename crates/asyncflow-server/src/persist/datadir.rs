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
        Ok(dir)
    }

    /// A directory belongs to one role: a controller's log means nothing to a storage daemon.
    fn check_role(&self, role: Role) -> Result<()> {
        let file = self.path.join("ROLE");
        match std::fs::read_to_string(&file) {
            Ok(found) if found.trim() == role.name() => Ok(()),
            Ok(found) => Err(Error::Config(format!(
                "data directory {} belongs to a {} daemon, not a {}",
                self.path.display(),
                found.trim(),
                role.name()
            ))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                private_file(&file, true)
                    .and_then(|mut f| f.write_all(format!("{}\n", role.name()).as_bytes()))
                    .map_err(|e| io(&self.path, "write ROLE", &e))?;
                self.sync()
            }
            Err(e) => Err(io(&self.path, "read ROLE", &e)),
        }
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

    /// Where a snapshot is written before it is complete.
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
            let Some(name) = name.to_str() else { continue };
            let parsed = |prefix: &str| {
                name.strip_prefix(prefix)?.strip_suffix(".meta")?.parse::<u64>().ok()
            };
            if let Some(g) = parsed("snap-") {
                contents.snapshot = contents.snapshot.max(Some(g));
            } else if let Some(g) = parsed("log-") {
                contents.logs.push(g);
            }
        }
        contents.logs.sort_unstable();
        Ok(contents)
    }

    /// Removes everything the snapshot of generation `keep_from` made obsolete, and leftovers of
    /// snapshots that never completed (never the copies `--recover` keeps).
    pub fn remove_before(&self, keep_from: u64) -> Result<()> {
        let entries = std::fs::read_dir(&self.path).map_err(|e| io(&self.path, "list it", &e))?;
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            let generation = name
                .strip_prefix("snap-")
                .or_else(|| name.strip_prefix("log-"))
                .and_then(|rest| rest.split('.').next())
                .and_then(|g| g.parse::<u64>().ok());
            let unfinished = Path::new(name).extension().is_some_and(|e| e == "tmp");
            // Copies of damaged files that `--recover` kept stay until someone removes them.
            let kept = name.contains(".damaged-");
            if (generation.is_some_and(|g| g < keep_from) || unfinished) && !kept {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn temp(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("af-datadir-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

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
}
