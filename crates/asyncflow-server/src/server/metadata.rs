//! Requests answered by a core store: every operation of a standalone daemon, and the metadata
//! operations of a controller (whose payloads live on storage daemons).

use std::time::Instant;

use asyncflow_core::{Column, Store, StoreError, Wait};
use asyncflow_proto::{CellPlace, PutRequest, Reply, Request, WireCell, WireClaimed, WireColumn};

use super::cells::{Outgoing, Payload, Placer, cells_in, extent, incoming_chunk, outgoing_cells};
use super::execute::{Execute, Outcome};
use super::outgoing::ReplyBody;
use super::session::Session;

// Every arm of `execute` stays one expression; the wrap is what lets `.and(done(...))` read.
#[allow(clippy::unnecessary_wraps)]
fn done(reply: Reply) -> Outcome {
    Ok((reply, ReplyBody::default()))
}

/// A put whose bytes came with it (inline or staged).
fn put(
    store: &Store,
    session: &Session,
    p: PutRequest,
    payload: Payload,
    wait: Wait<'_>,
) -> Outcome {
    let extent = extent(p.columns.iter().flat_map(|c| &c.cells));
    let chunk =
        incoming_chunk(session, p.source, payload, extent, |bytes| store.reserve(bytes, wait))?;
    let columns = p
        .columns
        .into_iter()
        .map(|c| Ok(Column { cells: cells_in(&chunk, &c.cells)?, name: c.name, schema: c.schema }))
        .collect::<Result<Vec<_>, StoreError>>()?;
    drop(chunk);
    done(Reply::Rows(store.put(columns, &p.target)?))
}

fn claimed(c: asyncflow_core::Claimed) -> WireClaimed {
    let now = Instant::now();
    WireClaimed {
        lease: c.lease,
        rows: c.rows,
        versions: c.versions,
        groups: c.groups,
        expires_in: c.deadline.map(|d| d.saturating_duration_since(now)),
    }
}

/// A claim's reply with its rows' cells of the claimed `fields`. The rows are leased whatever
/// happens here, so a claim whose cells cannot be read (none should be: claimed rows have every
/// claimed field) is answered without them, and the client reads them as it would anyway.
fn with_cells(
    store: &Store,
    session: &Session,
    claimed: WireClaimed,
    fields: &[String],
) -> (Reply, ReplyBody) {
    if claimed.rows.is_empty() {
        return (Reply::Claimed(claimed), ReplyBody::default());
    }
    let mut placer = Placer::new(session);
    let unplaced = WireCell { place: CellPlace::Inline(0), len: 0, first_dim: 0 };
    let mut cells = vec![vec![unplaced; claimed.rows.len()]; fields.len()];
    let visited = store
        .visit_claimed_cells(&claimed.rows, fields, |f, k, cell| cells[f][k] = placer.place(cell));
    match visited {
        Ok(schemas) => {
            let columns = fields
                .iter()
                .zip(schemas)
                .zip(cells)
                .map(|((name, schema), cells)| WireColumn { name: name.clone(), schema, cells })
                .collect();
            let Outgoing { columns, pin, segments, answer } = placer.finish(columns);
            (Reply::ClaimedCells { claimed, columns, pin, segments }, answer)
        }
        Err(e) => {
            tracing::warn!(error = %e, "claimed rows could not be read with their claim");
            (Reply::Claimed(claimed), ReplyBody::default())
        }
    }
}

impl Execute for Store {
    fn execute(
        &self,
        session: &Session,
        req: Request,
        payload: Payload,
        wait: Wait<'_>,
    ) -> Outcome {
        match req {
            Request::RegisterTask { name, scope } => {
                self.register_task(&name, scope).and(done(Reply::Done))
            }
            Request::Put(p) => {
                let ack = p.ack;
                let written = put(self, session, p, payload, wait)?;
                match ack {
                    Some(lease) => self.ack(lease, None).map(|()| written),
                    None => Ok(written),
                }
            }
            Request::Claim { spec, allow_partial, read, .. } => {
                let claimed = claimed(self.claim(&spec, allow_partial, wait)?);
                if read {
                    Ok(with_cells(self, session, claimed, &spec.fields))
                } else {
                    done(Reply::Claimed(claimed))
                }
            }
            Request::Ack { lease, subset } => {
                self.ack(lease, subset.as_deref()).and(done(Reply::Done))
            }
            Request::Release { lease, subset } => {
                self.release(lease, subset.as_deref()).and(done(Reply::Done))
            }
            Request::Renew { lease, timeout } => {
                let until = self.renew(lease, timeout)?;
                done(Reply::Renewed(until.saturating_duration_since(Instant::now())))
            }
            Request::Read { rows, fields } => {
                let columns = self.read(&rows, &fields)?;
                let columns = columns.into_iter().map(|c| (c.name, c.schema, c.cells)).collect();
                Ok(outgoing_cells(session, columns).read_reply())
            }
            Request::Rows { rows, partition } => done(Reply::RowInfos(match rows {
                Some(rows) => self.row_info(&rows)?,
                None => self.rows(partition.as_deref()),
            })),
            Request::Clear { partition } => done(Reply::Count(self.clear(&partition)?)),
            Request::Delete { rows } => self.delete(&rows).and(done(Reply::Done)),
            Request::Schema { field } => done(Reply::Schema(self.field_schema(&field)?)),
            Request::ReadyFields { rows } => done(Reply::Names(self.ready_fields(&rows)?)),
            Request::Stats => done(Reply::Stats(Box::new(self.stats()))),
            Request::Locate { rows, fields } => {
                done(Reply::Located { fields: self.locate(&rows, &fields)? })
            }
            other => Err(StoreError::bad_request(format!(
                "{:?} is not served by this daemon",
                other.op()
            ))),
        }
    }
}

/// Checks that each cell's byte length fits its schema, for puts whose bytes go elsewhere.
pub fn check_cell_sizes(p: &PutRequest) -> Result<(), StoreError> {
    for c in &p.columns {
        c.schema.validate()?;
        for (k, cell) in c.cells.iter().enumerate() {
            let expected = c.schema.cell_bytes(cell.first_dim)?;
            if cell.len != expected {
                return Err(StoreError::schema(format!(
                    "row {k} of field {:?} has {} bytes; a {} cell of first dimension {} needs {expected}",
                    c.name, cell.len, c.schema, cell.first_dim
                )));
            }
        }
    }
    Ok(())
}
