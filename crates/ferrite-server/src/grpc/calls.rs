//! What the gRPC listener keeps per call beside the call itself, as the HTTP listener does for its
//! requests: the call counts as in flight on its connection until its response has been sent (a
//! connection with no call open is closed after the idle timeout), and the request bytes received
//! are charged to the budget of bytes in flight that all listeners share (past it, the call fails
//! UNAVAILABLE with a retry hint). A unary call's bytes stay charged until its response is sent; a
//! stream's are released at each message boundary (its messages in flight are capped apart).
//! A message must arrive whole within the body timeout of its first byte (as an HTTP body must), so
//! a client trickling a large message cannot hold the shared budget (and the stream) forever.

use std::{
    future::Future,
    pin::Pin,
    sync::{
        atomic::{AtomicU32, Ordering},
        Arc,
    },
    task::{Context, Poll},
    time::Duration,
};

use bytes::Bytes;
use http_body::{Frame, SizeHint};
use tokio::sync::Semaphore;
use tonic::{
    body::Body,
    transport::server::{TcpConnectInfo, TlsConnectInfo},
    Status,
};

use crate::idle::{Held, InFlight};

/// The connect info of a gRPC connection: its peer, and its calls in flight.
#[derive(Clone)]
pub struct Conn {
    pub tcp: TcpConnectInfo,
    pub in_flight: Arc<InFlight>,
}

/// Wraps the gRPC server's service; see the module.
#[derive(Clone)]
pub struct CallLayer {
    /// Shared with the HTTP listener's bodies; one permit per KiB.
    pub budget: Arc<Semaphore>,
    /// Time a message has, from its first byte, to arrive whole (HTTP's body timeout).
    pub message_timeout: Duration,
}

impl<S> tower_layer::Layer<S> for CallLayer {
    type Service = CallService<S>;
    fn layer(&self, inner: S) -> CallService<S> {
        CallService { inner, layer: self.clone() }
    }
}

#[derive(Clone)]
pub struct CallService<S> {
    inner: S,
    layer: CallLayer,
}

impl<S> tower_service::Service<http::Request<Body>> for CallService<S>
where
    S: tower_service::Service<http::Request<Body>, Response = http::Response<Body>>,
    S::Future: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = S::Error;
    type Future = Pin<Box<dyn std::future::Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        let ext = req.extensions();
        let conn = ext.get::<Conn>().or_else(|| ext.get::<TlsConnectInfo<Conn>>().map(|c| c.get_ref()));
        let held = conn.map(|c| c.in_flight.enter());
        let streaming = req.uri().path().ends_with("/ModelStreamInfer");
        let charge = Arc::new(Charge { budget: self.layer.budget.clone(), permits: AtomicU32::new(0) });
        let limit = self.layer.message_timeout;
        let req = req.map(|inner| Body::new(Charged::new(inner, charge.clone(), streaming, limit)));
        let fut = self.inner.call(req);
        Box::pin(async move {
            let resp = fut.await?;
            let charge = (!streaming).then_some(charge);
            Ok(resp.map(|inner| Body::new(Kept { inner, _held: held, _charge: charge })))
        })
    }
}

/// Permits taken from the budget for one call, given back when the last holder drops it.
struct Charge {
    budget: Arc<Semaphore>,
    permits: AtomicU32,
}

impl Charge {
    /// Holds `want` permits in all (never fewer than held already), or fails if the budget has none.
    fn hold(&self, want: u32) -> Result<(), Status> {
        let have = self.permits.load(Ordering::Acquire);
        if want <= have {
            return Ok(());
        }
        match self.budget.try_acquire_many(want - have) {
            Ok(p) => {
                p.forget();
                self.permits.fetch_add(want - have, Ordering::AcqRel);
                Ok(())
            }
            Err(_) => Err(super::status(ferrite_core::Error::unavailable(
                "too many request bytes in flight on this server; retry shortly",
                Some(Duration::from_secs(1)),
            ))),
        }
    }

    fn release(&self) {
        let n = self.permits.swap(0, Ordering::AcqRel);
        self.budget.add_permits(n as usize);
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.release();
    }
}

/// Where a stream of gRPC length-prefixed messages stands: bytes of the 5-byte prefix seen, and
/// bytes of the message still to come once the prefix is whole.
#[derive(Default)]
struct Framing {
    prefix: [u8; 5],
    have: usize,
    left: usize,
}

impl Framing {
    /// Whether a message is partly received.
    fn partial(&self) -> bool {
        self.have > 0
    }

    /// Consumes `chunk`; returns how many of its bytes follow the last message that ended in it.
    fn advance(&mut self, mut chunk: &[u8]) -> Option<usize> {
        let mut after_end = None;
        while !chunk.is_empty() {
            if self.have < 5 {
                let n = (5 - self.have).min(chunk.len());
                self.prefix[self.have..self.have + n].copy_from_slice(&chunk[..n]);
                self.have += n;
                chunk = &chunk[n..];
                if self.have < 5 {
                    break;
                }
                self.left =
                    u32::from_be_bytes([self.prefix[1], self.prefix[2], self.prefix[3], self.prefix[4]]) as usize;
            } else {
                let n = self.left.min(chunk.len());
                self.left -= n;
                chunk = &chunk[n..];
            }
            if self.have == 5 && self.left == 0 {
                self.have = 0;
                after_end = Some(chunk.len());
            }
        }
        after_end
    }
}

