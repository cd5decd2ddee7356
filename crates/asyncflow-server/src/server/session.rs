//! What the daemon remembers about one connection: how it moves payloads, which of its requests
//! may be cancelled, and — on the shared-memory path — which segments it has mapped, which
//! regions it is writing, and which read cells it still views (pins).

use std::collections::hash_map::Entry;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use asyncflow_core::{Chunk, MemoryGuard};
use asyncflow_proto::Segments;
use asyncflow_shm::{Region, Segment, SegmentPool};
use parking_lot::Mutex;

/// A region staged for a put that has not arrived yet, with the memory it was granted.
pub struct Stage {
    pub region: Region,
    pub guard: MemoryGuard,
}

/// The shared-memory state of a connection on the Unix socket.
pub struct ShmSession {
    pub pool: SegmentPool,
    known: Mutex<HashMap<u64, Weak<Segment>>>,
    stages: Mutex<HashMap<u64, Stage>>,
    pins: Mutex<HashMap<u64, Vec<Arc<Chunk>>>>,
    next: AtomicU64,
}

impl ShmSession {
    pub fn new(pool: SegmentPool) -> Self {
        Self {
            pool,
            known: Mutex::new(HashMap::new()),
            stages: Mutex::new(HashMap::new()),
            pins: Mutex::new(HashMap::new()),
            next: AtomicU64::new(1),
        }
    }

    fn next_id(&self) -> u64 {
        self.next.fetch_add(1, Ordering::Relaxed)
    }

    /// Whether the client has mapped segment `id` (and it still exists).
    pub fn knows(&self, id: u64) -> bool {
        self.known.lock().get(&id).is_some_and(|w| w.strong_count() > 0)
    }

    /// Segments among `used` the client has not mapped yet (their descriptors must go with the
    /// reply), and segments it mapped that no longer exist.
    pub fn introduce<'a>(
        &self,
        used: impl IntoIterator<Item = &'a Arc<Segment>>,
    ) -> (Segments, Vec<Arc<Segment>>) {
        let mut known = self.known.lock();
        let mut segments = Segments::default();
        known.retain(|&id, weak| {
            let alive = weak.strong_count() > 0;
            if !alive {
                segments.retired.push(id);
            }
            alive
        });
        let mut fds = Vec::new();
        for seg in used {
            if let Entry::Vacant(slot) = known.entry(seg.id()) {
                slot.insert(Arc::downgrade(seg));
                segments.new.push((seg.id(), seg.len() as u64));
                fds.push(Arc::clone(seg));
            }
        }
        (segments, fds)
    }

    pub fn add_stage(&self, stage: Stage) -> u64 {
        let id = self.next_id();
        self.stages.lock().insert(id, stage);
        id
    }

    pub fn take_stage(&self, id: u64) -> Option<Stage> {
        self.stages.lock().remove(&id)
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
        Self {
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
