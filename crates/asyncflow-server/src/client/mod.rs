//! The Rust client: the store's operations over a connection to a standalone daemon, or over a
//! controller plus its storage daemons, where metadata goes to the controller and payload bytes
//! go straight to the storage daemon that owns each row (row `i` on daemon `i % n`).

mod connection;
mod layout;
mod link;
mod pid;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use asyncflow_core::{
    Cell, Chunk, ClaimSpec, FieldSchema, PutTarget, RowInfo, StoreError, StoreStats, Wait,
};
use asyncflow_proto::{
    CellPlace, PayloadSource, PutRequest, Reply, Request, Role, StoreCells, WireClaimed, WireColumn,
};
use asyncflow_shm::{SegmentView, size_class};

pub use connection::{Connection, Policy};
pub use layout::{Layout, PutColumn};
pub use link::{Answer, Link, Pending, PinToken, Preference};
pub use pid::process_id;

use crate::error::{Error, Result};

/// Read cells with their field's name and schema.
pub type ReadColumn = (String, FieldSchema, Vec<Cell>);

pub struct Client {
    primary: Connection,
    /// The controller's storage daemons, in shard order; empty for a standalone daemon.
    storage: Vec<Connection>,
}

fn unexpected(reply: &Reply) -> Error {
    Error::connection(format!("unexpected reply from the daemon: {reply:?}"))
}

/// The largest put whose cells go in its request's frame on a shared-memory link too, rather
/// than in a region of shared memory: a region is a segment of at least `MIN_SEGMENT` (64 KiB),
/// made for the put (a descriptor sent and mapped, tens of microseconds) and held for as long as
/// its rows live, where copying a few KiB through the frame costs a microsecond or two.
const INLINE_PUT_BYTES: u64 = 16 << 10;

/// Writes a put's cells where `conn` wants them — a staged shared-memory region, or the frame —
/// and sends the request `make` builds for that payload source; its reply is to be waited for
/// with [`put_reply`].
fn send_cells(
    conn: &Connection,
    layout: &Layout<'_>,
    timeout: Option<Duration>,
    wait: Wait<'_>,
    make: impl FnOnce(PayloadSource) -> Request,
) -> Result<Pending> {
    let link = conn.live_link(wait)?;
    if !link.is_shm() || layout.total <= INLINE_PUT_BYTES {
        return link.send(&make(PayloadSource::Inline), &layout.parts()).map_err(unknown);
    }
    // The region the daemon set aside after this link's last put saves staging one. One of
    // another size is given back, so that the daemon sets aside one of this put's size: a small
    // put would otherwise keep a large segment for as long as its rows live.
    let give_back = match link.take_spare() {
        Some(spare)
            if usize::try_from(layout.total).is_ok_and(|t| size_class(t) as u64 == spare.len) =>
        {
            copy_staged(&link, spare.cell.segment, spare.cell.offset, layout)?;
            let put = make(PayloadSource::Staged(spare.stage));
            return link.send(&put, &[]).map_err(unknown);
        }
        other => other.map(|s| s.stage),
    };
    let stage = Request::Stage { bytes: layout.total, timeout, give_back };
    // A stage holds nothing yet: if its link broke, stage again on a new one.
    let (link, staged) = match link.call(&stage, &[], wait) {
        Err(Error::Connection(_)) => {
            let link = conn.link(wait)?;
            let stage = Request::Stage { bytes: layout.total, timeout, give_back: None };
            let staged = link.call(&stage, &[], wait)?;
            (link, staged)
        }
        other => (link, other?),
    };
    let Reply::Staged { stage, cell, .. } = staged.reply else {
        return Err(unexpected(&staged.reply));
    };
    copy_staged(&link, cell.segment, cell.offset, layout)?;
    // The stage belongs to this link: the put must go on it, not on a new one.
    link.send(&make(PayloadSource::Staged(stage)), &[]).map_err(unknown)
}

/// The reply to a request [`send_cells`] sent.
fn put_reply(sent: Pending, wait: Wait<'_>) -> Result<Reply> {
    sent.wait(wait).map(|answer| answer.reply).map_err(unknown)
}

/// How many bytes of a put's copy into shared memory go between two notices to the daemon that
/// the put's request is coming (`Link::heads_up`): at a few GB/s, well within the daemon's spin
/// after a notice, so that a daemon awake when the copy starts stays awake until the request.
const HEADS_UP_BYTES: usize = 1 << 20;

