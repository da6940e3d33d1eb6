//! Large request bodies read into buffers reused from request to request.
//!
//! From 1 MiB glibc gives each buffer a mapping of its own (`fix_mmap_threshold` in main.rs), so a
//! fresh one is a page fault per 4 KiB written: a detector's 1.2 MB image cost about 300 faults
//! to read, more than copying it. A body's buffer goes back here when the last view of it (the
//! request's tensors, split off it) is dropped. Large unary gRPC messages are read into the same
//! buffers (`grpc::calls`).

use std::sync::{
    atomic::{AtomicBool, Ordering::Relaxed},
    Mutex,
};

use axum::body::{Body, Bytes};

use crate::budget::{HeldFor, Reserved};
use http_body_util::BodyExt;

/// Bodies stated this large and larger are read into a pooled buffer; smaller ones come from the
/// heap, which reuses freed memory on its own.
pub const POOLED_FROM: usize = 1 << 20;

/// The most bytes of idle buffers kept.
const IDLE_BYTES: usize = 64 << 20;

pub struct Pool {
    idle: Mutex<Vec<Vec<u8>>>,
    /// A buffer was taken since the last `trim`.
    taken: AtomicBool,
}

/// The server's request bodies.
pub static BODIES: Pool = Pool::new();

impl Pool {
    const fn new() -> Pool {
        Pool { idle: Mutex::new(Vec::new()), taken: AtomicBool::new(false) }
    }

    /// A buffer of at least `len` bytes' capacity, its bytes as the last request left them: the
    /// smallest idle one that holds them, else a new (empty) one.
    fn take(&self, len: usize) -> Vec<u8> {
        self.idle_holding(len).unwrap_or_else(|| Vec::with_capacity(len))
    }

    /// The smallest idle buffer that holds `len` bytes, if any.
    fn idle_holding(&self, len: usize) -> Option<Vec<u8>> {
        self.taken.store(true, Relaxed);
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        let best = idle.iter().enumerate().filter(|(_, b)| b.capacity() >= len).min_by_key(|(_, b)| b.capacity());
        best.map(|(i, _)| i).map(|i| idle.swap_remove(i))
    }

    /// A buffer back from a body no one reads any more: kept while the idle ones stay within
    /// `IDLE_BYTES`, with its length, so that the next `filled` of that length need not zero it
    /// first (its bytes are never seen before a read has written over them).
    fn give(&self, buf: Vec<u8>) {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        if idle.iter().map(Vec::capacity).sum::<usize>() + buf.capacity() <= IDLE_BYTES {
            idle.push(buf);
        }
    }

    /// Frees the idle buffers if none was taken since the last call (the server calls this every
    /// 20 s): what a burst left goes back to the system within two periods.
    pub fn trim(&self) {
        if !self.taken.swap(false, Relaxed) {
            self.idle.lock().unwrap_or_else(|e| e.into_inner()).clear();
        }
    }

    /// The whole body, at most `max` bytes, each of its bytes held in `held` before it is kept
    /// (as they arrive: a client that states a large body and trickles it holds only what it
    /// sent): into a pooled buffer when it states a length of at least `POOLED_FROM` (`buffer`:
    /// grown as the bytes come; a body that sends more than stated grows it, up to `max`), else
    /// as it comes.
    pub async fn read(
        &'static self,
        mut body: Body,
        max: usize,
        stated: Option<usize>,
        held: &mut Reserved,
    ) -> Result<Bytes, ReadError> {
        // Past `max`, refused before the bytes are charged.
        let mut hold = |n: usize| match n > max {
            true => Err(ReadError::TooLarge),
            false => held.hold(n, HeldFor::Request).map_err(ReadError::OverBudget),
        };
        let Some(len) = stated.filter(|&n| (POOLED_FROM..=max).contains(&n)) else {
            // Small or unsized: its one frame as it came, or the frames copied into one.
            let (mut first, mut joined) = (None::<Bytes>, Vec::new());
            while let Some(frame) = body.frame().await {
                let frame = frame.map_err(|e| ReadError::Failed(e.to_string()))?;
                if let Ok(data) = frame.into_data() {
                    hold(first.as_ref().map_or(joined.len(), Bytes::len) + data.len())?;
                    match first.take() {
                        None if joined.is_empty() => first = Some(data),
                        earlier => {
                            joined.extend_from_slice(earlier.as_deref().unwrap_or_default());
                            joined.extend_from_slice(&data);
                        }
                    }
                }
            }
            return Ok(first.unwrap_or_else(|| joined.into()));
        };
        let mut buf = self.buffer(len);
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| ReadError::Failed(e.to_string()))?;
            if let Some(data) = frame.data_ref() {
                hold(buf.filled() + data.len())?;
                buf.extend(data);
            }
        }
        Ok(buf.into_bytes())
    }

    /// An empty buffer for `len` bytes stated by a client, back to the pool when dropped (or
    /// when the last view of `into_bytes` is): an idle one that holds them (memory the server
    /// holds already), else a new one of at most `POOLED_FROM` grown as the bytes come (doubled,
    /// up to `len`; glibc moves such mappings without copying): a client that states a large
    /// body and sends little has the server allocate little.
    pub fn buffer(&'static self, len: usize) -> Pooled {
        let mut buf = self.idle_holding(len).unwrap_or_else(|| Vec::with_capacity(len.min(POOLED_FROM)));
        buf.clear();
        Pooled { buf, pool: self, stated: len }
    }

    /// A buffer of `len` bytes that `read` fills whole (an error gives it back unseen). Bytes a
    /// previous request left in it are written over rather than zeroed first: zeroing a
    /// detector's 1.2 MB image read from shared memory was a memset as large as the read.
    pub fn filled<E>(&'static self, len: usize, read: impl FnOnce(&mut [u8]) -> Result<(), E>) -> Result<Pooled, E> {
        let mut buf = Pooled { buf: self.take(len), pool: self, stated: len };
        if buf.buf.len() < len {
            buf.buf.resize(len, 0);
        }
        buf.buf.truncate(len);
        read(&mut buf.buf)?;
        Ok(buf)
    }
}

