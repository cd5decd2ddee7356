//! The Unix socket of the shared-memory path never outlives its daemon: it is removed when a
//! start fails after binding it, and a daemon that was killed has its socket removed by the next
//! one to start. Only stale sockets of this user go: a live one is never touched. A client
//! uses a socket only if the daemon behind it is the one it reached over TCP.

mod support;

use std::os::unix::net::UnixListener;
use std::path::PathBuf;

use asyncflow_server::client::{Client, Preference};
use support::{Daemon, NOW, POLICY, put_ints, read_ints};

fn temp(name: &str) -> PathBuf {
    let path = std::env::temp_dir().join(name);
    let _ = std::fs::remove_file(&path);
    path
}

#[test]
fn a_failed_start_removes_its_socket() {
    // The metrics port is taken, which fails start-up after the Unix socket is bound.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let metrics = taken.local_addr().unwrap().to_string();
    let socket = temp(&format!("af-failed-start-{}.sock", std::process::id()));
    let path = socket.to_str().unwrap();
    let err = Daemon::try_start(&["--metrics", &metrics, "--shm-socket", path]).err().unwrap();
    assert!(err.to_string().contains("metrics"), "{err}");
    assert!(!socket.exists(), "the socket of a failed start is removed");
}

#[test]
fn a_killed_daemons_socket_is_removed_by_the_next_start_and_a_live_one_kept() {
    // No process has a pid this large: these are the sockets of daemons that were killed.
    let dead = temp("asyncflow-store-999999999-7379-0.sock");
    drop(UnixListener::bind(&dead).unwrap());
    let dead_but_not_a_socket = temp("asyncflow-store-999999998-7379-0.sock");
    std::fs::write(&dead_but_not_a_socket, b"mine").unwrap();
    // A live daemon's socket (this very process).
    let live_path = temp(&format!("asyncflow-store-{}-1-999.sock", std::process::id()));
    let live = UnixListener::bind(&live_path).unwrap();

    let daemon = Daemon::start(&[]);
    assert!(!dead.exists(), "a dead daemon's socket is removed at start");
    assert!(dead_but_not_a_socket.exists(), "a file that is no socket is left be");
    assert!(live_path.exists(), "a live socket is left be");
    drop(daemon);

    // A daemon told to use a live socket's path refuses rather than steal it.
    let err = Daemon::try_start(&["--shm-socket", live_path.to_str().unwrap()]).err().unwrap();
    assert!(err.to_string().contains("in use"), "{err}");
    assert!(live_path.exists());
    drop(live);
    for path in [dead_but_not_a_socket, live_path] {
        std::fs::remove_file(path).unwrap();
    }
}

/// A daemon whose `--shm-socket` path is served by another daemon (its socket file replaced
/// after it bound it): a client that reached it over TCP must not send its data to the other.
#[test]
fn a_client_never_uses_a_socket_another_daemon_serves() {
    let (path_a, path_b) = (temp("instance-a.sock"), temp("instance-b.sock"));
    let a = Daemon::start(&["--shm-socket", path_a.to_str().unwrap()]);
    let b = Daemon::start(&["--shm-socket", path_b.to_str().unwrap()]);
    // b's path now leads to a.
    std::fs::rename(&path_a, &path_b).unwrap();
    let shm = Client::connect_with(&b.url(), None, Preference::Shm, POLICY).err().unwrap();
    assert!(shm.to_string().contains("served by another daemon"), "{shm}");
    // Preferring shared memory where possible, the client stays on TCP to b.
    let client = b.connect(Preference::Auto);
    assert_eq!(client.transport(), "tcp");
    let rows = put_ints(&client, "x", &[42]);
    let over_tcp = b.connect(Preference::Tcp);
    assert_eq!(read_ints(&over_tcp, &rows, "x"), vec![42]);
    assert!(a.connect(Preference::Tcp).rows(None, None, NOW).unwrap().is_empty(), "a got the row");
}
