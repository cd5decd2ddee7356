//! One client connection: greet and authenticate, then read frames and run each request that
//! may wait apart from the reading (a claim as a task, a put short of memory on the blocking
//! pool), so a claim that waits a minute holds no other request of the same client;
//! replies go back through one writer task in whatever order requests finish. A frame that
//! cannot be trusted closes the connection; every other client is unaffected.
//!
//! A client on this machine usually sends its next request within microseconds of a reply, and
//! a thread asleep in the kernel takes far longer than that to be woken for it. So a local
//! client's connection has a thread (and event loop) of its own, whose socket wakes no other
//! thread, and after each frame it keeps reading its socket (or its rings in shared memory, see
//! `ring.rs`) for a short while before it waits; one connection at a time does so, to leave the
//! machine's other cores alone, for about as long as its client has lately taken to send (a
//! worker that asks now and then soon has its requests followed by no spin at all).

use std::os::fd::{AsFd, BorrowedFd};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use asyncflow_core::{MemoryGuard, StoreError, Wait};
use asyncflow_proto::{
    Failure, FrameHeader, HEADER_LEN, Limits, Op, ProtoError, Reply, Request, ServerHello,
};
use asyncflow_shm::{DaemonEnds, send_with_fds};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt, BufReader, BufWriter, Interest, ReadBuf};
use tokio::net::{TcpStream, UnixStream, tcp, unix};
use tokio::sync::{Mutex, mpsc, watch};
use tokio::task::JoinSet;

use super::Daemon;
use super::cells::Payload;
use super::outgoing::{Outgoing, Part, ReplyBody};
use super::ring::{self, RingIn, RingOut};
use super::routing::{dispatch, over_max_frame};
use super::session::{Descriptor, Session, ShmSession};
use super::transit::{Transit, TransitGuard};
use crate::auth::token_matches;
use crate::host::host_id;

const BUFFER: usize = 256 << 10;
/// A hello is small; a client that sends more before authenticating is cut off early.
const HELLO_LIMITS: Limits = Limits { max_meta: 64 << 10, max_payload: 0 };
static ZEROS: [u8; 4096] = [0; 4096];
/// How long a local connection keeps reading its socket before it waits on the runtime.
const SPIN: Duration = Duration::from_micros(250);
/// Set while some connection spins: only one does at a time.
static SPINNING: AtomicBool = AtomicBool::new(false);

pub enum Socket {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Socket {
    /// Whether the client is on this machine: the Unix socket, or TCP over loopback.
    fn is_local(&self) -> bool {
        match self {
            Socket::Tcp(s) => s.peer_addr().is_ok_and(|a| a.ip().is_loopback()),
            Socket::Unix(_) => true,
        }
    }
}

/// The same socket, taken off the runtime that accepted it, to be served on another.
enum StdSocket {
    Tcp(std::net::TcpStream),
    Unix(std::os::unix::net::UnixStream),
}

impl StdSocket {
    fn of(socket: Socket) -> std::io::Result<Self> {
        Ok(match socket {
            Socket::Tcp(s) => StdSocket::Tcp(s.into_std()?),
            Socket::Unix(s) => StdSocket::Unix(s.into_std()?),
        })
    }

    /// Registers the socket with the runtime this is called on.
    fn into_socket(self) -> std::io::Result<Socket> {
        Ok(match self {
            StdSocket::Tcp(s) => Socket::Tcp(TcpStream::from_std(s)?),
            StdSocket::Unix(s) => Socket::Unix(UnixStream::from_std(s)?),
        })
    }
}

/// What a queued reply is counted as beyond its metadata: the frame's bookkeeping and the
/// queue's.
const REPLY_OVERHEAD: u64 = 256;
/// Bytes of replies one connection may have queued before it stops reading requests.
const REPLY_SHARE: u64 = 4 << 20;

/// A reply on its way to the writer task, with the transit bytes it holds until written.
struct Queued {
    out: Outgoing,
    _held: TransitGuard,
}

/// Replies queued for the writer task (of requests that ran on the blocking pool), counted so
/// that a spinning read gives way to them at once, and so that a client that does not read its
/// replies stops being read (see `transit.rs`).
#[derive(Clone)]
pub(super) struct Replies {
    tx: mpsc::UnboundedSender<Queued>,
    counts: Arc<ReplyCounts>,
    transit: Arc<Transit>,
}

/// What the reader and the writer task know of the replies queued between them.
struct ReplyCounts {
    queued: Arc<AtomicUsize>,
    /// Bytes queued (as counted in the transit pool).
    bytes: AtomicU64,
    /// Told each time the writer task has written a reply, and when it stops.
    drained: tokio::sync::Notify,
    /// Set when the writer task stops (the client is gone): nothing queued will be written.
    gone: AtomicBool,
}

impl Replies {
    pub(super) fn send(&self, out: Outgoing) {
        let cost = out.meta.len() as u64 + REPLY_OVERHEAD;
        let held = self.transit.force(cost);
        self.counts.queued.fetch_add(1, Ordering::AcqRel);
        self.counts.bytes.fetch_add(cost, Ordering::AcqRel);
        if self.tx.send(Queued { out, _held: held }).is_err() {
            self.counts.queued.fetch_sub(1, Ordering::AcqRel);
            self.counts.bytes.fetch_sub(cost, Ordering::AcqRel);
        }
    }

