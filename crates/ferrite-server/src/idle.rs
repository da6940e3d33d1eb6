//! Closing HTTP connections that hold a place while doing nothing: no request in flight on them
//! and no answer moving for the idle timeout (between keep-alive requests, or an HTTP/2 connection
//! kept open with pings alone). A request being received or computed is never cut: the clock runs
//! only while none is in flight on the connection, and starts again whenever its answers move (at
//! least [`MOVING`] bytes written). Nor may a client hold its answers by not reading them: a write
//! that makes no progress for the idle timeout fails, and so does a connection whose answers wait
//! on a window the client never opens (HTTP/2): closed, with the answers it holds, whatever else
//! is in flight on it once a stream's answers wait on the client ([`InFlight::wait`]).

use std::{
    future::Future,
    io,
    pin::Pin,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    task::{Context, Poll},
    time::Duration,
};

use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    time::{Instant, Sleep},
};

/// Bytes written since the idle clock last started that show the connection's answers moving,
/// more than its own frames (an HTTP/2 ping's acknowledgement is 17 bytes).
pub const MOVING: usize = 1024;

/// Requests in flight on one connection, how many have finished, and how many of its streams
/// have answers waiting on the client.
#[derive(Debug, Default)]
pub struct InFlight {
    now: AtomicUsize,
    finished: AtomicUsize,
    waiting: AtomicUsize,
}

impl InFlight {
    /// Counts one request in flight on the connection until the returned guard is dropped.
    pub fn enter(self: &Arc<Self>) -> Held {
        self.now.fetch_add(1, Ordering::AcqRel);
        Held(self.clone())
    }

    /// A stream's answers wait on the client (`true`), or no longer do: while any does, the
    /// connection counts as idle unless its answers move, whatever else is in flight on it.
    pub fn wait(&self, waiting: bool) {
        if waiting {
            self.waiting.fetch_add(1, Ordering::AcqRel);
            // The idle clock starts again (at the connection's next read), as when work ends.
            self.finished.fetch_add(1, Ordering::AcqRel);
        } else {
            self.waiting.fetch_sub(1, Ordering::AcqRel);
        }
    }

    /// Whether the connection is busy: requests in flight and no answers waiting on the client.
    fn busy(&self) -> bool {
        self.now.load(Ordering::Acquire) > 0 && self.waiting.load(Ordering::Acquire) == 0
    }
}

/// A connection's stream that fails its reads once it has had no request in flight for `idle`, and
/// its writes once they have waited on the client for `idle`.
pub struct IdleIo<T> {
    inner: T,
    in_flight: Arc<InFlight>,
    idle: Duration,
    deadline: Pin<Box<Sleep>>,
    /// `in_flight.finished` when the deadline was last set.
    seen: usize,
    /// Bytes written since the deadline was last set.
    written: usize,
    /// Armed when a write finds the client not reading (the socket's buffer full), until one
    /// makes progress.
    write_deadline: Pin<Box<Sleep>>,
    write_stalled: bool,
}

impl<T> IdleIo<T> {
    pub fn new(inner: T, in_flight: Arc<InFlight>, idle: Duration) -> IdleIo<T> {
        IdleIo {
            inner,
            in_flight,
            idle,
            deadline: Box::pin(tokio::time::sleep(idle)),
            seen: 0,
            written: 0,
            write_deadline: Box::pin(tokio::time::sleep(idle)),
            write_stalled: false,
        }
    }

    fn wrote(&mut self, r: &Poll<io::Result<usize>>) {
        if let Poll::Ready(Ok(n)) = r {
            self.written = self.written.saturating_add(*n);
        }
    }

    /// `r`, a write's outcome, unless the writes have been stuck for the idle timeout.
    fn progress<R>(&mut self, cx: &mut Context<'_>, r: Poll<io::Result<R>>) -> Poll<io::Result<R>> {
        if !r.is_pending() {
            self.write_stalled = false;
            return r;
        }
        if !self.write_stalled {
            self.write_stalled = true;
            let next = Instant::now() + self.idle;
            self.write_deadline.as_mut().reset(next);
        }
        match self.write_deadline.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("the client took no bytes of its answers for {} s", self.idle.as_secs()),
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for IdleIo<T> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let finished = this.in_flight.finished.load(Ordering::Acquire);
        if this.in_flight.busy() || finished != this.seen || this.written >= MOVING {
            // Busy, work ended or answers sent since: the idle clock starts again from now.
            this.seen = finished;
            this.written = 0;
            let next = Instant::now() + this.idle;
            this.deadline.as_mut().reset(next);
        }
        if this.in_flight.busy() {
            return Pin::new(&mut this.inner).poll_read(cx, buf);
        }
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Pending if this.deadline.as_mut().poll(cx).is_ready() => {
                Poll::Ready(Err(io::Error::new(io::ErrorKind::TimedOut, "connection idle")))
            }
            other => other,
        }
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for IdleIo<T> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.inner).poll_write(cx, buf);
        this.wrote(&r);
        this.progress(cx, r)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.inner).poll_flush(cx);
        this.progress(cx, r)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        this.wrote(&r);
        this.progress(cx, r)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

