//! A local connection's requests and replies in shared memory (see `asyncflow_shm::ring`): the
//! client asks for the rings in its hello on the Unix socket, and their descriptors come back
//! with the daemon's answer. From then on the socket carries only the descriptors of segments a
//! reply names (each sent, one byte with them, before the reply goes into the ring) and, by
//! closing, the news that the client is gone.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use asyncflow_shm::ring::{MAX_RING, MIN_RING};
use asyncflow_shm::{Consumer, DaemonEnds, Producer, ShmError};
use rustix::event::{PollFd, PollFlags, Timespec, poll};
use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, Interest, ReadBuf};
use tokio::net::unix;

/// How often a daemon waiting for room in a reply ring checks that its client is still there.
const CHECK_CLIENT: Duration = Duration::from_millis(100);

/// Replies written in a row, at most, before the client is told of them (see `RingOut::answers`).
const TELL_EVERY: usize = 64;

/// The rings for a client that asked for rings of `asked` bytes: the nearest power of two within
/// what a ring may hold.
pub fn create(asked: u64) -> Result<DaemonEnds, ShmError> {
    let cap = usize::try_from(asked).unwrap_or(MAX_RING).clamp(MIN_RING, MAX_RING);
    DaemonEnds::create(cap.next_power_of_two().min(MAX_RING))
}

/// The number of an eventfd that the ring end beside it owns: registered with the runtime as it
/// is, not as a duplicate, so that a connection holds no descriptor more than its channel's.
struct BellFd(RawFd);

impl AsRawFd for BellFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0
    }
}

/// An eventfd of the channel, registered with the runtime this is called on.
///
/// # Safety
/// `bell` must stay open until the returned value is dropped: it is declared before the ring
/// end that owns `bell` in `RingIn` and `RingOut`, so it drops first.
unsafe fn registered(bell: BorrowedFd<'_>) -> io::Result<AsyncFd<BellFd>> {
    // SAFETY: upheld by the caller; the number always names the same descriptor.
    Ok(unsafe { AsyncFd::register_with_interest(BellFd(bell.as_raw_fd()), Interest::READABLE) }?)
}

/// Waits for `bell` to ring, and silences it.
fn poll_bell(
    bell: &AsyncFd<BellFd>,
    silence: impl FnOnce() -> bool,
    cx: &mut Context<'_>,
) -> Poll<io::Result<()>> {
    let mut guard = ready!(bell.poll_read_ready(cx))?;
    silence();
    guard.clear_ready();
    Poll::Ready(Ok(()))
}

/// Whether the other end of `socket` has closed (or the socket failed).
fn hung_up(socket: BorrowedFd<'_>) -> bool {
    let mut fds = [PollFd::new(&socket, PollFlags::RDHUP)];
    poll(&mut fds, Some(&Timespec { tv_sec: 0, tv_nsec: 0 })).is_ok_and(|n| n > 0)
}

/// The reading end: requests.
pub struct RingIn {
    // Declared (so dropped) before the ring end that owns its descriptor.
    bell: AsyncFd<BellFd>,
    requests: Consumer,
    /// Whether the client said that the request being read was coming (`expected`).
    announced: bool,
}

impl RingIn {
    /// Whether the client said a request is on its way (`Producer::expect`, sent ahead of a
    /// request it is still preparing, such as a put's copy into shared memory) since the last
    /// look; the notice is taken.
    pub fn expected(&mut self) -> bool {
        let expected = self.requests.expected();
        self.announced |= expected;
        expected
    }

    /// Whether the request read since the last call was announced (see `expected`).
    pub fn take_announced(&mut self) -> bool {
        std::mem::take(&mut self.announced)
    }

    /// Copies what is there into `buf`; `None` if nothing is.
    pub fn take(&mut self, buf: &mut ReadBuf<'_>) -> Option<io::Result<()>> {
        match self.requests.pop(buf.initialize_unfilled()) {
            Ok(0) => None,
            Ok(n) => {
                // What the client said was coming has come.
                self.expected();
                buf.advance(n);
                Some(Ok(()))
            }
            Err(e) => Some(Err(e)),
        }
    }

    /// With nothing to read: sleeps until the client rings or `socket` says something, which can
    /// only be that the client closed it (its end, read as nothing) or broke the protocol.
    pub fn poll_wait<S: AsyncRead + Unpin>(
        &mut self,
        socket: &mut S,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        loop {
            if let Some(got) = self.take(buf) {
                self.requests.awake();
                return Poll::Ready(got);
            }
            if !self.requests.sleep_for_bytes()? {
                continue;
            }
            let bell = self.requests.bytes_bell();
            if poll_bell(&self.bell, || bell.silence(), cx)?.is_ready() {
                continue;
            }
            let mut byte = [0u8; 1];
            let mut probe = ReadBuf::new(&mut byte);
            ready!(Pin::new(&mut *socket).poll_read(cx, &mut probe))?;
            if probe.filled().is_empty() {
                return Poll::Ready(Ok(()));
            }
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "bytes on the socket of a connection whose requests come in shared memory",
            )));
        }
    }
}

/// The writing end: replies.
pub struct RingOut {
    // Declared (so dropped) before the ring end that owns its descriptor.
    bell: AsyncFd<BellFd>,
    replies: Producer,
    socket: unix::OwnedWriteHalf,
    /// The requests whose replies were written since the client was last told of replies: a
    /// reader that sleeps for one of them is rung by `flush`, one that sleeps for another not.
    answered: Vec<u64>,
}