    /// Whether the connection must stop reading until its client reads replies: it has more
    /// than its share queued, or some queued while the transit pool is over its limit.
    fn backed_up(&self) -> bool {
        let own = self.counts.bytes.load(Ordering::Acquire);
        own > REPLY_SHARE || (own > 0 && self.transit.over())
    }
}

enum Half {
    Tcp(tcp::OwnedReadHalf),
    Unix(unix::OwnedReadHalf),
}

/// The reading half of a connection; a local one reads the socket itself for up to `SPIN`
/// before it waits on its event loop (see the module documentation).
struct Incoming {
    half: Half,
    /// Where requests come from instead of `half`, if the client asked for rings.
    ring: Option<RingIn>,
    local: bool,
    /// Replies waiting for the writer task, which runs only once this read waits.
    queued: Arc<AtomicUsize>,
    /// The connection's activity: while a claim of it waits as a task of this runtime, which
    /// runs only once this read waits, the read does not spin.
    activity: Arc<Activity>,
    /// How long the next read spins (see `next_spin`): a client that sends its requests one
    /// after another is read by spinning; one that sends them now and then is not, and the
    /// spin after a burst's last request (which finds nothing) is short: each spin costs the
    /// machine a core while it lasts.
    spin_for: Duration,
    /// Since when this read has asked for bytes without getting any.
    asking_since: Option<Instant>,
    /// Whether it found none there at once (only then does its wait say how the client sends).
    waited: bool,
}

impl Incoming {
    fn new(
        half: Half,
        ring: Option<RingIn>,
        local: bool,
        queued: Arc<AtomicUsize>,
        activity: Arc<Activity>,
    ) -> Self {
        Self {
            half,
            ring,
            local,
            queued,
            activity,
            spin_for: SPIN,
            asking_since: None,
            waited: false,
        }
    }

    /// Reads what has come, without waiting; `None` if nothing has.
    fn read_now(&mut self, buf: &mut ReadBuf<'_>) -> Option<std::io::Result<()>> {
        if let Some(ring) = &mut self.ring {
            return ring.take(buf);
        }
        let fd = match &self.half {
            Half::Tcp(h) => h.as_ref().as_fd(),
            Half::Unix(h) => h.as_ref().as_fd(),
        };
        match rustix::net::recv(fd, buf.initialize_unfilled(), rustix::net::RecvFlags::DONTWAIT) {
            Ok((n, _)) => {
                buf.advance(n);
                Some(Ok(()))
            }
            Err(rustix::io::Errno::INTR | rustix::io::Errno::AGAIN) => None,
            Err(e) => Some(Err(e.into())),
        }
    }

