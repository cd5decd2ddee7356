//! A connection's requests and replies in shared memory: two single-producer, single-consumer
//! byte rings (requests from the client, replies from the daemon) in one memfd both processes
//! map, so a request and its reply cross without a system call while both sides are awake.
//!
//! A side about to sleep says so in its ring's header and sleeps on an eventfd (its *bell*); the
//! other side rings that bell only when the header says someone sleeps. The sleeper announces
//! itself, then looks at the ring once more; the other side publishes its index, then looks at
//! the announcement; a full fence on each side between the two steps means at least one of them
//! sees the other, so no wake-up is lost.
//!
//! A reader of replies may sleep for one reply only ([`waiting_for`] its request): the daemon
//! then rings only once it has written that reply, and the replies other callers read for
//! themselves meanwhile do not wake it. Announcements join: a second sleeper waiting for
//! something else turns the word into [`ANY`], which every push rings.
//!
//! A producer still preparing bytes can say they are coming (`Producer::expect`): a flag the
//! consumer takes (`Consumer::expected`), and the bell rung if the consumer sleeps, so that the
//! consumer's wake-up overlaps the preparation instead of following it.
//!
//! Each side keeps the index it owns (a producer's head, a consumer's tail) in its own memory and
//! only publishes it: the index it reads from the other side is checked before it is used, since
//! the other side may be a hostile process, and bytes are copied out of the ring before anything
//! decodes them.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering, fence};

use rustix::event::{EventfdFlags, eventfd};
use rustix::fs;
use rustix::mm::{self, ProtFlags};

use crate::error::ShmError;
use crate::segment::{anonymous_fd, map};

/// Bytes of a ring's header, before its data: the head, the tail and the two sleep words, each
/// on a cache line of its own (the producer's notice that bytes are coming beside the
/// consumer's word).
const HEADER: usize = 256;
const HEAD: usize = 0;
const TAIL: usize = 64;
/// 0 while the consumer is awake; else what it sleeps for: [`ANY`] or [`waiting_for`] a request.
const CONSUMER_ASLEEP: usize = 128;
/// Set by the producer ahead of bytes it is about to send (`Producer::expect`); on the
/// consumer's line, which the producer already writes.
const EXPECTED: usize = 136;
/// 0 while the producer is awake, [`ANY`] while it sleeps for room.
const PRODUCER_ASLEEP: usize = 192;

/// A sleep word that any push (or freed room) answers. Odd, as every announcement is, so that
/// the word's low half, the whole flag of older peers, reads as asleep.
pub const ANY: u64 = 1;

/// The sleep word of a reader that waits for the reply to request `id` only: it is rung when
/// the producer has written that reply (`Producer::wake_consumer_for`), or any bytes at all.
#[must_use]
pub const fn waiting_for(id: u64) -> u64 {
    (id << 1) | 1
}

/// What two announcements in one sleep word make: either when they agree, else [`ANY`].
const fn join(word: u64, wanted: u64) -> u64 {
    if word == 0 || word == wanted { wanted } else { ANY }
}

/// The smallest and largest capacity of one ring.
pub const MIN_RING: usize = 4 << 10;
pub const MAX_RING: usize = 64 << 20;

/// Descriptors a channel travels as: the memory, then the bells (requests' bytes and room,
/// replies' bytes and room).
pub const CHANNEL_FDS: usize = 5;

/// The shared mapping of a channel's memfd (the descriptor itself is not kept: a mapping
/// outlives it).
struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: plain shared memory owned by this value, touched only through atomics (the header) and
// through the ring discipline (data bytes); unmapped only on drop.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: mapped in `map` with this length; nothing uses it after drop.
        let _ = unsafe { mm::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// An eventfd one side sleeps on and the other rings.
pub struct Bell(OwnedFd);

impl AsFd for Bell {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }
}

impl Bell {
    fn new() -> io::Result<Self> {
        Ok(Self(eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)?))
    }

    pub fn fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }

    fn ring(&self) {
        // Cannot block (the count would have to reach 2^64 - 1) and cannot fail on an eventfd.
        let _ = rustix::io::write(&self.0, &1u64.to_ne_bytes());
    }

    /// Takes the rings heard so far; whether there were any.
    pub fn silence(&self) -> bool {
        let mut count = [0u8; 8];
        rustix::io::read(&self.0, &mut count).is_ok()
    }
}

