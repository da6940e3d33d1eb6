//! Tensors as the core carries them: a name, a datatype, a shape and row-major little-endian bytes.

use std::sync::Arc;

use bytes::Bytes;

use crate::{DataType, Error, Result};

/// A tensor's elements. (`bytes::Bytes` is the shared buffer type; `DataType::Bytes` is the V2
/// BYTES datatype, whose elements are the `Strings` here.)
#[derive(Debug, Clone, PartialEq)]
pub enum TensorData {
    /// Fixed-size elements, little-endian, row-major, no padding (BOOL is one byte).
    Fixed(Bytes),
    /// One buffer per element of a BYTES tensor (arbitrary bytes, not necessarily UTF-8).
    Strings(Vec<Bytes>),
}

#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    pub name: String,
    pub datatype: DataType,
    pub shape: Vec<usize>,
    pub data: TensorData,
}

/// A copy of `src` in a 16-byte-aligned buffer, so typed views (NumPy arrays, SIMD loads) can
/// read any fixed-size element type in place.
pub fn aligned_bytes(src: &[u8]) -> Bytes {
    let mut buf = vec![0u128; src.len().div_ceil(16)];
    copy_into(&mut buf, src);
    Bytes::from_owner(Aligned { buf, len: src.len() })
}

/// The first `len` bytes of a buffer of 16-byte words (`Vec<u128>`, or an `Arc` of one), as
/// `Bytes` own them.
struct Aligned<B> {
    buf: B,
    len: usize,
}

impl<B> AsRef<[u8]> for Aligned<B>
where
    B: std::ops::Deref,
    B::Target: AsRef<[u128]>,
{
    fn as_ref(&self) -> &[u8] {
        let words = (*self.buf).as_ref();
        assert!(self.len <= words.len() * 16);
        // SAFETY: the words hold at least `len` initialised bytes (checked above).
        unsafe { std::slice::from_raw_parts(words.as_ptr().cast::<u8>(), self.len) }
    }
}

/// Copies `src` to the start of `dst`, which has room for it.
fn copy_into(dst: &mut [u128], src: &[u8]) {
    assert!(src.len() <= dst.len() * 16);
    // SAFETY: `dst` has room for `src.len()` bytes (checked above); the regions do not overlap.
    unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst.as_mut_ptr().cast::<u8>(), src.len()) };
}

/// Copies this large and larger go into `Reused` buffers; smaller ones come from the heap, which
/// reuses freed memory on its own (the server's mmap threshold is this size).
pub const REUSED_FROM: usize = 1 << 20;

/// The most buffers a `Reused` keeps, and their most bytes in all: a few batches' outputs in
/// flight at once (a detector's batch of 8 maps at 640x640 is 13 MB).
const REUSED_KEPT: usize = 4;
const REUSED_BYTES: usize = 64 << 20;

/// Buffers that large outputs are copied into, as `aligned_bytes` copies, each used again once no
/// view of its last copy lives. A fresh buffer of a megabyte or more is a fresh mapping, a page
/// fault per 4 KiB written: a YOLO's batch of four outputs at 320x320 (2.8 MB) cost about 700
/// faults a batch. A reused buffer is overwritten only as far as the new copy, and views see
/// only that far.
#[derive(Default)]
pub struct Reused {
    bufs: Vec<Arc<Vec<u128>>>,
}

impl Reused {
    /// A copy of `src` in a 16-byte-aligned buffer: a kept one when one is free and large enough,
    /// else a new one, kept while there is room (a free one too small makes way for it).
    pub fn copy(&mut self, src: &[u8]) -> Bytes {
        if src.len() < REUSED_FROM {
            return aligned_bytes(src);
        }
        let words = src.len().div_ceil(16);
        // Free: no view holds it (and none can be made but here).
        let free = |b: &Arc<Vec<u128>>| Arc::strong_count(b) == 1;
        let fit =
            self.bufs.iter().enumerate().filter(|(_, b)| b.len() >= words && free(b)).min_by_key(|(_, b)| b.len());
        let i = match fit.map(|(i, _)| i) {
            Some(i) => i,
            None => {
                if let Some(small) = self.bufs.iter().position(free) {
                    self.bufs.swap_remove(small);
                }
                let held: usize = self.bufs.iter().map(|b| b.len() * 16).sum();
                if self.bufs.len() >= REUSED_KEPT || held + words * 16 > REUSED_BYTES {
                    return aligned_bytes(src);
                }
                self.bufs.push(Arc::new(vec![0u128; words]));
                self.bufs.len() - 1
            }
        };
        let Some(buf) = Arc::get_mut(&mut self.bufs[i]) else {
            return aligned_bytes(src);
        };
        copy_into(buf, src);
        Bytes::from_owner(Aligned { buf: self.bufs[i].clone(), len: src.len() })
    }

