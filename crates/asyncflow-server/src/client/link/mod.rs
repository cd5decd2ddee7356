//! One socket to a daemon, shared by every thread of a client process. Requests carry ids and
//! each reply goes to whoever waits for it, so a claim waiting a minute does not hold up an ack
//! sent meanwhile. Plain threads, no async runtime: nothing here has to survive a fork, and a
//! forked child that touches the link is told to connect again.
//!
//! A caller waiting for a reply reads the socket itself, for a short while, when nobody else is
//! reading it: most replies come within tens of microseconds, sooner than a sleeping thread can
//! be woken to pass one on. A caller whose reply takes longer goes to sleep, and the link's
//! watcher thread reads for it. The watcher also notices at once when the daemon hangs up, even
//! while nobody waits, so the next request connects again instead of failing.
//!
//! Nothing here waits without a bound. Connecting, the hello and every write give up after the
//! policy's request timeout; while requests are outstanding and the daemon sends nothing, the
//! reader pings it, and a daemon that answers nothing for a whole request timeout (stopped,
//! frozen, or cut off) fails every outstanding request with an error that says so.
//!
//! On the daemon's machine the link moves to the daemon's Unix socket, where shared-memory
//! segments arrive as descriptors and are mapped once.

mod frames;
mod handshake;
mod segments;
mod stream;
mod waiter;

use std::collections::HashMap;
use std::io::{BufWriter, Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering, fence};
use std::sync::mpsc::{self, SyncSender};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use asyncflow_core::{StoreError, Wait};
use asyncflow_proto::{Limits, Reply, Request, Segments, ServerHello, Spare, decode_answer};
use asyncflow_shm::ring::{ANY, waiting_for};
use asyncflow_shm::{ClientEnds, Segment, Watcher};
use parking_lot::Mutex;
use rustix::event::{PollFd, PollFlags, poll};

use self::frames::{RawFrame, Started, read_rest_of_frame, write_frame};
use self::handshake::{Ask, greet};
use self::segments::mapped;
use self::stream::{Stream, connect_tcp, timespec};
pub use self::waiter::{Pending, PinToken};
use super::Policy;
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
    /// Shared memory for payloads, with requests and replies on the Unix socket instead of in
    /// rings (the path before rings, kept to compare against), or an error.
    ShmSocket,
}

/// The capacity of each ring a link asks for: a request or reply larger than this streams
/// through it in pieces.
const RING: u64 = 1 << 20;

static PADDING: [u8; 64] = [0; 64];

/// A reply with the payload section of its frame, and the link it came on (shared-memory
/// segments and read pins belong to that link).
pub struct Answer {
    pub reply: Reply,
    pub payload: Vec<u8>,
    pub link: Arc<Link>,
}

type Delivery = Result<(Reply, Vec<u8>)>;

/// A request waiting for its reply: where the reply goes, and whether its caller sleeps until
/// it comes (the watcher then reads for it).
struct Waiting {
    reply: SyncSender<Delivery>,
    asleep: bool,
}

/// The reading end of the socket; whoever holds it reads whole frames.
struct Reader {
    stream: Stream,
    last_heard: Instant,
}

/// One socket to a daemon (see the module documentation).
pub struct Link {
    writer: Mutex<BufWriter<Stream>>,
    /// Kept to wake the watcher thread when the link is dropped.
    stream: Stream,
    reader: Mutex<Reader>,
    /// A byte written here wakes the watcher to look again at who sleeps.
    wake_watcher: UnixStream,
    /// Requests not answered yet; while the caller of one sleeps, the watcher reads.
    pending: Mutex<HashMap<u64, Waiting>>,
    next_id: AtomicU64,
    broken: Mutex<Option<String>>,
    /// Read pins whose views are gone, to be sent before the next request.
    unpins: Mutex<Vec<u64>>,
    segments: Mutex<HashMap<u64, Arc<Segment>>>,
    /// The region the daemon set aside for this link's next put (see `Reply::WithSpare`).
    spare: Mutex<Option<Spare>>,
    pid: u32,
    shm: bool,
    /// On rings (see `Stream::rings`), the watcher thread's look at the replies' ring, for a
    /// caller about to sleep to ask for its bell (which the watcher always listens to) in place
    /// of waking the watcher to ask.
    replies_bell: Option<Arc<Watcher>>,
    hello: ServerHello,
    address: String,
    policy: Policy,
}

