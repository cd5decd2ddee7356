//! One connection to a daemon, shared by every thread of a client process. Requests carry ids
//! and a reader thread hands each reply to whoever waits for it, so a claim waiting a minute
//! does not hold up an ack sent meanwhile. Plain threads, no async runtime: nothing here has to
//! survive a fork, and a forked child that touches the connection is told to connect again.
//!
//! On the daemon's machine the connection moves to the daemon's Unix socket, where shared-memory
//! segments arrive as descriptors and are mapped once.

use std::collections::HashMap;
use std::io::{BufWriter, Read, Write};
use std::net::{Shutdown, TcpStream, ToSocketAddrs};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender};
use std::sync::{Arc, Weak};
use std::time::Duration;

use asyncflow_core::wait::INTERRUPT_POLL;
use asyncflow_core::{StoreError, Wait};
use asyncflow_proto::{
    FrameHeader, HEADER_LEN, Hello, Limits, Reply, Request, Segments, ServerHello, decode_answer,
};
use asyncflow_shm::{Segment, recv_with_fds};
use parking_lot::Mutex;

use crate::error::{Error, Result};
use crate::host::host_id;

/// Which data path to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Preference {
    /// Shared memory when the daemon is on this machine and its socket is reachable, else TCP.
    Auto,
    Tcp,
    /// Shared memory or an error.
    Shm,
}

const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
static PADDING: [u8; 64] = [0; 64];

enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Stream {
    fn try_clone(&self) -> std::io::Result<Stream> {
        Ok(match self {
            Stream::Tcp(s) => Stream::Tcp(s.try_clone()?),
            Stream::Unix(s) => Stream::Unix(s.try_clone()?),
        })
    }

    fn shutdown(&self) {
        let _ = match self {
            Stream::Tcp(s) => s.shutdown(Shutdown::Both),
            Stream::Unix(s) => s.shutdown(Shutdown::Both),
        };
    }

    /// Reads exactly `buf.len()` bytes, collecting any descriptors that come with them.
    fn read_exact_with_fds(
        &mut self,
        buf: &mut [u8],
        fds: &mut Vec<OwnedFd>,
    ) -> std::io::Result<()> {
        let Stream::Unix(s) = self else {
            return self.read_exact(buf);
        };
        let mut at = 0;
        while at < buf.len() {
            match recv_with_fds(s.as_fd(), &mut buf[at..], fds) {
                Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => at += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.read(buf),
            Stream::Unix(s) => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.write(buf),
            Stream::Unix(s) => s.write(buf),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            Stream::Tcp(s) => s.flush(),
            Stream::Unix(s) => s.flush(),
        }
    }
}

/// A reply with the payload section of its frame.
pub struct Answer {
    pub reply: Reply,
    pub payload: Vec<u8>,
}

type Delivery = Result<Answer>;

struct Inner {
    writer: Mutex<BufWriter<Stream>>,
    pending: Mutex<HashMap<u64, SyncSender<Delivery>>>,
    next_id: AtomicU64,
    broken: Mutex<Option<String>>,
    /// Read pins whose views are gone, to be sent before the next request.
    unpins: Mutex<Vec<u64>>,
    segments: Mutex<HashMap<u64, Arc<Segment>>>,
    pid: u32,
    shm: bool,
    hello: ServerHello,
    address: String,
}

pub struct Connection {
    inner: Arc<Inner>,
    stream: Stream,
}

/// A request sent and not yet answered.
pub struct Pending<'c> {
    conn: &'c Connection,
    id: u64,
    rx: Receiver<Delivery>,
}

fn write_frame(
    w: &mut impl Write,
    id: u64,
    req: &Request,
    payload: &[&[u8]],
) -> std::io::Result<()> {
    let meta = req.encode();
    let payload_len: usize = payload.iter().map(|p| p.len()).sum();
    w.write_all(&FrameHeader::new(req.op(), id, meta.len(), payload_len).encode())?;
    w.write_all(&meta)?;
    for part in payload {
        w.write_all(part)?;
    }
    Ok(())
}

struct RawFrame {
    header: FrameHeader,
    meta: Vec<u8>,
    payload: Vec<u8>,
    fds: Vec<OwnedFd>,
}

fn read_frame(stream: &mut Stream, limits: Limits) -> Result<RawFrame> {
    let mut head = [0u8; HEADER_LEN];
    let mut fds = Vec::new();
    stream.read_exact_with_fds(&mut head, &mut fds)?;
    let header = FrameHeader::decode(&head, limits)?;
    let mut meta = vec![0u8; header.meta_len as usize];
    stream.read_exact(&mut meta)?;
    let mut payload = vec![0u8; header.payload_len as usize];
    stream.read_exact(&mut payload)?;
    Ok(RawFrame { header, meta, payload, fds })
}

