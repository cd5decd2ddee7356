//! Daemons inside the test process, on loopback ports the kernel picks, stopped on drop.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::thread::JoinHandle;
use std::time::Duration;

use asyncflow_core::{DType, FieldSchema, NewRows, PutTarget, Wait};
use asyncflow_server::client::{Client, Policy, Preference, PutColumn, ReadColumn};
use asyncflow_server::config::Flags;
use tokio::sync::oneshot;

pub const NOW: Wait<'static> = Wait { deadline: None, interrupted: None };

/// Clients of tests give up on a daemon that is gone quickly.
pub const POLICY: Policy =
    Policy { request_timeout: Duration::from_secs(20), reconnect_timeout: Duration::from_secs(1) };

pub struct Daemon {
    pub address: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<asyncflow_server::Result<()>>>,
}

impl Daemon {
    /// Starts a daemon with these flags (plus `--listen 127.0.0.1:0`).
    pub fn start(flags: &[&str]) -> Self {
        Self::start_at("127.0.0.1:0", flags)
    }

    /// Starts a daemon listening on `listen` with these flags.
    pub fn start_at(listen: &str, flags: &[&str]) -> Self {
        Self::try_start_at(listen, flags).expect("daemon started")
    }

    /// Starts a daemon with these flags, or returns why it would not start.
    pub fn try_start(flags: &[&str]) -> asyncflow_server::Result<Self> {
        Self::try_start_at("127.0.0.1:0", flags)
    }

    fn try_start_at(listen: &str, flags: &[&str]) -> asyncflow_server::Result<Self> {
        let mut args =
            vec!["--listen".to_owned(), listen.to_owned(), "--log-level".into(), "warn".into()];
        args.extend(flags.iter().map(|s| (*s).to_owned()));
        let config = Flags::parse_args(args).and_then(Flags::resolve)?;
        let (stop_tx, stop_rx) = oneshot::channel::<()>();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let thread = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(asyncflow_server::server::serve(
                config,
                move |address| ready_tx.send(address).unwrap(),
                async {
                    let _ = stop_rx.await;
                    "test over"
                },
            ))
        });
        match ready_rx.recv_timeout(Duration::from_secs(10)) {
            Ok(address) => Ok(Self { address, stop: Some(stop_tx), thread: Some(thread) }),
            // `serve` returned before it was ready, dropping the sender.
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                Err(thread.join().unwrap().expect_err("serve ended before it was ready"))
            }
            Err(e) => panic!("the daemon did not start: {e}"),
        }
    }

    pub fn url(&self) -> String {
        format!("tcp://{}", self.address)
    }

    pub fn connect(&self, prefer: Preference) -> Client {
        Client::connect_with(&self.url(), None, prefer, POLICY).expect("connected")
    }

    /// Asks the daemon to stop and returns how its `serve` ended.
    pub fn stop(mut self) -> asyncflow_server::Result<()> {
        self.stop.take().unwrap().send(()).unwrap();
        self.thread.take().unwrap().join().unwrap()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
            let _ = self.thread.take().unwrap().join();
        }
    }
}

pub fn new_rows() -> PutTarget {
    PutTarget::New(NewRows { partition: "p".into(), versions: vec![0], ..NewRows::default() })
}

/// Puts one i64 field with one row per value (each row a 1-element array).
pub fn put_ints(client: &Client, field: &str, values: &[i64]) -> Vec<u64> {
    let bytes: Vec<[u8; 8]> = values.iter().map(|v| v.to_le_bytes()).collect();
    let column = PutColumn {
        name: field.into(),
        schema: FieldSchema::ragged(DType::I64, vec![]),
        cells: bytes.iter().map(|b| (b.as_slice(), 1)).collect(),
    };
    client.put(&[column], new_rows(), Some(Duration::from_secs(5)), None, NOW).unwrap()
}

/// Puts one row of `values` in `field`: 4 KiB values or more make it larger than a put that
/// travels in its request, so that over shared memory it is written into a segment.
pub fn put_row(client: &Client, field: &str, values: &[i64]) -> u64 {
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let column = PutColumn {
        name: field.into(),
        schema: FieldSchema::ragged(DType::I64, vec![]),
        cells: vec![(bytes.as_slice(), values.len() as u64)],
    };
    client.put(&[column], new_rows(), Some(Duration::from_secs(5)), None, NOW).unwrap()[0]
}

/// The values of row `row`'s `field`, as `put_row` put them.
pub fn read_row(client: &Client, row: u64, field: &str) -> Vec<i64> {
    let columns = client.read(&[row], &[field.to_owned()], NOW).unwrap();
    columns[0].2[0].bytes().chunks(8).map(|b| i64::from_le_bytes(b.try_into().unwrap())).collect()
}

pub fn read_ints(client: &Client, rows: &[u64], field: &str) -> Vec<i64> {
    ints(&client.read(rows, &[field.to_owned()], NOW).unwrap()[0])
}

/// The values of a column of `put_ints` cells.
pub fn ints(column: &ReadColumn) -> Vec<i64> {
    column.2.iter().map(|c| i64::from_le_bytes(c.bytes().try_into().unwrap())).collect()
}
