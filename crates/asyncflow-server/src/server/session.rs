//! What the daemon remembers about one connection: how it moves payloads, which of its requests
//! may be cancelled, and — on the shared-memory path — which segments it has mapped, which
//! regions it is writing (staged for it, and its spare), and which read cells it still views
//! (pins).

use std::collections::hash_map::Entry;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};

use asyncflow_core::{Chunk, MemoryGuard, StoreError};
use asyncflow_proto::{Segments, SharedCell, Spare};
use asyncflow_shm::{Region, Segment, SegmentPool};
use parking_lot::Mutex;

/// A segment's descriptor on its way to the client in a reply. Until a reply carrying it has
/// been written, every reply that uses the segment carries it again: replies are written in the
/// order they finish, not the order they were built, so the first one built may not be the first
/// one the client reads.
pub struct Descriptor {
    pub segment: Arc<Segment>,
    written: Arc<AtomicBool>,
}

impl Descriptor {
    /// Notes that the descriptor is in the socket: replies written after it need not carry it.
    pub fn written(&self) {
        self.written.store(true, Ordering::Release);
    }
}

/// A segment the client was sent, or is being sent, and whether a reply carrying it was written.
struct Known {
    segment: Weak<Segment>,
    written: Arc<AtomicBool>,
}

/// A region staged for a put that has not arrived yet, with the memory it was granted: a region
/// the client asked for is paid for when staged; a spare, when a put uses it.
pub struct Stage {
    pub region: Region,
    pub guard: Option<MemoryGuard>,
}

/// How many regions one connection may have staged and not used yet (besides its one spare):
/// enough for every thread that shares the connection to have a put under way.
pub const MAX_STAGES: usize = 64;

/// Regions staged on a connection: at most [`MAX_STAGES`] it asked for, and one spare.
#[derive(Default)]
struct Stages {
    by_id: HashMap<u64, Stage>,
    spare: Option<u64>,
}

/// The shared-memory state of a connection on the Unix socket.
pub struct ShmSession {
    pub pool: SegmentPool,
    known: Mutex<HashMap<u64, Known>>,
    stages: Mutex<Stages>,
    /// The size of the region the connection's last staged put used (0 before one): the size
    /// of the spare it is offered.
    spare_size: AtomicUsize,
    pins: Mutex<HashMap<u64, Vec<Arc<Chunk>>>>,
    next: AtomicU64,
}

impl ShmSession {
    pub fn new(pool: SegmentPool) -> Self {
        Self {
            pool,
            known: Mutex::new(HashMap::new()),
            stages: Mutex::new(Stages::default()),
            spare_size: AtomicUsize::new(0),
            pins: Mutex::new(HashMap::new()),
            next: AtomicU64::new(1),
        }
    }

    fn next_id(&self) -> u64 {
        self.next.fetch_add(1, Ordering::Relaxed)
    }

    /// Whether the client has mapped segment `id` (and it still exists).
    pub fn knows(&self, id: u64) -> bool {
        self.known.lock().get(&id).is_some_and(|k| k.segment.strong_count() > 0)
    }