/// Copies a put's cells into the region staged at `offset` of `segment`, telling the daemon at
/// the start and after every `HEADS_UP_BYTES` that the request is coming: a daemon woken by a
/// request (tens of microseconds on this kind of machine) would add that to the put.
fn copy_staged(link: &Link, segment: u64, offset: u64, layout: &Layout<'_>) -> Result<()> {
    let segment = link.segment(segment)?;
    link.heads_up();
    let mut unnoticed = 0;
    for &(at, bytes) in &layout.sources {
        let mut to = (offset + at) as usize;
        for piece in bytes.chunks(HEADS_UP_BYTES) {
            segment.write(to, piece)?;
            to += piece.len();
            unnoticed += piece.len();
            if unnoticed >= HEADS_UP_BYTES {
                link.heads_up();
                unnoticed = 0;
            }
        }
    }
    Ok(())
}

/// A put's link broke before its reply came: say that it may or may not have been applied.
fn unknown(e: Error) -> Error {
    match e {
        Error::Connection(why) => {
            Error::connection(format!("{why} (the put may or may not have been carried out)"))
        }
        other => other,
    }
}

/// Turns a `Cells` reply into cells (see `view_cells`).
fn cells_of(answer: Answer) -> Result<Vec<ReadColumn>> {
    let Reply::Cells { columns, pin, .. } = answer.reply else {
        return Err(unexpected(&answer.reply));
    };
    view_cells(columns, pin, answer.payload, &answer.link)
}

/// Cells sent by the daemon: inline ones view the received `payload`, shared ones view the
/// mapped segment and keep the daemon's `pin` until the last of them is dropped.
fn view_cells(
    columns: Vec<WireColumn>,
    pin: Option<u64>,
    mut payload: Vec<u8>,
    conn: &Arc<Link>,
) -> Result<Vec<ReadColumn>> {
    // Made when a first cell needs it: most claims over shared memory have no inline cell, and
    // most have their cells in one segment, kept at hand in `last` (the map holds the others).
    let mut inline: Option<Arc<Chunk>> = None;
    let token = pin.map(|p| Arc::new(conn.pin_token(p)));
    let mut shared: HashMap<u64, Arc<Chunk>> = HashMap::new();
    let mut last: Option<(u64, Arc<Chunk>, u64)> = None;
    let mut out = Vec::with_capacity(columns.len());
    for column in columns {
        let mut cells = Vec::with_capacity(column.cells.len());
        for c in column.cells {
            let (chunk, offset, chunk_len) = match c.place {
                CellPlace::Inline(offset) => {
                    let inline = inline.get_or_insert_with(|| {
                        crate::received::into_chunk(std::mem::take(&mut payload), None)
                    });
                    (Arc::clone(inline), offset, inline.len() as u64)
                }
                CellPlace::Shared(s) => {
                    if last.as_ref().is_none_or(|l| l.0 != s.segment) {
                        let chunk = if let Some(chunk) = shared.remove(&s.segment) {
                            chunk
                        } else {
                            let segment = conn.segment(s.segment)?;
                            let keep: Box<dyn std::any::Any + Send + Sync> =
                                Box::new(token.clone());
                            let view = Box::new(SegmentView::new(segment, keep));
                            Chunk::new(view, None)
                        };
                        let len = chunk.len() as u64;
                        if let Some((segment, before, _)) = last.replace((s.segment, chunk, len)) {
                            shared.insert(segment, before);
                        }
                    }
                    let (_, chunk, len) = last.as_ref().expect("just set");
                    (Arc::clone(chunk), s.offset, *len)
                }
            };
            if offset.checked_add(c.len).is_none_or(|end| end > chunk_len) {
                return Err(Error::connection("the daemon named a cell outside its memory"));
            }
            cells.push(Cell {
                chunk,
                offset: offset as usize,
                len: c.len as usize,
                first_dim: c.first_dim,
            });
        }
        out.push((column.name, column.schema, cells));
    }
    Ok(out)
}

/// Positions of `rows` grouped by the storage daemon that owns them.
fn by_owner(rows: &[u64], n: usize) -> Vec<Vec<usize>> {
    let mut owners = vec![Vec::new(); n];
    for (k, &row) in rows.iter().enumerate() {
        owners[(row % n as u64) as usize].push(k);
    }
    owners
}

impl Client {
    /// Connects to `url` (`tcp://HOST:PORT` or `HOST:PORT`): a standalone daemon, or a controller
    /// (then also to each of its storage daemons).
    pub fn connect(url: &str, token: Option<&str>, prefer: Preference) -> Result<Self> {
        Self::connect_with(url, token, prefer, Policy::default())
    }