    /// Whether any buffer is kept.
    pub fn is_empty(&self) -> bool {
        self.bufs.is_empty()
    }

    /// Lets go of the kept buffers (those in use live on with their views).
    pub fn clear(&mut self) {
        self.bufs.clear();
    }
}

/// The number of elements of `shape`, overflow-checked and capped at `max` (inclusive).
pub fn element_count(shape: &[usize], max: usize) -> Result<usize> {
    let mut n: usize = 1;
    for &d in shape {
        n = n
            .checked_mul(d)
            .filter(|&n| n <= max)
            .ok_or_else(|| Error::invalid(format!("shape {shape:?} has more than {max} elements")))?;
    }
    Ok(n)
}

impl TensorData {
    /// Decodes the raw wire form shared by Triton's binary extension and gRPC raw contents:
    /// fixed-size elements little-endian with no padding, BYTES as a 4-byte little-endian length
    /// then the bytes. `count` elements are expected; fixed-size data is not copied.
    pub fn from_wire(name: &str, datatype: DataType, count: usize, raw: Bytes) -> Result<TensorData> {
        if let Some(size) = datatype.size() {
            // Checked: a count from a forged header must not wrap into a small product.
            let need = count.checked_mul(size);
            if need != Some(raw.len()) {
                return Err(Error::invalid(format!(
                    "input '{name}': {count} {datatype} elements need {} bytes, got {}",
                    need.map_or("more than 2^64".to_string(), |n| n.to_string()),
                    raw.len()
                )));
            }
            return Ok(TensorData::Fixed(raw));
        }
        let mut items = Vec::with_capacity(count.min(raw.len() / 4));
        let mut at = 0;
        while at < raw.len() {
            let len_bytes: [u8; 4] = raw
                .get(at..at + 4)
                .and_then(|b| b.try_into().ok())
                .ok_or_else(|| Error::invalid(format!("input '{name}': truncated BYTES length at byte {at}")))?;
            let len = u32::from_le_bytes(len_bytes) as usize;
            at += 4;
            if len > raw.len() - at {
                return Err(Error::invalid(format!(
                    "input '{name}': BYTES element of {len} bytes at byte {at} runs past the {} given",
                    raw.len()
                )));
            }
            if items.len() == count {
                return Err(Error::invalid(format!("input '{name}': more than {count} BYTES elements")));
            }
            items.push(raw.slice(at..at + len));
            at += len;
        }
        if items.len() != count {
            return Err(Error::invalid(format!(
                "input '{name}': {count} BYTES elements expected, got {}",
                items.len()
            )));
        }
        Ok(TensorData::Strings(items))
    }

    /// The bytes it holds in memory: a fixed-size tensor's, and a BYTES tensor's elements with a
    /// handle each (32 bytes: eight times what an empty element takes in the binary extension,
    /// ten in JSON, sixteen in protobuf), whether or not they are views of a buffer held elsewhere
    /// (a request body's).
    pub fn held_len(&self) -> usize {
        match self {
            TensorData::Fixed(b) => b.len(),
            TensorData::Strings(items) => items.iter().map(|b| b.len() + std::mem::size_of::<Bytes>()).sum(),
        }
    }

    /// The length of `to_wire()`, without building it.
    pub fn wire_len(&self) -> usize {
        match self {
            TensorData::Fixed(b) => b.len(),
            TensorData::Strings(items) => items.iter().map(|b| b.len() + 4).sum(),
        }
    }

