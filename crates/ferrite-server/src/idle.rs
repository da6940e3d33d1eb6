//! Closing HTTP connections that hold a place while doing nothing: no request in flight on them
//! for the idle timeout (between keep-alive requests, or an HTTP/2 connection kept open with pings
//! alone). A request being received or computed is never cut: the clock runs only while none is in
//! flight on the connection.

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

/// Requests in flight on one connection, and how many have finished.
#[derive(Debug, Default)]
pub struct InFlight {
    now: AtomicUsize,
    finished: AtomicUsize,
}

impl InFlight {
    /// Counts one request in flight on the connection until the returned guard is dropped.
    pub fn enter(self: &Arc<Self>) -> Held {
        self.now.fetch_add(1, Ordering::AcqRel);
        Held(self.clone())
    }
}

/// A connection's stream that fails its reads once it has had no request in flight for `idle`.
pub struct IdleIo<T> {
    inner: T,
    in_flight: Arc<InFlight>,
    idle: Duration,
    deadline: Pin<Box<Sleep>>,
    /// `in_flight.finished` when the deadline was last set.
    seen: usize,
}

impl<T> IdleIo<T> {
    pub fn new(inner: T, in_flight: Arc<InFlight>, idle: Duration) -> IdleIo<T> {
        IdleIo { inner, in_flight, idle, deadline: Box::pin(tokio::time::sleep(idle)), seen: 0 }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for IdleIo<T> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let finished = this.in_flight.finished.load(Ordering::Acquire);
        if this.in_flight.now.load(Ordering::Acquire) > 0 || finished != this.seen {
            // Busy, or work ended since: the idle clock starts again from now.
            this.seen = finished;
            let next = Instant::now() + this.idle;
            this.deadline.as_mut().reset(next);
        }
        if this.in_flight.now.load(Ordering::Acquire) > 0 {
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
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
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