/// One direction of a channel.
struct Ring {
    map: Arc<Mapping>,
    base: usize,
    cap: usize,
}

impl Ring {
    #[allow(clippy::cast_ptr_alignment)] // aligned: see the SAFETY note
    fn word64(&self, at: usize) -> &AtomicU64 {
        // SAFETY: `base + at` is inside the mapping, 64-byte aligned (the mapping is page
        // aligned, `base` and `at` are multiples of 64), and lives as long as `self.map`.
        unsafe { &*self.map.ptr.as_ptr().add(self.base + at).cast::<AtomicU64>() }
    }

    #[allow(clippy::cast_ptr_alignment)] // aligned: see `word64`
    fn word32(&self, at: usize) -> &AtomicU32 {
        // SAFETY: as in `word64`.
        unsafe { &*self.map.ptr.as_ptr().add(self.base + at).cast::<AtomicU32>() }
    }

    fn data(&self) -> *mut u8 {
        // SAFETY: the data area follows the header inside the mapping.
        unsafe { self.map.ptr.as_ptr().add(self.base + HEADER) }
    }

    /// Bytes between `tail` and `head`, checked: never more than the ring holds.
    fn used(&self, head: u64, tail: u64) -> io::Result<usize> {
        let used = head.wrapping_sub(tail);
        if used > self.cap as u64 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "the shared-memory ring says it holds {used} bytes, more than its {}",
                    self.cap
                ),
            ));
        }
        Ok(used as usize)
    }

    /// Announces that this side sleeps for `wanted` (joined into the word at `at`) and returns
    /// whether `ready` holds now; if it does, the word is cleared and the caller should not
    /// sleep (nor should another sleeper of the word count on it: see `Watcher`).
    fn announce(
        &self,
        at: usize,
        wanted: u64,
        ready: impl FnOnce() -> io::Result<bool>,
    ) -> io::Result<bool> {
        let word = self.word64(at);
        let _ =
            word.fetch_update(Ordering::SeqCst, Ordering::Relaxed, |seen| Some(join(seen, wanted)));
        fence(Ordering::SeqCst);
        let ready = ready()?;
        if ready {
            word.store(0, Ordering::Relaxed);
        }
        Ok(ready)
    }

    /// After publishing an index: rings `bell` if the other side said it sleeps (word at `at`)
    /// for anything, or for what `answers` says the published bytes hold.
    fn wake(&self, at: usize, bell: &Bell, answers: impl Fn(u64) -> bool) {
        fence(Ordering::SeqCst);
        let word = self.word64(at);
        let mut seen = word.load(Ordering::Relaxed);
        while seen != 0 && (seen == ANY || answers(seen)) {
            match word.compare_exchange(seen, 0, Ordering::AcqRel, Ordering::Relaxed) {
                Ok(_) => return bell.ring(),
                Err(now) => seen = now,
            }
        }
    }
}

/// The writing end of a ring.
pub struct Producer {
    ring: Ring,
    head: u64,
    /// Rung when bytes come for a consumer that sleeps.
    bytes: Bell,
    /// Where this side sleeps for room.
    room: Bell,
}