    /// Reads whatever arrives from a local client within `spin_for`, or `SPIN` more each time
    /// the client says a request is on its way (`RingIn::expected`: a client that keeps saying
    /// so keeps the spin going, as one that keeps sending requests does); `None` if nothing did (or
    /// another connection is spinning, a reply waits to be written, a claim waits, or this one
    /// is not local). Looking at a ring costs no system call, so it yields the core only now
    /// and then; a socket is read with one, after which it yields every time.
    fn spin(&mut self, buf: &mut ReadBuf<'_>) -> Option<std::io::Result<()>> {
        if !self.local || self.activity.waiting.load(Ordering::Acquire) > 0 {
            return None;
        }
        let spin_for = match self.spin_for {
            d if !d.is_zero() => d,
            _ if self.ring.as_mut().is_some_and(RingIn::expected) => SPIN,
            _ => return None,
        };
        if SPINNING.swap(true, Ordering::Acquire) {
            return None;
        }
        let mut until = Instant::now() + spin_for;
        let yield_every = if self.ring.is_some() { 64 } else { 1 };
        let mut turns = 0u32;
        let got = loop {
            if let Some(got) = self.read_now(buf) {
                break Some(got);
            }
            if self.queued.load(Ordering::Acquire) > 0 {
                break None;
            }
            if Instant::now() >= until {
                if !self.ring.as_mut().is_some_and(RingIn::expected) {
                    break None;
                }
                until = Instant::now() + SPIN;
            }
            self.waited = true;
            turns += 1;
            if turns.is_multiple_of(yield_every) {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        };
        SPINNING.store(false, Ordering::Release);
        got
    }
}

/// How long to spin after a read that spun for `spun` and got its bytes `took` after asking:
/// twice `took`, at most `SPIN`; after a gap longer than that, half the last spin (a client
/// that asks now and then soon gets none).
fn next_spin(spun: Duration, took: Duration) -> Duration {
    if took >= SPIN {
        // Not none at once: a client that works a while between bursts (fills a buffer, then
        // puts, claims and acks it) sends the burst's next request within microseconds.
        return spun / 2;
    }
    // Not below three quarters of the last spin: a client's gaps alternate (a notice right after
    // its request's reply, then its next request a little later).
    (2 * took).max(spun * 3 / 4).min(SPIN)
}

impl AsyncRead for Incoming {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let since = *this.asking_since.get_or_insert_with(Instant::now);
        let read = match this.spin(buf) {
            Some(got) => Poll::Ready(got),
            None => match (&mut this.ring, &mut this.half) {
                (Some(ring), Half::Unix(half)) => ring.poll_wait(half, cx, buf),
                (Some(ring), Half::Tcp(half)) => ring.poll_wait(half, cx, buf),
                (None, Half::Tcp(half)) => Pin::new(half).poll_read(cx, buf),
                (None, Half::Unix(half)) => Pin::new(half).poll_read(cx, buf),
            },
        };
        if read.is_pending() {
            this.waited = true;
            return read;
        }
        this.asking_since = None;
        let announced = this.ring.as_mut().is_some_and(RingIn::take_announced);
        if std::mem::take(&mut this.waited) {
            // A request the client announced took as long as the work it announced it after
            // (a put's copy), not as long as the client takes to send after a reply.
            let took = if announced { Duration::ZERO } else { since.elapsed() };
            this.spin_for = next_spin(this.spin_for, took);
        }
        read
    }
}

enum FrameWriter {
    Tcp(BufWriter<tcp::OwnedWriteHalf>),
    Unix(BufWriter<unix::OwnedWriteHalf>),
    Ring(RingOut),
}

enum ReadError {
    Closed,
    Proto(ProtoError),
}

impl From<std::io::Error> for ReadError {
    fn from(_: std::io::Error) -> Self {
        ReadError::Closed
    }
}

pub(super) struct Frame {
    pub(super) header: FrameHeader,
    pub(super) meta: Vec<u8>,
    pub(super) payload: Payload,
    /// Transit bytes the frame holds until its request is done (see `transit.rs`).
    pub(super) held: Vec<TransitGuard>,
}

async fn read_frame<R: AsyncRead + Unpin>(r: &mut R, limits: Limits) -> Result<Frame, ReadError> {
    let mut head = [0u8; HEADER_LEN];
    r.read_exact(&mut head).await?;
    let header = FrameHeader::decode(&head, limits).map_err(ReadError::Proto)?;
    let mut meta = vec![0u8; header.meta_len as usize];
    r.read_exact(&mut meta).await?;
    let mut payload = vec![0u8; header.payload_len as usize];
    r.read_exact(&mut payload).await?;
    Ok(Frame { header, meta, payload: Payload { bytes: payload, paid: None }, held: Vec::new() })
}

/// A request frame as read: whole, or refused before its bytes were kept (a put over
/// `--max-frame` or with no room under `--memory-limit`, metadata over the transit pool), its
/// bytes read and dropped.
enum Received {
    Frame(Frame),
    Refused(FrameHeader, Failure),
}

/// How a frame's payload is paid for before it is read.
enum Pay {
    /// From the store's memory, which it will use once put.
    Store(MemoryGuard),
    /// From the transit pool, until its put finds room in the store.
    Transit(TransitGuard),
    /// Not at all: the daemon has no `--memory-limit` (or keeps no payloads).
    Unbudgeted,
    Refused(Failure),
}

/// Reads a request frame, each part paid for before it is read: the metadata from the transit
/// pool, the payload (a put's bytes) from the store's memory if it has room now, else from the
/// transit pool, waiting for either if neither has (reading nothing meanwhile). A payload that
/// can never fit, or that finds no room before its put's timeout, is refused.
async fn read_request<R: AsyncRead + Unpin>(
    r: &mut R,
    daemon: &Arc<Daemon>,
) -> Result<Received, ReadError> {
    let mut head = [0u8; HEADER_LEN];
    r.read_exact(&mut head).await?;
    // A put over --max-frame is refused below, with a reply: the header is read without that
    // limit (the frame's length field bounds the bytes to skip at 4 GiB).
    let unbounded = Limits { max_payload: u32::MAX, ..daemon.config.limits };
    let header = FrameHeader::decode(&head, unbounded).map_err(ReadError::Proto)?;
    let pool = &daemon.transit;
    let meta_len = u64::from(header.meta_len);
    let max_payload = daemon.config.limits.max_payload;
    if header.payload_len > max_payload {
        if header.op != Op::Put {
            // Only a put carries a large payload: anything else breaks the protocol.
            return Err(ReadError::Proto(ProtoError::TooLarge {
                what: "payload",
                len: header.payload_len.into(),
                max: max_payload.into(),
            }));
        }
        // Refused as the metadata below is, so that the sender knows it did not run; the
        // bytes are read and dropped, never held.
        discard(r, meta_len + u64::from(header.payload_len)).await?;
        let failure = over_max_frame(header.payload_len.into(), max_payload);
        return Ok(Received::Refused(header, failure));
    }
    if meta_len > pool.limit() {
        // A well-formed request this daemon was set too small for: refused with a reply, not
        // by cutting the connection (its sender could not tell whether it ran).
        discard(r, meta_len + u64::from(header.payload_len)).await?;
        return Ok(Received::Refused(
            header,
            Failure::Store(StoreError::bad_request(format!(
                "a request with {meta_len} bytes of metadata exceeds the daemon's \
                 --max-transit-bytes of {}; send it in parts",
                pool.limit()
            ))),
        ));
    }
    let mut paid_transit = vec![pool.take(meta_len).await];
    let mut meta = vec![0u8; header.meta_len as usize];
    r.read_exact(&mut meta).await?;
    let len = u64::from(header.payload_len);
    let mut paid = None;
    if len > 0 {
        match pay_for(daemon, &header, &meta, len).await {
            Pay::Store(guard) => paid = Some(guard),
            Pay::Transit(guard) => paid_transit.push(guard),
            Pay::Unbudgeted => {}
            Pay::Refused(failure) => {
                drop(paid_transit);
                discard(r, len).await?;
                return Ok(Received::Refused(header, failure));
            }
        }
    }
    let mut payload = vec![0u8; header.payload_len as usize];
    r.read_exact(&mut payload).await?;
    let payload = Payload { bytes: payload, paid };
    Ok(Received::Frame(Frame { header, meta, payload, held: paid_transit }))
}

async fn pay_for(daemon: &Arc<Daemon>, header: &FrameHeader, meta: &[u8], len: u64) -> Pay {
    let Some(limit) = daemon.config.memory_limit.filter(|_| daemon.roles.keeps_payloads()) else {
        return Pay::Unbudgeted;
    };
    if len > limit {
        return Pay::Refused(Failure::Store(StoreError::MemoryLimit(format!(
            "a put of {len} bytes can never fit in the daemon's {limit}-byte --memory-limit"
        ))));
    }
    if let Ok(guard) =
        daemon.roles.reserve(len, Wait { deadline: Some(Instant::now()), interrupted: None })
    {
        return Pay::Store(guard);
    }
    if len <= daemon.transit.limit() {
        return Pay::Transit(daemon.transit.take(len).await);
    }
    // Too large for the transit pool: wait for the store's room, as the put itself would.
    let timeout = match Request::decode(header.op, meta, len) {
        Ok(Request::Put(p)) => p.timeout,
        Ok(Request::StoreCells(s)) => s.timeout,
        Ok(_) => None,
        Err(e) => return Pay::Refused(Failure::Protocol(e.to_string())),
    };
    let deadline = timeout.map(|t| Instant::now() + t);
    let d = Arc::clone(daemon);
    let reserved = tokio::task::spawn_blocking(move || {
        let interrupted = || d.stopping.load(Ordering::Relaxed);
        d.roles.reserve(len, Wait { deadline, interrupted: Some(&interrupted) })
    })
    .await;
    match reserved {
        Ok(Ok(guard)) => Pay::Store(guard),
        Ok(Err(StoreError::Interrupted)) | Err(_) => {
            Pay::Refused(Failure::Unavailable("the daemon is shutting down".into()))
        }
        Ok(Err(e)) => Pay::Refused(Failure::Store(e)),
    }
}

/// Reads and drops `len` bytes.
async fn discard<R: AsyncRead + Unpin>(r: &mut R, mut len: u64) -> Result<(), ReadError> {
    let mut sink = vec![0u8; 64 << 10];
    while len > 0 {
        let n = sink.len().min(usize::try_from(len).unwrap_or(usize::MAX));
        r.read_exact(&mut sink[..n]).await?;
        len -= n as u64;
    }
    Ok(())
}

impl FrameWriter {
    async fn write_all(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        match self {
            FrameWriter::Tcp(w) => w.write_all(bytes).await,
            FrameWriter::Unix(w) => w.write_all(bytes).await,
            FrameWriter::Ring(w) => w.write_all(bytes).await,
        }
    }

