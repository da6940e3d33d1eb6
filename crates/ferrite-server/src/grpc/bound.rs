//! What a gRPC message costs once decoded, bounded before prost decodes it. A message's bytes are
//! bounded (`--grpc-max-decoding-message-size`) and held in the budget of bytes in flight, but
//! what prost makes of them is not the same size: an empty `inputs` entry of a ModelInfer request
//! is 2 bytes on the wire and a few hundred in memory, an empty string 2 bytes and 24, a small
//! packed int64 1 byte and 8. One 64 MiB message of empty inputs took 10 GB to decode, a TEI
//! rerank call of empty texts 0.9 GB. So every message the gRPC listener decodes (`Codec`, and
//! the ModelInfer messages captured into pooled buffers) is first walked, field by field from the
//! protocol's own descriptors, with nothing allocated, and refused (RESOURCE_EXHAUSTED) when what
//! it would decode to, beyond the bytes it shares with its buffer, is more than sixteen times its
//! length (a megabyte more for small ones), or its length and one largest message: no legitimate
//! message comes near that (a packed tensor decodes to at most eight times its bytes, a tensor of
//! empty strings to sixteen, and both are bounded by the elements a request may carry).

use std::sync::{
    atomic::{AtomicUsize, Ordering},
    LazyLock,
};

use bytes::Buf;
use prost_reflect::{DescriptorPool, Kind, MessageDescriptor};
use tonic::{
    codec::{DecodeBuf, Decoder},
    Status,
};

/// The descriptors of the protocols served (KServe V2's, TEI's), as the build compiled them.
static POOL: LazyLock<DescriptorPool> = LazyLock::new(|| {
    let mut pool = DescriptorPool::new();
    for set in [
        &include_bytes!(concat!(env!("OUT_DIR"), "/inference.bin"))[..],
        &include_bytes!(concat!(env!("OUT_DIR"), "/tei.bin"))[..],
    ] {
        pool.decode_file_descriptor_set(set).expect("the build's own descriptors");
    }
    pool
});

/// The largest message accepted (the inference service's decoding limit), set when the gRPC
/// listener starts.
static LARGEST: AtomicUsize = AtomicUsize::new(64 << 20);

pub fn set_largest(bytes: usize) {
    LARGEST.store(bytes, Ordering::Relaxed);
}

/// What prost allocates for one entry of a repeated or map field of messages (the struct, its
/// vector's share, a map's hashing), for a string or bytes copied (besides its bytes), and for a
/// `Bytes` that shares the buffer.
const MESSAGE: usize = 256;
const STRING: usize = 24;
const SHARED: usize = 32;

/// What a message may decode to, beyond the bytes it shares with its buffer: `RATIO` times its
/// length and `SLACK` (a tensor of empty strings as `bytes_contents` is 16 times its bytes, of
/// small int64s 8 times), and never more than its length and one largest message. The bytes in
/// flight bound the messages held, so this bounds what they may decode to.
const RATIO: usize = 16;
const SLACK: usize = 1 << 20;

/// Refuses a message of type `U` whose decoding would allocate more than its bound (`RATIO`).
/// A message that is not valid protobuf is left to prost to refuse. One too small to reach its
/// bound, whatever its fields (a field is two bytes at least, and costs at most `MESSAGE`), is not
/// walked: most are (an MLP's request, 2 KB, is).
pub fn check<U: prost::Name>(wire: &[u8]) -> Result<(), Status> {
    let limit = bound(wire.len(), LARGEST.load(Ordering::Relaxed));
    if wire.len().saturating_mul(MESSAGE / 2) <= limit {
        return Ok(());
    }
    within(&U::full_name(), wire, limit)
}

/// What a message of `n` bytes may decode to, `largest` the largest message accepted.
fn bound(n: usize, largest: usize) -> usize {
    n.saturating_mul(RATIO).saturating_add(SLACK).min(n.saturating_add(largest))
}

