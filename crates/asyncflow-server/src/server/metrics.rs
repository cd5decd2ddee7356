//! Prometheus metrics in the text exposition format, on their own address so scraping never
//! competes with clients: connection and request counters kept here, store gauges read at
//! scrape time.

use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use super::Daemon;

#[derive(Debug, Default)]
pub struct Metrics {
    pub connections: AtomicU64,
    pub refused_connections: AtomicU64,
    pub evicted_connections: AtomicU64,
    pub requests: AtomicU64,
    pub request_errors: AtomicU64,
    pub protocol_errors: AtomicU64,
    pub auth_failures: AtomicU64,
    pub leases_given_back: AtomicU64,
    pub bytes_in: AtomicU64,
    pub bytes_out: AtomicU64,
    /// Claims waiting for their rows now.
    pub waiting_claims: AtomicU64,
}

impl Metrics {
    pub fn render(&self, daemon: &Daemon) -> String {
        let mut out = String::new();
        let mut metric = |name: &str, kind: &str, help: &str, value: u64| {
            let _ = writeln!(
                out,
                "# HELP asyncflow_{name} {help}\n# TYPE asyncflow_{name} {kind}\nasyncflow_{name} {value}"
            );
        };
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        metric("connections_total", "counter", "Connections accepted.", load(&self.connections));
        metric(
            "refused_connections_total",
            "counter",
            "Connections refused at --max-connections or --max-unauthenticated.",
            load(&self.refused_connections),
        );
        metric(
            "evicted_connections_total",
            "counter",
            "Idle connections closed to serve a new one at --max-connections.",
            load(&self.evicted_connections),
        );
        metric("requests_total", "counter", "Requests served.", load(&self.requests));
        metric(
            "request_errors_total",
            "counter",
            "Requests that failed.",
            load(&self.request_errors),
        );
        metric(
            "protocol_errors_total",
            "counter",
            "Frames that broke the protocol.",
            load(&self.protocol_errors),
        );
        metric(
            "leases_given_back_total",
            "counter",
            "Leases given back once their connection had been closed for --reconnect-grace.",
            load(&self.leases_given_back),
        );
        metric(
            "auth_failures_total",
            "counter",
            "Connections refused at hello.",
            load(&self.auth_failures),
        );
        metric("received_bytes_total", "counter", "Frame bytes received.", load(&self.bytes_in));
        metric("sent_bytes_total", "counter", "Frame bytes sent.", load(&self.bytes_out));
        metric(
            "waiting_claims",
            "gauge",
            "Claims waiting for their rows.",
            load(&self.waiting_claims),
        );
        let s = daemon.roles.stats();
        metric("live_rows", "gauge", "Rows whose payload is held.", s.index.live_rows);
        metric("payload_rows", "gauge", "Rows with payload bytes on this daemon.", s.payload_rows);
        metric("memory_used_bytes", "gauge", "Payload bytes held.", s.memory_used);
        metric(
            "active_leases",
            "gauge",
            "Leases not yet acked, released or expired.",
            s.index.active_leases,
        );
        metric("rows_put_total", "counter", "Rows written.", s.index.counters.rows_put);
        metric(
            "rows_claimed_total",
            "counter",
            "Rows leased by claims.",
            s.index.counters.rows_claimed,
        );
        metric("rows_acked_total", "counter", "Rows acked.", s.index.counters.rows_acked);
        metric(
            "leases_expired_total",
            "counter",
            "Leases that expired.",
            s.index.counters.leases_expired,
        );
        out
    }
}

/// Answers every HTTP request on `listener` with the metrics page.
pub async fn serve(daemon: Arc<Daemon>, listener: TcpListener) {
    let mut backoff = super::AcceptBackoff::default();
    loop {
        let mut stream = match listener.accept().await {
            Ok((stream, _)) => {
                backoff.accepted("accepting on the metrics port");
                stream
            }
            Err(e) => {
                tokio::time::sleep(backoff.failed("accepting on the metrics port", &e)).await;
                continue;
            }
        };
        let daemon = Arc::clone(&daemon);
        tokio::spawn(async move {
            // The request itself does not matter; read what arrived so the client sees a reply.
            let mut request = [0u8; 1024];
            let _ =
                tokio::time::timeout(std::time::Duration::from_secs(2), stream.read(&mut request))
                    .await;
            let body = daemon.metrics.render(&daemon);
            let head = format!(
                "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                body.len()
            );
            let _ = stream.write_all(head.as_bytes()).await;
            let _ = stream.write_all(body.as_bytes()).await;
            let _ = stream.shutdown().await;
        });
    }
}