    async fn flush(&mut self) -> std::io::Result<()> {
        match self {
            FrameWriter::Tcp(w) => w.flush().await,
            FrameWriter::Unix(w) => w.flush().await,
            FrameWriter::Ring(w) => {
                w.flush();
                Ok(())
            }
        }
    }

    /// Writes the header; on the Unix socket, with the frame's segment descriptors attached.
    async fn write_header(&mut self, out: &Outgoing) -> std::io::Result<()> {
        let header = out.header.encode();
        if let FrameWriter::Ring(w) = self {
            w.answers(out.header.request_id);
            if !out.fds.is_empty() {
                let fds: Vec<BorrowedFd<'_>> = out.fds.iter().map(|d| d.segment.fd()).collect();
                w.send_fds(&fds).await?;
                out.fds.iter().for_each(Descriptor::written);
            }
        }
        let FrameWriter::Unix(w) = self else {
            return self.write_all(&header).await;
        };
        if out.fds.is_empty() {
            return w.write_all(&header).await;
        }
        w.flush().await?;
        let fds: Vec<BorrowedFd<'_>> = out.fds.iter().map(|d| d.segment.fd()).collect();
        let sent = send_fds(w.get_ref().as_ref(), &header, &fds).await?;
        // The descriptors are in the socket ahead of every frame written from now on.
        out.fds.iter().for_each(Descriptor::written);
        w.write_all(&header[sent..]).await
    }

