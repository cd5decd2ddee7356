//! One shared-memory segment: a memfd (or, where memfd is missing, a /dev/shm file unlinked the
//! moment it is created), readable and writable only by its owner (mode 0600), mapped shared.
//!
//! A segment received from its owner is mapped read-only (`PROT_READ`) for reading: the views a
//! client hands out point into that mapping, so a write through one of them (an in-place op on a
//! tensor made from a read-only array) faults instead of changing what every other reader of the
//! cell sees. Writing a staged region goes through a second, writable mapping made on the first
//! `write`, which nothing but `write` ever touches.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

use rustix::fs::{self, Mode, OFlags};
use rustix::mm::{self, MapFlags, ProtFlags};

use crate::error::ShmError;

/// A mapped segment. Both processes may write it; the protocol decides who writes when (a
/// client writes a staged region before its put, nobody writes a region while it holds cells).
#[derive(Debug)]
pub struct Segment {
    id: u64,
    fd: OwnedFd,
    /// The mapping `bytes` reads: read-write in the owner, read-only in a receiver.
    ptr: NonNull<u8>,
    /// The mapping `write` writes: `ptr` itself in the owner; in a receiver, a writable mapping
    /// of its own, made on the first write.
    writable: OnceLock<NonNull<u8>>,
    len: usize,
}

// SAFETY: the mapping is plain shared memory owned by this value; access discipline is the
// protocol's (see the type's docs), and the pointer is only unmapped on drop.
unsafe impl Send for Segment {}
// SAFETY: as above.
unsafe impl Sync for Segment {}

fn owner_only() -> Mode {
    Mode::RUSR | Mode::WUSR
}

/// A new file of no size, named `name` where the kernel shows it (`/proc/PID/fd`).
pub(crate) fn anonymous_fd(name: &str, len: usize) -> std::io::Result<OwnedFd> {
    match fs::memfd_create(name, fs::MemfdFlags::CLOEXEC) {
        Ok(fd) => {
            fs::fchmod(&fd, owner_only())?;
            Ok(fd)
        }
        Err(rustix::io::Errno::NOSYS) => unlinked_shm_file(len),
        Err(e) => Err(e.into()),
    }
}

/// The fallback for kernels without memfd: a fresh /dev/shm file, unlinked at once so nothing
/// is left behind whatever happens to this process.
fn unlinked_shm_file(len: usize) -> std::io::Result<OwnedFd> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let name = format!(
        "/dev/shm/asyncflow-{}-{}-{len}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    );
    let flags = OFlags::RDWR | OFlags::CREATE | OFlags::EXCL | OFlags::CLOEXEC;
    let fd = fs::open(name.as_str(), flags, owner_only())?;
    fs::unlink(name.as_str())?;
    Ok(fd)
}

pub(crate) fn map(fd: &OwnedFd, len: usize, prot: ProtFlags) -> Result<NonNull<u8>, ShmError> {
    // SAFETY: a fresh shared mapping of a file we hold; no existing memory is affected.
    let ptr = unsafe { mm::mmap(std::ptr::null_mut(), len.max(1), prot, MapFlags::SHARED, fd, 0) }
        .map_err(|e| ShmError::Map { len, source: e.into() })?;
    Ok(NonNull::new(ptr.cast()).expect("mmap never returns null on success"))
}

impl Segment {
    /// Creates a zero-filled segment of `len` bytes.
    pub fn create(id: u64, len: usize) -> Result<Self, ShmError> {
        let create = |e: std::io::Error| ShmError::Create { len, source: e };
        let fd = anonymous_fd("asyncflow-segment", len).map_err(create)?;
        fs::ftruncate(&fd, len as u64).map_err(|e| create(e.into()))?;
        let ptr = map(&fd, len, ProtFlags::READ | ProtFlags::WRITE)?;
        Ok(Self { id, fd, ptr, writable: OnceLock::from(ptr), len })
    }

    /// Maps a segment received from its owner, after checking it really has `len` bytes. The
    /// mapping `bytes` reads is read-only.
    pub fn open(id: u64, fd: OwnedFd, len: usize) -> Result<Self, ShmError> {
        let actual = fs::fstat(&fd).map_err(|e| ShmError::Map { len, source: e.into() })?.st_size;
        if u64::try_from(actual).ok() != Some(len as u64) {
            return Err(ShmError::SizeMismatch { expected: len, actual: actual as u64 });
        }
        let ptr = map(&fd, len, ProtFlags::READ)?;
        Ok(Self { id, fd, ptr, writable: OnceLock::new(), len })
    }