    /// The raw wire form (see `from_wire`); fixed-size data is shared, not copied.
    pub fn to_wire(&self) -> Bytes {
        match self {
            TensorData::Fixed(b) => b.clone(),
            TensorData::Strings(items) => {
                let mut out = Vec::with_capacity(self.wire_len());
                for b in items {
                    out.extend_from_slice(&(b.len() as u32).to_le_bytes());
                    out.extend_from_slice(b);
                }
                out.into()
            }
        }
    }
}

impl Tensor {
    pub fn new(name: impl Into<String>, datatype: DataType, shape: Vec<usize>, data: TensorData) -> Self {
        Tensor { name: name.into(), datatype, shape, data }
    }

    /// A fixed-size tensor from typed values (for tests, examples and backends).
    pub fn from_le<T: crate::Element>(name: &str, datatype: DataType, shape: Vec<usize>, values: &[T]) -> Self {
        let mut buf = Vec::with_capacity(std::mem::size_of_val(values));
        for v in values {
            v.put_le(&mut buf);
        }
        Tensor::new(name, datatype, shape, TensorData::Fixed(buf.into()))
    }

    pub fn element_count(&self) -> usize {
        self.shape.iter().product()
    }

    /// Checks that the data holds exactly the `n` elements (the shape's, counted by the caller)
    /// the datatype calls for.
    pub fn check_size(&self, n: usize) -> Result<()> {
        match (&self.data, self.datatype.size()) {
            (TensorData::Fixed(b), Some(size)) if b.len() == n * size => Ok(()),
            (TensorData::Strings(v), None) if v.len() == n => Ok(()),
            (TensorData::Fixed(b), Some(size)) => Err(Error::invalid(format!(
                "input '{}': shape {:?} of {} needs {} bytes, got {}",
                self.name,
                self.shape,
                self.datatype,
                n * size,
                b.len()
            ))),
            (TensorData::Strings(v), None) => Err(Error::invalid(format!(
                "input '{}': shape {:?} needs {} BYTES elements, got {}",
                self.name,
                self.shape,
                n,
                v.len()
            ))),
            _ => Err(Error::invalid(format!("input '{}': data does not match datatype {}", self.name, self.datatype))),
        }
    }