    async fn write_frame(&mut self, out: &Outgoing) -> std::io::Result<()> {
        self.write_header(out).await?;
        self.write_all(&out.meta).await?;
        for part in &out.payload {
            match part {
                Part::Cell(cell) => self.write_all(cell.bytes()).await?,
                &Part::Zeros(mut n) => {
                    while n > 0 {
                        let k = n.min(ZEROS.len());
                        self.write_all(&ZEROS[..k]).await?;
                        n -= k;
                    }
                }
            }
        }
        Ok(())
    }
}

/// Sends replies of requests that ran on the blocking pool (and greetings), in the order they
/// finish; replies of requests answered on the spot are written by the reader itself.
async fn write_loop(
    daemon: Arc<Daemon>,
    writer: Arc<Mutex<FrameWriter>>,
    mut rx: mpsc::UnboundedReceiver<Queued>,
    replies: Arc<ReplyCounts>,
) {
    while let Some(queued) = rx.recv().await {
        replies.queued.fetch_sub(1, Ordering::AcqRel);
        let mut w = writer.lock().await;
        let written = write_out(&daemon, &mut w, &queued.out, rx.is_empty()).await;
        let cost = queued.out.meta.len() as u64 + REPLY_OVERHEAD;
        drop(queued);
        replies.bytes.fetch_sub(cost, Ordering::AcqRel);
        replies.drained.notify_one();
        if written.is_err() {
            replies.gone.store(true, Ordering::Release);
            replies.drained.notify_one();
            return;
        }
    }
    let _ = writer.lock().await.flush().await;
}

async fn write_out(
    daemon: &Daemon,
    w: &mut FrameWriter,
    out: &Outgoing,
    flush: bool,
) -> std::io::Result<()> {
    daemon.metrics.bytes_out.fetch_add(out.bytes() as u64, Ordering::Relaxed);
    w.write_frame(out).await?;
    if flush {
        w.flush().await?;
    }
    Ok(())
}

/// Sends some of `bytes` (returns how many, at least one) with `fds` attached to the first,
/// once the socket takes them.
pub(super) async fn send_fds(
    socket: &UnixStream,
    bytes: &[u8],
    fds: &[BorrowedFd<'_>],
) -> std::io::Result<usize> {
    loop {
        socket.writable().await?;
        match socket.try_io(Interest::WRITABLE, || send_with_fds(socket.as_fd(), bytes, fds)) {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            sent => return sent,
        }
    }
}

/// Writes a frame with no payload straight to the socket, `fds` attached to its first bytes.
async fn write_with_fds(
    socket: &mut UnixStream,
    out: &Outgoing,
    fds: &[BorrowedFd<'_>],
) -> std::io::Result<()> {
    let mut bytes = out.header.encode().to_vec();
    bytes.extend_from_slice(&out.meta);
    let sent = send_fds(socket, &bytes, fds).await?;
    socket.write_all(&bytes[sent..]).await
}

/// A hello that passed: its request id and the leases the client says it still holds.
struct Greeted {
    id: u64,
    leases: Vec<u64>,
    /// The ring capacity it asks for (0: none).
    ring: u64,
    /// Only looking (see `Hello::probe`).
    probe: bool,
}

/// Reads the hello within `--hello-timeout` and checks the token, reading no byte past the
/// hello (the connection may move to another thread after it). `None` if the connection must
/// be closed; a refusal has been sent then.
async fn greet(daemon: &Daemon, socket: &mut Socket, cut: &tokio::sync::Notify) -> Option<Greeted> {
    let refused = async |socket: &mut Socket, id: u64, f: Failure| {
        daemon.metrics.auth_failures.fetch_add(1, Ordering::Relaxed);
        let _ = write_raw(socket, &Outgoing::failure(id, &f)).await;
        None
    };
    let read = async {
        match socket {
            Socket::Tcp(s) => read_frame(s, HELLO_LIMITS).await,
            Socket::Unix(s) => read_frame(s, HELLO_LIMITS).await,
        }
    };
    let read = tokio::time::timeout(daemon.config.hello_timeout, read);
    let frame = tokio::select! {
        r = read => r,
        () = cut.notified() => {
            let why = "newer connections took the place of this one, which had not said hello";
            let _ = write_raw(socket, &Outgoing::failure(0, &Failure::Unavailable(why.into()))).await;
            return None;
        }
    };
    let frame = match frame {
        Ok(Ok(frame)) => frame,
        Ok(Err(ReadError::Proto(e))) => {
            return refused(socket, 0, Failure::Protocol(e.to_string())).await;
        }
        Ok(Err(ReadError::Closed)) | Err(_) => return None,
    };
    let id = frame.header.request_id;
    let hello = match Request::decode(frame.header.op, &frame.meta, 0) {
        Ok(Request::Hello(h)) => h,
        Ok(_) => {
            let f = Failure::Auth("the first frame must be a hello".into());
            return refused(socket, id, f).await;
        }
        Err(e) => return refused(socket, id, Failure::Protocol(e.to_string())).await,
    };
    if let Some(token) = &daemon.config.token
        && !token_matches(token, hello.token.as_deref())
    {
        return refused(socket, id, Failure::Auth("wrong or missing token".into())).await;
    }
    Some(Greeted { id, leases: hello.leases, ring: hello.ring, probe: hello.probe })
}

/// The answer to a hello that passed; `ring`: the capacity of the connection's rings (0: none).
fn hello_reply(daemon: &Daemon, id: u64, ring: u64) -> Outgoing {
    let reply = Reply::Hello(ServerHello {
        version: env!("CARGO_PKG_VERSION").into(),
        role: daemon.config.role,
        host: host_id().into(),
        shm_socket: daemon.config.shm_socket.as_ref().map(|p| p.display().to_string()),
        storage: daemon.config.storage.clone(),
        instance: daemon.instance,
        ring,
    });
    Outgoing::reply(id, &reply, ReplyBody::default())
}

/// Writes a frame with no payload and no descriptors straight to the socket.
async fn write_raw(socket: &mut Socket, out: &Outgoing) -> std::io::Result<()> {
    let mut bytes = out.header.encode().to_vec();
    bytes.extend_from_slice(&out.meta);
    match socket {
        Socket::Tcp(s) => s.write_all(&bytes).await,
        Socket::Unix(s) => s.write_all(&bytes).await,
    }
}

/// A connection's place among those that have not said hello yet (at most
/// `--max-unauthenticated`), freed however it ends. A new connection over the limit takes the
/// place of the one waiting longest, which is closed: a client says hello at once, so a socket
/// that has waited longest is the likeliest to be idle, and a flood of silent sockets cannot
/// keep a client out.
pub struct Ungreeted {
    daemon: Arc<Daemon>,
    seq: u64,
    /// Told when a newer connection takes this one's place.
    pub cut: Arc<tokio::sync::Notify>,
}

impl Ungreeted {
    pub fn enter(daemon: &Arc<Daemon>) -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let seq = NEXT.fetch_add(1, Ordering::Relaxed);
        let cut = Arc::new(tokio::sync::Notify::new());
        let mut waiting = daemon.unauthenticated.lock();
        if waiting.len() >= daemon.config.max_unauthenticated
            && let Some((_, oldest)) = waiting.pop_first()
        {
            oldest.notify_one();
            daemon.metrics.refused_connections.fetch_add(1, Ordering::Relaxed);
            tracing::debug!("closing the connection waiting longest for its hello");
        }
        waiting.insert(seq, Arc::clone(&cut));
        Self { daemon: Arc::clone(daemon), seq, cut }
    }
}

impl Drop for Ungreeted {
    fn drop(&mut self) {
        self.daemon.unauthenticated.lock().remove(&self.seq);
    }
}

/// Frees the connection's place under `--max-connections` when it ends, however it ends.
struct Counted(Arc<Daemon>, Arc<Activity>);

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.connections.fetch_sub(1, Ordering::AcqRel);
        self.0.active.lock().remove(&self.1.slot);
    }
}

