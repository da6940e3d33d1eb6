//! The cache key of a request: a 128-bit hash of everything that determines its response.

use xxhash_rust::xxh3::Xxh3;

use crate::{Tensor, TensorData};

/// A 128-bit hash of everything that determines a response.
pub type Key = u128;

/// The key of a request: the tenant it is answered for (`None`: shared by every tenant), model,
/// version, a hash of the model file's bytes, every input's name, datatype, shape and bytes (in
/// model order), and which outputs were asked for. Lengths are hashed too, so no two different
/// requests can be made to feed the hasher the same stream.
pub fn key(
    tenant: Option<&str>,
    model: &str,
    version: u64,
    content: u64,
    inputs: &[Tensor],
    outputs: Option<&[usize]>,
) -> Key {
    let mut h = Xxh3::new();
    let mut field = |b: &[u8]| {
        h.update(&(b.len() as u64).to_le_bytes());
        h.update(b);
    };
    // A tenant's answers are its own: another tenant can neither hit them (and so learn by the
    // time or the statistics what was sent) nor be answered from them.
    field(&[u8::from(tenant.is_some())]);
    field(tenant.unwrap_or_default().as_bytes());
    field(model.as_bytes());
    field(&version.to_le_bytes());
    field(&content.to_le_bytes());
    for t in inputs {
        field(t.name.as_bytes());
        field(t.datatype.as_str().as_bytes());
        field(&t.shape.iter().flat_map(|d| (*d as u64).to_le_bytes()).collect::<Vec<_>>());
        match &t.data {
            TensorData::Fixed(b) => field(b),
            TensorData::Strings(items) => {
                field(&(items.len() as u64).to_le_bytes());
                for b in items {
                    field(b);
                }
            }
        }
    }
    match outputs {
        None => field(b"*"),
        Some(idx) => field(&idx.iter().flat_map(|i| (*i as u64).to_le_bytes()).collect::<Vec<_>>()),
    }
    h.digest128()
}