fn timed_out(what: &str, address: &str, after: Duration) -> Error {
    Error::Store(StoreError::Timeout {
        what: format!("the store daemon at {address} to answer {what}"),
        waited: after,
    })
}

impl Link {
    /// Connects to `address` (HOST:PORT), authenticates with `token`, and moves to the shared
    /// memory path if `prefer` allows and the daemon is on this machine.
    pub fn open(
        address: &str,
        token: Option<&str>,
        prefer: Preference,
        policy: Policy,
    ) -> Result<Arc<Self>> {
        Self::open_holding(address, token, prefer, policy, &[])
    }

    /// Says hello on the Unix socket of the daemon that answered `found` over TCP, asking for
    /// rings unless `prefer` is `ShmSocket`: the socket, the daemon's answer there and the ends
    /// of the rings it set up.
    fn move_local(
        address: &str,
        token: Option<&str>,
        prefer: Preference,
        policy: &Policy,
        leases: &[u64],
        found: &ServerHello,
    ) -> Result<(Stream, ServerHello, Option<ClientEnds>)> {
        let same_host = found.host == host_id() && !found.host.is_empty();
        let unix = match (&found.shm_socket, same_host) {
            (Some(path), true) => UnixStream::connect(path)
                .map_err(|e| Error::connection(format!("shared-memory socket {path}: {e}")))?,
            (None, _) => return Err(Error::connection("the daemon offers no shared-memory path")),
            (_, false) => return Err(Error::connection("the daemon is on another machine")),
        };
        let mut local = Stream::Unix(unix);
        let ring = if prefer == Preference::ShmSocket { 0 } else { RING };
        let (local_hello, fds) =
            greet(&mut local, token, Ask::Serve { leases, ring }, address, policy)?;
        // The socket must be served by the daemon that answered over TCP: a path another
        // daemon serves would send this client's data there.
        if local_hello.instance != found.instance {
            let e = Error::connection(format!(
                "the shared-memory socket {} is served by another daemon than the one at \
                 {address} (instance {:#x}, not {:#x})",
                found.shm_socket.as_deref().unwrap_or_default(),
                local_hello.instance,
                found.instance
            ));
            tracing::warn!(error = %e, "not using the shared-memory path");
            return Err(e);
        }
        // Rings the daemon set up must be used: it reads requests from them only.
        let ends = match local_hello.ring {
            0 => None,
            cap => Some(ClientEnds::open(cap as usize, fds).map_err(|e| {
                Error::connection(format!("the daemon's shared-memory rings: {e}"))
            })?),
        };
        Ok((local, local_hello, ends))
    }