/// A pooled buffer's bytes, as long as any view of them lives.
pub struct Pooled {
    buf: Vec<u8>,
    pool: &'static Pool,
    /// The length its client stated: what it grows to at most in one step.
    stated: usize,
}

impl Pooled {
    /// Bytes written so far.
    pub fn filled(&self) -> usize {
        self.buf.len()
    }

    pub fn extend(&mut self, data: &[u8]) {
        let (len, cap) = (self.buf.len(), self.buf.capacity());
        if len + data.len() > cap {
            let to = (len + data.len()).max((2 * cap).min(self.stated));
            self.buf.reserve_exact(to - len);
        }
        self.buf.extend_from_slice(data);
    }

    pub fn into_bytes(self) -> Bytes {
        Bytes::from_owner(self)
    }
}

impl AsRef<[u8]> for Pooled {
    fn as_ref(&self) -> &[u8] {
        &self.buf
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        self.pool.give(std::mem::take(&mut self.buf));
    }
}

/// Why a body could not be read.
pub enum ReadError {
    /// Over `max` bytes.
    TooLarge,
    /// Past the bytes in flight all requests (or its tenant's) may hold, now or ever.
    OverBudget(ferrite_core::Error),
    /// The connection failed or the framing was broken.
    Failed(String),
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferrite_core::Error;

    static POOL: Pool = Pool::new();

    fn idle() -> Vec<usize> {
        POOL.idle.lock().unwrap().iter().map(Vec::capacity).collect()
    }

