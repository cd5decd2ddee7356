//! The hello a link opens with: the client's token, host and leases; the daemon's answer.

use std::os::fd::OwnedFd;

use asyncflow_proto::{Hello, Limits, Reply, Request, ServerHello, decode_answer};

use super::frames::{read_frame, write_frame};
use super::stream::Stream;
use super::{Policy, timed_out};
use crate::error::{Error, Result};
use crate::host::host_id;

/// What a hello asks for beyond the token.
#[derive(Clone, Copy)]
pub(super) enum Ask<'a> {
    /// Only the daemon's answer (`Hello::probe`): where its Unix socket is, and which machine.
    Probe,
    /// To be served, keeping `leases` and with rings of `ring` bytes each (0: none).
    Serve { leases: &'a [u64], ring: u64 },
}

/// Says hello and returns the daemon's answer with the descriptors that came with it; a refused
/// token is [`Error::Auth`]. The socket's timeouts bound the wait.
pub(super) fn greet(
    stream: &mut Stream,
    token: Option<&str>,
    ask: Ask<'_>,
    address: &str,
    policy: &Policy,
) -> Result<(ServerHello, Vec<OwnedFd>)> {
    let (leases, ring, probe) = match ask {
        Ask::Probe => (Vec::new(), 0, true),
        Ask::Serve { leases, ring } => (leases.to_vec(), ring, false),
    };
    let hello = Request::Hello(Hello {
        token: token.map(str::to_owned),
        host: host_id().into(),
        leases,
        ring,
        probe,
    });
    let wait = policy.request_timeout;
    stream.set_timeouts(Some(wait), Some(wait))?;
    let silent = |e: Error| match e {
        Error::Io(io)
            if matches!(
                io.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) =>
        {
            timed_out("hello", address, wait)
        }
        other => other,
    };
    write_frame(stream, 0, &hello, &[]).map_err(|e| silent(e.into()))?;
    let mut refuse_idle = || Err(std::io::ErrorKind::TimedOut.into());
    let frame = read_frame(stream, Limits::DEFAULT, &mut refuse_idle).map_err(silent)?;
    match decode_answer(frame.header.op, &frame.meta, frame.payload.len() as u64)? {
        Ok(Reply::Hello(h)) => Ok((h, frame.fds)),
        Ok(other) => Err(Error::connection(format!("unexpected answer to hello: {other:?}"))),
        Err(failure) => Err(failure.into()),
    }
}
