//! What the gRPC listener keeps per call beside the call itself, as the HTTP listener does for its
//! requests: the call counts as in flight on its connection until its response has been sent (a
//! connection with no call open is closed after the idle timeout), and the request bytes received
//! are charged to the budget of bytes in flight that all listeners share (past it, the call fails
//! UNAVAILABLE with a retry hint). A unary call's bytes stay charged until its response has been
//! written; a stream's, message by message, until each message's answer has (past the budget,
//! the stream ends UNAVAILABLE once the messages in flight are answered).
//! A message must arrive whole within the body timeout of its first byte (as an HTTP body must), so
//! a client trickling a large message cannot hold the shared budget (and the stream) forever.
//!
//! A unary `ModelInfer` message of `CAPTURED_FROM` bytes or more (an image) is read into a buffer of
//! the HTTP bodies' pool instead of tonic's per-call buffer, which is a fresh mapping each call (a
//! page fault per 4 KiB written, about 300 for a 1.2 MB image): the body hands tonic an empty
//! message in its place and the handler decodes the one it finds in the call's `Captured` slot, its
//! tensors views of the pooled buffer.

use std::{
    future::Future,
    pin::Pin,
    sync::{
        atomic::{AtomicU32, Ordering},
        Arc, Mutex,
    },
    task::{ready, Context, Poll},
    time::Duration,
};

use bytes::{BufMut, Bytes, BytesMut};
use ferrite_core::Error;
use http_body::{Frame, SizeHint};
use tonic::{
    body::Body,
    transport::server::{TcpConnectInfo, TlsConnectInfo},
    Status,
};

use crate::{
    auth::Acting,
    budget::{self, Budget, HeldFor, Reserved},
    http::pool::{Pooled, BODIES},
    idle::{Held, InFlight},
};

/// Messages this large and larger are captured. Below the pool's own threshold (1 MiB) too: tonic's
/// buffer doubles as the frames come, so a message over 512 KiB grows it to a mapping of 1 MiB (a
/// ResNet's 224x224 image, 602 KB, took 79 faults a request).
pub const CAPTURED_FROM: usize = 256 << 10;

/// The connect info of a gRPC connection: its peer, and its calls in flight.
#[derive(Clone)]
pub struct Conn {
    pub tcp: TcpConnectInfo,
    pub in_flight: Arc<InFlight>,
}

/// Wraps the gRPC server's service; see the module.
#[derive(Clone)]
pub struct CallLayer {
    /// Shared with the HTTP listener's bodies.
    pub budget: Arc<Budget>,
    /// Whose share of the budget a call's bytes are in: its tenant's (`auth::tenant`).
    pub core: ferrite_core::Core,
    /// Time a message has, from its first byte, to arrive whole (HTTP's body timeout).
    pub message_timeout: Duration,
    /// The inference service's decoding limit: larger messages are left to tonic to refuse.
    pub max_message: usize,
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
        let conn = ext
            .get::<Conn>()
            .or_else(|| ext.get::<TlsConnectInfo<Conn>>().map(|c| c.get_ref()))
            .map(|c| c.in_flight.clone());
        let held = conn.as_ref().map(|f| f.enter());
        let streaming = req.uri().path().ends_with("/ModelStreamInfer");
        // The tenant the call acts for (one the service refuses later counts as no tenant's);
        // the service reads it from the extensions.
        let acting = Acting::of(ext, self.layer.core.tenants(), |h| req.headers().get(h).and_then(|v| v.to_str().ok()));
        let tenant = acting.share().map(str::to_string);
        let charge = Arc::new(Charge { budget: self.layer.budget.clone(), tenant, permits: AtomicU32::new(0) });
        let limit = self.layer.message_timeout;
        let mut req = req;
        req.extensions_mut().insert(acting);
        let mut answers = None;
        let big = if req.uri().path() == "/inference.GRPCInferenceService/ModelInfer" {
            let slot = Captured::default();
            req.extensions_mut().insert(slot.clone());
            req.extensions_mut().insert(AnswerCharge(charge.clone()));
            Big::Armed { slot, max: self.layer.max_message }
        } else {
            if streaming {
                let stream = StreamAnswers::new(charge.clone(), conn);
                req.extensions_mut().insert(stream.clone());
                answers = Some(stream);
            }
            Big::Off
        };
        let stream = answers.clone();
        // The inference service's compressed messages are decompressed by the body, not by tonic
        // on the I/O thread (`unpack`).
        let unpack = req
            .uri()
            .path()
            .starts_with("/inference.GRPCInferenceService/")
            .then(|| {
                let encoding = req.headers().get("grpc-encoding").and_then(|v| v.to_str().ok());
                let share = (self.layer.budget.clone(), charge.tenant.clone());
                super::unpack::Unpack::new(encoding, self.layer.max_message, share, limit, streaming)
            })
            .flatten();
        let req = req.map(|inner| {
            let mut body = Charged::new(inner, charge.clone(), stream, limit, big);
            body.unpack = unpack;
            Body::new(body)
        });
        let fut = self.inner.call(req);
        Box::pin(async move {
            let resp = fut.await?;
            // A unary call's work is done: from here its answer is the connection's to send, and
            // the connection is closed if the answer stops moving (`IdleIo`); a stream is in
            // flight while it is open, unless its answers wait on the client (`StreamAnswers`).
            let (held, charge) = if streaming { (held, None) } else { (None, Some(charge)) };
            Ok(resp.map(|inner| Body::new(Kept { inner, _held: held, charge, answers })))
        })
    }
}