/// One request in flight on a connection; see [`InFlight::enter`].
pub struct Held(Arc<InFlight>);

impl Drop for Held {
    fn drop(&mut self) {
        self.0.finished.fetch_add(1, Ordering::AcqRel);
        self.0.now.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test(start_paused = true)]
    async fn writes_stuck_for_the_idle_timeout_fail_and_slow_progress_does_not() {
        let (ours, mut client) = tokio::io::duplex(1024);
        let mut io = IdleIo::new(ours, Arc::new(InFlight::default()), Duration::from_secs(5));
        // A client reading 1 KiB every 4 s: each write waits, none as long as the timeout.
        let reader = tokio::spawn(async move {
            let mut buf = vec![0; 1024];
            for _ in 0..4 {
                tokio::time::sleep(Duration::from_secs(4)).await;
                client.read_exact(&mut buf).await.unwrap();
            }
            client // kept open, never read again
        });
        io.write_all(&[7; 5 * 1024]).await.unwrap();
        let _client = reader.await.unwrap();
        // Now nothing reads: the next write fails after the timeout.
        let started = Instant::now();
        let stuck = tokio::time::timeout(Duration::from_secs(60), io.write_all(&[7; 2048])).await;
        let err = stuck.expect("the write was still waiting after 60 s").unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert!(err.to_string().contains("no bytes of its answers for 5 s"), "{err}");
        assert_eq!(started.elapsed(), Duration::from_secs(5));
    }

    #[tokio::test(start_paused = true)]
    async fn answers_moving_keep_a_connection_open_and_small_frames_do_not() {
        let (ours, _client) = tokio::io::duplex(1 << 20);
        let (mut read, mut write) =
            tokio::io::split(IdleIo::new(ours, Arc::new(InFlight::default()), Duration::from_secs(5)));
        let started = Instant::now();
        let waiting = tokio::spawn(async move { read.read(&mut [0; 1]).await.unwrap_err() });
        // No request in flight, but 4 KiB of answers every 4 s: the connection is not idle...
        for _ in 0..3 {
            tokio::time::sleep(Duration::from_secs(4)).await;
            write.write_all(&[7; 4096]).await.unwrap();
        }
        // ...then only a ping's acknowledgement: closed a timeout after the answers last moved.
        tokio::time::sleep(Duration::from_secs(4)).await;
        write.write_all(&[0; 17]).await.unwrap();
        assert_eq!(waiting.await.unwrap().kind(), io::ErrorKind::TimedOut);
        assert_eq!(started.elapsed(), Duration::from_secs(20));
    }

    #[tokio::test(start_paused = true)]
    async fn a_call_in_flight_keeps_a_connection_open_unless_answers_wait_on_its_client() {
        let in_flight = Arc::new(InFlight::default());
        let (ours, mut client) = tokio::io::duplex(1 << 20);
        let (mut read, _write) = tokio::io::split(IdleIo::new(ours, in_flight.clone(), Duration::from_secs(5)));
        let _stream = in_flight.enter();
        let started = Instant::now();
        let waiting = tokio::spawn(async move {
            loop {
                if let Err(e) = read.read(&mut [0; 1]).await {
                    return e;
                }
            }
        });
        // An open stream is in flight: quiet for three timeouts, the connection stays open...
        tokio::time::sleep(Duration::from_secs(15)).await;
        assert!(!waiting.is_finished());
        // ...until its answers wait on the client: closed a timeout after the connection next
        // reads (a client's ping acknowledgement, here a byte at 16 s), unless answers move.
        in_flight.wait(true);
        tokio::time::sleep(Duration::from_secs(1)).await;
        client.write_all(&[0]).await.unwrap();
        let closed = tokio::time::timeout(Duration::from_secs(60), waiting).await;
        assert_eq!(closed.expect("still open after 60 s").unwrap().kind(), io::ErrorKind::TimedOut);
        assert_eq!(started.elapsed(), Duration::from_secs(21));
    }
}
