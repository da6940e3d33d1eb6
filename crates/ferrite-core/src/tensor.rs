//! Tensors as the core carries them: a name, a datatype, a shape and row-major little-endian bytes.

use bytes::Bytes;

use crate::{DataType, Error, Result};

#[derive(Debug, Clone, PartialEq)]
pub enum TensorData {
    /// Fixed-size elements, little-endian, row-major, no padding (BOOL is one byte).
    Raw(Bytes),
    /// One entry per BYTES element.
    Bytes(Vec<Bytes>),
}

#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    pub name: String,
    pub datatype: DataType,
    pub shape: Vec<usize>,
    pub data: TensorData,
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

impl Tensor {
    pub fn new(name: impl Into<String>, datatype: DataType, shape: Vec<usize>, data: TensorData) -> Self {
        Tensor { name: name.into(), datatype, shape, data }
    }

    /// A fixed-size tensor from typed values (for tests, examples and backends).
    pub fn from_le<T: LeBytes>(name: &str, datatype: DataType, shape: Vec<usize>, values: &[T]) -> Self {
        let mut buf = Vec::with_capacity(std::mem::size_of_val(values));
        for v in values {
            v.put_le(&mut buf);
        }
        Tensor::new(name, datatype, shape, TensorData::Raw(buf.into()))
    }

    pub fn element_count(&self) -> usize {
        self.shape.iter().product()
    }

    /// Checks that the data holds exactly the elements the shape and datatype call for.
    pub fn check_size(&self) -> Result<()> {
        let n = self.element_count();
        match (&self.data, self.datatype.size()) {
            (TensorData::Raw(b), Some(size)) if b.len() == n * size => Ok(()),
            (TensorData::Bytes(v), None) if v.len() == n => Ok(()),
            (TensorData::Raw(b), Some(size)) => Err(Error::invalid(format!(
                "input '{}': shape {:?} of {} needs {} bytes, got {}",
                self.name,
                self.shape,
                self.datatype,
                n * size,
                b.len()
            ))),
            (TensorData::Bytes(v), None) => Err(Error::invalid(format!(
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
            TensorData::Raw(b) => {
                let row_bytes = b.len() / total;
                TensorData::Raw(b.slice(start * row_bytes..(start + rows) * row_bytes))
            }
            TensorData::Bytes(v) => TensorData::Bytes(v[start * per_row..(start + rows) * per_row].to_vec()),
        };
        Tensor { name: self.name.clone(), datatype: self.datatype, shape, data }
    }
}

/// Little-endian encoding of the fixed-size element types.
pub trait LeBytes: Copy {
    fn put_le(self, buf: &mut Vec<u8>);
}

macro_rules! le_bytes {
    ($($t:ty),*) => {$(
        impl LeBytes for $t {
            fn put_le(self, buf: &mut Vec<u8>) {
                buf.extend_from_slice(&self.to_le_bytes());
            }
        }
    )*};
}
le_bytes!(u8, u16, u32, u64, i8, i16, i32, i64, f32, f64, half::f16, half::bf16);

impl LeBytes for bool {
    fn put_le(self, buf: &mut Vec<u8>) {
        buf.push(self as u8);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
            TensorData::Bytes(vec![Bytes::from_static(b"a"), Bytes::from_static(b"b")]),
        );
        assert_eq!(s.rows(1, 1).data, TensorData::Bytes(vec![Bytes::from_static(b"b")]));
    }

    #[test]
    fn size_mismatch_names_the_input() {
        let mut t = Tensor::from_le("x", DataType::Fp32, vec![2], &[1.0f32, 2.0]);
        t.shape = vec![3];
        let err = t.check_size().unwrap_err().to_string();
        assert!(err.contains("'x'") && err.contains("12 bytes"), "{err}");
    }
}
