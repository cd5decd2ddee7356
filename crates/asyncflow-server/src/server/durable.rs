//! Each role's state and its data directory: restoring it at start-up, and the background work
//! that keeps the log in shape while serving — syncing it on the `--fsync` interval, replacing
//! it by a snapshot once it has grown, and a last sync at stop.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use asyncflow_core::{Change, Journal, Store, StoreError, Wait};
use asyncflow_proto::Record;

use super::roles::Roles;
use crate::config::Config;
use crate::error::{Error, Result};
use crate::persist::{Fsync, Payloads, PersistConfig, Persistence, Recovered};

/// How often the background thread looks at the log.
const TICK: Duration = Duration::from_millis(50);
/// How often it considers a snapshot.
const SNAPSHOT_CHECK: Duration = Duration::from_secs(1);

/// Lease ids a run of the daemon may hand out per millisecond of its life before they reach the
/// floor of a run started that much later (2^21: about two million).
const LEASES_PER_MS_BITS: u32 = 21;

/// The lease ids a run started at `now` starts from: milliseconds since 1970 in the high bits
/// (room until the year 2248), so ids a client kept from an earlier run of the daemon
/// (persistent or not), started at least a millisecond before, never name a lease of this one.
/// Whole seconds let a daemon restarted within the second hand an old lease's id to another
/// claim, whose rows the old holder's late ack would then have committed.
pub fn lease_floor(now: SystemTime) -> u64 {
    let ms = now.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis());
    u64::try_from(ms).unwrap_or(u64::MAX) << LEASES_PER_MS_BITS
}

fn unfit(e: &StoreError) -> Error {
    Error::Config(format!("the data directory does not fit this daemon: {e}"))
}

/// Replays one record into a store (standalone, or a controller's index without payloads).
fn restore_store(store: &Store, record: Record, payloads: &mut Payloads<'_>) -> Result<bool> {
    match record {
        Record::Change(change) => store.restore(&change, None).map_err(|e| unfit(&e))?,
        Record::Stored(stored) => {
            let reserve = |bytes| store.reserve(bytes, Wait::timeout(Some(Duration::ZERO)));
            let Some(cells) = payloads.cells(&stored, &reserve)? else {
                return Ok(false);
            };
            let ready = Change::Ready { rows: stored.rows, fields: stored.fields };
            store.restore(&ready, Some(cells)).map_err(|e| unfit(&e))?;
        }
        Record::Dropped(_) => {
            return Err(Error::Config(
                "this data directory holds a storage daemon's log, not an index".into(),
            ));
        }
    }
    Ok(true)
}

/// Restores `roles` from the daemon's data directory and starts logging their changes there
/// (`None`: the daemon keeps none).
pub fn open(daemon: &Config, roles: &Roles) -> Result<Option<Arc<Persistence>>> {
    let Some(config) = &daemon.persist else { return Ok(None) };
    let (role, storage) = (daemon.role, &daemon.storage);
    let (persistence, recovered) = match roles {
        Roles::Standalone(store) => {
            Persistence::open(config, role, storage, |r, p| restore_store(store, r, p))?
        }
        Roles::Controller(c) => {
            Persistence::open(config, role, storage, |r, p| restore_store(&c.store, r, p))?
        }
        Roles::Storage(s) => Persistence::open(config, role, storage, |r, p| s.restore(r, p))?,
    };
    match roles {
        Roles::Standalone(store) => attach(store, &persistence)?,
        Roles::Controller(c) => attach(&c.store, &persistence)?,
        Roles::Storage(s) => s.set_persistence(Arc::clone(&persistence)),
    }
    report(config, &recovered, roles);
    Ok(Some(persistence))
}

/// Journals the store from now on, and drops the rows of puts that never completed: their
/// producer (or the daemon) stopped between admitting and committing them.
fn attach(store: &Store, persistence: &Arc<Persistence>) -> Result<()> {
    store.set_journal(Arc::clone(persistence) as Arc<dyn Journal>);
    let unfinished = store.unfinished_rows();
    if !unfinished.is_empty() {
        tracing::info!(rows = unfinished.len(), "dropping rows of puts that never completed");
        store.delete(&unfinished).map_err(|e| unfit(&e))?;
    }
    Ok(())
}

fn report(config: &PersistConfig, r: &Recovered, roles: &Roles) {
    for dropped in &r.dropped {
        // Printed as well as logged: whoever ran --recover must see what it cost.
        eprintln!("asyncflow-store: --recover: {dropped}");
    }
    let stats = roles.stats();
    tracing::info!(
        dir = %config.dir.display(),
        snapshot = ?r.snapshot,
        logs = r.logs,
        records = r.records,
        payload_bytes = r.payload_bytes,
        torn_bytes = r.torn_bytes,
        dropped_logs = r.dropped.len(),
        live_rows = stats.index.live_rows,
        payload_rows = stats.payload_rows,
        fsync = ?config.fsync,
        "restored from the data directory"
    );
}

fn snapshot(persistence: &Persistence, roles: &Roles) -> std::result::Result<(), StoreError> {
    persistence.compact(|rotate| match roles {
        Roles::Standalone(store) => store.snapshot(true, rotate),
        Roles::Controller(c) => c.store.snapshot(false, rotate),
        Roles::Storage(s) => Ok(s.snapshot(rotate)),
    })
}

/// Syncs on the `--fsync` interval and snapshots when the log has grown, until `stop`; then
/// syncs a last time.
pub fn maintain(persistence: &Persistence, roles: &Roles, stop: &AtomicBool) {
    let interval = match persistence.fsync() {
        Fsync::Every(d) => Some(d),
        Fsync::Always | Fsync::Never => None,
    };
    let (mut last_sync, mut last_check) = (Instant::now(), Instant::now());
    while !stop.load(Ordering::Relaxed) {
        std::thread::sleep(TICK);
        if interval.is_some_and(|d| last_sync.elapsed() >= d) {
            last_sync = Instant::now();
            if let Err(e) = persistence.flush() {
                tracing::error!(error = %e, "cannot sync the write-ahead log");
            }
        }
        if last_check.elapsed() >= SNAPSHOT_CHECK {
            last_check = Instant::now();
            let live = roles.stats().memory_used;
            if persistence.wants_snapshot(live) {
                let started = Instant::now();
                match snapshot(persistence, roles) {
                    Ok(()) => tracing::info!(
                        generation = persistence.generation(),
                        seconds = started.elapsed().as_secs_f64(),
                        "replaced the log by a snapshot"
                    ),
                    Err(e) => tracing::error!(error = %e, "cannot write a snapshot"),
                }
            }
        }
    }
    if let Err(e) = persistence.flush() {
        tracing::error!(error = %e, "cannot sync the write-ahead log at stop");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_restart_a_millisecond_later_starts_above_every_id_the_last_run_could_hand_out() {
        let start = UNIX_EPOCH + Duration::from_millis(1_795_000_000_123);
        let restart = start + Duration::from_millis(1); // within the same second
        assert!(lease_floor(start) + (1 << 20) < lease_floor(restart));
        // A run of an hour that handed out a million leases a second stays below a restart.
        let hour = Duration::from_secs(3600);
        assert!(lease_floor(start) + 3600 * 1_000_000 < lease_floor(start + hour));
    }
}