/// A ModelInfer call's charge, in its request's extensions: its answer holds its bytes of the budget
/// (what the request held, and more if the answer is larger) until sent or its connection closed,
/// so that answers clients do not take (no window opened for them) count against what all
/// requests (and its tenant's) may hold.
#[derive(Clone)]
pub struct AnswerCharge(Arc<Charge>);

impl AnswerCharge {
    /// Adds an answer of `bytes`, or fails the call when the budget cannot take it (the answer's
    /// memory is then freed at once, not held for a client that may never read it).
    pub fn add(&self, bytes: usize) -> Result<(), Status> {
        self.0.hold(budget::permits(bytes), HeldFor::Answer).map_err(super::status)
    }

    /// Holds `bytes` in all for the request its message decoded to (never less than its message's
    /// bytes, held already), unless the budget cannot take them: a message may decode to many
    /// times its bytes (a BYTES element of 2 bytes holds 32 while queued).
    pub fn decoded(&self, bytes: usize) -> Result<(), Error> {
        self.0.hold(budget::permits(bytes), HeldFor::Request)
    }
}

/// A ModelStreamInfer call's answers on their way to its client, in its request's extensions. Each
/// answer holds its bytes of the budget (and its tenant's share), as a unary call's does
/// ([`AnswerCharge`]), until the client has taken it: until the bytes it was encoded to have been
/// written (`Kept`), however long hyper and h2 keep them. A stream is a call in
/// flight while it is open (never idle, however quiet), but not while its answers wait on the
/// client: then its connection counts as idle unless answers move (`InFlight::wait`), so a
/// client that opens streams and takes none of their answers has its connection closed after the
/// idle timeout, as a unary call's client has, and the answers it held freed.
#[derive(Clone)]
pub struct StreamAnswers(Arc<Stream>);

struct Stream {
    charge: Arc<Charge>,
    in_flight: Option<Arc<InFlight>>,
    state: Mutex<StreamState>,
}

#[derive(Default)]
struct StreamState {
    /// Answers made and not yet taken by the client.
    unsent: usize,
    /// Answers handed on to be encoded, and what they hold, until their bytes come by (`Kept`).
    handed: usize,
    handed_held: Vec<Reserved>,
    /// Messages received whole, in order, with what their bytes hold (messages that ended in one
    /// frame share the first's), until the handler takes them.
    received: std::collections::VecDeque<Option<Reserved>>,
}

impl StreamAnswers {
    fn new(charge: Arc<Charge>, in_flight: Option<Arc<InFlight>>) -> StreamAnswers {
        StreamAnswers(Arc::new(Stream { charge, in_flight, state: Mutex::default() }))
    }

    fn state(&self) -> std::sync::MutexGuard<'_, StreamState> {
        self.0.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `ended` messages received whole, their bytes held by `held`.
    fn received(&self, held: Reserved, ended: usize) {
        let received = &mut self.state().received;
        received.push_back(Some(held));
        received.extend((1..ended).map(|_| None));
    }