/// Takes a place under `--max-connections` for a connection that said hello. With every place
/// taken, the connection idle longest is told to close, if it has been idle (no request read or
/// running) for `--evict-idle-after`: then the new one is served at once, and the count may run
/// over the limit for as long as the idle one takes to close. `None`: every place is busy.
fn admit(daemon: &Arc<Daemon>) -> Option<Counted> {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    let activity = Arc::new(Activity::new(NEXT.fetch_add(1, Ordering::Relaxed), daemon.uptime()));
    let mut active = daemon.active.lock();
    if daemon.connections.fetch_add(1, Ordering::AcqRel) >= daemon.config.max_connections {
        let now = daemon.uptime();
        let min_idle = daemon.config.evict_idle_after.as_nanos() as u64;
        let victim = active
            .values()
            .filter(|a| !a.evicted.load(Ordering::Relaxed) && a.busy.load(Ordering::Acquire) == 0)
            .map(|a| (now.saturating_sub(a.last.load(Ordering::Acquire)), a))
            .filter(|(idle, _)| *idle >= min_idle)
            .max_by_key(|(idle, _)| *idle)
            .map(|(_, a)| Arc::clone(a));
        let Some(victim) = victim else {
            daemon.connections.fetch_sub(1, Ordering::AcqRel);
            return None;
        };
        victim.evicted.store(true, Ordering::Release);
        victim.evict.notify_one();
        daemon.metrics.evicted_connections.fetch_add(1, Ordering::Relaxed);
        tracing::info!(
            slot = victim.slot,
            "closing the connection idle longest to serve a new one"
        );
    }
    active.insert(activity.slot, Arc::clone(&activity));
    Some(Counted(Arc::clone(daemon), activity))
}

/// What is known of a served connection's use, to pick one to close when all places are taken.
pub struct Activity {
    slot: u64,
    /// When it last read a request or finished one (nanoseconds of the daemon's uptime).
    pub(super) last: AtomicU64,
    /// Requests running (a claim waiting for rows included).
    pub(super) busy: AtomicUsize,
    /// Claims waiting for rows as tasks of the connection's runtime.
    pub(super) waiting: AtomicUsize,
    evicted: AtomicBool,
    evict: tokio::sync::Notify,
}

impl Activity {
    fn new(slot: u64, now: u64) -> Self {
        Self {
            slot,
            last: AtomicU64::new(now),
            busy: AtomicUsize::new(0),
            waiting: AtomicUsize::new(0),
            evicted: AtomicBool::new(false),
            evict: tokio::sync::Notify::new(),
        }
    }
}

/// Requests one connection may have running at once; its reading pauses beyond that.
const MAX_IN_FLIGHT: usize = 4096;