/// Says hello and returns the daemon's answer; a refused token is [`Error::Auth`].
fn greet(stream: &mut Stream, token: Option<&str>) -> Result<ServerHello> {
    let hello = Request::Hello(Hello { token: token.map(str::to_owned), host: host_id().into() });
    write_frame(stream, 0, &hello, &[])?;
    let frame = read_frame(stream, Limits::DEFAULT)?;
    match decode_answer(frame.header.op, &frame.meta, frame.payload.len() as u64)? {
        Ok(Reply::Hello(h)) => Ok(h),
        Ok(other) => Err(Error::connection(format!("unexpected answer to hello: {other:?}"))),
        Err(failure) => Err(failure.into()),
    }
}

fn connect_tcp(address: &str) -> Result<TcpStream> {
    let mut last = None;
    for addr in
        address.to_socket_addrs().map_err(|e| Error::connection(format!("{address}: {e}")))?
    {
        match TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT) {
            Ok(s) => {
                s.set_nodelay(true)?;
                return Ok(s);
            }
            Err(e) => last = Some(e),
        }
    }
    Err(Error::connection(format!(
        "cannot reach the store daemon at {address}: {}",
        last.map_or_else(|| "no address".to_owned(), |e| e.to_string())
    )))
}

impl Inner {
    fn fail_all(&self, why: &str) {
        *self.broken.lock() = Some(why.to_owned());
        for (_, tx) in self.pending.lock().drain() {
            let _ = tx.try_send(Err(Error::connection(why.to_owned())));
        }
    }

    fn map_segments(&self, segments: &Segments, fds: Vec<OwnedFd>) -> Result<()> {
        if fds.len() != segments.new.len() {
            return Err(Error::connection(format!(
                "{} segments announced but {} descriptors received",
                segments.new.len(),
                fds.len()
            )));
        }
        let mut map = self.segments.lock();
        for (&(id, len), fd) in segments.new.iter().zip(fds) {
            map.insert(id, Arc::new(Segment::open(id, fd, len as usize)?));
        }
        for id in &segments.retired {
            map.remove(id);
        }
        Ok(())
    }

    fn deliver(&self, frame: RawFrame) -> Result<()> {
        let RawFrame { header, meta, payload, fds } = frame;
        let answer = decode_answer(header.op, &meta, payload.len() as u64)?;
        let delivery = match answer {
            Ok(reply) => {
                let segments = match &reply {
                    Reply::Cells { segments, .. } | Reply::Staged { segments, .. } => {
                        Some(segments)
                    }
                    _ => None,
                };
                match segments.map(|s| self.map_segments(s, fds)).transpose() {
                    Ok(_) => Ok(Answer { reply, payload }),
                    Err(e) => Err(e),
                }
            }
            Err(failure) => Err(failure.into()),
        };
        let waiter = self.pending.lock().remove(&header.request_id);
        match waiter {
            Some(tx) => {
                let _ = tx.try_send(delivery);
            }
            None => {
                // Nobody waits any more (interrupted): let go of what the reply pinned.
                if let Ok(Answer { reply: Reply::Cells { pin: Some(pin), .. }, .. }) = delivery {
                    self.unpins.lock().push(pin);
                }
            }
        }
        Ok(())
    }

    fn read_loop(self: Arc<Self>, mut stream: Stream) {
        let why = loop {
            let frame = match read_frame(&mut stream, Limits::DEFAULT) {
                Ok(f) => f,
                Err(e) => break format!("connection to {} lost: {e}", self.address),
            };
            if let Err(e) = self.deliver(frame) {
                break format!("bad reply from {}: {e}", self.address);
            }
        };
        self.fail_all(&why);
    }

    fn check_usable(&self) -> Result<()> {
        if std::process::id() != self.pid {
            return Err(Error::connection(
                "this connection was opened before a fork; call asyncflow.connect again in the child",
            ));
        }
        match &*self.broken.lock() {
            Some(why) => Err(Error::connection(why.clone())),
            None => Ok(()),
        }
    }

    /// Writes one frame, preceded by any pending unpins.
    fn send(&self, id: u64, req: &Request, payload: &[&[u8]]) -> Result<()> {
        let mut w = self.writer.lock();
        let pins = std::mem::take(&mut *self.unpins.lock());
        if !pins.is_empty() {
            write_frame(&mut *w, 0, &Request::Unpin { pins }, &[])?;
        }
        write_frame(&mut *w, id, req, payload)?;
        w.flush()?;
        Ok(())
    }

    /// Lets the daemon reuse the memory of a read whose views are all gone.
    fn unpin(&self, pin: u64) {
        if std::process::id() != self.pid {
            return;
        }
        self.unpins.lock().push(pin);
        let mut w = self.writer.lock();
        let pins = std::mem::take(&mut *self.unpins.lock());
        if !pins.is_empty() {
            let sent =
                write_frame(&mut *w, 0, &Request::Unpin { pins }, &[]).and_then(|()| w.flush());
            if sent.is_err() {
                *self.broken.lock() = Some("connection lost while releasing a read".into());
            }
        }
    }
}