    /// What the bytes of the next message the handler takes hold, until it is answered: nothing
    /// yet for a message whose bytes an earlier one of its frame holds, but what it decodes to,
    /// and its answer, are held in it as another's are (they were held nowhere: a message of a
    /// few KiB of 2-byte strings decodes to 16 times its bytes).
    pub fn next_message(&self) -> Reserved {
        let held = self.state().received.pop_front().flatten();
        held.unwrap_or_else(|| self.0.charge.budget.taken(self.0.charge.tenant.as_deref(), 0))
    }

    /// The answers handed on since the last call, and what they hold.
    fn take_handed(&self) -> (usize, Vec<Reserved>) {
        let mut s = self.state();
        (std::mem::take(&mut s.handed), std::mem::take(&mut s.handed_held))
    }

    /// The bytes of an answer of `bytes` held (what its request's held, and more if the answer is
    /// larger), or why the budget cannot take them.
    pub fn hold(&self, mut request: Reserved, bytes: usize) -> Result<Reserved, String> {
        request.hold(bytes, HeldFor::Answer).map(|()| request).map_err(|e| e.to_string())
    }

    /// An answer is ready for the client.
    pub fn made(&self) {
        let mut s = self.state();
        s.unsent += 1;
        if s.unsent == 1 {
            if let Some(f) = &self.0.in_flight {
                f.wait(true);
            }
        }
    }

    /// An answer is handed on to be encoded, with what it holds.
    pub fn handed(&self, held: Option<Reserved>) {
        let mut s = self.state();
        s.handed += 1;
        s.handed_held.extend(held);
    }

    /// The client has taken `n` answers (or they were never sent).
    pub fn taken(&self, n: usize) {
        let mut s = self.state();
        if s.unsent == 0 || n == 0 {
            return;
        }
        s.unsent = s.unsent.saturating_sub(n);
        if s.unsent == 0 {
            if let Some(f) = &self.0.in_flight {
                f.wait(false);
            }
        }
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        let unsent = self.state.get_mut().unwrap_or_else(|e| e.into_inner()).unsent;
        if let (true, Some(f)) = (unsent > 0, &self.in_flight) {
            f.wait(false);
        }
    }
}

/// Permits taken from the budget for one call (within its tenant's share), given back when the
/// last holder drops it.
struct Charge {
    budget: Arc<Budget>,
    tenant: Option<String>,
    permits: AtomicU32,
}

impl Charge {
    /// Holds `want` permits in all (never fewer than held already), or fails if the budget has none
    /// ([`Budget::refusal`]).
    fn hold(&self, want: u32, held: HeldFor) -> Result<(), Error> {
        let have = self.permits.load(Ordering::Acquire);
        if want <= have {
            return Ok(());
        }
        if self.budget.try_take(self.tenant.as_deref(), want - have) {
            self.permits.fetch_add(want - have, Ordering::AcqRel);
            return Ok(());
        }
        Err(self.budget.refusal(self.tenant.as_deref(), want as usize * 1024, held))
    }

    fn release(&self) {
        let n = self.permits.swap(0, Ordering::AcqRel);
        self.budget.give(self.tenant.as_deref(), n);
    }

    /// `permits` of what it holds, held from now by the returned reservation instead.
    fn take(&self, permits: u32) -> Reserved {
        self.permits.fetch_sub(permits, Ordering::AcqRel);
        self.budget.taken(self.tenant.as_deref(), permits)
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.release();
    }
}

/// Where a stream of gRPC length-prefixed messages stands: bytes of the 5-byte prefix seen, and
/// bytes of the message still to come once the prefix is whole.
#[derive(Clone, Default)]
struct Framing {
    prefix: [u8; 5],
    have: usize,
    left: usize,
    /// Messages ended since this was last taken.
    ended: usize,
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
                self.ended += 1;
                after_end = Some(chunk.len());
            }
        }
        after_end
    }
}

/// A unary `ModelInfer` call's message when the body read it into a pooled buffer (see the
/// module); the handler takes it in place of the empty message tonic decoded.
#[derive(Clone, Default)]
pub struct Captured(Arc<std::sync::Mutex<Option<Bytes>>>);

impl Captured {
    pub fn take(&self) -> Option<Bytes> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).take()
    }
}

/// Where a body stands with capturing its message.
enum Big {
    /// Not a call whose message is captured, or no longer one.
    Off,
    /// Decided by the first data frame: captured when it opens an uncompressed message of
    /// `CAPTURED_FROM..=max` bytes, its prefix whole.
    Armed { slot: Captured, max: usize },
    /// Reading the message's `want` bytes into `buf`.
    Reading { slot: Captured, buf: Pooled, want: usize },
}