    /// [`Link::open`] for a client that still holds `leases` from a link that broke: the daemon
    /// keeps them for this link (see `--reconnect-grace`).
    pub fn open_holding(
        address: &str,
        token: Option<&str>,
        prefer: Preference,
        policy: Policy,
        leases: &[u64],
    ) -> Result<Arc<Self>> {
        let serve = Ask::Serve { leases, ring: 0 };
        // A client that may move to the Unix socket only looks over TCP first, so that a daemon
        // at `--max-connections` does not count it twice (or close an idle client for it).
        let first = if prefer == Preference::Tcp { serve } else { Ask::Probe };
        let mut stream = Stream::Tcp(connect_tcp(address, policy.request_timeout)?);
        let (mut hello, _) = greet(&mut stream, token, first, address, &policy)?;
        let mut shm = false;
        let mut rings = None;
        if prefer != Preference::Tcp {
            match Self::move_local(address, token, prefer, &policy, leases, &hello) {
                Ok((local, local_hello, ends)) => {
                    hello = local_hello;
                    stream.shutdown();
                    stream = local;
                    shm = true;
                    rings = ends;
                }
                Err(e) if prefer != Preference::Auto => return Err(e),
                Err(_) => {
                    // The daemon closes a probe: stay on TCP over a connection of its own.
                    stream = Stream::Tcp(connect_tcp(address, policy.request_timeout)?);
                    (hello, _) = greet(&mut stream, token, serve, address, &policy)?;
                }
            }
        }
        // Reads wake up every ping interval to check on the daemon; writes give up after a
        // whole request timeout (a daemon that stopped reading has stopped serving).
        let timeouts = (Some(policy.ping_interval()), Some(policy.request_timeout));
        stream.set_timeouts(timeouts.0, timeouts.1)?;
        let (read, written, replies_bell) = match (rings, &stream) {
            (Some(ends), Stream::Unix(socket)) => {
                let replies_bell = Arc::new(ends.replies.watcher()?);
                let (mut read, mut written) = Stream::rings(ends, socket)?;
                read.set_timeouts(timeouts.0, None)?;
                written.set_timeouts(None, timeouts.1)?;
                (read, written, Some(replies_bell))
            }
            _ => (stream.try_clone()?, stream.try_clone()?, None),
        };
        let reader = Reader { stream: read, last_heard: Instant::now() };
        let watched = stream.as_fd().try_clone_to_owned()?;
        let writer = BufWriter::with_capacity(256 << 10, written);
        let (wake_watcher, woken) = UnixStream::pair()?;
        wake_watcher.set_nonblocking(true)?;
        woken.set_nonblocking(true)?;
        let watched_ring = replies_bell.clone();
        let link = Arc::new(Self {
            writer: Mutex::new(writer),
            stream,
            reader: Mutex::new(reader),
            wake_watcher,
            pending: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            broken: Mutex::new(None),
            unpins: Mutex::new(Vec::new()),
            segments: Mutex::new(HashMap::new()),
            spare: Mutex::new(None),
            pid: super::process_id(),
            shm,
            replies_bell,
            hello,
            address: address.to_owned(),
            policy,
        });
        let for_watcher = Arc::downgrade(&link);
        std::thread::Builder::new()
            .name("asyncflow-client".into())
            .spawn(move || watch(&for_watcher, &watched, woken, watched_ring.as_deref()))
            .map_err(|e| Error::connection(format!("cannot start the watcher thread: {e}")))?;
        Ok(link)
    }

    pub fn hello(&self) -> &ServerHello {
        &self.hello
    }

    pub fn is_shm(&self) -> bool {
        self.shm
    }

    /// Whether requests and replies travel in shared-memory rings.
    pub fn has_rings(&self) -> bool {
        self.replies_bell.is_some()
    }

    pub fn address(&self) -> &str {
        &self.address
    }

    /// Whether the link has failed (and will fail every request).
    pub fn is_broken(&self) -> bool {
        self.broken.lock().is_some()
    }

    /// A segment this link has mapped.
    pub fn segment(&self, id: u64) -> Result<Arc<Segment>> {
        self.segments.lock().get(&id).cloned().ok_or_else(|| {
            Error::connection(format!("the daemon named segment {id}, which was never sent"))
        })
    }

    /// The spare region the daemon set aside for this link. Only whoever takes it may write it,
    /// and must then name it to the daemon: in a put, or given back with a stage.
    pub fn take_spare(&self) -> Option<Spare> {
        self.spare.lock().take()
    }

    /// A token whose drop releases read pin `pin`.
    pub fn pin_token(self: &Arc<Self>, pin: u64) -> PinToken {
        PinToken { link: Arc::downgrade(self), pin }
    }

