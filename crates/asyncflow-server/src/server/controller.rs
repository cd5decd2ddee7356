//! The controller role: rows, readiness and leases for a store whose payloads live on storage
//! daemons. A put is admitted here, its bytes go from the client straight to the storage daemons
//! that own its rows, and a commit here makes them claimable. Freed rows are forwarded to their
//! storage daemons in the background, batched, so acks never wait on another host.

use std::sync::Arc;
use std::sync::mpsc;

use asyncflow_core::{ColumnSpec, PutTarget, Store, StoreError, Wait};
use asyncflow_proto::{PayloadSource, Reply, Request};

use super::cells::Payload;
use super::execute::{Execute, Outcome};
use super::metadata::check_cell_sizes;
use super::outgoing::ReplyBody;
use super::session::Session;
use crate::client::{Link, Policy, Preference};

pub struct Controller {
    pub store: Arc<Store>,
}

impl Controller {
    pub fn new(store: Arc<Store>, storage: Vec<String>, token: Option<String>) -> Self {
        let (tx, rx) = mpsc::channel::<Vec<u64>>();
        store.on_free(move |rows| {
            let _ = tx.send(rows.to_vec());
        });
        std::thread::Builder::new()
            .name("asyncflow-drops".into())
            .spawn(move || forward_drops(&rx, &storage, token.as_deref()))
            .expect("cannot start the thread that forwards freed rows");
        Self { store }
    }
}

impl Execute for Controller {
    fn execute(
        &self,
        session: &Session,
        req: Request,
        payload: Payload,
        wait: Wait<'_>,
    ) -> Outcome {
        match req {
            Request::Put(p) if p.ack.is_some() => Err(StoreError::bad_request(
                "a controller admits a put before its bytes are stored: ack the lease after the \
                 put's commit, not with it",
            )),
            Request::Put(p) if p.source == PayloadSource::Elsewhere => {
                check_cell_sizes(&p)?;
                let specs: Vec<ColumnSpec<'_>> = p
                    .columns
                    .iter()
                    .map(|c| ColumnSpec { name: &c.name, schema: &c.schema, rows: c.cells.len() })
                    .collect();
                let admitted = self.store.admit(&specs, &p.target)?;
                let first_dims =
                    p.columns.iter().map(|c| c.cells.iter().map(|cell| cell.first_dim));
                let columns: Vec<_> = admitted
                    .fields
                    .iter()
                    .copied()
                    .zip(first_dims.map(Iterator::collect))
                    .collect();
                self.store.note_first_dims(&admitted.rows, &columns);
                if matches!(p.target, PutTarget::New(_)) {
                    session.admitted.lock().extend(admitted.rows.iter().copied());
                }
                Ok((
                    Reply::Admitted { rows: admitted.rows, fields: admitted.fields },
                    ReplyBody::default(),
                ))
            }
            Request::Put(_) | Request::Read { .. } => Err(StoreError::bad_request(
                "this is a controller: payloads go to its storage daemons",
            )),
            Request::Commit { rows, fields } => {
                let known = self.store.stats().index.fields.len();
                if let Some(f) = fields.iter().find(|&&f| f as usize >= known) {
                    return Err(StoreError::bad_request(format!("unknown field id {f}")));
                }
                // Rows dropped meanwhile (their client left, or this daemon restarted before the
                // put completed) must fail the put, not complete it with nothing in it.
                self.store.row_info(&rows)?;
                self.store.commit(&rows, &fields)?;
                let mut admitted = session.admitted.lock();
                for row in &rows {
                    admitted.remove(row);
                }
                Ok((Reply::Done, ReplyBody::default()))
            }
            // The payloads are on the storage daemons: a claim comes without them.
            Request::Claim { spec, allow_partial, timeout, .. } => {
                let claim = Request::Claim { spec, allow_partial, timeout, read: false };
                self.store.execute(session, claim, payload, wait)
            }
            other => self.store.execute(session, other, payload, wait),
        }
    }
}

impl Controller {
    /// Drops the rows a client admitted and never committed, now that it is gone.
    pub fn forget_session(&self, session: &Session) {
        let admitted: Vec<u64> = session.admitted.lock().drain().collect();
        let unfinished = self.store.unfinished(&admitted);
        if unfinished.is_empty() {
            return;
        }
        tracing::info!(peer = %session.peer, rows = unfinished.len(), "dropping rows of a put its client never completed");
        if let Err(e) = self.store.delete(&unfinished) {
            tracing::warn!(error = %e, "cannot drop the rows of an unfinished put");
        }
    }
}

/// How often drops that could not be delivered are tried again.
const DROP_RETRY: std::time::Duration = std::time::Duration::from_secs(1);

/// Sends freed rows to the storage daemons that own them (row `i` lives on `i % n`). Drops for
/// a storage daemon that cannot be reached wait and are tried again every `DROP_RETRY`, so a
/// storage daemon that restarts from its data directory still forgets what was freed meanwhile.
fn forward_drops(rx: &mpsc::Receiver<Vec<u64>>, addresses: &[String], token: Option<&str>) {
    let n = addresses.len();
    let mut links: Vec<Option<Arc<Link>>> = addresses.iter().map(|_| None).collect();
    let mut waiting: Vec<Vec<u64>> = vec![Vec::new(); n];
    loop {
        match rx.recv_timeout(DROP_RETRY) {
            Ok(rows) => {
                for rows in std::iter::once(rows).chain(rx.try_iter()) {
                    for row in rows {
                        waiting[(row % n as u64) as usize].push(row);
                    }
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => return,
        }
        for (owner, link) in links.iter_mut().enumerate() {
            if waiting[owner].is_empty() {
                continue;
            }
            if link.as_ref().is_none_or(|l| l.is_broken()) {
                match Link::open(&addresses[owner], token, Preference::Tcp, Policy::default()) {
                    Ok(c) => *link = Some(c),
                    Err(e) => {
                        tracing::warn!(storage = %addresses[owner], error = %e, rows = waiting[owner].len(), "cannot forward freed rows yet");
                        continue;
                    }
                }
            }
            let rows = std::mem::take(&mut waiting[owner]);
            let sent = link.as_ref().map(|c| c.notify(&Request::DropRows { rows: rows.clone() }));
            if let Some(Err(e)) = sent {
                tracing::warn!(storage = %addresses[owner], error = %e, "lost the link to a storage daemon; will retry");
                *link = None;
                waiting[owner] = rows;
            }
        }
    }
}
