//! The socket under a link: TCP, or the daemon's Unix socket, which also carries descriptors;
//! or, on the Unix socket, the rings in shared memory the daemon set up for the link (one end
//! each: the reader's and the writer's), with the socket beside them for the descriptors and
//! to see the daemon hang up.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream, ToSocketAddrs};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use asyncflow_shm::{ClientEnds, Consumer, Producer, recv_with_fds};
use rustix::event::{PollFd, PollFlags, Timespec, poll};
use rustix::net::RecvFlags;

use crate::error::{Error, Result};

pub(super) enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
    /// Replies, read from their ring.
    Replies(Box<Ring<Consumer>>),
    /// Requests, written into their ring.
    Requests(Box<Ring<Producer>>),
}

/// One end of a ring, the socket beside it, and how long a read or a write may wait.
pub(super) struct Ring<End> {
    end: End,
    socket: UnixStream,
    timeout: Option<Duration>,
}

/// How many times a reader waiting for the rest of a frame looks at its ring, yielding the core
/// each time, before it sleeps between looks: the rest of a frame is usually being written.
const LOOKS_BEFORE_NAPS: u32 = 1000;
const NAP: Duration = Duration::from_micros(50);

fn nothing_yet() -> Timespec {
    Timespec { tv_sec: 0, tv_nsec: 0 }
}

pub(super) fn timespec(d: Duration) -> Timespec {
    Timespec { tv_sec: d.as_secs() as i64, tv_nsec: i64::from(d.subsec_nanos()) }
}

impl Stream {
    /// A link's two ends of its rings, each with its own handle on `socket`.
    pub(super) fn rings(
        ends: ClientEnds,
        socket: &UnixStream,
    ) -> std::io::Result<(Stream, Stream)> {
        let ClientEnds { requests, replies } = ends;
        let reader = Ring { end: replies, socket: socket.try_clone()?, timeout: None };
        let writer = Ring { end: requests, socket: socket.try_clone()?, timeout: None };
        Ok((Stream::Replies(Box::new(reader)), Stream::Requests(Box::new(writer))))
    }