impl Producer {
    /// Copies as much of `bytes` as fits and publishes it; returns how much (0: the ring is full).
    pub fn push(&mut self, bytes: &[u8]) -> io::Result<usize> {
        let n = self.room()?.min(bytes.len());
        let at = (self.head % self.ring.cap as u64) as usize;
        let first = n.min(self.ring.cap - at);
        // SAFETY: `[at, at + first)` and `[0, n - first)` are inside the data area and free: the
        // consumer reads only below the head, which is published after the copy.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.ring.data().add(at), first);
            std::ptr::copy_nonoverlapping(bytes.as_ptr().add(first), self.ring.data(), n - first);
        }
        self.head += n as u64;
        self.ring.word64(HEAD).store(self.head, Ordering::Release);
        Ok(n)
    }

    /// Bytes that would fit now.
    pub fn room(&self) -> io::Result<usize> {
        let tail = self.ring.word64(TAIL).load(Ordering::Acquire);
        Ok(self.ring.cap - self.ring.used(self.head, tail)?)
    }

    /// Wakes the consumer if it sleeps: call once what was pushed should be read.
    pub fn wake_consumer(&self) {
        self.ring.wake(CONSUMER_ASLEEP, &self.bytes, |_| true);
    }

    /// Wakes the consumer if it sleeps for anything, or for the reply to one of `requests`:
    /// call once the replies to `requests` are pushed whole.
    pub fn wake_consumer_for(&self, requests: &[u64]) {
        self.ring.wake(CONSUMER_ASLEEP, &self.bytes, |word| {
            requests.iter().any(|&id| waiting_for(id) == word)
        });
    }

    /// Tells the consumer that bytes are about to come (the producer is still preparing them),
    /// waking it if it sleeps, so that its wake-up overlaps that work; see
    /// [`Consumer::expected`].
    pub fn expect(&self) {
        self.ring.word32(EXPECTED).store(1, Ordering::Release);
        self.wake_consumer();
    }

    /// About to sleep on [`Producer::room_bell`] for room: false if there is room already.
    pub fn sleep_for_room(&self) -> io::Result<bool> {
        self.ring.announce(PRODUCER_ASLEEP, ANY, || Ok(self.room()? > 0)).map(|ready| !ready)
    }

    /// Awake again (whether the bell rang or not).
    pub fn awake(&self) {
        self.ring.word64(PRODUCER_ASLEEP).store(0, Ordering::Relaxed);
    }

    pub fn room_bell(&self) -> &Bell {
        &self.room
    }

    pub fn capacity(&self) -> usize {
        self.ring.cap
    }
}

/// The reading end of a ring.
pub struct Consumer {
    ring: Ring,
    tail: u64,
    /// Where this side sleeps for bytes.
    bytes: Bell,
    /// Rung when room frees for a producer that sleeps.
    room: Bell,
}

impl Consumer {
    /// Copies out as many bytes as are there and fit in `buf`; returns how many (0: none).
    pub fn pop(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.available()?.min(buf.len());
        if n == 0 {
            return Ok(0);
        }
        let at = (self.tail % self.ring.cap as u64) as usize;
        let first = n.min(self.ring.cap - at);
        // SAFETY: `[at, at + first)` and `[0, n - first)` are inside the data area, below the
        // published head: the producer does not write them until the tail passes them.
        unsafe {
            std::ptr::copy_nonoverlapping(self.ring.data().add(at), buf.as_mut_ptr(), first);
            std::ptr::copy_nonoverlapping(self.ring.data(), buf.as_mut_ptr().add(first), n - first);
        }
        self.tail += n as u64;
        self.ring.word64(TAIL).store(self.tail, Ordering::Release);
        self.ring.wake(PRODUCER_ASLEEP, &self.room, |_| true);
        Ok(n)
    }

    /// Bytes there to read now.
    pub fn available(&self) -> io::Result<usize> {
        self.ring.used(self.ring.word64(HEAD).load(Ordering::Acquire), self.tail)
    }

    /// About to sleep on [`Consumer::bytes_bell`]: false if bytes are there already.
    pub fn sleep_for_bytes(&self) -> io::Result<bool> {
        self.ring.announce(CONSUMER_ASLEEP, ANY, || Ok(self.available()? > 0)).map(|ready| !ready)
    }

    /// Awake again (whether the bell rang or not).
    pub fn awake(&self) {
        self.ring.word64(CONSUMER_ASLEEP).store(0, Ordering::Relaxed);
    }

    /// Whether the producer said bytes are about to come ([`Producer::expect`]) since the last
    /// call; the notice is taken.
    pub fn expected(&self) -> bool {
        let word = self.ring.word32(EXPECTED);
        word.load(Ordering::Relaxed) != 0 && word.swap(0, Ordering::AcqRel) != 0
    }

    pub fn bytes_bell(&self) -> &Bell {
        &self.bytes
    }
}

/// A second look at a consumer's ring, for a thread that sleeps until bytes come while others
/// may be reading them: it sees the ring's published indexes only.
///
/// Several threads may announce on one watcher's word; one that finds bytes there clears the
/// word, and so withdraws the others' announcements too, which they then have to make again.
pub struct Watcher {
    ring: Ring,
    bell: Bell,
}