    /// Segments among `used` the client may not have mapped by the time it reads this reply
    /// (their descriptors must go with the reply), and segments it mapped that no longer exist.
    pub fn introduce<'a>(
        &self,
        used: impl IntoIterator<Item = &'a Arc<Segment>>,
    ) -> (Segments, Vec<Descriptor>) {
        let mut known = self.known.lock();
        let mut segments = Segments::default();
        known.retain(|&id, k| {
            let alive = k.segment.strong_count() > 0;
            if !alive {
                segments.retired.push(id);
            }
            alive
        });
        let mut fds = Vec::new();
        for seg in used {
            let written = match known.entry(seg.id()) {
                Entry::Vacant(slot) => {
                    let written = Arc::new(AtomicBool::new(false));
                    let segment = Arc::downgrade(seg);
                    slot.insert(Known { segment, written: Arc::clone(&written) });
                    written
                }
                Entry::Occupied(k) if !k.get().written.load(Ordering::Acquire) => {
                    Arc::clone(&k.get().written)
                }
                Entry::Occupied(_) => continue,
            };
            segments.new.push((seg.id(), seg.len() as u64));
            fds.push(Descriptor { segment: Arc::clone(seg), written });
        }
        (segments, fds)
    }

    /// Keeps a region the client asked for until its put names it; `None` if the connection
    /// already has [`MAX_STAGES`] such regions unused.
    pub fn add_stage(&self, stage: Stage) -> Option<u64> {
        let id = self.next_id();
        let mut stages = self.stages.lock();
        if stages.by_id.len() - usize::from(stages.spare.is_some()) >= MAX_STAGES {
            return None;
        }
        stages.by_id.insert(id, stage);
        Some(id)
    }

    /// Notes that a put used a staged region of `size` bytes: from now on the connection is
    /// offered spare regions of that size.
    pub fn staged_put(&self, size: usize) {
        self.spare_size.store(size, Ordering::Relaxed);
    }

    /// A spare region for the connection's next put, if it has used staged regions, has no
    /// spare, and a free segment of the size its last staged put used is at hand. None is made:
    /// a segment that was just freed, and that the client has mapped and written before, is
    /// what makes the spare cheaper to write than a new one. A spare stays the connection's
    /// until a request names it (the client may be writing it), and holds no store memory
    /// until a put uses it.
    pub fn offer_spare(&self) -> Option<(Spare, Vec<Descriptor>)> {
        let size = self.spare_size.load(Ordering::Relaxed);
        if size == 0 || self.stages.lock().spare.is_some() {
            return None;
        }
        let region = self.pool.reuse(size)?;
        let segment = Arc::clone(region.segment());
        let len = region.capacity() as u64;
        let id = self.next_id();
        {
            let mut stages = self.stages.lock();
            if stages.spare.is_some() {
                drop(stages);
                drop(region);
                return None;
            }
            stages.spare = Some(id);
            stages.by_id.insert(id, Stage { region, guard: None });
        }
        let (segments, fds) = self.introduce([&segment]);
        let cell = SharedCell { segment: segment.id(), offset: 0 };
        Some((Spare { stage: id, cell, len, segments }, fds))
    }

    /// Frees the spare region `id`, which the client will not write.
    pub fn give_back_spare(&self, id: u64) {
        let region = {
            let mut stages = self.stages.lock();
            if stages.spare != Some(id) {
                return;
            }
            stages.spare = None;
            stages.by_id.remove(&id)
        };
        drop(region);
    }

    /// Whether `id` is the connection's spare region and not paid for yet.
    pub fn is_unpaid_spare(&self, id: u64) -> bool {
        let stages = self.stages.lock();
        stages.spare == Some(id) && stages.by_id.get(&id).is_some_and(|s| s.guard.is_none())
    }

    /// Pays now for a put of `extent` bytes into the spare region `id`, if `reserve` grants its
    /// charge (see `cells::spare_charge`) without waiting: then the put cannot wait. Anything
    /// else (another region, a put that does not fit, no room) is left to the put.
    pub fn pay_spare(
        &self,
        id: u64,
        extent: u64,
        reserve: impl FnOnce(u64) -> Result<MemoryGuard, StoreError>,
    ) {
        let mut stages = self.stages.lock();
        if stages.spare != Some(id) {
            return;
        }
        let Some(stage) = stages.by_id.get_mut(&id).filter(|s| s.guard.is_none()) else {
            return;
        };
        // A put that fits has its region cut to its length here rather than when it runs.
        if let Ok(charge) = super::cells::spare_charge(&mut stage.region, extent)
            && let Ok(guard) = reserve(charge)
        {
            stage.guard = Some(guard);
        }
    }

    pub fn take_stage(&self, id: u64) -> Option<Stage> {
        let mut stages = self.stages.lock();
        if stages.spare == Some(id) {
            stages.spare = None;
        }
        stages.by_id.remove(&id)
    }

    /// Keeps `chunks` alive until the client unpins the returned id (or disconnects).
    pub fn pin(&self, chunks: Vec<Arc<Chunk>>) -> u64 {
        let id = self.next_id();
        self.pins.lock().insert(id, chunks);
        id
    }

    pub fn unpin(&self, pins: &[u64]) {
        let dropped: Vec<_> = {
            let mut map = self.pins.lock();
            pins.iter().filter_map(|p| map.remove(p)).collect()
        };
        drop(dropped);
    }
}

/// One client connection.
pub struct Session {
    /// Tells this connection from every other of the daemon's run.
    pub id: u64,
    pub peer: String,
    /// `Some` on the shared-memory path.
    pub shm: Option<ShmSession>,
    cancels: Mutex<HashMap<u64, Arc<AtomicBool>>>,
    pub closed: AtomicBool,
    /// On a controller: rows this client admitted and has not committed yet, dropped if it
    /// leaves first (a producer that died mid-put leaves nothing behind).
    pub admitted: Mutex<HashSet<u64>>,
}

impl Session {
    pub fn new(peer: String, shm: Option<ShmSession>) -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        Self {
            id: NEXT.fetch_add(1, Ordering::Relaxed),
            peer,
            shm,
            cancels: Mutex::new(HashMap::new()),
            closed: AtomicBool::new(false),
            admitted: Mutex::new(HashSet::new()),
        }
    }

    pub fn transport(&self) -> &'static str {
        if self.shm.is_some() { "shm" } else { "tcp" }
    }

    /// A flag that tells request `id` to stop waiting.
    pub fn track(&self, id: u64) -> Arc<AtomicBool> {
        let flag = Arc::new(AtomicBool::new(false));
        self.cancels.lock().insert(id, Arc::clone(&flag));
        flag
    }

    pub fn untrack(&self, id: u64) {
        self.cancels.lock().remove(&id);
    }

    pub fn cancel(&self, id: u64) {
        if let Some(flag) = self.cancels.lock().get(&id) {
            flag.store(true, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(segments: &Segments) -> Vec<u64> {
        segments.new.iter().map(|&(id, _)| id).collect()
    }

    #[test]
    fn a_segment_travels_with_every_reply_until_one_carrying_it_is_written() {
        let shm = ShmSession::new(SegmentPool::new(0));
        let segment = Arc::new(Segment::create(7, 4096).unwrap());
        // Two replies use the segment before either is written: the one built second may be
        // written first, so both carry the descriptor.
        let (first, first_fds) = shm.introduce([&segment]);
        let (second, second_fds) = shm.introduce([&segment]);
        assert_eq!((ids(&first), ids(&second)), (vec![7], vec![7]));
        assert_eq!((first_fds.len(), second_fds.len()), (1, 1));
        // Once one of them is written, later replies name the segment without its descriptor.
        second_fds[0].written();
        let (third, third_fds) = shm.introduce([&segment]);
        assert!(ids(&third).is_empty() && third_fds.is_empty());
        assert!(shm.knows(7));
        // A segment that no longer exists is retired, once.
        drop((first_fds, second_fds, segment));
        let (fourth, _) = shm.introduce([]);
        assert_eq!(fourth.retired, vec![7]);
        assert!(!shm.knows(7) && shm.introduce([]).0.retired.is_empty());
    }
}
