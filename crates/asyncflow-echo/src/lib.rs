//! A loopback TCP echo tuned to be as fast as the socket allows: the ceiling the store
//! benchmark's `tcp/*` cases are measured against.
//!
//! Both ends are pipelined. The client writes its rounds on one thread while it reads the echo
//! on another, and the server forwards each chunk it reads to a writer thread, so no side waits
//! for a round to come back before sending the next. Sockets get `TCP_NODELAY` and
//! [`SOCKET_BUFFER`]-byte send and receive buffers, set before the connection is made so the
//! window scale is negotiated for them.

use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, SocketAddrV4, TcpListener, TcpStream};
use std::sync::{Barrier, mpsc};
use std::thread;
use std::time::{Duration, Instant};

use rustix::net::{AddressFamily, SocketType, sockopt};

/// Bytes of each socket's send and receive buffers: Linux's usual `net.core.{w,r}mem_max`.
/// The kernel caps a larger request at that limit.
pub const SOCKET_BUFFER: usize = 4 << 20;
/// Bytes the server reads at a time, and how many such chunks may wait for its writer.
const CHUNK: usize = 1 << 20;
const CHUNKS: usize = 4;

fn tune(socket: impl rustix::fd::AsFd) -> io::Result<()> {
    let socket = socket.as_fd();
    sockopt::set_socket_send_buffer_size(socket, SOCKET_BUFFER)?;
    sockopt::set_socket_recv_buffer_size(socket, SOCKET_BUFFER)?;
    Ok(())
}

/// A listener on a free loopback port whose connections inherit the tuned buffers.
pub fn listen() -> io::Result<TcpListener> {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
    tune(&listener)?;
    Ok(listener)
}

/// Serves the listener's connections one after another, each until its client shuts down.
pub fn serve(listener: &TcpListener) -> io::Result<()> {
    for stream in listener.incoming() {
        echo(&stream?)?;
    }
    Ok(())
}

/// Sends back every byte read from `stream` until it reaches end of file; returns the count.
pub fn echo(stream: &TcpStream) -> io::Result<u64> {
    stream.set_nodelay(true)?;
    let (full_tx, full_rx) = mpsc::sync_channel::<(Vec<u8>, usize)>(CHUNKS);
    let (free_tx, free_rx) = mpsc::sync_channel::<Vec<u8>>(CHUNKS);
    for _ in 0..CHUNKS {
        free_tx.send(vec![0; CHUNK]).expect("the receiver is held here");
    }
    thread::scope(|s| {
        let writer = s.spawn(move || -> io::Result<u64> {
            let mut out = stream;
            let mut sent = 0;
            for (chunk, n) in full_rx {
                out.write_all(&chunk[..n])?;
                sent += n as u64;
                // The reader may have stopped already; then the chunk is simply dropped.
                let _ = free_tx.send(chunk);
            }
            out.shutdown(std::net::Shutdown::Write)?;
            Ok(sent)
        });
        let mut input = stream;
        let read = loop {
            // An error here means the writer has failed; joining it below reports why.
            let Ok(mut chunk) = free_rx.recv() else { break Ok(()) };
            match input.read(&mut chunk) {
                Ok(0) => break Ok(()),
                Ok(n) => {
                    if full_tx.send((chunk, n)).is_err() {
                        break Ok(());
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => break Err(e),
            }
        };
        drop(full_tx);
        let sent = writer.join().expect("the echo writer panicked")?;
        read.map(|()| sent)
    })
}

/// A tuned connection to the echo server on loopback `port`.
pub fn connect(port: u16) -> io::Result<TcpStream> {
    let socket = rustix::net::socket(AddressFamily::INET, SocketType::STREAM, None)?;
    tune(&socket)?;
    rustix::net::connect(&socket, &SocketAddrV4::new(Ipv4Addr::LOCALHOST, port))?;
    let stream = TcpStream::from(socket);
    stream.set_nodelay(true)?;
    Ok(stream)
}

/// Sends `block` `rounds` times over `stream` while reading the echo back into `back` (one
/// round at a time, so `back` ends holding the last round); returns the time from the first
/// byte sent to the last byte received.
pub fn round_trips(
    stream: &TcpStream,
    block: &[u8],
    rounds: usize,
    back: &mut [u8],
) -> io::Result<Duration> {
    assert_eq!(block.len(), back.len(), "the echo comes back into a buffer of the block's size");
    let start = Barrier::new(2);
    thread::scope(|s| {
        let writer = s.spawn(|| -> io::Result<()> {
            let mut out = stream;
            start.wait();
            for _ in 0..rounds {
                out.write_all(block)?;
            }
            Ok(())
        });
        start.wait();
        let t0 = Instant::now();
        let mut input = stream;
        let mut read = Ok(());
        for _ in 0..rounds {
            read = input.read_exact(back);
            if read.is_err() {
                break;
            }
        }
        let elapsed = t0.elapsed();
        writer.join().expect("the round writer panicked")?;
        read.map(|()| elapsed)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn server() -> (u16, thread::JoinHandle<io::Result<u64>>) {
        let listener = listen().unwrap();
        let port = listener.local_addr().unwrap().port();
        let served = thread::spawn(move || echo(&listener.accept()?.0));
        (port, served)
    }

    #[test]
    fn every_round_comes_back_byte_for_byte() {
        let (port, served) = server();
        let stream = connect(port).unwrap();
        // Not a multiple of the server's chunk, so rounds straddle its reads.
        let block: Vec<u8> = (0..3 * CHUNK + 12_345).map(|i| (i * 7 + i / 251) as u8).collect();
        let mut back = vec![0; block.len()];
        round_trips(&stream, &block, 5, &mut back).unwrap();
        assert!(back == block, "the last round came back different");
        stream.shutdown(std::net::Shutdown::Write).unwrap();
        let mut rest = Vec::new();
        (&stream).read_to_end(&mut rest).unwrap();
        assert!(rest.is_empty(), "the server sent more than it was sent");
        assert_eq!(served.join().unwrap().unwrap(), 5 * block.len() as u64);
    }

    #[test]
    fn the_connection_gets_the_tuned_buffers() {
        let (port, served) = server();
        let stream = connect(port).unwrap();
        // The kernel caps the request at net.core.{w,r}mem_max, then reports twice what it
        // granted (its bookkeeping overhead).
        let cap = |name: &str| -> usize {
            let path = format!("/proc/sys/net/core/{name}");
            std::fs::read_to_string(path).unwrap().trim().parse().unwrap()
        };
        let send = sockopt::socket_send_buffer_size(&stream).unwrap();
        let recv = sockopt::socket_recv_buffer_size(&stream).unwrap();
        assert!(send >= SOCKET_BUFFER.min(cap("wmem_max")), "send buffer {send}");
        assert!(recv >= SOCKET_BUFFER.min(cap("rmem_max")), "receive buffer {recv}");
        assert!(sockopt::tcp_nodelay(&stream).unwrap());
        stream.shutdown(std::net::Shutdown::Write).unwrap();
        assert_eq!(served.join().unwrap().unwrap(), 0);
    }
}
