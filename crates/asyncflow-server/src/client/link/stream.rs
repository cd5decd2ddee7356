//! The socket under a link: TCP, or the daemon's Unix socket, which also carries descriptors.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream, ToSocketAddrs};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use asyncflow_shm::recv_with_fds;
use rustix::event::{PollFd, PollFlags, Timespec, poll};
use rustix::net::RecvFlags;

use crate::error::{Error, Result};

pub(super) enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Stream {
    pub(super) fn as_fd(&self) -> BorrowedFd<'_> {
        match self {
            Stream::Tcp(s) => s.as_fd(),
            Stream::Unix(s) => s.as_fd(),
        }
    }

    /// Whether a read would find something (bytes, the end of the stream, or an error) now.
    pub(super) fn readable(&self) -> bool {
        let fd = self.as_fd();
        let mut fds = [PollFd::new(&fd, PollFlags::IN)];
        poll(&mut fds, Some(&Timespec { tv_sec: 0, tv_nsec: 0 })).is_ok_and(|n| n > 0)
    }

    /// Whether the other end has closed the connection (or it failed).
    pub(super) fn hung_up(&self) -> bool {
        let fd = self.as_fd();
        let mut fds = [PollFd::new(&fd, PollFlags::RDHUP)];
        poll(&mut fds, Some(&Timespec { tv_sec: 0, tv_nsec: 0 })).is_ok_and(|n| n > 0)
    }

    pub(super) fn try_clone(&self) -> std::io::Result<Stream> {
        Ok(match self {
            Stream::Tcp(s) => Stream::Tcp(s.try_clone()?),
            Stream::Unix(s) => Stream::Unix(s.try_clone()?),
        })
    }

    pub(super) fn shutdown(&self) {
        let _ = match self {
            Stream::Tcp(s) => s.shutdown(Shutdown::Both),
            Stream::Unix(s) => s.shutdown(Shutdown::Both),
        };
    }

    /// Bounds every later read and write of this socket (and of its clones).
    pub(super) fn set_timeouts(
        &self,
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
        while at < buf.len() {
            let got = match self {
                Stream::Unix(s) => {
                    recv_with_fds(s.as_fd(), &mut buf[at..], fds, RecvFlags::empty())
                }
                Stream::Tcp(s) => s.read(&mut buf[at..]),
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