impl Watcher {
    /// About to sleep on [`Watcher::bell`] for `wanted` ([`ANY`] or [`waiting_for`] a
    /// request's reply): false if bytes are there already (or the ring is broken, which a read
    /// will say).
    pub fn sleep_for(&self, wanted: u64) -> bool {
        let ready = self.ring.announce(CONSUMER_ASLEEP, wanted, || {
            let head = self.ring.word64(HEAD).load(Ordering::Acquire);
            let tail = self.ring.word64(TAIL).load(Ordering::Acquire);
            Ok(self.ring.used(head, tail).map_or(true, |n| n > 0))
        });
        matches!(ready, Ok(false))
    }

    /// Awake again (whether the bell rang or not).
    pub fn awake(&self) {
        self.ring.word64(CONSUMER_ASLEEP).store(0, Ordering::Relaxed);
    }

    pub fn bell(&self) -> &Bell {
        &self.bell
    }
}

impl Consumer {
    /// A [`Watcher`] of this ring.
    pub fn watcher(&self) -> io::Result<Watcher> {
        let ring =
            Ring { map: Arc::clone(&self.ring.map), base: self.ring.base, cap: self.ring.cap };
        Ok(Watcher { ring, bell: Bell(self.bytes.0.try_clone()?) })
    }
}

/// The daemon's ends of a channel: it reads requests and writes replies. `memory` is the
/// channel's memfd, kept only to be sent to the client (see [`DaemonEnds::descriptors`]); drop
/// it once sent.
pub struct DaemonEnds {
    pub requests: Consumer,
    pub replies: Producer,
    pub memory: OwnedFd,
}

/// The client's ends: it writes requests and reads replies.
pub struct ClientEnds {
    pub requests: Producer,
    pub replies: Consumer,
}

fn check_capacity(cap: usize) -> Result<(), ShmError> {
    if cap.is_power_of_two() && (MIN_RING..=MAX_RING).contains(&cap) {
        return Ok(());
    }
    Err(ShmError::Ring(format!(
        "a ring's capacity must be a power of two from {MIN_RING} to {MAX_RING} bytes, not {cap}"
    )))
}

fn mapping_len(cap: usize) -> usize {
    2 * (HEADER + cap)
}

fn rings(map: &Arc<Mapping>, cap: usize) -> (Ring, Ring) {
    let ring = |base| Ring { map: Arc::clone(map), base, cap };
    (ring(0), ring(HEADER + cap))
}

impl DaemonEnds {
    /// A new channel whose rings hold `cap` bytes each (a power of two, see [`MIN_RING`] and
    /// [`MAX_RING`]).
    pub fn create(cap: usize) -> Result<Self, ShmError> {
        check_capacity(cap)?;
        let len = mapping_len(cap);
        let create = |e: io::Error| ShmError::Create { len, source: e };
        let fd = anonymous_fd("asyncflow-ring", len).map_err(create)?;
        fs::ftruncate(&fd, len as u64).map_err(|e| create(e.into()))?;
        let ptr = map(&fd, len, ProtFlags::READ | ProtFlags::WRITE)?;
        let map = Arc::new(Mapping { ptr, len });
        let (requests, replies) = rings(&map, cap);
        let bell = || Bell::new().map_err(create);
        Ok(Self {
            requests: Consumer { ring: requests, tail: 0, bytes: bell()?, room: bell()? },
            replies: Producer { ring: replies, head: 0, bytes: bell()?, room: bell()? },
            memory: fd,
        })
    }

    /// What the client needs to open its ends, in the order [`ClientEnds::open`] takes them.
    pub fn descriptors(&self) -> [BorrowedFd<'_>; CHANNEL_FDS] {
        [
            self.memory.as_fd(),
            self.requests.bytes.fd(),
            self.requests.room.fd(),
            self.replies.bytes.fd(),
            self.replies.room.fd(),
        ]
    }
}