impl RingOut {
    /// Notes that the reply to `request` is being written. While replies keep coming, the
    /// client is told of those written so far every so often, which also bounds the list.
    pub fn answers(&mut self, request: u64) {
        if self.answered.len() >= TELL_EVERY {
            self.flush();
        }
        self.answered.push(request);
    }

    pub async fn write_all(&mut self, mut bytes: &[u8]) -> io::Result<()> {
        loop {
            let n = self.replies.push(bytes)?;
            bytes = &bytes[n..];
            if bytes.is_empty() {
                return Ok(());
            }
            self.replies.wake_consumer();
            self.wait_for_room().await?;
        }
    }

    /// Lets the client read what was written: wakes a reader that sleeps for any reply, or for
    /// one of those written since the last flush.
    pub fn flush(&mut self) {
        self.replies.wake_consumer_for(&self.answered);
        self.answered.clear();
    }

    async fn wait_for_room(&mut self) -> io::Result<()> {
        while self.replies.sleep_for_room()? {
            let bell = self.replies.room_bell();
            let rang = tokio::time::timeout(
                CHECK_CLIENT,
                std::future::poll_fn(|cx| poll_bell(&self.bell, || bell.silence(), cx)),
            )
            .await;
            self.replies.awake();
            match rang {
                Ok(r) => return r,
                Err(_) if hung_up(self.socket.as_ref().as_fd()) => {
                    return Err(io::ErrorKind::BrokenPipe.into());
                }
                Err(_) => {}
            }
        }
        Ok(())
    }

    /// Sends `fds` on the socket, ahead of the reply that names them.
    pub async fn send_fds(&mut self, fds: &[BorrowedFd<'_>]) -> io::Result<()> {
        super::connection::send_fds(self.socket.as_ref(), &[0], fds).await.map(drop)
    }
}

/// Both ends, registered with the runtime this is called on; `socket` is the connection's
/// writing half. The channel's memory descriptor, sent with the hello, is closed here.
pub fn ends(rings: DaemonEnds, socket: unix::OwnedWriteHalf) -> io::Result<(RingIn, RingOut)> {
    let DaemonEnds { requests, replies, memory } = rings;
    drop(memory);
    // SAFETY: each end owns the bell registered beside it, and drops after it.
    let (asked, room) =
        unsafe { (registered(requests.bytes_bell().fd())?, registered(replies.room_bell().fd())?) };
    Ok((
        RingIn { bell: asked, requests, announced: false },
        RingOut { bell: room, replies, socket, answered: Vec::new() },
    ))
}

#[cfg(test)]
mod tests {
    use asyncflow_shm::ClientEnds;
    use asyncflow_shm::ring::waiting_for;

    use super::*;

    #[tokio::test]
    async fn a_client_asleep_for_a_reply_is_told_of_it_within_a_long_run_of_replies() {
        let daemon = DaemonEnds::create(MIN_RING).unwrap();
        let fds = daemon.descriptors().iter().map(|f| f.try_clone_to_owned().unwrap()).collect();
        let client = ClientEnds::open(MIN_RING, fds).unwrap();
        let watcher = client.replies.watcher().unwrap();
        let (socket, _peer) = tokio::net::UnixStream::pair().unwrap();
        let (_requests, mut replies) = ends(daemon, socket.into_split().1).unwrap();
        assert!(watcher.sleep_for(waiting_for(1)));
        // Replies written one after another, with more always queued: no flush between them.
        for id in 1..=TELL_EVERY as u64 {
            replies.answers(id);
            replies.write_all(b"r").await.unwrap();
        }
        assert!(!watcher.bell().silence(), "rung before the run of replies paused");
        replies.answers(TELL_EVERY as u64 + 1);
        assert!(watcher.bell().silence(), "request 1's reply went untold");
    }

    #[tokio::test]
    async fn a_request_the_client_said_was_coming_is_told_apart_from_one_it_did_not() {
        let daemon = DaemonEnds::create(MIN_RING).unwrap();
        let fds = daemon.descriptors().iter().map(|f| f.try_clone_to_owned().unwrap()).collect();
        let mut client = ClientEnds::open(MIN_RING, fds).unwrap();
        let (socket, _peer) = tokio::net::UnixStream::pair().unwrap();
        let (mut requests, _replies) = ends(daemon, socket.into_split().1).unwrap();
        let mut bytes = [0u8; 16];
        let mut take = |ring: &mut RingIn| {
            let mut buf = ReadBuf::new(&mut bytes);
            ring.take(&mut buf).map(|r| r.map(|()| buf.filled().len()).unwrap())
        };
        // Sent unannounced: its wait says how soon the client sends.
        client.requests.push(b"ab").unwrap();
        assert_eq!(take(&mut requests), Some(2));
        assert!(!requests.take_announced());
        // Announced, then sent: taken with the request.
        client.requests.expect();
        client.requests.push(b"c").unwrap();
        assert_eq!(take(&mut requests), Some(1));
        assert!(requests.take_announced());
        assert!(!requests.take_announced(), "told twice");
        // Announced and seen while waiting for it (a spin that goes on): still this request's.
        client.requests.expect();
        assert!(requests.expected());
        assert!(!requests.expected(), "a notice is taken once");
        assert_eq!(take(&mut requests), None);
        client.requests.push(b"d").unwrap();
        assert_eq!(take(&mut requests), Some(1));
        assert!(requests.take_announced());
    }
}