/// `check`'s walk of `wire` as the message `name`, against `limit`.
fn within(name: &str, wire: &[u8], limit: usize) -> Result<(), Status> {
    let Some(message) = POOL.get_message_by_name(name) else {
        return Ok(());
    };
    let mut cost = 0;
    match walk(&message, wire, &mut cost, limit, 0) {
        Ok(()) | Err(Stop::Malformed) => Ok(()),
        Err(Stop::Over) => Err(Status::resource_exhausted(format!(
            "the message of {} bytes would take more than {limit} bytes of memory once decoded (its many \
             small fields): refused before decoding",
            wire.len()
        ))),
    }
}

enum Stop {
    /// Past the limit.
    Over,
    /// Not protobuf (or nested deeper than prost decodes): prost refuses it.
    Malformed,
}

/// Adds what decoding `buf` as `message` allocates to `cost`.
fn walk(message: &MessageDescriptor, mut buf: &[u8], cost: &mut usize, limit: usize, depth: u32) -> Result<(), Stop> {
    if depth > 100 {
        return Err(Stop::Malformed);
    }
    while !buf.is_empty() {
        let key = varint(&mut buf)?;
        let field = u32::try_from(key >> 3).ok().and_then(|n| message.get_field(n));
        let (repeated, kind) = match &field {
            Some(f) => (f.is_list() || f.is_map(), Some(f.kind())),
            // Unknown fields are skipped.
            None => (false, None),
        };
        // A number is an entry of its list when repeated (unpacked), else no allocation.
        let number = if repeated { 8 } else { 0 };
        let added = match key & 7 {
            0 => {
                varint(&mut buf)?;
                number
            }
            1 | 5 => {
                let n = if key & 7 == 1 { 8 } else { 4 };
                if buf.len() < n {
                    return Err(Stop::Malformed);
                }
                buf.advance(n);
                number
            }
            2 => {
                let len = usize::try_from(varint(&mut buf)?).map_err(|_| Stop::Malformed)?;
                if buf.len() < len {
                    return Err(Stop::Malformed);
                }
                let (inner, rest) = buf.split_at(len);
                buf = rest;
                match kind {
                    None => 0,
                    Some(Kind::Message(m)) => {
                        walk(&m, inner, cost, limit, depth + 1)?;
                        MESSAGE
                    }
                    Some(Kind::String) => STRING + len,
                    // `Bytes`: a view of the buffer (the build asks for them).
                    Some(Kind::Bytes) => SHARED,
                    // A packed list: of fixed-width numbers, as many bytes as sent; of varints,
                    // eight bytes each at most.
                    Some(
                        Kind::Double | Kind::Fixed64 | Kind::Sfixed64 | Kind::Float | Kind::Fixed32 | Kind::Sfixed32,
                    ) => len,
                    Some(_) => inner.iter().filter(|&&b| b < 0x80).count() * 8,
                }
            }
            _ => return Err(Stop::Malformed),
        };
        *cost = cost.saturating_add(added);
        if *cost > limit {
            return Err(Stop::Over);
        }
    }
    Ok(())
}

/// A protobuf varint, taken from the front of `buf`.
fn varint(buf: &mut &[u8]) -> Result<u64, Stop> {
    prost::encoding::decode_varint(buf).map_err(|_| Stop::Malformed)
}

/// The gRPC services' codec (`tonic_prost`'s, named in the build): each message is checked
/// (`check`) before prost decodes it.
pub struct Codec<T, U>(tonic_prost::ProstCodec<T, U>);

impl<T, U> Default for Codec<T, U> {
    fn default() -> Self {
        Codec(tonic_prost::ProstCodec::default())
    }
}

impl<T, U> tonic::codec::Codec for Codec<T, U>
where
    T: prost::Message + Send + 'static,
    U: prost::Message + prost::Name + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = <tonic_prost::ProstCodec<T, U> as tonic::codec::Codec>::Encoder;
    type Decoder = Checked<U>;

    fn encoder(&mut self) -> Self::Encoder {
        self.0.encoder()
    }

    fn decoder(&mut self) -> Self::Decoder {
        Checked(self.0.decoder())
    }
}

pub struct Checked<U>(tonic_prost::ProstDecoder<U>);