/// What to do with a data frame.
enum Step {
    /// Hand it to tonic as it is.
    Pass,
    /// Its bytes went into the captured message, which is not whole yet.
    Held,
    /// The message is whole: hand tonic this instead (an empty message and any bytes after).
    Emit(Bytes),
}

/// A request body whose bytes are charged to the budget as they arrive, and whose messages must
/// each arrive within `limit` of their first byte.
struct Charged {
    inner: Body,
    charge: Arc<Charge>,
    /// A stream's: each message's bytes, once whole, go with it to the handler.
    stream: Option<StreamAnswers>,
    frame: Framing,
    /// Bytes received since the charge was last released.
    since: usize,
    limit: Duration,
    /// Set while a message is partly received: when it must be whole.
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
    big: Big,
    /// Compressed messages decompressed here (`unpack`): the one being decompressed, the bytes
    /// received after it, and the bytes made for tonic and not yet handed to it.
    unpack: Option<super::unpack::Unpack>,
    decompressing: Option<super::unpack::Decompressing>,
    rest: Bytes,
    pending: std::collections::VecDeque<Bytes>,
    /// A stream's frame the budget could not take yet, since when and for how long at most (the
    /// body timeout, `STALLED_HOLDING` inside a message), and what it waits on: permits given
    /// back, or its next try (`STALLED_RETRY`).
    stalled: Option<Frame<Bytes>>,
    stalled_since: Option<(tokio::time::Instant, Duration)>,
    freed: Option<(Freed, Pin<Box<tokio::time::Sleep>>)>,
}

type Freed = Pin<Box<tokio::sync::futures::OwnedNotified>>;

/// How often a stream waiting for room in the budget tries again, beside when woken by permits
/// given back (which wake one waiter each).
pub(super) const STALLED_RETRY: Duration = Duration::from_millis(100);

/// How long a stream holding part of a message waits for room before it ends, as it did before
/// streams waited (a unary call's message is refused at once).
pub(super) const STALLED_HOLDING: Duration = Duration::from_secs(1);

impl Charged {
    fn new(inner: Body, charge: Arc<Charge>, stream: Option<StreamAnswers>, limit: Duration, big: Big) -> Charged {
        Charged {
            inner,
            charge,
            stream,
            frame: Framing::default(),
            since: 0,
            limit,
            deadline: None,
            big,
            unpack: None,
            decompressing: None,
            rest: Bytes::new(),
            pending: Default::default(),
            stalled: None,
            stalled_since: None,
            freed: None,
        }
    }

    fn capture(&mut self, data: &Bytes) -> Step {
        match std::mem::replace(&mut self.big, Big::Off) {
            Big::Off => Step::Pass,
            Big::Armed { slot, max } => {
                let Some(&[0, a, b, c, d]) = data.get(..5) else { return Step::Pass };
                let want = u32::from_be_bytes([a, b, c, d]) as usize;
                if !(CAPTURED_FROM..=max).contains(&want) {
                    return Step::Pass;
                }
                self.big = Big::Reading { slot, buf: BODIES.buffer(want), want };
                self.fill(data.slice(5..))
            }
            reading @ Big::Reading { .. } => {
                self.big = reading;
                self.fill(data.clone())
            }
        }
    }

    /// Adds `data` to the message being read (`self.big` is `Reading`; it stays so until whole).
    fn fill(&mut self, data: Bytes) -> Step {
        let Big::Reading { slot, mut buf, want } = std::mem::replace(&mut self.big, Big::Off) else {
            return Step::Pass;
        };
        let n = (want - buf.filled()).min(data.len());
        buf.extend(&data[..n]);
        if buf.filled() < want {
            self.big = Big::Reading { slot, buf, want };
            return Step::Held;
        }
        *slot.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(buf.into_bytes());
        let mut out = BytesMut::with_capacity(5 + data.len() - n);
        out.put_bytes(0, 5);
        out.put_slice(&data[n..]);
        Step::Emit(out.freeze())
    }

