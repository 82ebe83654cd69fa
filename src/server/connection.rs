//! The HTTP connections: accepted up to a cap, each served by hyper's HTTP/1 with a header
//! (and idle) timeout and a timeout on every write, and closed at a deadline after a shutdown.
//!
//! `axum::serve` sets none of these: a client could hold a connection open for ever by sending
//! nothing, or by never reading a stream.

use super::config::ConnectionLimits;
use axum::Router;
use hyper_util::{
    rt::{TokioIo, TokioTimer},
    server::graceful::GracefulShutdown,
    service::TowerToHyperService,
};
use std::{
    future::Future,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::Duration,
};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpListener,
    sync::Semaphore,
    task::JoinSet,
};
use tokio_io_timeout::TimeoutStream;

/// Open connections, for `/metrics`.
#[derive(Debug, Default)]
pub(super) struct ConnectionCounts {
    pub(super) open: AtomicUsize,
    pub(super) refused: AtomicUsize,
}

/// Counts a connection open while it lives.
struct Open(Arc<ConnectionCounts>);

impl Open {
    fn new(counts: &Arc<ConnectionCounts>) -> Self {
        counts.open.fetch_add(1, Ordering::SeqCst);
        Self(Arc::clone(counts))
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Bytes hyper buffers per connection, each way: the largest request head, and the output
/// held for a client that reads slowly.
const CONNECTION_BUFFER_BYTES: usize = 64 << 10;

/// What a connection past the cap is told before it is closed.
fn refusal() -> Vec<u8> {
    let body = r#"{"error":{"message":"too many connections; try again later","type":"service_unavailable","param":null,"code":null}}"#;
    format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
         connection: close\r\nretry-after: 1\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// Serves `app` on `listener` until `shutdown` completes; then takes no more connections, lets
/// the requests in flight finish within `limits.shutdown_deadline`, and closes what is left.
pub(super) async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ConnectionLimits,
    counts: Arc<ConnectionCounts>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let permits = Arc::new(Semaphore::new(limits.max_connections));
    let graceful = GracefulShutdown::new();
    let mut connections = JoinSet::new();
    let mut http = hyper::server::conn::http1::Builder::new();
    // hyper buffers up to about 400 KB per connection by default: 64 KB bounds what a slow
    // reader holds (and the size of a request's headers), so that a stalled stream is found
    // after that much, not 400 KB, of its output.
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .keep_alive(true)
        .max_buf_size(CONNECTION_BUFFER_BYTES);
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = &mut shutdown => break,
        };
        // Finished connections' tasks, so that the set holds only live ones.
        while connections.try_join_next().is_some() {}
        let stream = match accepted {
            Ok((stream, _)) => stream,
            // Out of file descriptors, or a connection reset before it was taken: the server
            // goes on (a moment later, where the process is out of descriptors).
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let Ok(permit) = Arc::clone(&permits).try_acquire_owned() else {
            counts.refused.fetch_add(1, Ordering::Relaxed);
            let mut stream = stream;
            tokio::spawn(async move {
                // The answer, then the end of what we send; what the client sent is read and
                // dropped for a moment, so that closing does not reset the connection (which
                // would discard the answer) before the client has read it.
                let _ = tokio::time::timeout(Duration::from_secs(1), async {
                    stream.write_all(&refusal()).await?;
                    stream.shutdown().await?;
                    let mut sink = [0u8; 4096];
                    while stream.read(&mut sink).await? > 0 {}
                    Ok::<_, std::io::Error>(())
                })
                .await;
            });
            continue;
        };
        let _ = stream.set_nodelay(true);
        let mut io = TimeoutStream::new(stream);
        io.set_write_timeout(Some(limits.write_timeout));
        let io = TokioIo::new(Box::pin(io));
        let connection = graceful.watch(http.serve_connection(io, TowerToHyperService::new(app.clone())));
        let open = Open::new(&counts);
        connections.spawn(async move {
            // A connection's end (a client gone, a timeout) is no error of the server's.
            let _ = connection.await;
            drop((open, permit));
        });
    }
    drop(listener);
    if tokio::time::timeout(limits.shutdown_deadline, graceful.shutdown()).await.is_err() {
        connections.abort_all();
    }
    while connections.join_next().await.is_some() {}
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    /// A write the reader never takes fails after the write timeout, instead of waiting for ever.
    #[tokio::test]
    async fn a_write_nobody_reads_times_out() {
        let (client, server) = tokio::io::duplex(64);
        let mut io = TimeoutStream::new(server);
        io.set_write_timeout(Some(Duration::from_millis(100)));
        let mut io = Box::pin(io);
        let started = std::time::Instant::now();
        let written = io.write_all(&[7u8; 4096]).await;
        let e = written.expect_err("the write should time out");
        assert_eq!(e.kind(), std::io::ErrorKind::TimedOut);
        assert!(started.elapsed() >= Duration::from_millis(100), "{:?}", started.elapsed());
        drop(client);
    }

    #[test]
    fn the_refusal_is_a_whole_json_response() {
        let text = String::from_utf8(refusal()).unwrap_or_default();
        let (head, body) = text.split_once("\r\n\r\n").unwrap_or_default();
        assert!(head.starts_with("HTTP/1.1 503"), "{head}");
        assert!(head.contains(&format!("content-length: {}", body.len())), "{head}");
        let json: serde_json::Value = serde_json::from_str(body).unwrap_or_default();
        assert_eq!(json["error"]["type"], "service_unavailable");
    }
}