/// Serves one connection until the client leaves, breaks the protocol, or the daemon stops. It
/// says hello here, on the runtime that accepted it, holding only a place among those that have
/// not said hello yet (`unauthenticated`); then takes a place under `--max-connections` and is
/// served: a local client's on a thread of its own (see the module documentation), any other
/// here. However it ends, the places it took are freed.
pub async fn serve(
    daemon: Arc<Daemon>,
    mut socket: Socket,
    peer: String,
    stopping: watch::Receiver<bool>,
    unauthenticated: Ungreeted,
) {
    let Some(greeted) = greet(&daemon, &mut socket, &unauthenticated.cut).await else { return };
    if greeted.probe {
        // Answered and closed: a client that goes on to the Unix socket takes one place, there.
        let _ = write_raw(&mut socket, &hello_reply(&daemon, greeted.id, 0)).await;
        return;
    }
    drop(unauthenticated);
    let Some(counted) = admit(&daemon) else {
        daemon.metrics.refused_connections.fetch_add(1, Ordering::Relaxed);
        let max = daemon.config.max_connections;
        tracing::warn!(peer = %peer, max, "refusing a connection: too many, none idle");
        let why = format!("the daemon serves at most {max} connections");
        let _ = write_raw(&mut socket, &Outgoing::failure(greeted.id, &Failure::Unavailable(why)))
            .await;
        return;
    };
    // A client on the Unix socket that asks for rings gets them, unless they cannot be made:
    // then it stays on the socket, as the answer says.
    let rings = match &socket {
        Socket::Unix(_) if greeted.ring > 0 => ring::create(greeted.ring)
            .inspect_err(|e| tracing::warn!(peer = %peer, error = %e, "cannot make rings"))
            .ok(),
        _ => None,
    };
    let capacity = rings.as_ref().map_or(0, |r| r.replies.capacity() as u64);
    let hello = hello_reply(&daemon, greeted.id, capacity);
    let sent = match (&mut socket, &rings) {
        (Socket::Unix(s), Some(r)) => write_with_fds(s, &hello, &r.descriptors()).await,
        _ => write_raw(&mut socket, &hello).await,
    };
    if sent.is_err() {
        return;
    }
    let leases = greeted.leases;
    if !socket.is_local() {
        return serve_here(daemon, counted, socket, peer, stopping, false, (leases, None)).await;
    }
    let moved = match StdSocket::of(socket) {
        Ok(moved) => moved,
        Err(e) => {
            // The socket is gone with its registration; the client sees its connection close.
            tracing::warn!(peer = %peer, error = %e, "cannot hand a connection to its own thread");
            return;
        }
    };
    let (done, finished) = tokio::sync::oneshot::channel::<()>();
    let (p, s) = (peer.clone(), stopping.clone());
    let spawned = std::thread::Builder::new().name("asyncflow-local".into()).spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build();
        let served = runtime.map(|rt| {
            rt.block_on(async move {
                match moved.into_socket() {
                    Ok(socket) => {
                        serve_here(daemon, counted, socket, p, s, true, (leases, rings)).await;
                    }
                    Err(e) => tracing::warn!(peer = %p, error = %e, "cannot serve a connection"),
                }
            });
        });
        if let Err(e) = served {
            tracing::warn!(error = %e, "cannot start a connection's event loop");
        }
        drop(done);
    });
    if let Err(e) = spawned {
        tracing::warn!(peer = %peer, error = %e, "cannot start a connection's thread");
        return;
    }
    let _ = finished.await;
}

/// The connection's reading half, its rings' reading end if it has rings, and its writer;
/// `None` if its rings cannot be served (logged).
fn split(
    socket: Socket,
    rings: Option<DaemonEnds>,
    peer: &str,
) -> Option<(Half, Option<RingIn>, FrameWriter)> {
    Some(match (socket, rings) {
        (Socket::Tcp(s), _) => {
            let _ = s.set_nodelay(true);
            let (r, w) = s.into_split();
            (Half::Tcp(r), None, FrameWriter::Tcp(BufWriter::with_capacity(BUFFER, w)))
        }
        (Socket::Unix(s), None) => {
            let (r, w) = s.into_split();
            (Half::Unix(r), None, FrameWriter::Unix(BufWriter::with_capacity(BUFFER, w)))
        }
        (Socket::Unix(s), Some(rings)) => {
            let (r, w) = s.into_split();
            let (input, output) = ring::ends(rings, w)
                .inspect_err(|e| tracing::warn!(peer, error = %e, "cannot serve rings"))
                .ok()?;
            (Half::Unix(r), Some(input), FrameWriter::Ring(output))
        }
    })
}

/// Waits while the connection has too many replies queued (see [`Replies::backed_up`]); false if
/// it is to close instead (the daemon stops, or the client is gone).
async fn replies_read(tx: &Replies, daemon: &Daemon, stopping: &mut watch::Receiver<bool>) -> bool {
    while tx.backed_up() {
        if *stopping.borrow() || tx.counts.gone.load(Ordering::Acquire) {
            return false;
        }
        tokio::select! {
            () = tx.counts.drained.notified() => {}
            () = daemon.transit.wait_freed() => {}
            _ = stopping.changed() => {}
        }
    }
    true
}

/// Answers a request refused as it was read (see [`Received`]); false if the connection broke.
async fn refuse(daemon: &Daemon, w: &mut FrameWriter, header: &FrameHeader, why: &Failure) -> bool {
    daemon.metrics.request_errors.fetch_add(1, Ordering::Relaxed);
    // Its bytes were read (and dropped) all the same.
    let bytes = (HEADER_LEN + header.body_len()) as u64;
    daemon.metrics.bytes_in.fetch_add(bytes, Ordering::Relaxed);
    if header.op.is_notice() {
        return true; // a notice gets no reply, a refusal neither
    }
    let refusal = Outgoing::failure(header.request_id, why);
    write_out(daemon, w, &refusal, true).await.is_ok()
}