    /// [`Client::connect`] with the given timeouts.
    pub fn connect_with(
        url: &str,
        token: Option<&str>,
        prefer: Preference,
        policy: Policy,
    ) -> Result<Self> {
        let address = url.strip_prefix("tcp://").unwrap_or(url);
        if address.contains("://") {
            return Err(Error::connection(format!(
                "unsupported address {url:?}; use tcp://HOST:PORT"
            )));
        }
        let primary = Connection::open(address, token, prefer, policy)?;
        let hello = primary.hello();
        let storage = match hello.role {
            Role::Standalone => Vec::new(),
            Role::Controller => hello
                .storage
                .iter()
                .map(|a| Connection::open(a, token, prefer, policy))
                .collect::<Result<_>>()?,
            Role::Storage => {
                return Err(Error::connection(format!(
                    "{address} is a storage daemon; connect to its controller"
                )));
            }
        };
        Ok(Self { primary, storage })
    }

    /// The data path in use: `shm` if every payload connection uses shared memory with its
    /// requests and replies in rings, `shm-socket` if with them on the Unix socket, else `tcp`.
    pub fn transport(&self) -> &'static str {
        let payload_links: Vec<&Connection> = if self.storage.is_empty() {
            vec![&self.primary]
        } else {
            self.storage.iter().collect()
        };
        if !payload_links.iter().all(|c| c.is_shm()) {
            "tcp"
        } else if payload_links.iter().all(|c| c.has_rings()) {
            "shm"
        } else {
            "shm-socket"
        }
    }

    /// How many storage daemons hold the payloads (0 for a standalone daemon).
    pub fn storage_daemons(&self) -> usize {
        self.storage.len()
    }

    fn call(&self, req: &Request, wait: Wait<'_>) -> Result<Reply> {
        Ok(self.primary.call(req, &[], wait)?.reply)
    }

    fn done(&self, req: &Request, wait: Wait<'_>) -> Result<()> {
        match self.call(req, wait)? {
            Reply::Done => Ok(()),
            other => Err(unexpected(&other)),
        }
    }

    pub fn register_task(
        &self,
        name: &str,
        scope: Option<Vec<String>>,
        wait: Wait<'_>,
    ) -> Result<()> {
        self.done(&Request::RegisterTask { name: name.to_owned(), scope }, wait)
    }

    /// The names of the fields ready on each row.
    pub fn ready_fields(&self, rows: &[u64], wait: Wait<'_>) -> Result<Vec<Vec<String>>> {
        match self.call(&Request::ReadyFields { rows: rows.to_vec() }, wait)? {
            Reply::Names(names) => Ok(names),
            other => Err(unexpected(&other)),
        }
    }

    /// Writes rows; with `ack`, then acks that lease whole (in the put's own request, but for
    /// a sharded deployment, whose controller commits a put only after its storage daemons
    /// hold the bytes: there the ack follows the put). Nothing is acked if the put fails.
    pub fn put(
        &self,
        columns: &[PutColumn<'_>],
        target: PutTarget,
        timeout: Option<Duration>,
        ack: Option<u64>,
        wait: Wait<'_>,
    ) -> Result<Vec<u64>> {
        if !self.storage.is_empty() {
            let rows = self.put_sharded(columns, target, timeout, wait)?;
            return match ack {
                Some(lease) => self.ack(lease, None, wait).map(|()| rows),
                None => Ok(rows),
            };
        }
        let layout = Layout::place(columns, None);
        let metas = layout.column_metas(columns);
        let rows = send_cells(&self.primary, &layout, timeout, wait, |source| {
            Request::Put(PutRequest { columns: metas, target, timeout, source, ack })
        })
        .and_then(|sent| match put_reply(sent, wait)? {
            Reply::Rows(rows) => Ok(rows),
            other => Err(unexpected(&other)),
        });
        if let Some(lease) = ack {
            self.settled(lease, true, &rows);
        }
        rows
    }

    /// Admit on the controller, bytes to the owners, then commit: the rows become claimable only
    /// once every owner holds its part. If an owner fails, new rows are deleted again.
    fn put_sharded(
        &self,
        columns: &[PutColumn<'_>],
        target: PutTarget,
        timeout: Option<Duration>,
        wait: Wait<'_>,
    ) -> Result<Vec<u64>> {
        let metas = Layout::place(columns, None).column_metas(columns);
        let created = matches!(target, PutTarget::New(_));
        let admit = Request::Put(PutRequest {
            columns: metas,
            target,
            timeout,
            source: PayloadSource::Elsewhere,
            ack: None,
        });
        let (rows, fields) = match self.call(&admit, wait)? {
            Reply::Admitted { rows, fields } => (rows, fields),
            other => return Err(unexpected(&other)),
        };
        // Every owner's bytes are sent before any reply is awaited: the owners store them (and
        // a durable one syncs its log) at the same time, not one after another.
        let mut sent = Vec::new();
        let mut stored = Ok(());
        for (owner, positions) in by_owner(&rows, self.storage.len()).into_iter().enumerate() {
            if positions.is_empty() {
                continue;
            }
            let layout = Layout::place(columns, Some(&positions));
            let subset: Vec<u64> = positions.iter().map(|&k| rows[k]).collect();
            let cells = fields.iter().copied().zip(layout.columns.iter().cloned()).collect();
            match send_cells(&self.storage[owner], &layout, timeout, wait, |source| {
                Request::StoreCells(StoreCells { rows: subset, columns: cells, timeout, source })
            }) {
                Ok(pending) => sent.push(pending),
                Err(e) => {
                    stored = Err(e);
                    break;
                }
            }
        }
        for pending in sent {
            let reply = put_reply(pending, wait).and_then(|reply| match reply {
                Reply::Done => Ok(()),
                other => Err(unexpected(&other)),
            });
            stored = stored.and(reply);
        }
        if let Err(e) = stored {
            if created {
                let _ = self.done(&Request::Delete { rows }, wait);
            }
            return Err(e);
        }
        match self.done(&Request::Commit { rows: rows.clone(), fields }, wait) {
            Err(Error::Store(StoreError::UnknownIndex(_))) => Err(Error::connection(
                "the put's rows were dropped before it completed (the controller restarted, or \
                 lost this client's connection); it was not applied",
            )),
            other => other.map(|()| rows),
        }
    }

    /// Leases rows. On the shared-memory path of a standalone daemon the claimed fields' cells
    /// come with the claim (only their places cross the socket): they are returned too, and
    /// reading them takes no second round trip.
    pub fn claim(
        &self,
        spec: ClaimSpec,
        allow_partial: bool,
        timeout: Option<Duration>,
        wait: Wait<'_>,
    ) -> Result<(WireClaimed, Option<Vec<ReadColumn>>)> {
        let read = self.storage.is_empty() && self.primary.is_shm();
        let req = Request::Claim { spec, allow_partial, timeout, read };
        let answer = self.primary.call(&req, &[], wait)?;
        let claimed = match &answer.reply {
            Reply::Claimed(c) | Reply::ClaimedCells { claimed: c, .. } => Some(c),
            _ => None,
        };
        if let Some(lease) = claimed.and_then(|c| c.lease) {
            self.primary.hold(lease, claimed.and_then(|c| c.expires_in));
        }
        match answer.reply {
            Reply::Claimed(c) => Ok((c, None)),
            Reply::ClaimedCells { claimed, columns, pin, .. } => {
                let cells = view_cells(columns, pin, answer.payload, &answer.link)?;
                Ok((claimed, Some(cells)))
            }
            other => Err(unexpected(&other)),
        }
    }

    pub fn ack(&self, lease: u64, subset: Option<&[u64]>, wait: Wait<'_>) -> Result<()> {
        let done = self.done(&Request::Ack { lease, subset: subset.map(<[u64]>::to_vec) }, wait);
        self.settled(lease, subset.is_none(), &done);
        done
    }

    pub fn release(&self, lease: u64, subset: Option<&[u64]>, wait: Wait<'_>) -> Result<()> {
        let req = Request::Release { lease, subset: subset.map(<[u64]>::to_vec) };
        let done = self.done(&req, wait);
        self.settled(lease, subset.is_none(), &done);
        done
    }

    /// After an ack or release of `lease` (`whole`, or a subset of its rows), or a put that
    /// acked it: whether this client still holds it.
    fn settled<T>(&self, lease: u64, whole: bool, done: &Result<T>) {
        match done {
            Ok(_) if whole => self.primary.forget(lease),
            Err(Error::Store(StoreError::Lease { .. })) => self.primary.forget(lease),
            _ => {}
        }
    }

    /// Extends a lease; returns how long it now has.
    pub fn renew(&self, lease: u64, timeout: Option<Duration>, wait: Wait<'_>) -> Result<Duration> {
        match self.call(&Request::Renew { lease, timeout }, wait)? {
            Reply::Renewed(d) => {
                self.primary.hold(lease, Some(d));
                Ok(d)
            }
            other => Err(unexpected(&other)),
        }
    }

    pub fn read(&self, rows: &[u64], fields: &[String], wait: Wait<'_>) -> Result<Vec<ReadColumn>> {
        let req = Request::Read { rows: rows.to_vec(), fields: fields.to_vec() };
        if self.storage.is_empty() {
            return cells_of(self.primary.call(&req, &[], wait)?);
        }
        let located = match self
            .call(&Request::Locate { rows: rows.to_vec(), fields: fields.to_vec() }, wait)?
        {
            Reply::Located { fields } => fields,
            other => return Err(unexpected(&other)),
        };
        let ids: Vec<u32> = located.iter().map(|(id, _)| *id).collect();
        let owners = by_owner(rows, self.storage.len());
        let pending = owners
            .iter()
            .enumerate()
            .filter(|(_, positions)| !positions.is_empty())
            .map(|(owner, positions)| {
                let subset = positions.iter().map(|&k| rows[k]).collect();
                let conn = &self.storage[owner];
                let req = Request::FetchCells { rows: subset, fields: ids.clone() };
                let sent = conn.send(&req, &[], wait);
                (owner, req, sent)
            })
            .collect::<Vec<_>>();
        let mut merged: Vec<Vec<Option<Cell>>> = vec![vec![None; rows.len()]; ids.len()];
        for (owner, req, sent) in pending {
            let answer = match sent.and_then(|p| p.wait(wait)) {
                // Sent to every owner at once; one whose link broke, before or after the
                // request went out, is asked again (a read changes nothing), reconnecting as a
                // call does.
                Err(Error::Connection(_)) => self.storage[owner].call(&req, &[], wait)?,
                other => other?,
            };
            let columns = cells_of(answer)?;
            for (f, (_, _, cells)) in columns.into_iter().enumerate() {
                for (&k, cell) in owners[owner].iter().zip(cells) {
                    merged[f][k] = Some(cell);
                }
            }
        }
        fields
            .iter()
            .zip(located)
            .zip(merged)
            .map(|((name, (_, schema)), cells)| {
                let cells = cells.into_iter().collect::<Option<Vec<_>>>();
                let cells =
                    cells.ok_or_else(|| Error::connection("a storage daemon left out cells"))?;
                Ok((name.clone(), schema, cells))
            })
            .collect()
    }

    pub fn rows(
        &self,
        rows: Option<&[u64]>,
        partition: Option<&str>,
        wait: Wait<'_>,
    ) -> Result<Vec<RowInfo>> {
        let req = Request::Rows {
            rows: rows.map(<[u64]>::to_vec),
            partition: partition.map(str::to_owned),
        };
        match self.call(&req, wait)? {
            Reply::RowInfos(infos) => Ok(infos),
            other => Err(unexpected(&other)),
        }
    }

    pub fn clear(&self, partition: &str, wait: Wait<'_>) -> Result<u64> {
        match self.call(&Request::Clear { partition: partition.to_owned() }, wait)? {
            Reply::Count(n) => Ok(n),
            other => Err(unexpected(&other)),
        }
    }

    pub fn delete(&self, rows: &[u64], wait: Wait<'_>) -> Result<()> {
        self.done(&Request::Delete { rows: rows.to_vec() }, wait)
    }

    pub fn schema(&self, field: &str, wait: Wait<'_>) -> Result<FieldSchema> {
        match self.call(&Request::Schema { field: field.to_owned() }, wait)? {
            Reply::Schema(s) => Ok(s),
            other => Err(unexpected(&other)),
        }
    }

    /// The daemon's statistics; for a sharded store, payload figures summed over its storage
    /// daemons.
    pub fn stats(&self, wait: Wait<'_>) -> Result<StoreStats> {
        let stats = |conn: &Connection| match conn.call(&Request::Stats, &[], wait)?.reply {
            Reply::Stats(s) => Ok(*s),
            other => Err(unexpected(&other)),
        };
        let mut total = stats(&self.primary)?;
        if self.storage.is_empty() {
            return Ok(total);
        }
        let parts = self.storage.iter().map(stats).collect::<Result<Vec<_>>>()?;
        total.payload_rows = parts.iter().map(|p| p.payload_rows).sum();
        total.memory_used = parts.iter().map(|p| p.memory_used).sum();
        total.memory_limit = parts.iter().map(|p| p.memory_limit).sum();
        Ok(total)
    }
}