    /// Charges `data`, or nothing at all if the budget cannot take it.
    fn account(&mut self, data: &[u8]) -> Result<(), Error> {
        let mut frame = self.frame.clone();
        let after = frame.advance(data);
        let total = self.since + data.len();
        // A stream's messages that ended here hold their bytes until answered (`StreamAnswers`),
        // apart from those after them.
        let ended = after.filter(|_| self.stream.is_some()).map(|after| (budget::permits(total - after), after));
        let want = ended.map_or(budget::permits(total), |(held, after)| held + budget::permits(after));
        self.charge.hold(want, HeldFor::Request)?;
        self.frame = frame;
        match (ended, &self.stream) {
            (Some((held, after)), Some(stream)) => {
                stream.received(self.charge.take(held), std::mem::take(&mut self.frame.ended));
                self.since = after;
            }
            _ => self.since = total,
        }
        // A message that ended here (and none begun after it) stops the clock; a new one starts it.
        if after.is_some() && !self.frame.partial() {
            self.deadline = None;
        } else if after.is_some() || self.deadline.is_none() {
            self.deadline = Some(Box::pin(tokio::time::sleep(self.limit)));
        }
        Ok(())
    }
}

impl http_body::Body for Charged {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let this = self.get_mut();
        loop {
            if let Some(out) = this.pending.pop_front() {
                return Poll::Ready(Some(Ok(Frame::data(out))));
            }
            // A compressed message is being decompressed: nothing more is read until it is.
            if let Some(decompressing) = &mut this.decompressing {
                let plain = ready!(decompressing.as_mut().poll(cx));
                this.decompressing = None;
                match plain {
                    Ok(plain) => this.pending.extend(plain),
                    Err(refused) => {
                        this.unpack = None;
                        return Poll::Ready(Some(Err(refused)));
                    }
                }
                continue;
            }
            if let Some(unpack) = this.unpack.as_mut().filter(|_| !this.rest.is_empty()) {
                this.decompressing = unpack.feed(&mut this.rest, &mut this.pending);
                continue;
            }
            // A stream waiting for room reads nothing more (its client's window closes meanwhile)
            // until permits are given back, within the body timeout.
            if let Some((freed, retry)) = &mut this.freed {
                if freed.as_mut().poll(cx).is_pending() && retry.as_mut().poll(cx).is_pending() {
                    return Poll::Pending;
                }
                this.freed = None;
                if this.stalled_since.is_some_and(|(since, most)| since.elapsed() >= most) {
                    (this.stalled, this.stalled_since) = (None, None);
                    return Poll::Ready(Some(Err(super::unavailable(crate::http::BODIES_OVER_BUDGET))));
                }
            }
            let polled = match this.stalled.take() {
                Some(frame) => Poll::Ready(Some(Ok(frame))),
                None => Pin::new(&mut this.inner).poll_frame(cx),
            };
            if polled.is_pending() && this.deadline.as_mut().is_some_and(|d| d.as_mut().poll(cx).is_ready()) {
                this.deadline = None;
                let secs = this.limit.as_secs_f64();
                return Poll::Ready(Some(Err(Status::deadline_exceeded(format!(
                    "the request message did not arrive whole within {secs} s of its first byte"
                )))));
            }
            let data = match &polled {
                Poll::Ready(Some(Ok(frame))) => frame.data_ref(),
                _ => None,
            };
            let Some(data) = data else {
                let inside =
                    matches!(this.big, Big::Reading { .. }) || this.unpack.as_ref().is_some_and(|u| !u.between());
                if inside && matches!(polled, Poll::Ready(None | Some(Ok(_)))) {
                    // The body ended inside the message, as tonic would say.
                    this.big = Big::Off;
                    return Poll::Ready(Some(Err(Status::internal("Unexpected EOF decoding stream."))));
                }
                return polled;
            };
            match this.account(data) {
                Ok(()) => this.stalled_since = None,
                // A stream carries requests behind this one: it waits for room rather than ending.
                Err(Error::Unavailable { .. }) if this.stream.is_some() => {
                    let mut freed = Box::pin(this.charge.budget.freed());
                    freed.as_mut().enable();
                    if this.account(data).is_err() {
                        this.freed = Some((freed, Box::pin(tokio::time::sleep(STALLED_RETRY))));
                        // Holding part of a message, it waits a second at most: streams each
                        // holding part of one would wait for each other, and everyone else for
                        // them, the whole body timeout.
                        let most = if this.since > 0 { STALLED_HOLDING } else { this.limit };
                        this.stalled_since.get_or_insert_with(|| (tokio::time::Instant::now(), most));
                        let Poll::Ready(Some(Ok(frame))) = polled else { unreachable!("a data frame") };
                        this.stalled = Some(frame);
                        continue;
                    }
                    this.stalled_since = None;
                }
                Err(refused) => return Poll::Ready(Some(Err(super::status(refused)))),
            }
            let out = match this.capture(data) {
                Step::Pass if this.unpack.is_none() => return polled,
                Step::Pass => data.clone(),
                Step::Held => continue,
                Step::Emit(out) => out,
            };
            if this.unpack.is_none() {
                return Poll::Ready(Some(Ok(Frame::data(out))));
            }
            this.rest = out;
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
            && self.pending.is_empty()
            && self.decompressing.is_none()
            && self.rest.is_empty()
            && self.stalled.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        match self.unpack {
            // Decompressed messages are longer than they came.
            Some(_) => SizeHint::default(),
            None => self.inner.size_hint(),
        }
    }
}

