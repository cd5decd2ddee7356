//! The controller role: rows, readiness and leases for a store whose payloads live on storage
//! daemons. A put is admitted here, its bytes go from the client straight to the storage daemons
//! that own its rows, and a commit here makes them claimable. Freed rows are forwarded to their
//! storage daemons in the background, batched, so acks never wait on another host.

use std::sync::Arc;
use std::sync::mpsc;

use asyncflow_core::{ColumnSpec, Store, StoreError, Wait};
use asyncflow_proto::{PayloadSource, Reply, Request};

use super::metadata::{self, Outcome, check_cell_sizes};
use super::outgoing::Answer;
use super::session::Session;
use crate::client::{Connection, Preference};

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

    pub fn execute(
        &self,
        session: &Session,
        req: Request,
        payload: Vec<u8>,
        wait: Wait<'_>,
    ) -> Outcome {
        match req {
            Request::Put(p) if p.source == PayloadSource::Elsewhere => {
                check_cell_sizes(&p)?;
                let specs: Vec<ColumnSpec<'_>> = p
                    .columns
                    .iter()
                    .map(|c| ColumnSpec { name: &c.name, schema: &c.schema, rows: c.cells.len() })
                    .collect();
                let admitted = self.store.admit(&specs, &p.target)?;
                Ok((
                    Reply::Admitted { rows: admitted.rows, fields: admitted.fields },
                    Answer::default(),
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
                self.store.commit(&rows, &fields)?;
                Ok((Reply::Done, Answer::default()))
            }
            other => metadata::execute(&self.store, session, other, payload, wait),
        }
    }
}

/// Sends freed rows to the storage daemons that own them (row `i` lives on `i % n`).
fn forward_drops(rx: &mpsc::Receiver<Vec<u64>>, addresses: &[String], token: Option<&str>) {
    let mut links: Vec<Option<Connection>> = addresses.iter().map(|_| None).collect();
    while let Ok(mut rows) = rx.recv() {
        while let Ok(more) = rx.try_recv() {
            rows.extend(more);
        }
        let n = addresses.len() as u64;
        for (owner, link) in links.iter_mut().enumerate() {
            let mine: Vec<u64> = rows.iter().copied().filter(|r| r % n == owner as u64).collect();
            if mine.is_empty() {
                continue;
            }
            if link.is_none() {
                match Connection::open(&addresses[owner], token, Preference::Tcp) {
                    Ok(c) => *link = Some(c),
                    Err(e) => {
                        tracing::warn!(storage = %addresses[owner], error = %e, rows = mine.len(), "cannot forward freed rows");
                        continue;
                    }
                }
            }
            let sent = link.as_ref().map(|c| c.notify(&Request::DropRows { rows: mine }));
            if let Some(Err(e)) = sent {
                tracing::warn!(storage = %addresses[owner], error = %e, "lost the link to a storage daemon");
                *link = None;
            }
        }
    }
}