/// A request body whose bytes are charged to the budget as they arrive, and whose messages must
/// each arrive within `limit` of their first byte.
struct Charged {
    inner: Body,
    charge: Arc<Charge>,
    streaming: bool,
    frame: Framing,
    /// Bytes received since the charge was last released.
    since: usize,
    limit: Duration,
    /// Set while a message is partly received: when it must be whole.
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl Charged {
    fn new(inner: Body, charge: Arc<Charge>, streaming: bool, limit: Duration) -> Charged {
        Charged { inner, charge, streaming, frame: Framing::default(), since: 0, limit, deadline: None }
    }

    fn account(&mut self, data: &[u8]) -> Result<(), Status> {
        let after = self.frame.advance(data);
        match after.filter(|_| self.streaming) {
            Some(after) => {
                self.charge.release();
                self.since = after;
            }
            None => self.since += data.len(),
        }
        // A message that ended here (and none begun after it) stops the clock; a new one starts it.
        if after.is_some() && !self.frame.partial() {
            self.deadline = None;
        } else if after.is_some() || self.deadline.is_none() {
            self.deadline = Some(Box::pin(tokio::time::sleep(self.limit)));
        }
        self.charge.hold(u32::try_from(self.since.div_ceil(1024)).unwrap_or(u32::MAX))
    }
}

impl http_body::Body for Charged {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        if polled.is_pending() && this.deadline.as_mut().is_some_and(|d| d.as_mut().poll(cx).is_ready()) {
            this.deadline = None;
            let secs = this.limit.as_secs_f64();
            return Poll::Ready(Some(Err(Status::deadline_exceeded(format!(
                "the request message did not arrive whole within {secs} s of its first byte"
            )))));
        }
        if let Poll::Ready(Some(Ok(frame))) = &polled {
            if let Some(data) = frame.data_ref() {
                if let Err(refused) = this.account(data) {
                    return Poll::Ready(Some(Err(refused)));
                }
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// A response body that keeps the call counted (and a unary call's bytes charged) until sent.
struct Kept {
    inner: Body,
    _held: Option<Held>,
    _charge: Option<Arc<Charge>>,
}

impl http_body::Body for Kept {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        Pin::new(&mut self.get_mut().inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(len: usize) -> Vec<u8> {
        let mut m = vec![0u8];
        m.extend_from_slice(&(len as u32).to_be_bytes());
        m.extend(std::iter::repeat_n(7u8, len));
        m
    }

    #[test]
    fn framing_finds_message_ends_across_chunks() {
        let mut f = Framing::default();
        let mut stream = message(10);
        stream.extend(message(0));
        stream.extend(message(3));
        // 15 + 5 + 8 bytes: cut after 2, 17 and 23 bytes.
        assert_eq!(f.advance(&stream[..2]), None);
        assert_eq!(f.advance(&stream[2..17]), Some(2));
        assert_eq!(f.advance(&stream[17..23]), Some(3));
        assert_eq!(f.advance(&stream[23..]), Some(0));
        assert_eq!(f.advance(&message(4)[..6]), None);
    }

    #[tokio::test(start_paused = true)]
    async fn a_message_trickled_past_the_timeout_fails_and_frees_its_bytes() {
        use http_body_util::BodyExt;
        let budget = Arc::new(Semaphore::new(100));
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, Status>>(4);
        let inner = Body::new(http_body_util::StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx)));
        let charge = Arc::new(Charge { budget: budget.clone(), permits: AtomicU32::new(0) });
        let mut body = Charged::new(inner, charge.clone(), false, Duration::from_secs(30));
        // A whole small message, then 10 KiB of a 1 MB one, then nothing.
        tx.send(Ok(Frame::data(Bytes::from(message(3))))).await.unwrap();
        assert!(body.frame().await.unwrap().is_ok());
        let mut big = message(1 << 20);
        big.truncate(10 << 10);
        tx.send(Ok(Frame::data(Bytes::from(big)))).await.unwrap();
        assert!(body.frame().await.unwrap().is_ok());
        assert!(budget.available_permits() < 100);
        let started = tokio::time::Instant::now();
        let refused = body.frame().await.unwrap().unwrap_err();
        assert_eq!(refused.code(), tonic::Code::DeadlineExceeded, "{refused:?}");
        assert!(started.elapsed() >= Duration::from_secs(29));
        drop(body);
        drop(charge);
        assert_eq!(budget.available_permits(), 100);
        drop(tx);
    }

    #[tokio::test(start_paused = true)]
    async fn whole_messages_stop_the_clock() {
        use http_body_util::BodyExt;
        let budget = Arc::new(Semaphore::new(100));
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, Status>>(4);
        let inner = Body::new(http_body_util::StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx)));
        let charge = Arc::new(Charge { budget, permits: AtomicU32::new(0) });
        let mut body = Charged::new(inner, charge, true, Duration::from_secs(30));
        tx.send(Ok(Frame::data(Bytes::from(message(8))))).await.unwrap();
        assert!(body.frame().await.unwrap().is_ok());
        // A quiet stream between whole messages is not cut.
        tokio::time::sleep(Duration::from_secs(120)).await;
        tx.send(Ok(Frame::data(Bytes::from(message(8))))).await.unwrap();
        assert!(body.frame().await.unwrap().is_ok());
        drop(tx);
        assert!(body.frame().await.is_none());
    }

    #[test]
    fn charge_is_refused_past_the_budget_and_given_back() {
        let budget = Arc::new(Semaphore::new(4));
        let a = Charge { budget: budget.clone(), permits: AtomicU32::new(0) };
        a.hold(3).unwrap();
        a.hold(2).unwrap();
        let b = Charge { budget: budget.clone(), permits: AtomicU32::new(0) };
        let refused = b.hold(2).unwrap_err();
        assert_eq!(refused.code(), tonic::Code::Unavailable);
        drop(a);
        b.hold(4).unwrap();
        assert_eq!(budget.available_permits(), 0);
        b.release();
        assert_eq!(budget.available_permits(), 4);
    }
}
