//! The binary form of a cached response in the shared tier, and its checked decoding.

use bytes::Bytes;

use crate::{data::tensor::element_count, DataType, Error, Result, Tensor, TensorData};

/// Compact binary form for Redis: per tensor its name, datatype, shape and wire bytes.
pub fn encode(outputs: &[Tensor]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&(outputs.len() as u32).to_le_bytes());
    for t in outputs {
        out.extend_from_slice(&(t.name.len() as u32).to_le_bytes());
        out.extend_from_slice(t.name.as_bytes());
        out.push(DataType::ALL.iter().position(|&d| d == t.datatype).unwrap_or(0) as u8);
        out.extend_from_slice(&(t.shape.len() as u32).to_le_bytes());
        for d in &t.shape {
            out.extend_from_slice(&(*d as u64).to_le_bytes());
        }
        let wire = t.data.to_wire();
        out.extend_from_slice(&(wire.len() as u64).to_le_bytes());
        out.extend_from_slice(&wire);
    }
    out
}

/// The inverse of `encode`. A value from the shared tier is client input: every length and element
/// count is checked (with checked arithmetic, each tensor at most `max_elements` elements), so a
/// corrupt or forged value is an error, never a panic or a huge allocation.
pub fn decode(mut b: Bytes, max_elements: usize) -> Result<Vec<Tensor>> {
    fn take(b: &mut Bytes, n: usize) -> Result<Bytes> {
        if n > b.len() {
            return Err(Error::internal("corrupt cache value"));
        }
        Ok(b.split_to(n))
    }
    fn int(b: &mut Bytes, n: usize) -> Result<u64> {
        let bytes = take(b, n)?;
        let mut v = [0u8; 8];
        v[..n].copy_from_slice(&bytes);
        Ok(u64::from_le_bytes(v))
    }
    let count = int(&mut b, 4)? as usize;
    let mut out = Vec::with_capacity(count.min(64));
    for _ in 0..count {
        let name_len = int(&mut b, 4)? as usize;
        let name =
            String::from_utf8(take(&mut b, name_len)?.to_vec()).map_err(|_| Error::internal("corrupt cache value"))?;
        let datatype =
            *DataType::ALL.get(int(&mut b, 1)? as usize).ok_or_else(|| Error::internal("corrupt cache value"))?;
        let rank = int(&mut b, 4)? as usize;
        if rank > crate::wire::MAX_RANK {
            return Err(Error::internal("corrupt cache value"));
        }
        let shape = (0..rank).map(|_| int(&mut b, 8).map(|d| d as usize)).collect::<Result<Vec<_>>>()?;
        let len = int(&mut b, 8)? as usize;
        let wire = take(&mut b, len)?;
        let count = element_count(&shape, max_elements).map_err(|_| Error::internal("corrupt cache value"))?;
        let data = TensorData::from_wire(&name, datatype, count, wire)?;
        out.push(Tensor::new(name, datatype, shape, data));
    }
    Ok(out)
}