    /// Rows `start..start + rows` along dim 0, without copying fixed-size data.
    pub fn rows(&self, start: usize, rows: usize) -> Tensor {
        let total = self.shape.first().copied().unwrap_or(1).max(1);
        let per_row = self.element_count() / total;
        let mut shape = self.shape.clone();
        if let Some(d0) = shape.first_mut() {
            *d0 = rows;
        }
        let data = match &self.data {
            TensorData::Fixed(b) => {
                let row_bytes = b.len() / total;
                TensorData::Fixed(b.slice(start * row_bytes..(start + rows) * row_bytes))
            }
            TensorData::Strings(v) => TensorData::Strings(v[start * per_row..(start + rows) * per_row].to_vec()),
        };
        Tensor { name: self.name.clone(), datatype: self.datatype, shape, data }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_bytes_are_aligned_copies() {
        let src: Vec<u8> = (0..37).collect();
        let b = aligned_bytes(&src[1..]);
        assert_eq!(&b[..], &src[1..]);
        assert_eq!(b.as_ptr() as usize % 16, 0);
    }

    #[test]
    fn large_copies_reuse_a_buffer_once_its_views_are_gone() {
        let mut reused = Reused::default();
        let small = reused.copy(&[1, 2, 3]);
        assert!(reused.is_empty(), "small copies come from the heap");
        assert_eq!(&small[..], &[1, 2, 3]);
        let a: Vec<u8> = (0..REUSED_FROM + 3).map(|i| i as u8).collect();
        let first = reused.copy(&a);
        assert_eq!(&first[..], &a[..]);
        assert_eq!(first.as_ptr() as usize % 16, 0);
        let at = first.as_ptr();
        let view = first.slice(10..20);
        drop(first);
        // A view still reads it: the next copy goes elsewhere.
        let b = vec![9u8; REUSED_FROM];
        let second = reused.copy(&b);
        assert_ne!(second.as_ptr(), at);
        assert_eq!(&view[..], &a[10..20]);
        drop(view);
        // Free now, and large enough: reused, and the copy's views end where it ends.
        let third = reused.copy(&b[..REUSED_FROM]);
        assert_eq!(third.as_ptr(), at);
        assert_eq!(&third[..], &b[..]);
        // All kept buffers busy and no room for more: a copy of its own.
        let busy: Vec<Bytes> = (0..REUSED_KEPT).map(|_| reused.copy(&b)).collect();
        assert_eq!(reused.bufs.len(), REUSED_KEPT);
        assert!(busy.iter().all(|c| c[..] == b[..]));
        drop((second, third, busy));
        // A larger copy than any free buffer holds: one free buffer makes way for it.
        let big = vec![5u8; 2 * REUSED_FROM];
        assert_eq!(&reused.copy(&big)[..], &big[..]);
        assert_eq!(reused.bufs.len(), REUSED_KEPT);
        assert_eq!(reused.bufs.iter().filter(|b| b.len() * 16 >= big.len()).count(), 1);
        reused.clear();
        assert!(reused.is_empty());
    }

    #[test]
    fn element_count_is_checked() {
        assert_eq!(element_count(&[2, 3], 100).unwrap(), 6);
        assert_eq!(element_count(&[], 100).unwrap(), 1);
        assert!(element_count(&[usize::MAX, 2], usize::MAX).is_err());
        assert!(element_count(&[10, 11], 100).is_err());
    }

    #[test]
    fn rows_slice_fixed_and_bytes() {
        let t = Tensor::from_le("x", DataType::Int32, vec![3, 2], &[1i32, 2, 3, 4, 5, 6]);
        assert_eq!(t.rows(1, 2), Tensor::from_le("x", DataType::Int32, vec![2, 2], &[3i32, 4, 5, 6]));
        let s = Tensor::new(
            "s",
            DataType::Bytes,
            vec![2, 1],
            TensorData::Strings(vec![Bytes::from_static(b"a"), Bytes::from_static(b"b")]),
        );
        assert_eq!(s.rows(1, 1).data, TensorData::Strings(vec![Bytes::from_static(b"b")]));
    }

    #[test]
    fn wire_form_round_trips_and_checks_every_length() {
        let items = vec![Bytes::from_static(b"ab"), Bytes::new(), Bytes::from_static(b"xyz")];
        let wire = TensorData::Strings(items.clone()).to_wire();
        assert_eq!(TensorData::Strings(items.clone()).wire_len(), wire.len());
        assert_eq!(&wire[..], b"\x02\0\0\0ab\0\0\0\0\x03\0\0\0xyz");
        assert_eq!(TensorData::from_wire("s", DataType::Bytes, 3, wire.clone()).unwrap(), TensorData::Strings(items));
        for (count, raw, needle) in [
            (3, wire.slice(..wire.len() - 1), "runs past"),
            (2, wire.clone(), "more than 2"),
            (4, wire.clone(), "4 BYTES elements expected"),
            (1, Bytes::from_static(b"\x01\0"), "truncated"),
            (1, Bytes::from_static(b"\xff\xff\xff\xff"), "runs past"),
        ] {
            let err = TensorData::from_wire("s", DataType::Bytes, count, raw).unwrap_err().to_string();
            assert!(err.contains(needle) && err.contains("'s'"), "{err}");
        }
        let f = TensorData::from_wire("f", DataType::Fp32, 2, Bytes::from_static(&[0; 8])).unwrap();
        assert_eq!(f.to_wire().len(), 8);
        assert!(TensorData::from_wire("f", DataType::Fp32, 2, Bytes::from_static(&[0; 7])).is_err());
    }

    #[test]
    fn size_mismatch_names_the_input() {
        let mut t = Tensor::from_le("x", DataType::Fp32, vec![2], &[1.0f32, 2.0]);
        t.shape = vec![3];
        let err = t.check_size(t.element_count()).unwrap_err().to_string();
        assert!(err.contains("'x'") && err.contains("12 bytes"), "{err}");
    }
}