async fn serve_here(
    daemon: Arc<Daemon>,
    counted: Counted,
    socket: Socket,
    peer: String,
    mut stopping: watch::Receiver<bool>,
    local: bool,
    (leases, rings): (Vec<u64>, Option<DaemonEnds>),
) {
    let shm = matches!(socket, Socket::Unix(_)).then(|| daemon.pool.clone()).flatten();
    let Some((half, ring, writer)) = split(socket, rings, &peer) else { return };
    let queued = Arc::new(AtomicUsize::new(0));
    let activity = Arc::clone(&counted.1);
    let incoming = Incoming::new(half, ring, local, Arc::clone(&queued), Arc::clone(&activity));
    let mut reader = BufReader::with_capacity(BUFFER, incoming);
    let (tx, rx) = mpsc::unbounded_channel();
    let counts = Arc::new(ReplyCounts {
        queued,
        bytes: AtomicU64::new(0),
        drained: tokio::sync::Notify::new(),
        gone: AtomicBool::new(false),
    });
    let tx = Replies { tx, counts: Arc::clone(&counts), transit: Arc::clone(&daemon.transit) };
    let writer = Arc::new(Mutex::new(writer));
    let writer_task =
        tokio::spawn(write_loop(Arc::clone(&daemon), Arc::clone(&writer), rx, counts));
    {
        let session = Arc::new(Session::new(peer.clone(), shm.map(ShmSession::new)));
        let kept = daemon.holders.attach(session.id, &leases);
        tracing::info!(peer = %peer, transport = session.transport(), leases_kept = kept, "client connected");
        let mut tasks = JoinSet::new();
        let mut in_flight = 0u64;
        loop {
            // Replies the client has not read stay in memory: past the connection's share (or
            // the daemon's), stop reading until it reads them.
            if !replies_read(&tx, &daemon, &mut stopping).await {
                break;
            }
            // Bytes of requests still running stay in memory: past the connection's share,
            // stop reading until some finish (the client's writes then wait in its socket).
            while let Some(done) = tasks.try_join_next() {
                in_flight -= done.unwrap_or(0);
            }
            while in_flight > daemon.config.max_connection_bytes || tasks.len() >= MAX_IN_FLIGHT {
                match tasks.join_next().await {
                    Some(done) => in_flight -= done.unwrap_or(0),
                    None => break,
                }
            }
            let frame = tokio::select! {
                f = read_request(&mut reader, &daemon) => f,
                _ = stopping.wait_for(|s| *s) => break,
                () = activity.evict.notified() => {
                    tracing::info!(peer = %peer, "closing an idle connection to serve a new one");
                    break;
                }
            };
            match frame {
                Ok(Received::Refused(header, failure)) => {
                    activity.last.store(daemon.uptime(), Ordering::Release);
                    if !refuse(&daemon, &mut *writer.lock().await, &header, &failure).await {
                        break;
                    }
                }
                Ok(Received::Frame(frame)) => {
                    activity.last.store(daemon.uptime(), Ordering::Release);
                    daemon.metrics.bytes_in.fetch_add(
                        (HEADER_LEN + frame.header.body_len()) as u64,
                        Ordering::Relaxed,
                    );
                    if let Some(out) = dispatch(
                        &daemon,
                        &session,
                        &tx,
                        &mut tasks,
                        &mut in_flight,
                        &activity,
                        frame,
                    ) {
                        let mut w = writer.lock().await;
                        if write_out(&daemon, &mut w, &out, true).await.is_err() {
                            break;
                        }
                    }
                }
                Err(ReadError::Closed) => break,
                Err(ReadError::Proto(e)) => {
                    daemon.metrics.protocol_errors.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(peer = %peer, error = %e, "closing a connection that broke the protocol");
                    tx.send(Outgoing::failure(0, &Failure::Protocol(e.to_string())));
                    break;
                }
            }
        }
        // Requests still waiting (claims, puts short of memory) stop waiting; the rest finish.
        session.closed.store(true, Ordering::Relaxed);
        daemon.claims.wake_all();
        while tasks.join_next().await.is_some() {}
        daemon.roles.forget_session(&session);
        // A connection closed for being idle keeps its leases until they run out: its client
        // may be busy with their rows, and names them when it connects again.
        if !activity.evicted.load(Ordering::Acquire) {
            daemon.holders.closed(session.id, Instant::now());
        }
        tracing::info!(peer = %peer, "client disconnected");
    }
    drop(tx);
    let _ = writer_task.await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn us(n: u64) -> Duration {
        Duration::from_micros(n)
    }

    #[test]
    fn a_read_spins_as_long_as_its_client_takes_to_send_and_not_for_a_client_that_sends_now_and_then()
     {
        // A client sending one request after another: twice its gap, never more than SPIN.
        assert_eq!(next_spin(SPIN, us(10)), SPIN * 3 / 4);
        assert_eq!(next_spin(us(20), us(10)), us(20));
        assert_eq!(next_spin(us(20), us(200)), SPIN);
        // Gaps that alternate short and long keep a spin long enough for the long ones.
        let mut spin = us(20);
        for took in [us(5), us(40)].repeat(10) {
            spin = next_spin(spin, took);
        }
        assert!(spin >= us(60), "{spin:?}");
        // A client that took longer than SPIN: half the spin, then less and less.
        assert_eq!(next_spin(us(80), SPIN), us(40));
        let mut spin = SPIN;
        for _ in 0..12 {
            spin = next_spin(spin, 10 * SPIN);
        }
        assert!(spin < us(1), "{spin:?}");
        assert_eq!(next_spin(Duration::ZERO, us(30)), us(60));
        // A client that works a while, then sends a burst: the spin after the long gap still
        // catches the burst's next request.
        let mut spin = Duration::ZERO;
        for took in [us(400), us(8), us(8)].repeat(10) {
            spin = next_spin(spin, took);
        }
        assert!(next_spin(spin, us(400)) >= us(8), "{spin:?}");
    }
}
