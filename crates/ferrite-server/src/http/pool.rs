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
        self.taken.store(true, Relaxed);
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        let best = idle.iter().enumerate().filter(|(_, b)| b.capacity() >= len).min_by_key(|(_, b)| b.capacity());
        match best.map(|(i, _)| i) {
            Some(i) => idle.swap_remove(i),
            None => Vec::with_capacity(len),
        }
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

    /// The whole body, at most `max` bytes: into a pooled buffer when it states a length of at
    /// least `POOLED_FROM` (the buffer holds the stated length; a body that sends more grows it,
    /// up to `max`), else as axum reads it.
    pub async fn read(&'static self, body: Body, max: usize, stated: Option<usize>) -> Result<Bytes, ReadError> {
        let Some(len) = stated.filter(|&n| (POOLED_FROM..=max).contains(&n)) else {
            return axum::body::to_bytes(body, max).await.map_err(|e| {
                if std::error::Error::source(&e).is_some_and(|s| s.is::<http_body_util::LengthLimitError>()) {
                    ReadError::TooLarge
                } else {
                    ReadError::Failed(e.to_string())
                }
            });
        };
        let mut buf = self.buffer(len);
        let mut body = body;
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| ReadError::Failed(e.to_string()))?;
            if let Some(data) = frame.data_ref() {
                if buf.filled() + data.len() > max {
                    return Err(ReadError::TooLarge);
                }
                buf.extend(data);
            }
        }
        Ok(buf.into_bytes())
    }

    /// An empty buffer that holds `len` bytes without growing; back to the pool when dropped (or
    /// when the last view of `into_bytes` is).
    pub fn buffer(&'static self, len: usize) -> Pooled {
        let mut buf = self.take(len);
        buf.clear();
        Pooled { buf, pool: self }
    }

    /// A buffer of `len` bytes that `read` fills whole (an error gives it back unseen). Bytes a
    /// previous request left in it are written over rather than zeroed first: zeroing a
    /// detector's 1.2 MB image read from shared memory was a memset as large as the read.
    pub fn filled<E>(&'static self, len: usize, read: impl FnOnce(&mut [u8]) -> Result<(), E>) -> Result<Pooled, E> {
        let mut buf = Pooled { buf: self.take(len), pool: self };
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
}

impl Pooled {
    /// Bytes written so far.
    pub fn filled(&self) -> usize {
        self.buf.len()
    }

    pub fn extend(&mut self, data: &[u8]) {
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
    /// The connection failed or the framing was broken.
    Failed(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    static POOL: Pool = Pool::new();

    fn idle() -> Vec<usize> {
        POOL.idle.lock().unwrap().iter().map(Vec::capacity).collect()
    }

    #[tokio::test]
    async fn bodies_reuse_buffers_and_idle_ones_are_freed() {
        let body = vec![7u8; POOLED_FROM + 5];
        let read_one = |b: Vec<u8>, stated| POOL.read(Body::from(b), 4 * POOLED_FROM, stated);
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