/// Keeps a read's shared cells pinned on the daemon until the last view of them is dropped.
pub struct PinToken {
    inner: Weak<Inner>,
    pin: u64,
}

impl Drop for PinToken {
    fn drop(&mut self) {
        if let Some(inner) = self.inner.upgrade() {
            inner.unpin(self.pin);
        }
    }
}

impl Connection {
    /// Connects to `address` (HOST:PORT), authenticates with `token`, and moves to the shared
    /// memory path if `prefer` allows and the daemon is on this machine.
    pub fn open(address: &str, token: Option<&str>, prefer: Preference) -> Result<Self> {
        let mut stream = Stream::Tcp(connect_tcp(address)?);
        let mut hello = greet(&mut stream, token)?;
        let same_host = hello.host == host_id() && !hello.host.is_empty();
        let mut shm = false;
        if prefer != Preference::Tcp {
            let unix = match (&hello.shm_socket, same_host) {
                (Some(path), true) => UnixStream::connect(path)
                    .map_err(|e| Error::connection(format!("shared-memory socket {path}: {e}"))),
                (None, _) => Err(Error::connection("the daemon offers no shared-memory path")),
                (_, false) => Err(Error::connection("the daemon is on another machine")),
            };
            match unix {
                Ok(u) => {
                    let mut local = Stream::Unix(u);
                    hello = greet(&mut local, token)?;
                    stream.shutdown();
                    stream = local;
                    shm = true;
                }
                Err(e) if prefer == Preference::Shm => return Err(e),
                Err(_) => {}
            }
        }
        let reader = stream.try_clone()?;
        let writer = BufWriter::with_capacity(256 << 10, stream.try_clone()?);
        let inner = Arc::new(Inner {
            writer: Mutex::new(writer),
            pending: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            broken: Mutex::new(None),
            unpins: Mutex::new(Vec::new()),
            segments: Mutex::new(HashMap::new()),
            pid: std::process::id(),
            shm,
            hello,
            address: address.to_owned(),
        });
        let for_reader = Arc::clone(&inner);
        std::thread::Builder::new()
            .name("asyncflow-client".into())
            .spawn(move || for_reader.read_loop(reader))
            .map_err(|e| Error::connection(format!("cannot start the reader thread: {e}")))?;
        Ok(Self { inner, stream })
    }

    pub fn hello(&self) -> &ServerHello {
        &self.inner.hello
    }

    pub fn is_shm(&self) -> bool {
        self.inner.shm
    }

    pub fn address(&self) -> &str {
        &self.inner.address
    }

    /// A segment this connection has mapped.
    pub fn segment(&self, id: u64) -> Result<Arc<Segment>> {
        self.inner.segments.lock().get(&id).cloned().ok_or_else(|| {
            Error::connection(format!("the daemon named segment {id}, which was never sent"))
        })
    }

    /// A token whose drop releases read pin `pin`.
    pub fn pin_token(&self, pin: u64) -> PinToken {
        PinToken { inner: Arc::downgrade(&self.inner), pin }
    }

    /// Sends a request whose payload section is `payload` (written in order).
    pub fn send(&self, req: &Request, payload: &[&[u8]]) -> Result<Pending<'_>> {
        self.inner.check_usable()?;
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::sync_channel(1);
        self.inner.pending.lock().insert(id, tx);
        if let Err(e) = self.inner.send(id, req, payload) {
            self.inner.pending.lock().remove(&id);
            return Err(e);
        }
        Ok(Pending { conn: self, id, rx })
    }

    pub fn call(&self, req: &Request, payload: &[&[u8]], wait: Wait<'_>) -> Result<Answer> {
        self.send(req, payload)?.wait(wait)
    }

    /// Sends a request that gets no reply.
    pub fn notify(&self, req: &Request) -> Result<()> {
        debug_assert!(req.op().is_notice());
        self.inner.check_usable()?;
        self.inner.send(0, req, &[])
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        // Wakes the reader thread, which fails whatever still waits and exits. A forked child
        // must not: shutting the shared socket down would cut off its parent.
        if std::process::id() == self.inner.pid {
            self.stream.shutdown();
        }
    }
}

impl Pending<'_> {
    /// Waits for the answer; if the caller interrupts, tells the daemon to stop working on it.
    pub fn wait(self, wait: Wait<'_>) -> Result<Answer> {
        loop {
            match self.rx.recv_timeout(INTERRUPT_POLL) {
                Ok(delivery) => return delivery,
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(Error::connection("connection closed"));
                }
                Err(RecvTimeoutError::Timeout) => {
                    if (wait.interrupted)() {
                        self.conn.inner.pending.lock().remove(&self.id);
                        let _ = self.conn.notify(&Request::Cancel { request: self.id });
                        return Err(Error::Store(StoreError::Interrupted));
                    }
                }
            }
        }
    }
}

/// Zero bytes to pad a payload part up to the next cell boundary.
pub fn padding(len: usize) -> &'static [u8] {
    &PADDING[..len]
}