impl<U: prost::Message + prost::Name + Default> Decoder for Checked<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        // The message is whole in one buffer, and its chunk ends with it.
        check::<U>(buf.chunk())?;
        self.0.decode(buf)
    }

    fn buffer_settings(&self) -> tonic::codec::BufferSettings {
        self.0.buffer_settings()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::grpc::pb;
    use bytes::Bytes;
    use prost::Message as _;

    fn ok(name: &str, wire: &[u8]) -> bool {
        within(name, wire, bound(wire.len(), 64 << 20)).is_ok()
    }

    #[test]
    fn messages_of_many_empty_entries_are_refused_before_decoding() {
        let mut wire = pb::ModelInferRequest { model_name: "m".into(), ..Default::default() }.encode_to_vec();
        // 2 bytes each: an empty `inputs` entry (field 5).
        wire.extend(std::iter::repeat_n([0x2a, 0x00], 1 << 20).flatten());
        assert!(!ok("inference.ModelInferRequest", &wire));
        // The same bytes as one raw tensor are fine.
        let raw = pb::ModelInferRequest { raw_input_contents: vec![vec![0u8; 2 << 20].into()], ..Default::default() };
        assert!(ok("inference.ModelInferRequest", &raw.encode_to_vec()));
    }

    #[test]
    fn tensors_as_typed_contents_pass_up_to_eight_times_their_bytes() {
        let contents = |n: usize| pb::InferTensorContents { int64_contents: vec![1; n], ..Default::default() };
        let tensor = |n| pb::ModelInferRequest {
            inputs: vec![pb::model_infer_request::InferInputTensor {
                name: "x".into(),
                datatype: "INT64".into(),
                shape: vec![n as i64],
                contents: Some(contents(n)),
                ..Default::default()
            }],
            ..Default::default()
        };
        // 8 MiB of one-byte varints: 64 MiB of int64s, within a largest message.
        assert!(ok("inference.ModelInferRequest", &tensor(8 << 20).encode_to_vec()));
        // A million empty strings: 2 MiB, 32 MiB of `Bytes`.
        let strings = pb::InferTensorContents { bytes_contents: vec![Bytes::new(); 1 << 20], ..Default::default() };
        let wire = pb::ModelInferRequest {
            inputs: vec![pb::model_infer_request::InferInputTensor { contents: Some(strings), ..Default::default() }],
            ..Default::default()
        }
        .encode_to_vec();
        assert!(ok("inference.ModelInferRequest", &wire));
        // Within one largest message, but far more than sixteen times its bytes.
        let mut empties = pb::ModelInferRequest::default().encode_to_vec();
        empties.extend(std::iter::repeat_n([0x2a, 0x00], 64 << 10).flatten());
        assert!(!ok("inference.ModelInferRequest", &empties));
    }

    #[test]
    fn tei_texts_are_charged_their_strings() {
        let wire = crate::grpc::tei::pb::RerankRequest {
            query: "q".into(),
            texts: vec![String::new(); 1 << 20],
            ..Default::default()
        }
        .encode_to_vec();
        assert!(ok("tei.v1.RerankRequest", &wire));
        assert!(within("tei.v1.RerankRequest", &wire, bound(wire.len(), 16 << 20)).is_err());
    }

    #[test]
    fn messages_too_small_to_reach_their_bound_need_no_walk() {
        // The densest message there is (empty entries of messages), at the largest size not walked.
        let n = (1..).take_while(|&n| n * (MESSAGE / 2) <= bound(n, 64 << 20)).last().unwrap();
        let wire: Vec<u8> = std::iter::repeat_n([0x2a, 0x00], n / 2).flatten().collect();
        assert!(ok("inference.ModelInferRequest", &wire));
        assert!(n > 8 << 10, "{n}: an MLP's request is walked");
    }

    #[test]
    fn what_is_not_protobuf_is_left_to_prost() {
        assert!(ok("inference.ModelInferRequest", &[0xff, 0xff, 0xff]));
        assert!(ok("no.Such", &[0x2a, 0x00]));
    }
}