    pub fn id(&self) -> u64 {
        self.id
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Where `bytes` starts.
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    /// The segment's bytes. Another process may write them while the protocol allows it; a
    /// reader only looks at cells that nobody writes any more.
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: `len` bytes are mapped at `ptr` for as long as `self` lives.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// Copies `src` to `offset`. Callers write only regions staged for them.
    pub fn write(&self, offset: usize, src: &[u8]) -> Result<(), ShmError> {
        assert!(offset.checked_add(src.len()).is_some_and(|end| end <= self.len), "write past end");
        let dst = self.writable_ptr()?;
        // SAFETY: bounds checked above; the destination is mapped and writable, and a staged
        // region is written by its one stager only.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst.as_ptr().add(offset), src.len()) }
        Ok(())
    }

    fn writable_ptr(&self) -> Result<NonNull<u8>, ShmError> {
        if let Some(&ptr) = self.writable.get() {
            return Ok(ptr);
        }
        let fresh = map(&self.fd, self.len, ProtFlags::READ | ProtFlags::WRITE)?;
        if let Err(lost) = self.writable.set(fresh) {
            // Another thread mapped it first: keep theirs.
            // SAFETY: `lost` was mapped just above with this length and was never shared.
            let _ = unsafe { mm::munmap(lost.as_ptr().cast(), self.len.max(1)) };
        }
        Ok(*self.writable.get().expect("set above"))
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        let len = self.len.max(1);
        if let Some(&w) = self.writable.get().filter(|&&w| w != self.ptr) {
            // SAFETY: a mapping of its own, made in `writable_ptr`, not used after drop.
            let _ = unsafe { mm::munmap(w.as_ptr().cast(), len) };
        }
        // SAFETY: this mapping was created in `map` with this length and is not used after drop.
        let _ = unsafe { mm::munmap(self.ptr.as_ptr().cast(), len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_segment_is_private_to_its_owner_and_shared_by_its_mappings() {
        let seg = Segment::create(1, 8192).unwrap();
        let mode = fs::fstat(seg.fd()).unwrap().st_mode & 0o777;
        assert_eq!(mode, 0o600);
        let again = Segment::open(1, seg.fd().try_clone_to_owned().unwrap(), 8192).unwrap();
        seg.write(100, b"hello").unwrap();
        assert_eq!(&again.bytes()[100..105], b"hello");
    }

    /// The permissions (`rw-s`, `r--s`, ...) of this process's mapping that holds `addr`.
    fn permissions_at(addr: usize) -> String {
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        for line in maps.lines() {
            let mut fields = line.split_whitespace();
            let (range, perms) = (fields.next().unwrap(), fields.next().unwrap());
            let (start, end) = range.split_once('-').unwrap();
            let start = usize::from_str_radix(start, 16).unwrap();
            let end = usize::from_str_radix(end, 16).unwrap();
            if (start..end).contains(&addr) {
                return perms.to_owned();
            }
        }
        panic!("no mapping holds {addr:#x}")
    }

    #[test]
    fn a_received_segment_is_read_through_a_read_only_mapping() {
        let seg = Segment::create(1, 8192).unwrap();
        let again = Segment::open(1, seg.fd().try_clone_to_owned().unwrap(), 8192).unwrap();
        // What views of the received segment point into: a write through one must fault, not
        // change what the owner and every other reader see.
        assert_eq!(permissions_at(again.as_ptr() as usize), "r--s");
        assert_eq!(permissions_at(again.as_ptr() as usize + 8191), "r--s");
        assert_eq!(permissions_at(seg.as_ptr() as usize), "rw-s");
        // Staging still writes it, through a mapping of its own; the read mapping stays read-only.
        again.write(8000, b"staged").unwrap();
        assert_eq!(&seg.bytes()[8000..8006], b"staged");
        assert_eq!(&again.bytes()[8000..8006], b"staged");
        assert_eq!(permissions_at(again.as_ptr() as usize), "r--s");
        let writable = *again.writable.get().unwrap();
        assert_ne!(writable, again.ptr);
        assert_eq!(permissions_at(writable.as_ptr() as usize), "rw-s");
        again.write(0, b"again").unwrap();
        assert_eq!(*again.writable.get().unwrap(), writable, "mapped once");
        assert_eq!(&seg.bytes()[..5], b"again");
    }

    #[test]
    fn a_descriptor_of_the_wrong_size_is_refused() {
        let seg = Segment::create(1, 4096).unwrap();
        let fd = seg.fd().try_clone_to_owned().unwrap();
        assert!(matches!(Segment::open(1, fd, 8192), Err(ShmError::SizeMismatch { .. })));
    }
}