/// A response body that keeps a stream counted while it is open, and a unary call's bytes (or a
/// stream's answers') charged until written: its frames hold them for as long as hyper and
/// h2 keep them (`budget::holding`), which is past the body's end: hyper ends a body as soon as
/// it has its last bytes, and h2 buffers them, whatever the size, until the client's window lets
/// them go.
struct Kept {
    inner: Body,
    _held: Option<Held>,
    charge: Option<Arc<Charge>>,
    answers: Option<StreamAnswers>,
}

/// A stream's answers encoded in one frame, taken by the client when its bytes are dropped.
struct Sent {
    answers: StreamAnswers,
    count: usize,
    _held: Vec<Reserved>,
}

impl Drop for Sent {
    fn drop(&mut self) {
        self.answers.taken(self.count);
    }
}

impl http_body::Body for Kept {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let this = self.get_mut();
        let frame = ready!(Pin::new(&mut this.inner).poll_frame(cx));
        let (charge, answers) = (&this.charge, &this.answers);
        Poll::Ready(frame.map(|f| {
            f.map(|f| {
                f.map_data(|b| match (charge, answers) {
                    (Some(c), _) => budget::holding(b, c.clone()),
                    (_, Some(a)) => {
                        let (count, held) = a.take_handed();
                        if count == 0 {
                            return b;
                        }
                        budget::holding(b, Sent { answers: a.clone(), count, _held: held })
                    }
                    _ => b,
                })
            })
        }))
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
    use crate::http::pool::POOLED_FROM;

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

    type Feed = tokio::sync::mpsc::Sender<Result<Frame<Bytes>, Status>>;