    fn fail_all(&self, why: &str) {
        self.broken.lock().get_or_insert_with(|| why.to_owned());
        let why = self.broken.lock().clone().unwrap_or_default();
        for (_, waiting) in self.pending.lock().drain() {
            let _ = waiting.reply.try_send(Err(Error::connection(why.clone())));
        }
        self.stream.shutdown();
    }

    fn map_segments(&self, segments: &Segments, mut fds: Vec<OwnedFd>) -> Result<()> {
        if self.has_rings() {
            // They were sent on the socket just before the reply went into its ring.
            self.stream.receive_fds(&mut fds, segments.new.len()).map_err(|e| {
                Error::connection(format!("the descriptors of a reply did not come: {e}"))
            })?;
        }
        if fds.len() != segments.new.len() {
            return Err(Error::connection(format!(
                "{} segments announced but {} descriptors received",
                segments.new.len(),
                fds.len()
            )));
        }
        let mut map = self.segments.lock();
        for (&(id, len), fd) in segments.new.iter().zip(fds) {
            map.insert(id, mapped(self.hello.instance, id, len as usize, fd)?);
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
            Ok(Reply::WithSpare { reply, spare }) => {
                // The daemon offers a spare only while this link has none, and keeps it until a
                // request names it: the one kept here is the one the daemon holds.
                self.map_segments(&spare.segments, fds).map(|()| {
                    *self.spare.lock() = Some(spare);
                    (*reply, payload)
                })
            }
            Ok(reply) => {
                let segments = match &reply {
                    Reply::Cells { segments, .. }
                    | Reply::Staged { segments, .. }
                    | Reply::ClaimedCells { segments, .. } => Some(segments),
                    _ => None,
                };
                match segments.map(|s| self.map_segments(s, fds)).transpose() {
                    Ok(_) => Ok((reply, payload)),
                    Err(e) => Err(e),
                }
            }
            Err(failure) => Err(failure.into()),
        };
        let waiter = self.pending.lock().remove(&header.request_id);
        match waiter {
            Some(waiting) => {
                let _ = waiting.reply.try_send(delivery);
            }
            None => {
                // Nobody waits (a ping, or a caller that gave up): let go of what it pinned.
                if let Ok((
                    Reply::Cells { pin: Some(pin), .. }
                    | Reply::ClaimedCells { pin: Some(pin), .. },
                    _,
                )) = delivery
                {
                    self.unpins.lock().push(pin);
                }
            }
        }
        Ok(())
    }

    /// Whether the daemon has closed its end of this link, which then breaks: it reads nothing
    /// more, so a request is better sent on a new link than written into this one.
    pub fn hung_up(&self) -> bool {
        if !self.stream.hung_up() {
            return false;
        }
        self.fail_all(&format!("the store daemon at {} closed the connection", self.address));
        true
    }

    fn check_usable(&self) -> Result<()> {
        if super::process_id() != self.pid {
            return Err(Error::connection(
                "this connection was opened before a fork; call asyncflow.connect again in the child",
            ));
        }
        match &*self.broken.lock() {
            Some(why) => Err(Error::connection(why.clone())),
            None => Ok(()),
        }
    }

    /// Tells the daemon that a request is being prepared on this link (a put's copy into shared
    /// memory), waking it if it sleeps: it then looks at the ring for a while longer instead of
    /// sleeping until the request rings it, which takes tens of microseconds. Nothing on a
    /// socket.
    pub fn heads_up(&self) {
        self.writer.lock().get_ref().heads_up();
    }

