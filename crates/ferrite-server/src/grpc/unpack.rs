//! Compressed messages of the inference service, decompressed here and handed to tonic as plain
//! ones. tonic decompresses a message inline, on the I/O thread polling the call, up to the
//! decoding limit: a few KB of gzip ask for 64 MiB (tens of milliseconds of a core), so a flood of
//! such calls stalled every connection served by those threads (a steady client's p99 went from 5 to
//! 146 ms beside two of them). Here a message is read whole (its bytes charged as the call's
//! are), then decompressed on the blocking pool a quarter of the cores at a time, as HTTP bodies
//! are (`http::DECOMPRESSING`), the call waiting its turn without a thread, its output held in the
//! budget of bytes in flight until tonic has decoded it.

use std::{collections::VecDeque, future::Future, pin::Pin, sync::Arc, time::Duration};

use bytes::Bytes;
use tonic::Status;

use ferrite_core::Error;

use super::{
    calls::{STALLED_HOLDING, STALLED_RETRY},
    unavailable,
};
use crate::{
    budget::{self, Budget},
    http::{decompress_in_turn, Inflate, BODIES_OVER_BUDGET},
};

/// See the module.
pub struct Unpack {
    gzip: bool,
    /// The decoding limit: compressed messages longer, or decompressing to more, are refused.
    max: usize,
    budget: Arc<Budget>,
    tenant: Option<String>,
    /// How long a message may wait for a place to be decompressed.
    wait: Duration,
    /// A stream's: a message decompressing past the budget waits a while for room, as a stream's
    /// plain bytes do (`calls::Charged`), rather than ending the stream at once.
    stream: bool,
    at: At,
}

/// Where in the body's messages the bytes fed so far end.
enum At {
    /// Between messages: the bytes of the next one's 5-byte prefix read so far.
    Prefix(Vec<u8>),
    /// Inside a plain message: the bytes of it left, passed on as they come.
    Plain(usize),
    /// Inside a compressed message of `want` bytes, read whole before it is decompressed.
    Compressed { buf: Vec<u8>, want: usize },
}

impl Unpack {
    /// For a call whose messages the `grpc-encoding` header says are gzip or deflate ones; `None`
    /// for others (tonic refuses what it does not accept).
    pub fn new(
        encoding: Option<&str>,
        max: usize,
        (budget, tenant): (Arc<Budget>, Option<String>),
        wait: Duration,
        stream: bool,
    ) -> Option<Unpack> {
        let gzip = match encoding? {
            "gzip" => true,
            "deflate" => false,
            _ => return None,
        };
        Some(Unpack { gzip, max, budget, tenant, wait, stream, at: At::Prefix(Vec::new()) })
    }

    /// Whether the body may end here (between messages).
    pub fn between(&self) -> bool {
        matches!(&self.at, At::Prefix(p) if p.is_empty())
    }

    /// Takes bytes from the front of `data` and puts those to hand tonic for them, in order, into
    /// `out`: plain messages as they came. Stops where a compressed message is whole, with the
    /// rest of `data` left, and returns the work that makes it a plain one (`unpacked`).
    pub fn feed(&mut self, data: &mut Bytes, out: &mut VecDeque<Bytes>) -> Option<Decompressing> {
        while !data.is_empty() {
            match &mut self.at {
                At::Plain(left) => {
                    let n = (*left).min(data.len());
                    out.push_back(data.split_to(n));
                    *left -= n;
                    if *left == 0 {
                        self.at = At::Prefix(Vec::new());
                    }
                }
                At::Compressed { buf, want } => {
                    let n = (*want - buf.len()).min(data.len());
                    buf.extend_from_slice(&data.split_to(n));
                }
                At::Prefix(prefix) => {
                    let n = (5 - prefix.len()).min(data.len());
                    prefix.extend_from_slice(&data.split_to(n));
                    if prefix.len() < 5 {
                        continue;
                    }
                    let len = u32::from_be_bytes([prefix[1], prefix[2], prefix[3], prefix[4]]) as usize;
                    if prefix[0] == 1 && len <= self.max {
                        let buf = Vec::with_capacity(len.min(1 << 20));
                        self.at = At::Compressed { buf, want: len };
                    } else {
                        // Plain, or too long for tonic to take: as it came.
                        out.push_back(Bytes::from(std::mem::take(prefix)));
                        self.at = if len == 0 { At::Prefix(Vec::new()) } else { At::Plain(len) };
                    }
                }
            }
            if let At::Compressed { buf, want } = &mut self.at {
                if buf.len() == *want {
                    let compressed = std::mem::take(buf);
                    self.at = At::Prefix(Vec::new());
                    return Some(self.unpacked(compressed));
                }
            }
        }
        None
    }