    /// A body fed frame by frame through a channel, charged to `budget`, with a 30 s body timeout.
    fn fed(budget: &Arc<Budget>, streaming: bool, big: Big) -> (Feed, Charged, Arc<Charge>) {
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let inner = Body::new(http_body_util::StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx)));
        let charge = Arc::new(Charge { budget: budget.clone(), tenant: None, permits: AtomicU32::new(0) });
        let stream = streaming.then(|| StreamAnswers::new(charge.clone(), None));
        (tx, Charged::new(inner, charge.clone(), stream, Duration::from_secs(30), big), charge)
    }

    #[tokio::test(start_paused = true)]
    async fn a_message_trickled_past_the_timeout_fails_and_frees_its_bytes() {
        use http_body_util::BodyExt;
        let budget = Budget::new(100 << 10);
        let (tx, mut body, charge) = fed(&budget, false, Big::Off);
        // A whole small message, then 10 KiB of a 1 MB one, then nothing.
        tx.send(Ok(Frame::data(Bytes::from(message(3))))).await.unwrap();
        assert!(body.frame().await.unwrap().is_ok());
        let mut big = message(1 << 20);
        big.truncate(10 << 10);
        tx.send(Ok(Frame::data(Bytes::from(big)))).await.unwrap();
        assert!(body.frame().await.unwrap().is_ok());
        assert!(budget.available() < 100);
        let started = tokio::time::Instant::now();
        let refused = body.frame().await.unwrap().unwrap_err();
        assert_eq!(refused.code(), tonic::Code::DeadlineExceeded, "{refused:?}");
        assert!(started.elapsed() >= Duration::from_secs(29));
        drop(body);
        drop(charge);
        assert_eq!(budget.available(), 100);
        drop(tx);
    }

    #[tokio::test(start_paused = true)]
    async fn whole_messages_stop_the_clock() {
        use http_body_util::BodyExt;
        let budget = Budget::new(100 << 10);
        let (tx, mut body, _charge) = fed(&budget, true, Big::Off);
        tx.send(Ok(Frame::data(Bytes::from(message(8))))).await.unwrap();
        assert!(body.frame().await.unwrap().is_ok());
        // A quiet stream between whole messages is not cut.
        tokio::time::sleep(Duration::from_secs(120)).await;
        tx.send(Ok(Frame::data(Bytes::from(message(8))))).await.unwrap();
        assert!(body.frame().await.unwrap().is_ok());
        drop(tx);
        assert!(body.frame().await.is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn a_stream_past_the_budget_waits_for_room_and_a_unary_call_is_refused() {
        use http_body_util::BodyExt;
        let budget = Budget::new(8 << 10);
        let others = budget.take(None, 6 << 10).unwrap();
        let (tx, mut unary, _charge) = fed(&budget, false, Big::Off);
        tx.send(Ok(Frame::data(Bytes::from(message(3 << 10))))).await.unwrap();
        let refused = unary.frame().await.unwrap().unwrap_err();
        assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");
        assert_eq!(budget.available(), 2, "nothing of it held");
        // A stream's frame waits, read and held only once the others' bytes are given back.
        let (tx, mut body, _charge) = fed(&budget, true, Big::Off);
        let stream = body.stream.clone().unwrap();
        tx.send(Ok(Frame::data(Bytes::from(message(3 << 10))))).await.unwrap();
        let waiting = tokio::time::timeout(Duration::from_secs(10), body.frame()).await;
        assert!(waiting.is_err(), "no room: nothing read");
        assert_eq!(budget.available(), 2);
        drop(others);
        assert!(body.frame().await.unwrap().is_ok());
        assert_eq!(budget.available(), 4, "held by the message");
        drop(stream.next_message());
        // Past the body timeout without room: refused as before.
        let others = budget.take(None, 6 << 10).unwrap();
        tx.send(Ok(Frame::data(Bytes::from(message(3 << 10))))).await.unwrap();
        let started = tokio::time::Instant::now();
        let refused = body.frame().await.unwrap().unwrap_err();
        assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");
        assert!(started.elapsed() >= Duration::from_secs(30));
        drop(others);
        // A stream holding part of a message it cannot go on with waits a second at most: it
        // holds that part while it waits.
        let (tx, mut body, _charge) = fed(&budget, true, Big::Off);
        let mut begun = message(6 << 10);
        let rest = begun.split_off(3 << 10);
        tx.send(Ok(Frame::data(Bytes::from(begun)))).await.unwrap();
        assert!(body.frame().await.unwrap().is_ok());
        let _others = budget.take(None, 4 << 10).unwrap();
        tx.send(Ok(Frame::data(Bytes::from(rest)))).await.unwrap();
        let started = tokio::time::Instant::now();
        let refused = body.frame().await.unwrap().unwrap_err();
        assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");
        assert!((Duration::from_secs(1)..Duration::from_secs(2)).contains(&started.elapsed()));
    }

    #[tokio::test]
    async fn a_streams_messages_hold_their_bytes_until_answered() {
        use http_body_util::BodyExt;
        let budget = Budget::new(100 << 10);
        let (tx, mut body, _charge) = fed(&budget, true, Big::Off);
        let stream = body.stream.clone().unwrap();
        tx.send(Ok(Frame::data(Bytes::from(message(4000))))).await.unwrap();
        body.frame().await.unwrap().unwrap();
        let mut two = message(3000);
        two.extend(message(3000));
        tx.send(Ok(Frame::data(Bytes::from(two)))).await.unwrap();
        body.frame().await.unwrap().unwrap();
        // Whole, the messages' bytes stay held (4 KiB, and 6 for the two of one frame).
        assert_eq!(budget.available(), 90);
        let (first, second, mut third) = (stream.next_message(), stream.next_message(), stream.next_message());
        assert!(third.is_empty(), "the third's bytes are the second's");
        // What the third decodes to is held on its own.
        assert!(third.hold(8 << 10, HeldFor::Request).is_ok());
        assert_eq!(budget.available(), 82);
        drop((first, third));
        assert_eq!(budget.available(), 94);
        // An answer larger than its request holds more, then all goes back.
        let answer = stream.hold(second, 20 << 10).unwrap();
        assert_eq!(budget.available(), 80);
        drop(answer);
        assert_eq!(budget.available(), 100);
    }

    fn armed(chunks: Vec<Vec<u8>>, max: usize) -> (Charged, Captured) {
        let frames = chunks.into_iter().map(|c| Ok::<_, Status>(Frame::data(Bytes::from(c))));
        let inner = Body::new(http_body_util::StreamBody::new(tokio_stream::iter(frames)));
        let charge = Arc::new(Charge { budget: Budget::new(1 << 30), tenant: None, permits: AtomicU32::new(0) });
        let slot = Captured::default();
        let big = Big::Armed { slot: slot.clone(), max };
        (Charged::new(inner, charge, None, Duration::from_secs(30), big), slot)
    }

    async fn data_frames(mut body: Charged) -> Result<Vec<u8>, Status> {
        use http_body_util::BodyExt;
        let mut out = vec![];
        while let Some(frame) = body.frame().await {
            out.extend_from_slice(&frame?.into_data().expect("data"));
        }
        Ok(out)
    }

    #[tokio::test]
    async fn a_large_unary_message_is_captured_and_tonic_reads_an_empty_one() {
        for len in [POOLED_FROM + 10, CAPTURED_FROM] {
            let m = message(len);
            let mut rest = m[1000..].to_vec();
            rest.extend(message(0));
            let (body, slot) = armed(vec![m[..1000].to_vec(), rest], 2 * POOLED_FROM);
            assert_eq!(data_frames(body).await.unwrap(), [message(0), message(0)].concat());
            assert_eq!(slot.take().expect("captured")[..], m[5..]);
        }
    }

    #[tokio::test]
    async fn other_messages_reach_tonic_as_they_came() {
        let mut compressed = message(POOLED_FROM);
        compressed[0] = 1;
        let big = message(POOLED_FROM);
        // Small, compressed, over the limit, and a prefix cut across two frames.
        let bodies = [
            vec![message(100)],
            vec![message(CAPTURED_FROM - 1)],
            vec![compressed],
            vec![message(2 * POOLED_FROM)],
            vec![big[..3].to_vec(), big[3..].to_vec()],
        ];
        for chunks in bodies {
            let (body, slot) = armed(chunks.clone(), POOLED_FROM + 10);
            assert_eq!(data_frames(body).await.unwrap(), chunks.concat());
            assert!(slot.take().is_none());
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_captured_message_is_charged_and_timed_as_it_arrives() {
        use http_body_util::BodyExt;
        let budget = Budget::new(4096 << 10);
        let slot = Captured::default();
        let (tx, mut body, charge) = fed(&budget, false, Big::Armed { slot: slot.clone(), max: 2 * POOLED_FROM });
        // 100 KiB of a 1 MiB message, then nothing: charged as it came, cut at the timeout.
        let mut m = message(POOLED_FROM);
        m.truncate(100 << 10);
        tx.send(Ok(Frame::data(Bytes::from(m)))).await.unwrap();
        let refused = body.frame().await.unwrap().unwrap_err();
        assert_eq!(refused.code(), tonic::Code::DeadlineExceeded, "{refused:?}");
        assert_eq!(budget.available(), 4096 - 100);
        drop(body);
        drop(charge);
        assert_eq!(budget.available(), 4096);
        assert!(slot.take().is_none());
        drop(tx);
    }

    #[tokio::test]
    async fn a_body_that_ends_inside_a_captured_message_fails() {
        let m = message(POOLED_FROM);
        let (body, slot) = armed(vec![m[..m.len() - 1].to_vec()], 2 * POOLED_FROM);
        assert_eq!(data_frames(body).await.unwrap_err().code(), tonic::Code::Internal);
        assert!(slot.take().is_none());
    }

    #[test]
    fn charge_is_refused_past_the_budget_and_given_back() {
        let budget = Budget::new(4 << 10);
        let a = Charge { budget: budget.clone(), tenant: None, permits: AtomicU32::new(0) };
        a.hold(3, HeldFor::Request).unwrap();
        a.hold(2, HeldFor::Request).unwrap();
        let b = Charge { budget: budget.clone(), tenant: None, permits: AtomicU32::new(0) };
        assert!(matches!(b.hold(2, HeldFor::Request), Err(Error::Unavailable { .. })), "to retry");
        assert!(matches!(b.hold(5, HeldFor::Request), Err(Error::TooLarge(_))), "more than the whole budget: never");
        drop(a);
        b.hold(4, HeldFor::Request).unwrap();
        assert_eq!(budget.available(), 0);
        b.release();
        assert_eq!(budget.available(), 4);
    }
}
