//! What this daemon is — standalone, controller or storage — and the request dispatch that
//! follows from it. Staging shared memory for a put is the same for every role that keeps bytes.

use std::sync::Arc;

use asyncflow_core::{MemoryBudget, Store, StoreError, StoreStats, Wait};
use asyncflow_proto::{Reply, Request, SharedCell};

use super::cells::Payload;
use super::controller::Controller;
use super::execute::{Execute, Outcome};
use super::outgoing::ReplyBody;
use super::session::{MAX_STAGES, Session, Stage};
use super::storage::Storage;

pub enum Roles {
    Standalone(Arc<Store>),
    Controller(Controller),
    Storage(Storage),
}

impl Roles {
    pub fn stats(&self) -> StoreStats {
        match self {
            Roles::Standalone(store) => store.stats(),
            Roles::Controller(c) => c.store.stats(),
            Roles::Storage(s) => s.stats(),
        }
    }

    /// The store whose claims this daemon serves; `None` on a storage daemon, which serves none.
    pub fn claim_store(&self) -> Option<&Arc<Store>> {
        match self {
            Roles::Standalone(store) => Some(store),
            Roles::Controller(c) => Some(&c.store),
            Roles::Storage(_) => None,
        }
    }

    /// Whether this daemon keeps payloads (and so has a store memory budget for them).
    pub fn keeps_payloads(&self) -> bool {
        !matches!(self, Roles::Controller(_))
    }

    pub fn reserve(
        &self,
        bytes: u64,
        wait: Wait<'_>,
    ) -> Result<asyncflow_core::MemoryGuard, StoreError> {
        match self {
            Roles::Standalone(store) => store.reserve(bytes, wait),
            Roles::Storage(s) => MemoryBudget::reserve(&s.memory, bytes, wait),
            Roles::Controller(_) => Err(StoreError::bad_request(
                "this is a controller: payloads go to its storage daemons",
            )),
        }
    }

    /// Reserves memory and a shared-memory region for a put the client will write in place;
    /// frees the spare region the client gives back.
    fn stage(
        &self,
        session: &Session,
        bytes: u64,
        give_back: Option<u64>,
        wait: Wait<'_>,
    ) -> Outcome {
        let shm = session.shm.as_ref().ok_or_else(|| {
            StoreError::bad_request("shared memory is only offered on the daemon's Unix socket")
        })?;
        if let Some(id) = give_back {
            shm.give_back_spare(id);
        }
        let guard = self.reserve(bytes, wait)?;
        let region = shm
            .pool
            .allocate(bytes as usize)
            .map_err(|e| StoreError::MemoryLimit(format!("shared memory: {e}")))?;
        let segment = Arc::clone(region.segment());
        let (segments, fds) = shm.introduce([&segment]);
        let stage = shm.add_stage(Stage { region, guard: Some(guard) }).ok_or_else(|| {
            StoreError::bad_request(format!(
                "this connection already has {MAX_STAGES} staged regions its puts have not used"
            ))
        })?;
        let cell = SharedCell { segment: segment.id(), offset: 0 };
        Ok((
            Reply::Staged { stage, cell, len: bytes, segments },
            ReplyBody { payload: Vec::new(), fds },
        ))
    }

    /// Returns the rows of a lease whose connection closed to be delivered again; whether any
    /// were (a replica peer done with its part leaves it to its peers).
    pub fn release_lease(&self, lease: u64) -> bool {
        self.claim_store().is_some_and(|store| matches!(store.give_back(lease), Ok(true)))
    }

    /// Whatever a connection left unfinished when it closed.
    pub fn forget_session(&self, session: &Session) {
        if let Roles::Controller(c) = self {
            c.forget_session(session);
        }
    }
}

impl Execute for Roles {
    fn execute(
        &self,
        session: &Session,
        req: Request,
        payload: Payload,
        wait: Wait<'_>,
    ) -> Outcome {
        if let Request::Stage { bytes, give_back, .. } = req {
            return self.stage(session, bytes, give_back, wait);
        }
        match self {
            Roles::Standalone(store) => store.execute(session, req, payload, wait),
            Roles::Controller(c) => c.execute(session, req, payload, wait),
            Roles::Storage(s) => s.execute(session, req, payload, wait),
        }
    }
}