    /// Writes one frame, preceded by any pending unpins; a write that fails (or times out)
    /// breaks the link, since the daemon may have seen part of the frame.
    fn write(&self, id: u64, req: &Request, payload: &[&[u8]]) -> Result<()> {
        let mut w = self.writer.lock();
        let pins = std::mem::take(&mut *self.unpins.lock());
        let written = (|| {
            if !pins.is_empty() {
                write_frame(&mut *w, 0, &Request::Unpin { pins }, &[])?;
            }
            write_frame(&mut *w, id, req, payload)?;
            w.flush()
        })();
        written.map_err(|e| {
            let why = format!("cannot send to the store daemon at {}: {e}", self.address);
            self.fail_all(&why);
            Error::connection(why)
        })
    }

    /// Sends a request and waits for its answer, on this link only.
    pub fn call(
        self: &Arc<Self>,
        req: &Request,
        payload: &[&[u8]],
        wait: Wait<'_>,
    ) -> Result<Answer> {
        self.send(req, payload)?.wait(wait)
    }

    /// Sends a request whose payload section is `payload` (written in order).
    pub fn send(self: &Arc<Self>, req: &Request, payload: &[&[u8]]) -> Result<Pending> {
        let bytes: usize = payload.iter().map(|p| p.len()).sum();
        if u32::try_from(bytes).is_err() {
            // A frame's length field holds less; refused here, with nothing sent.
            return Err(Error::Store(StoreError::bad_request(format!(
                "a put of {bytes} bytes is larger than any frame (4 GiB); put fewer rows at once"
            ))));
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::sync_channel(1);
        // Waiting before the link is checked: a link that fails after the check answers it with
        // its error (`fail_all`), one that failed before is seen by the check. Rings take a
        // request whether or not the daemon is there to read it, so one written to a link that
        // failed in between would wait out its deadline.
        self.pending.lock().insert(id, Waiting { reply: tx, asleep: false });
        if let Err(e) = self.check_usable().and_then(|()| self.write(id, req, payload)) {
            self.pending.lock().remove(&id);
            return Err(e);
        }
        let deadline = self.policy.deadline(req);
        let may_wait =
            matches!(req, Request::Claim { timeout, .. } if *timeout != Some(Duration::ZERO));
        Ok(Pending { link: Arc::clone(self), id, rx, what: op_name(req), deadline, may_wait })
    }

    /// Sends a request that gets no reply.
    pub fn notify(&self, req: &Request) -> Result<()> {
        debug_assert!(req.op().is_notice());
        self.check_usable()?;
        self.write(0, req, &[])
    }

    /// Sends a ping (its answer is only proof of life, so nobody waits for it).
    fn ping(&self) {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let _ = self.write(id, &Request::Ping, &[]);
    }

    /// Lets the daemon reuse the memory of a read whose views are all gone.
    fn unpin(&self, pin: u64) {
        if super::process_id() != self.pid || self.is_broken() {
            return;
        }
        self.unpins.lock().push(pin);
        let pins = std::mem::take(&mut *self.unpins.lock());
        if !pins.is_empty() {
            let _ = self.write(0, &Request::Unpin { pins }, &[]);
        }
    }
}

fn op_name(req: &Request) -> &'static str {
    match req {
        Request::Hello(_) => "hello",
        Request::RegisterTask { .. } => "register_task",
        Request::Put(_) => "put",
        Request::Claim { .. } => "claim",
        Request::Ack { .. } => "ack",
        Request::Release { .. } => "release",
        Request::Renew { .. } => "renew",
        Request::Read { .. } => "read",
        Request::Rows { .. } => "rows",
        Request::Clear { .. } => "clear",
        Request::Delete { .. } => "delete",
        Request::Schema { .. } => "schema",
        Request::ReadyFields { .. } => "ready_fields",
        Request::Stats => "stats",
        Request::Ping => "ping",
        Request::Stage { .. } => "a put's staging",
        Request::Unpin { .. } => "unpin",
        Request::Cancel { .. } => "cancel",
        Request::Commit { .. } => "a put's commit",
        Request::Locate { .. } => "locate",
        Request::StoreCells(_) => "a put's cells",
        Request::FetchCells { .. } => "a read's cells",
        Request::DropRows { .. } => "drop",
    }
}

