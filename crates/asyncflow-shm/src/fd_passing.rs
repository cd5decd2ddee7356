//! File descriptors across a Unix socket (`SCM_RIGHTS`), which is how a segment reaches a client
//! without ever having a name in a file system. Works on any socket descriptor, blocking or not.

use std::io;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};

/// Descriptors one message may carry.
pub const MAX_FDS: usize = 16;

/// Sends `bytes` (some of them: returns how many) with `fds` attached to the first byte.
pub fn send_with_fds(
    socket: BorrowedFd<'_>,
    bytes: &[u8],
    fds: &[BorrowedFd<'_>],
) -> io::Result<usize> {
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut ancillary = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() && !ancillary.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "too many descriptors"));
    }
    let iov = [io::IoSlice::new(bytes)];
    Ok(rustix::net::sendmsg(socket, &iov, &mut ancillary, SendFlags::NOSIGNAL)?)
}

/// Receives into `buf`, appending any descriptors that arrive to `fds`. Returns the byte count
/// (0 at end of stream). With `flags` holding `DONTWAIT`, a socket with nothing to read fails
/// with `WouldBlock` instead of waiting.
pub fn recv_with_fds(
    socket: impl AsFd,
    buf: &mut [u8],
    fds: &mut Vec<OwnedFd>,
    flags: RecvFlags,
) -> io::Result<usize> {
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut ancillary = RecvAncillaryBuffer::new(&mut space);
    let mut iov = [io::IoSliceMut::new(buf)];
    let msg =
        rustix::net::recvmsg(socket, &mut iov, &mut ancillary, flags | RecvFlags::CMSG_CLOEXEC)?;
    for message in ancillary.drain() {
        if let RecvAncillaryMessage::ScmRights(received) = message {
            fds.extend(received);
        }
    }
    if msg.flags.contains(ReturnFlags::CTRUNC) {
        // The kernel closed descriptors it could not hand over: the stream's bytes are read,
        // what came with them is lost.
        return Err(io::Error::other(
            "descriptors sent with this message were dropped: the process has no room for more \
             (see its open-file limit, RLIMIT_NOFILE)",
        ));
    }
    Ok(msg.bytes)
}

#[cfg(test)]
mod tests {
    use std::os::unix::net::UnixStream;

    use super::*;
    use crate::segment::Segment;

    #[test]
    fn a_segment_descriptor_crosses_a_socket_and_maps_the_same_bytes() {
        let (a, b) = UnixStream::pair().unwrap();
        let seg = Segment::create(7, 4096).unwrap();
        seg.write(0, b"shared").unwrap();
        assert_eq!(send_with_fds(a.as_fd(), b"x", &[seg.fd()]).unwrap(), 1);
        let (mut buf, mut fds) = ([0u8; 4], Vec::new());
        assert_eq!(recv_with_fds(&b, &mut buf, &mut fds, RecvFlags::empty()).unwrap(), 1);
        let mapped = Segment::open(7, fds.pop().unwrap(), 4096).unwrap();
        assert_eq!(&mapped.bytes()[..6], b"shared");
    }

    /// Descriptors the receiver cannot take (here: more than its buffer has room for) are
    /// closed by the kernel; the receive says so instead of returning the bytes without them.
    #[test]
    fn descriptors_the_kernel_dropped_fail_the_receive() {
        let (a, b) = UnixStream::pair().unwrap();
        let seg = Segment::create(7, 4096).unwrap();
        let many = vec![seg.fd(); 4 * MAX_FDS];
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(4 * MAX_FDS))];
        let mut ancillary = SendAncillaryBuffer::new(&mut space);
        assert!(ancillary.push(SendAncillaryMessage::ScmRights(&many)));
        let iov = [io::IoSlice::new(b"x")];
        rustix::net::sendmsg(&a, &iov, &mut ancillary, SendFlags::empty()).unwrap();
        let (mut buf, mut fds) = ([0u8; 4], Vec::new());
        let err = recv_with_fds(&b, &mut buf, &mut fds, RecvFlags::empty()).unwrap_err();
        assert!(err.to_string().contains("RLIMIT_NOFILE"), "{err}");
    }
}