    #[tokio::test]
    async fn a_body_holds_the_bytes_it_has_sent_as_they_arrive() {
        use std::convert::Infallible;
        static OWN: Pool = Pool::new(); // not `POOL`, whose idle buffers the test below counts

        // Past what the budget has now (another request holds a KiB), or past all of it.
        for (stated, second) in [(None, 5), (Some(POOLED_FROM), 5), (None, 6), (Some(POOLED_FROM), 6)] {
            let budget = crate::budget::Budget::new(8 << 10);
            let other = budget.take(None, 1 << 10).unwrap();
            let (tx, rx) = tokio::sync::mpsc::channel::<Result<http_body::Frame<Bytes>, Infallible>>(1);
            let body = Body::new(http_body_util::StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx)));
            let mut held = budget.take(None, 0).unwrap();
            let reading = tokio::spawn(async move {
                let read = OWN.read(body, 4 * POOLED_FROM, stated, &mut held).await;
                (read, held)
            });
            let settle = |free: usize| {
                let budget = budget.clone();
                async move {
                    for _ in 0..1000 {
                        if budget.available() == free {
                            return true;
                        }
                        tokio::task::yield_now().await;
                    }
                    false
                }
            };
            // Stated large, sent small: only what was sent is held.
            assert!(settle(7).await, "nothing held before a byte");
            tx.send(Ok(http_body::Frame::data(Bytes::from(vec![1; 3 << 10])))).await.unwrap();
            assert!(settle(4).await, "{stated:?}: three KiB sent, three held");
            tx.send(Ok(http_body::Frame::data(Bytes::from(vec![2; second << 10])))).await.unwrap();
            let (read, held) = reading.await.unwrap();
            match second {
                5 => {
                    assert!(matches!(read, Err(ReadError::OverBudget(Error::Unavailable { .. }))), "{stated:?}: retry")
                }
                _ => assert!(matches!(read, Err(ReadError::OverBudget(Error::TooLarge(_)))), "{stated:?}: never fits"),
            }
            assert_eq!(budget.available(), 4, "what was kept is still held until the request ends");
            drop((held, other));
            assert_eq!(budget.available(), 8);
        }
        // Within the budget, the frames of a small body come back as one.
        for stated in [None, Some(6), Some(POOLED_FROM)] {
            let budget = crate::budget::Budget::new(8 << 10);
            let frames = [b"ab".as_slice(), b"", b"cd", b"e", b"f"]
                .map(|f| Ok::<_, Infallible>(http_body::Frame::data(Bytes::from_static(f))));
            let body = Body::new(http_body_util::StreamBody::new(tokio_stream::iter(frames)));
            let read = OWN.read(body, 4 * POOLED_FROM, stated, &mut budget.take(None, 0).unwrap()).await;
            assert!(matches!(read, Ok(b) if b[..] == *b"abcdef"), "{stated:?}");
        }
        // Memory follows the bytes too: a buffer for a body stated large, with no idle one that
        // holds it, starts small and grows as its bytes come, to the stated length at most.
        let mut buf = OWN.buffer(64 << 20);
        assert_eq!(buf.buf.capacity(), POOLED_FROM);
        buf.extend(&[5; 10]);
        buf.extend(&vec![5; POOLED_FROM]);
        assert_eq!(buf.buf.capacity(), 2 * POOLED_FROM);
        let mut near = OWN.buffer(POOLED_FROM + 5);
        near.extend(&vec![5; POOLED_FROM + 5]);
        assert_eq!(near.buf.capacity(), POOLED_FROM + 5, "doubled no further than stated");
    }

    #[tokio::test]
    async fn bodies_reuse_buffers_and_idle_ones_are_freed() {
        let body = vec![7u8; POOLED_FROM + 5];
        let budget = crate::budget::Budget::new(1 << 30);
        let read_one = |b: Vec<u8>, stated| {
            let budget = budget.clone();
            async move { POOL.read(Body::from(b), 4 * POOLED_FROM, stated, &mut budget.take(None, 0).unwrap()).await }
        };
        let Ok(first) = read_one(body.clone(), Some(body.len())).await else { panic!("read") };
        assert_eq!(&first[..], &body[..]);
        let view = first.slice(100..200);
        drop(first);
        assert!(idle().is_empty(), "a view of the body keeps its buffer");
        let at = view.as_ptr() as usize - 100;
        drop(view);
        assert_eq!(idle(), [POOLED_FROM + 5], "the last view gives the buffer back");

        let Ok(second) = read_one(body.clone(), Some(body.len())).await else { panic!("read") };
        assert_eq!(second.as_ptr() as usize, at, "the next body of that size reuses it");
        assert_eq!(&second[..], &body[..]);
        drop(second);

        let big = vec![1u8; 3 * POOLED_FROM];
        assert!(
            matches!(read_one(big.clone(), Some(POOLED_FROM)).await, Ok(b) if b[..] == big[..]),
            "more than stated"
        );
        assert!(matches!(read_one(vec![0; 5 * POOLED_FROM], Some(POOLED_FROM)).await, Err(ReadError::TooLarge)));
        assert!(matches!(read_one(vec![0; 5 * POOLED_FROM], None).await, Err(ReadError::TooLarge)));
        assert!(matches!(read_one(vec![3; 10], Some(10)).await, Ok(b) if b[..] == [3; 10]), "small bodies");

        // A buffer filled whole by its reader is not zeroed first; what the reader leaves is
        // all that is seen, whatever the buffer held, and a body read into it after starts empty.
        let write = |len: usize, v: u8| {
            POOL.filled(len, |b: &mut [u8]| {
                b.fill(v);
                Ok::<_, ()>(())
            })
        };
        let Ok(first) = write(POOLED_FROM + 5, 9) else { panic!("fill") };
        assert_eq!(first.as_ref(), &[9; POOLED_FROM + 5][..]);
        drop(first);
        let mut seen = 0;
        let Ok(again) = POOL.filled(POOLED_FROM, |b: &mut [u8]| {
            seen = b[0];
            b.fill(4);
            Ok::<_, ()>(())
        }) else {
            panic!("fill")
        };
        assert_eq!(seen, 9, "the bytes it held were not zeroed before the read");
        assert_eq!(again.as_ref(), &[4; POOLED_FROM][..]);
        drop(again);
        let Ok(longer) = write(POOLED_FROM + 5, 5) else { panic!("fill") };
        assert_eq!(longer.as_ref(), &[5; POOLED_FROM + 5][..]);
        drop(longer);
        let idle_before = idle().len();
        assert!(POOL.filled(POOLED_FROM, |_| Err(())).is_err());
        assert_eq!(idle().len(), idle_before, "a failed read gives its buffer back");
        let Ok(body) = read_one(vec![6; POOLED_FROM + 1], Some(POOLED_FROM + 1)).await else { panic!("read") };
        assert_eq!(&body[..], &[6; POOLED_FROM + 1][..]);
        drop(body);

        POOL.trim();
        assert!(!idle().is_empty(), "buffers were taken since the last trim");
        POOL.trim();
        assert!(idle().is_empty(), "none taken since: freed");
    }
}