impl Link {
    /// Reads one frame and hands it to whoever waits for it; a frame that cannot be read or
    /// understood breaks the link for everyone. `gone` says, while the daemon is silent, whether
    /// nobody uses the link any more. Returns whether the link still works.
    fn read_one(&self, reader: &mut Reader, gone: &dyn Fn() -> bool) -> bool {
        self.read_rest_of_one(reader, Started::default(), gone)
    }

    /// `read_one` of a frame whose first bytes are `started`.
    fn read_rest_of_one(
        &self,
        reader: &mut Reader,
        started: Started,
        gone: &dyn Fn() -> bool,
    ) -> bool {
        let Reader { stream, last_heard } = reader;
        let frame = {
            let mut idle = || -> std::io::Result<()> {
                if gone() {
                    return Err(std::io::ErrorKind::NotConnected.into());
                }
                if self.pending.lock().is_empty() {
                    *last_heard = Instant::now();
                    return Ok(());
                }
                if last_heard.elapsed() >= self.policy.request_timeout {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        format!(
                            "the daemon answered nothing, not even a ping, for {:.1}s",
                            last_heard.elapsed().as_secs_f64()
                        ),
                    ));
                }
                self.ping();
                Ok(())
            };
            read_rest_of_frame(stream, started, Limits::DEFAULT, &mut idle)
        };
        *last_heard = Instant::now();
        let why = match frame {
            Ok(frame) => match self.deliver(frame) {
                Ok(()) => return true,
                Err(e) => format!("bad reply from the store daemon at {}: {e}", self.address),
            },
            Err(e) => format!("connection to the store daemon at {} lost: {e}", self.address),
        };
        self.fail_all(&why);
        false
    }

    /// Has the watcher look again at whether callers sleep.
    fn nudge_watcher(&self) {
        let _ = (&self.wake_watcher).write(&[1]);
    }

    /// Makes sure the watcher reads the reply to request `id`, whose caller is about to sleep
    /// until it comes. On rings the caller asks for the replies' bell itself, for its reply
    /// only, which the watcher always listens to: the daemon rings it once that reply is
    /// written, and the watcher wakes once, to read, instead of twice (once to be told, once for
    /// the reply), and not for the replies other callers read for themselves meanwhile. If a
    /// reply is there already, or on a socket, the watcher is woken to look.
    fn sleep_until_answered(&self, id: u64) {
        match self.pending.lock().get_mut(&id) {
            Some(waiting) => waiting.asleep = true,
            None => return, // answered already
        }
        if !self.replies_bell.as_ref().is_some_and(|r| r.sleep_for(waiting_for(id))) {
            self.nudge_watcher();
        }
    }

    /// What the watcher waits for: nothing while no caller sleeps, else the reply of the one
    /// that sleeps, or of any (`ANY`) when several do.
    fn sleepers(&self) -> Option<u64> {
        let pending = self.pending.lock();
        let mut asleep = pending.iter().filter(|(_, w)| w.asleep).map(|(&id, _)| id);
        let first = asleep.next()?;
        Some(if asleep.next().is_some() { ANY } else { waiting_for(first) })
    }
}