impl ClientEnds {
    /// Maps a channel the daemon created with rings of `cap` bytes, from the descriptors
    /// [`DaemonEnds::descriptors`] lists.
    pub fn open(cap: usize, fds: Vec<OwnedFd>) -> Result<Self, ShmError> {
        check_capacity(cap)?;
        let Ok::<[OwnedFd; CHANNEL_FDS], _>([fd, asked, room_to_ask, answered, room_to_answer]) =
            fds.try_into()
        else {
            return Err(ShmError::Ring(format!("a channel comes as {CHANNEL_FDS} descriptors")));
        };
        let len = mapping_len(cap);
        let actual = fs::fstat(&fd).map_err(|e| ShmError::Map { len, source: e.into() })?.st_size;
        if u64::try_from(actual).ok() != Some(len as u64) {
            return Err(ShmError::SizeMismatch { expected: len, actual: actual as u64 });
        }
        let ptr = map(&fd, len, ProtFlags::READ | ProtFlags::WRITE)?;
        drop(fd);
        let map = Arc::new(Mapping { ptr, len });
        let (requests, replies) = rings(&map, cap);
        let head = requests.word64(HEAD).load(Ordering::Acquire);
        let tail = replies.word64(TAIL).load(Ordering::Acquire);
        Ok(Self {
            requests: Producer {
                ring: requests,
                head,
                bytes: Bell(asked),
                room: Bell(room_to_ask),
            },
            replies: Consumer {
                ring: replies,
                tail,
                bytes: Bell(answered),
                room: Bell(room_to_answer),
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(cap: usize) -> (DaemonEnds, ClientEnds) {
        let daemon = DaemonEnds::create(cap).unwrap();
        let fds = daemon.descriptors().iter().map(|f| f.try_clone_to_owned().unwrap()).collect();
        let client = ClientEnds::open(cap, fds).unwrap();
        (daemon, client)
    }

    #[test]
    fn bytes_cross_in_order_around_the_end_of_the_ring_and_a_full_ring_takes_nothing() {
        let (mut daemon, mut client) = pair(MIN_RING);
        let mut sent = Vec::new();
        let mut got = Vec::new();
        let mut buf = vec![0u8; 1000];
        for round in 0..50u32 {
            // 50 rounds of 3001 bytes wrap the 4 KiB ring many times, at odd offsets.
            let msg: Vec<u8> = (0..3001u32).map(|i| (i * 7 + round) as u8).collect();
            let mut rest = &msg[..];
            while !rest.is_empty() {
                let n = client.requests.push(rest).unwrap();
                rest = &rest[n..];
                let k = daemon.requests.pop(&mut buf).unwrap();
                got.extend_from_slice(&buf[..k]);
            }
            sent.extend_from_slice(&msg);
        }
        while let Ok(k @ 1..) = daemon.requests.pop(&mut buf) {
            got.extend_from_slice(&buf[..k]);
        }
        assert_eq!(got, sent);
        // Full: a push takes nothing until the consumer reads.
        assert_eq!(daemon.replies.push(&vec![1u8; MIN_RING + 10]).unwrap(), MIN_RING);
        assert_eq!(daemon.replies.push(b"more").unwrap(), 0);
        assert_eq!(client.replies.available().unwrap(), MIN_RING);
        assert_eq!(client.replies.pop(&mut buf[..10]).unwrap(), 10);
        assert_eq!(daemon.replies.push(b"more than ten").unwrap(), 10);
    }

    #[test]
    fn a_sleeper_is_rung_once_and_a_side_that_does_not_sleep_is_never_rung() {
        let (mut daemon, mut client) = pair(MIN_RING);
        // Nobody sleeps: a push and its wake-up ring no bell.
        client.requests.push(b"a").unwrap();
        client.requests.wake_consumer();
        assert!(!daemon.requests.bytes_bell().silence());
        // Bytes are there: the daemon does not sleep.
        assert!(!daemon.requests.sleep_for_bytes().unwrap());
        assert_eq!(daemon.requests.pop(&mut [0u8; 8]).unwrap(), 1);
        // Nothing there: it sleeps, and the next push rings it once.
        assert!(daemon.requests.sleep_for_bytes().unwrap());
        client.requests.push(b"b").unwrap();
        client.requests.wake_consumer();
        client.requests.wake_consumer();
        assert!(daemon.requests.bytes_bell().silence());
        assert!(!daemon.requests.bytes_bell().silence(), "rung twice");
        // A full ring: the producer sleeps for room and the consumer's read rings it.
        daemon.replies.push(&[0u8; MIN_RING]).unwrap();
        assert!(daemon.replies.sleep_for_room().unwrap());
        client.replies.pop(&mut [0u8; 1]).unwrap();
        assert!(daemon.replies.room_bell().silence());
        daemon.replies.awake();
    }

    #[test]
    fn a_reader_asleep_for_one_reply_is_rung_by_that_reply_only_and_two_sleepers_by_any() {
        let (mut daemon, mut client) = pair(MIN_RING);
        let watcher = client.replies.watcher().unwrap();
        let rung = || watcher.bell().silence();
        let mut take = || client.replies.pop(&mut [0u8; 64]).unwrap();
        // Asleep for request 7's reply: the replies to 5 and 6 pass it by, 7's rings it.
        assert!(watcher.sleep_for(waiting_for(7)));
        daemon.replies.push(b"5").unwrap();
        daemon.replies.wake_consumer_for(&[5, 6]);
        assert!(!rung(), "rung for replies it does not wait for");
        assert_eq!(take(), 1);
        daemon.replies.push(b"67").unwrap();
        daemon.replies.wake_consumer_for(&[6, 7]);
        assert!(rung());
        daemon.replies.wake_consumer_for(&[7]);
        assert!(!rung(), "rung twice");
        assert_eq!(take(), 2);
        // Two sleepers on one word, waiting for different replies: any reply rings.
        assert!(watcher.sleep_for(waiting_for(8)));
        assert!(watcher.sleep_for(waiting_for(9)));
        daemon.replies.push(b"3").unwrap();
        daemon.replies.wake_consumer_for(&[3]);
        assert!(rung());
        assert_eq!(take(), 1);
        // The same announcement twice stays that one; a plain wake-up (more bytes to come, as in
        // a reply larger than the ring) rings whatever a reader sleeps for.
        assert!(watcher.sleep_for(waiting_for(8)));
        assert!(watcher.sleep_for(waiting_for(8)));
        daemon.replies.push(b"9").unwrap();
        daemon.replies.wake_consumer_for(&[9]);
        assert!(!rung());
        daemon.replies.wake_consumer();
        assert!(rung());
        // With bytes there nobody sleeps, whatever it waits for.
        assert!(!watcher.sleep_for(waiting_for(8)));
        assert!(!watcher.sleep_for(ANY));
    }

    #[test]
    fn a_notice_that_bytes_are_coming_is_taken_once_and_rings_only_a_sleeper() {
        let (daemon, mut client) = pair(MIN_RING);
        assert!(!daemon.requests.expected());
        // Awake: the notice is a flag, no bell.
        client.requests.expect();
        assert!(!daemon.requests.bytes_bell().silence());
        assert!(daemon.requests.expected());
        assert!(!daemon.requests.expected(), "taken twice");
        // Asleep: the notice rings, once, with nothing in the ring.
        assert!(daemon.requests.sleep_for_bytes().unwrap());
        client.requests.expect();
        assert!(daemon.requests.bytes_bell().silence());
        daemon.requests.awake();
        assert_eq!(daemon.requests.available().unwrap(), 0);
        assert!(daemon.requests.expected());
        // The bytes that follow do not ring again: the sleeper was already woken.
        client.requests.push(b"x").unwrap();
        client.requests.wake_consumer();
        assert!(!daemon.requests.bytes_bell().silence());
    }

    #[test]
    fn an_index_the_other_side_made_up_is_refused() {
        let (mut daemon, client) = pair(MIN_RING);
        // A hostile client publishes a head past what the ring can hold.
        client.requests.ring.word64(HEAD).store(MIN_RING as u64 + 1, Ordering::Release);
        let err = daemon.requests.pop(&mut [0u8; 8]).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
        // Or a tail ahead of the daemon's head.
        client.replies.ring.word64(TAIL).store(5, Ordering::Release);
        assert!(daemon.replies.push(b"x").is_err());
    }

    #[test]
    fn a_capacity_that_is_no_power_of_two_or_descriptors_of_the_wrong_size_are_refused() {
        assert!(matches!(DaemonEnds::create(5000), Err(ShmError::Ring(_))));
        let daemon = DaemonEnds::create(MIN_RING).unwrap();
        let fds: Vec<OwnedFd> =
            daemon.descriptors().iter().map(|f| f.try_clone_to_owned().unwrap()).collect();
        assert!(matches!(ClientEnds::open(2 * MIN_RING, fds), Err(ShmError::SizeMismatch { .. })));
    }
}