    /// A whole compressed message made a plain one (its 5-byte prefix, then it): at once if it
    /// comes to little (`INFLATED_HERE`), else once a place is free (waited for asynchronously: a
    /// thread held per waiting message let a flood of them take tokio's blocking pool, and with it
    /// the runtime's hand-over of its I/O threads), on the blocking pool.
    fn unpacked(&self, compressed: Vec<u8>) -> Decompressing {
        let (gzip, max, wait, stream) = (self.gzip, self.max, self.wait, self.stream);
        let (budget, tenant) = (self.budget.clone(), self.tenant.clone());
        let compressed = Bytes::from(compressed);
        Box::pin(async move {
            let busy = "too many compressed messages are being decompressed on this server";
            let began = tokio::time::Instant::now();
            let (plain, held, _place) = loop {
                // Only a stream's message waits: a unary call's need not be told of permits.
                let mut freed = std::pin::pin!(budget.freed());
                if stream {
                    freed.as_mut().enable();
                }
                let Some(held) = budget.take(tenant.as_deref(), 0) else {
                    return Err(unavailable(BODIES_OVER_BUDGET));
                };
                let tried = decompress_in_turn(gzip, compressed.clone(), max, held, tenant.as_deref(), wait, busy);
                match tried.await.map_err(super::status)? {
                    // A stream's message past what the budget can take now waits for room (it
                    // holds its compressed bytes meanwhile, so a second at most, as a stream
                    // holding part of a message does), and starts again once there is room for
                    // what it last asked: woken by permits given back (its own, just dropped,
                    // included) or its next try.
                    (Err(Inflate::OverBudget(Error::Unavailable { .. }, wanted)), held, place) if stream => {
                        // Neither its reservation nor its place among those decompressing is kept
                        // while it waits (unbound, they would live as long as the match).
                        drop((held, place));
                        loop {
                            let left = STALLED_HOLDING.saturating_sub(began.elapsed());
                            if left.is_zero() {
                                return Err(unavailable(BODIES_OVER_BUDGET));
                            }
                            tokio::select! {
                                _ = freed.as_mut() => {}
                                _ = tokio::time::sleep(STALLED_RETRY.min(left)) => {}
                            }
                            if budget.fits(tenant.as_deref(), wanted) {
                                break;
                            }
                            freed.set(budget.freed());
                            freed.as_mut().enable();
                        }
                    }
                    done => break done,
                }
            };
            let plain = match plain.map(|plain| budget::holding(plain, held)) {
                Ok(plain) => plain,
                Err(Inflate::TooLarge) => return Err(too_large(max)),
                Err(Inflate::OverBudget(e, _)) => return Err(super::status(e)),
                Err(Inflate::Corrupt(e)) => return Err(Status::internal(format!("Error decompressing: {e}"))),
                Err(Inflate::Unwanted) => return Err(Status::cancelled("the call was cancelled")),
            };
            let len = u32::try_from(plain.len()).map_err(|_| too_large(max))?;
            let mut prefix = vec![0u8];
            prefix.extend_from_slice(&len.to_be_bytes());
            Ok([Bytes::from(prefix), plain])
        })
    }
}