/// The link's watcher thread: reads replies for callers asleep, pings the daemon while requests
/// wait and it is silent (giving up on it after a request timeout of silence), and notices when
/// the daemon hangs up. While no caller sleeps it waits for the hang-up only (and, on rings, for
/// the replies' bell, which rings only once a caller about to sleep has asked for it), so
/// replies that callers read themselves do not wake it.
fn watch(link: &Weak<Link>, socket: &OwnedFd, mut woken: UnixStream, ring: Option<&Watcher>) {
    loop {
        // A request leaves `pending` as its reply is handed over: the callers asleep there are
        // those still waiting. (Asking for the bell for a caller already answered would have
        // the next reply, which its caller reads itself, wake the watcher for nothing.)
        let Some((sleepers, interval)) =
            link.upgrade().map(|l| (l.sleepers(), l.policy.ping_interval()))
        else {
            return;
        };
        let wanted = sleepers.is_some();
        // Replies come on the socket, or in the ring, whose bell rings only if the watcher (or
        // a caller about to sleep, `Link::sleep_until_answered`) says it sleeps for them, and
        // the ring is empty then. The watcher asks while callers sleep, for their replies only;
        // asking again after each wake-up also renews a caller's request that its `awake` below
        // withdrew.
        let announced = ring.zip(sleepers);
        let in_ring = announced.is_some_and(|(r, wanted)| !r.sleep_for(wanted));
        let events = if wanted && ring.is_none() {
            PollFlags::IN | PollFlags::RDHUP
        } else {
            PollFlags::RDHUP
        };
        let mut fds = vec![PollFd::new(socket, events), PollFd::new(&woken, PollFlags::IN)];
        if let Some(r) = ring {
            fds.push(PollFd::new(r.bell(), PollFlags::IN));
        }
        let timeout = timespec(if in_ring { Duration::ZERO } else { interval });
        let polled = poll(&mut fds, Some(&timeout));
        if let Some(r) = ring {
            r.bell().silence();
        }
        if let Some((r, _)) = announced {
            r.awake();
            // The word is cleared before `pending` is read again: a caller that marks itself
            // asleep and asks for the bell after the clearing is then seen asleep at the top.
            fence(Ordering::SeqCst);
        }
        let ready = match polled {
            Ok(n) => n,
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => {
                // Nobody would read replies for callers asleep any more: they learn why now.
                if let Some(link) = link.upgrade() {
                    link.fail_all(&format!(
                        "connection to the store daemon at {} lost: cannot wait for its \
                         replies: {e}",
                        link.address
                    ));
                }
                return;
            }
        };
        let bell_rang = fds.get(2).is_some_and(|f| !f.revents().is_empty());
        let on_socket = !fds[0].revents().is_empty() || in_ring || bell_rang;
        if !fds[1].revents().is_empty() {
            while woken.read(&mut [0u8; 64]).is_ok_and(|n| n > 0) {}
        }
        let Some(link) = link.upgrade() else { return };
        if link.is_broken() {
            return;
        }
        let gone = || Arc::strong_count(&link) <= 1;
        if on_socket {
            let mut reader = link.reader.lock();
            // A caller may have read what was there meanwhile; a hang-up is read to its end.
            while reader.stream.readable() {
                if !link.read_one(&mut reader, &gone) {
                    return;
                }
            }
        } else if ready == 0
            && let Some(mut reader) = link.reader.try_lock()
        {
            // Replies nobody read (to pings, or to requests given up on) are read now.
            while reader.stream.readable() {
                if !link.read_one(&mut reader, &gone) {
                    return;
                }
            }
            if link.pending.lock().is_empty() {
                reader.last_heard = Instant::now();
                continue;
            }
            // Silence while requests wait: ping, or give up once it has lasted too long.
            if reader.last_heard.elapsed() >= link.policy.request_timeout {
                let why = format!(
                    "connection to the store daemon at {} lost: the daemon answered nothing, not \
                     even a ping, for {:.1}s",
                    link.address,
                    reader.last_heard.elapsed().as_secs_f64()
                );
                link.fail_all(&why);
                return;
            }
            link.ping();
        }
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        // Wakes the watcher thread, which exits. A forked child must not: shutting the shared
        // socket down would cut off its parent.
        if super::process_id() == self.pid {
            self.stream.shutdown();
        }
    }
}

/// Zero bytes to pad a payload part up to the next cell boundary.
pub fn padding(len: usize) -> &'static [u8] {
    &PADDING[..len]
}