    pub(super) fn as_fd(&self) -> BorrowedFd<'_> {
        match self {
            Stream::Tcp(s) => s.as_fd(),
            Stream::Unix(s) => s.as_fd(),
            Stream::Replies(r) => r.socket.as_fd(),
            Stream::Requests(r) => r.socket.as_fd(),
        }
    }

    /// Whether a read would find something (bytes, the end of the stream, or an error) now.
    pub(super) fn readable(&self) -> bool {
        if let Stream::Replies(r) = self {
            return r.end.available().map_or(true, |n| n > 0) || self.hung_up();
        }
        let fd = self.as_fd();
        let mut fds = [PollFd::new(&fd, PollFlags::IN)];
        poll(&mut fds, Some(&nothing_yet())).is_ok_and(|n| n > 0)
    }

    /// Whether the other end has closed the connection (or it failed).
    pub(super) fn hung_up(&self) -> bool {
        let fd = self.as_fd();
        let mut fds = [PollFd::new(&fd, PollFlags::RDHUP)];
        poll(&mut fds, Some(&nothing_yet())).is_ok_and(|n| n > 0)
    }

    pub(super) fn try_clone(&self) -> std::io::Result<Stream> {
        Ok(match self {
            Stream::Tcp(s) => Stream::Tcp(s.try_clone()?),
            Stream::Unix(s) => Stream::Unix(s.try_clone()?),
            Stream::Replies(_) | Stream::Requests(_) => {
                return Err(std::io::Error::other("a ring's end has one owner"));
            }
        })
    }

    pub(super) fn shutdown(&self) {
        let _ = match self {
            Stream::Tcp(s) => s.shutdown(Shutdown::Both),
            Stream::Unix(s) => s.shutdown(Shutdown::Both),
            Stream::Replies(r) => r.socket.shutdown(Shutdown::Both),
            Stream::Requests(r) => r.socket.shutdown(Shutdown::Both),
        };
    }

    /// Receives descriptors sent ahead of a reply read from a ring until `fds` holds `want`.
    pub(super) fn receive_fds(&self, fds: &mut Vec<OwnedFd>, want: usize) -> std::io::Result<()> {
        while fds.len() < want {
            match recv_with_fds(self.as_fd(), &mut [0u8; 1], fds, RecvFlags::empty()) {
                Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Bounds every later read and write of this socket (and of its clones).
    pub(super) fn set_timeouts(
        &mut self,
        read: Option<Duration>,
        write: Option<Duration>,
    ) -> std::io::Result<()> {
        match self {
            Stream::Tcp(s) => {
                s.set_read_timeout(read)?;
                s.set_write_timeout(write)
            }
            Stream::Unix(s) => {
                s.set_read_timeout(read)?;
                s.set_write_timeout(write)
            }
            Stream::Replies(r) => {
                r.timeout = read;
                r.socket.set_read_timeout(read)
            }
            Stream::Requests(r) => {
                r.timeout = write;
                Ok(())
            }
        }
    }

    /// Reads what has arrived into `buf`, collecting any descriptors that come with it, without
    /// waiting: `WouldBlock` if nothing has.
    pub(super) fn read_now(
        &mut self,
        buf: &mut [u8],
        fds: &mut Vec<OwnedFd>,
    ) -> std::io::Result<usize> {
        match self {
            Stream::Unix(s) => recv_with_fds(s.as_fd(), buf, fds, RecvFlags::DONTWAIT),
            Stream::Tcp(s) => Ok(rustix::net::recv(s.as_fd(), buf, RecvFlags::DONTWAIT)?.0),
            Stream::Replies(r) => match r.end.pop(buf)? {
                0 => Err(std::io::ErrorKind::WouldBlock.into()),
                n => Ok(n),
            },
            Stream::Requests(_) => Err(not_read()),
        }
    }

    /// Reads until `buf` is full, its first `at` bytes being there already, collecting any
    /// descriptors that come with them. When the socket's read timeout passes with nothing read,
    /// asks `idle` whether to keep waiting.
    pub(super) fn read_exact_patiently(
        &mut self,
        buf: &mut [u8],
        mut at: usize,
        fds: &mut Vec<OwnedFd>,
        idle: &mut dyn FnMut() -> std::io::Result<()>,
    ) -> std::io::Result<()> {
        if let Stream::Replies(r) = self {
            return r.read_exact_patiently(buf, at, idle);
        }
        while at < buf.len() {
            let got = match self {
                Stream::Unix(s) => {
                    recv_with_fds(s.as_fd(), &mut buf[at..], fds, RecvFlags::empty())
                }
                Stream::Tcp(s) => s.read(&mut buf[at..]),
                Stream::Replies(_) | Stream::Requests(_) => Err(not_read()),
            };
            match got {
                Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => at += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    idle()?;
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

fn not_read() -> std::io::Error {
    std::io::Error::other("a link's requests ring is only written")
}

impl Ring<Consumer> {
    /// `Stream::read_exact_patiently` on the replies' ring. Only the rest of a frame is waited
    /// for here (a frame is read once its first bytes are there), so the wait looks at the ring
    /// instead of sleeping on its bell, which the link's watcher sleeps on.
    fn read_exact_patiently(
        &mut self,
        buf: &mut [u8],
        mut at: usize,
        idle: &mut dyn FnMut() -> std::io::Result<()>,
    ) -> std::io::Result<()> {
        let mut looks = 0u32;
        let mut since = Instant::now();
        while at < buf.len() {
            let n = self.end.pop(&mut buf[at..])?;
            if n > 0 {
                at += n;
                looks = 0;
                continue;
            }
            looks += 1;
            if looks < LOOKS_BEFORE_NAPS {
                std::thread::yield_now();
                continue;
            }
            let mut fds = [PollFd::new(&self.socket, PollFlags::RDHUP)];
            if poll(&mut fds, Some(&timespec(NAP))).is_ok_and(|n| n > 0)
                && self.end.available()? == 0
            {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
            if self.timeout.is_some_and(|t| since.elapsed() >= t) {
                idle()?;
                since = Instant::now();
            }
        }
        Ok(())
    }
}

impl Ring<Producer> {
    /// Waits for room in the requests' ring, until the write timeout; the daemon's reads ring the
    /// bell.
    fn wait_for_room(&mut self) -> std::io::Result<()> {
        self.end.wake_consumer();
        let since = Instant::now();
        while self.end.sleep_for_room()? {
            let left = self.timeout.map(|t| t.saturating_sub(since.elapsed()));
            if left.is_some_and(|l| l.is_zero()) {
                self.end.awake();
                return Err(std::io::ErrorKind::TimedOut.into());
            }
            let bell = self.end.room_bell();
            let mut fds =
                [PollFd::new(bell, PollFlags::IN), PollFd::new(&self.socket, PollFlags::RDHUP)];
            let polled = poll(&mut fds, left.map(timespec).as_ref());
            bell.silence();
            self.end.awake();
            if !fds[1].revents().is_empty() {
                return Err(std::io::ErrorKind::BrokenPipe.into());
            }
            if let Err(e) = polled
                && e != rustix::io::Errno::INTR
            {
                return Err(e.into());
            }
        }
        Ok(())
    }
}

impl Stream {
    /// On the requests' ring: says a request is coming (see `Link::heads_up`). Nothing on a
    /// socket.
    pub(super) fn heads_up(&self) {
        if let Stream::Requests(r) = self {
            r.end.expect();
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.write(buf),
            Stream::Unix(s) => s.write(buf),
            Stream::Requests(r) => loop {
                match r.end.push(buf)? {
                    0 if !buf.is_empty() => r.wait_for_room()?,
                    n => return Ok(n),
                }
            },
            Stream::Replies(_) => Err(std::io::Error::other("a link's replies ring is only read")),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            Stream::Tcp(s) => s.flush(),
            Stream::Unix(s) => s.flush(),
            Stream::Requests(r) => {
                r.end.wake_consumer();
                Ok(())
            }
            Stream::Replies(_) => Ok(()),
        }
    }
}

pub(super) fn connect_tcp(address: &str, timeout: Duration) -> Result<TcpStream> {
    let mut last = None;
    for addr in
        address.to_socket_addrs().map_err(|e| Error::connection(format!("{address}: {e}")))?
    {
        match TcpStream::connect_timeout(&addr, timeout) {
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