/// A compressed message being made a plain one: its prefix and its bytes.
pub type Decompressing = Pin<Box<dyn Future<Output = Result<[Bytes; 2], Status>> + Send>>;

/// As tonic says it of a message over the decoding limit.
fn too_large(max: usize) -> Status {
    Status::resource_exhausted(format!(
        "Error, decoded message length too large: found more than {max} bytes, the limit is: {max} bytes"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::{decompress, decompress_in_turn, Awaited};
    use std::io::Write;

    fn frame(flag: u8, payload: &[u8]) -> Vec<u8> {
        let mut f = vec![flag];
        f.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        f.extend_from_slice(payload);
        f
    }

    fn gzip(data: &[u8]) -> Vec<u8> {
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        e.write_all(data).unwrap();
        e.finish().unwrap()
    }

    fn unpack(max: usize, budget: &Arc<Budget>) -> Unpack {
        Unpack::new(Some("gzip"), max, (budget.clone(), None), Duration::from_secs(1), false).unwrap()
    }

    async fn fed(u: &mut Unpack, body: &[u8], chunk: usize) -> Result<Vec<u8>, Status> {
        let mut out = VecDeque::new();
        for c in body.chunks(chunk) {
            let mut data = Bytes::copy_from_slice(c);
            while let Some(plain) = u.feed(&mut data, &mut out) {
                out.extend(plain.await?);
            }
            assert!(data.is_empty());
        }
        Ok(out.iter().flat_map(|b| b.to_vec()).collect())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn compressed_messages_reach_tonic_plain_and_plain_ones_as_they_came() {
        let budget = Budget::new(64 << 20);
        let a = b"first message".repeat(100);
        let b = vec![7u8; 300_000];
        let body = [frame(1, &gzip(&a)), frame(0, b"plain"), frame(0, b""), frame(1, &gzip(&b))].concat();
        let want = [frame(0, &a), frame(0, b"plain"), frame(0, b""), frame(0, &b)].concat();
        for chunk in [1, 3, 5, 4096, body.len()] {
            let mut u = unpack(1 << 20, &budget);
            assert_eq!(fed(&mut u, &body, chunk).await.unwrap(), want, "chunks of {chunk}");
            assert!(u.between());
        }
        let mut u = unpack(1 << 20, &budget);
        let _ = fed(&mut u, &body[..body.len() - 1], 4096).await.unwrap();
        assert!(!u.between(), "inside the last message");
        assert_eq!(budget.available(), Budget::new(64 << 20).available(), "the output is held only while it lives");
    }

    #[test]
    fn a_decompression_no_one_awaits_stops_at_its_next_step() {
        let budget = Budget::new(64 << 20);
        let bytes = gzip(&vec![0u8; 1 << 20]);
        let (awaited, wanted) = Awaited::new();
        let mut held = budget.take(None, 0).unwrap();
        assert_eq!(decompress(true, &bytes, 4 << 20, &mut held, &wanted).ok().map(|b| b.len()), Some(1 << 20));
        drop(awaited);
        assert!(matches!(decompress(true, &bytes, 4 << 20, &mut held, &wanted), Err(Inflate::Unwanted)));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn a_bomb_is_refused_past_the_limit_and_a_corrupt_message_fails() {
        let budget = Budget::new(64 << 20);
        let bomb = frame(1, &gzip(&vec![0u8; (1 << 20) + 1]));
        let e = fed(&mut unpack(1 << 20, &budget), &bomb, 4096).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e:?}");
        let e = fed(&mut unpack(1 << 20, &budget), &frame(1, b"not gzip at all"), 4096).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::Internal, "{e:?}");
        // Past the budget of bytes in flight: refused, as an uncompressed message would be, to
        // retry while others hold it, for good past what it could ever hold.
        let small = Budget::new(1 << 20);
        let others = small.take(None, 900 << 10).unwrap();
        let e = fed(&mut unpack(4 << 20, &small), &frame(1, &gzip(&[1u8; 200 << 10])), 4096).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
        drop(others);
        assert!(fed(&mut unpack(4 << 20, &small), &frame(1, &gzip(&[1u8; 200 << 10])), 4096).await.is_ok());
        let e = fed(&mut unpack(4 << 20, &small), &frame(1, &gzip(&[1u8; 2 << 20])), 4096).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e:?}");
        assert!(e.message().contains("more than this server ever holds"), "{e:?}");
        assert_eq!(small.available(), 1024);
        // A compressed message longer than the limit is tonic's to refuse: passed on as it came.
        let long = frame(1, &[1u8; 64]);
        assert_eq!(fed(&mut unpack(32, &budget), &long, 7).await.unwrap(), long);
        assert!(Unpack::new(Some("identity"), 1, (budget.clone(), None), Duration::ZERO, false).is_none());
        assert!(Unpack::new(None, 1, (budget, None), Duration::ZERO, false).is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn a_streams_message_decompressing_past_the_budget_waits_a_second_for_room() {
        let small = Budget::new(1 << 20);
        // Decompressed where it is (under `INFLATED_HERE`), so the clock alone says how long.
        let message = frame(1, &gzip(&[1u8; 40 << 10]));
        let stream =
            || Unpack::new(Some("gzip"), 4 << 20, (small.clone(), None), Duration::from_secs(1), true).unwrap();
        // Room comes within the second: the message is decompressed then, from the start.
        let others = small.take(None, 1000 << 10).unwrap();
        let (mut u, m) = (stream(), message.clone());
        let waiting = tokio::spawn(async move { fed(&mut u, &m, 4096).await });
        tokio::time::sleep(Duration::from_millis(600)).await;
        assert!(!waiting.is_finished());
        drop(others);
        assert_eq!(waiting.await.unwrap().unwrap(), frame(0, &[1u8; 40 << 10]));
        // None comes: the stream ends as it did before it waited, a second later.
        let _others = small.take(None, 1000 << 10).unwrap();
        let began = tokio::time::Instant::now();
        let e = fed(&mut stream(), &message, 4096).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
        assert!((STALLED_HOLDING..STALLED_HOLDING * 2).contains(&began.elapsed()), "{:?}", began.elapsed());
        // A unary call's is refused at once.
        let began = tokio::time::Instant::now();
        let e = fed(&mut unpack(4 << 20, &small), &message, 4096).await.unwrap_err();
        assert_eq!((e.code(), began.elapsed()), (tonic::Code::Unavailable, Duration::ZERO), "{e:?}");
        assert_eq!(small.available(), 24, "nothing of theirs is left held");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stream_waiting_for_room_holds_no_place_among_those_decompressing() {
        let small = Budget::new(1 << 20);
        // Past `INFLATED_HERE`: decompressed in one of the places (one on two cores).
        let big = frame(1, &gzip(&[1u8; 600 << 10]));
        let _others = small.take(None, 700 << 10).unwrap();
        let mut u = Unpack::new(Some("gzip"), 4 << 20, (small.clone(), None), Duration::from_secs(1), true).unwrap();
        let waiting = tokio::spawn(async move { fed(&mut u, &big, 1 << 20).await });
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(!waiting.is_finished());
        // Meanwhile another body is decompressed at once, not after the stream has given up.
        let other = Budget::new(64 << 20);
        let began = std::time::Instant::now();
        let held = other.take(None, 0).unwrap();
        let body = gzip(&[2u8; 100 << 10]);
        let (out, _, _) =
            decompress_in_turn(true, body, 1 << 20, held, None, Duration::from_secs(5), "busy").await.unwrap();
        assert_eq!(out.ok().map(|b| b.len()), Some(100 << 10));
        assert!(began.elapsed() < Duration::from_millis(500), "{:?}", began.elapsed());
        assert_eq!(waiting.await.unwrap().unwrap_err().code(), tonic::Code::Unavailable);
    }
}
