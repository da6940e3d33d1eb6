//! Tensor element types, named as the KServe V2 protocol names them.

use std::fmt;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DataType {
    Bool,
    Uint8,
    Uint16,
    Uint32,
    Uint64,
    Int8,
    Int16,
    Int32,
    Int64,
    Fp16,
    Bf16,
    Fp32,
    Fp64,
    /// Variable-length byte strings (ONNX `string`).
    Bytes,
}

impl DataType {
    pub const ALL: [DataType; 14] = [
        DataType::Bool,
        DataType::Uint8,
        DataType::Uint16,
        DataType::Uint32,
        DataType::Uint64,
        DataType::Int8,
        DataType::Int16,
        DataType::Int32,
        DataType::Int64,
        DataType::Fp16,
        DataType::Bf16,
        DataType::Fp32,
        DataType::Fp64,
        DataType::Bytes,
    ];

    /// The V2 protocol name (`FP32`).
    #[inline]
    pub fn as_str(self) -> &'static str {
        match self {
            DataType::Bool => "BOOL",
            DataType::Uint8 => "UINT8",
            DataType::Uint16 => "UINT16",
            DataType::Uint32 => "UINT32",
            DataType::Uint64 => "UINT64",
            DataType::Int8 => "INT8",
            DataType::Int16 => "INT16",
            DataType::Int32 => "INT32",
            DataType::Int64 => "INT64",
            DataType::Fp16 => "FP16",
            DataType::Bf16 => "BF16",
            DataType::Fp32 => "FP32",
            DataType::Fp64 => "FP64",
            DataType::Bytes => "BYTES",
        }
    }

    /// Parses a V2 protocol name; also accepts Triton's config spelling (`TYPE_FP32`, `TYPE_STRING`).
    pub fn parse(name: &str) -> Option<DataType> {
        let name = name.strip_prefix("TYPE_").unwrap_or(name);
        if name == "STRING" {
            return Some(DataType::Bytes);
        }
        DataType::ALL.into_iter().find(|d| d.as_str() == name)
    }

    /// Triton's model-config spelling (`TYPE_FP32`; BYTES is `TYPE_STRING`).
    pub fn config_name(self) -> String {
        match self {
            DataType::Bytes => "TYPE_STRING".to_string(),
            other => format!("TYPE_{}", other.as_str()),
        }
    }

    /// Bytes per element, `None` for variable-length BYTES.
    #[inline]
    pub fn size(self) -> Option<usize> {
        crate::dispatch!(self, T => Some(std::mem::size_of::<T>()), bytes => None)
    }

    /// Whether elements are floating point (FP16, BF16, FP32, FP64).
    #[inline]
    pub fn is_float(self) -> bool {
        matches!(self, DataType::Fp16 | DataType::Bf16 | DataType::Fp32 | DataType::Fp64)
    }
}

/// A number as the text front-ends carry one (JSON, gRPC's typed contents), before it becomes an
/// element of some datatype.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Number {
    Bool(bool),
    Int(i128),
    Float(f64),
}

impl From<bool> for Number {
    #[inline]
    fn from(b: bool) -> Self {
        Number::Bool(b)
    }
}

macro_rules! numbers {
    ($($t:ty => $v:ident),*) => {$(
        impl From<$t> for Number {
            #[inline]
            fn from(v: $t) -> Self {
                Number::$v(v.into())
            }
        }
    )*};
}
numbers!(i32 => Int, i64 => Int, u32 => Int, u64 => Int, f32 => Float, f64 => Float);

/// The Rust type of a fixed-size datatype's elements. Every conversion between a datatype's bytes
/// and values is written once here, and reached through [`dispatch!`](crate::dispatch).
pub trait Element: Copy + Send + Sync + 'static {
    const DATATYPE: DataType;
    /// Reads one element from exactly its size in little-endian bytes.
    fn read_le(b: &[u8]) -> Self;
    fn put_le(self, buf: &mut Vec<u8>);
    /// The element as a number (64-bit integers exactly; floats widened).
    fn number(self) -> Number;
    /// The element `n` stands for, if it is one: booleans only from booleans, integers only from
    /// integers in range, floats from any number but a boolean (rounded to the nearest).
    fn from_number(n: Number) -> Option<Self>;
    /// `v` converted as Rust's `as` would (booleans: non-zero is true); for made-up data.
    fn cast(v: f64) -> Self;
    #[inline]
    fn to_f64(self) -> f64 {
        match self.number() {
            Number::Bool(b) => f64::from(u8::from(b)),
            Number::Int(i) => i as f64,
            Number::Float(f) => f,
        }
    }
}

/// One `Element` impl: the type's little-endian bytes, and its conversions given as closures.
macro_rules! element {
    ($t:ty => $d:ident, number: $number:expr, from: $from:expr, cast: $cast:expr) => {
        impl Element for $t {
            const DATATYPE: DataType = DataType::$d;
            #[inline]
            fn read_le(b: &[u8]) -> Self {
                <$t>::from_le_bytes(b.try_into().expect("one element's bytes"))
            }
            #[inline]
            fn put_le(self, buf: &mut Vec<u8>) {
                buf.extend_from_slice(&self.to_le_bytes());
            }
            #[inline]
            fn number(self) -> Number {
                $number(self)
            }
            #[inline]
            fn from_number(n: Number) -> Option<Self> {
                $from(n)
            }
            #[inline]
            fn cast(v: f64) -> Self {
                $cast(v)
            }
        }
    };
}

macro_rules! integers {
    ($($t:ty => $d:ident),*) => {$(
        element!($t => $d,
            number: |x: $t| Number::Int(x as i128),
            from: |n| match n { Number::Int(i) => <$t>::try_from(i).ok(), _ => None },
            cast: |v| v as $t);
    )*};
}
integers!(u8 => Uint8, u16 => Uint16, u32 => Uint32, u64 => Uint64, i8 => Int8, i16 => Int16, i32 => Int32, i64 => Int64);

macro_rules! floats {
    ($($t:ty => $d:ident as $cast:expr),*) => {$(
        element!($t => $d,
            number: |x: $t| Number::Float(f64::from(x)),
            from: |n| match n {
                Number::Int(i) => Some(<$t as Element>::cast(i as f64)),
                Number::Float(f) => Some(<$t as Element>::cast(f)),
                Number::Bool(_) => None,
            },
            cast: $cast);
    )*};
}
floats!(half::f16 => Fp16 as half::f16::from_f64, half::bf16 => Bf16 as half::bf16::from_f64,
    f32 => Fp32 as |v| v as f32, f64 => Fp64 as |v| v);

impl Element for bool {
    const DATATYPE: DataType = DataType::Bool;
    #[inline]
    fn read_le(b: &[u8]) -> Self {
        b[0] != 0
    }
    #[inline]
    fn put_le(self, buf: &mut Vec<u8>) {
        buf.push(u8::from(self));
    }
    #[inline]
    fn number(self) -> Number {
        Number::Bool(self)
    }
    #[inline]
    fn from_number(n: Number) -> Option<Self> {
        match n {
            Number::Bool(b) => Some(b),
            _ => None,
        }
    }
    #[inline]
    fn cast(v: f64) -> Self {
        v != 0.0
    }
}

/// Runs `$body` with the type `$T` bound to the [`Element`] type of the fixed-size datatype
/// `$dt`, or `$bytes` for BYTES: the one place a datatype becomes a Rust type.
///
/// ```
/// use ferrite_core::{dispatch, DataType, Element};
/// let width = |dt: DataType| dispatch!(dt, T => Some(std::mem::size_of::<T>()), bytes => None);
/// assert_eq!(width(DataType::Fp16), Some(2));
/// ```
#[macro_export]
macro_rules! dispatch {
    ($dt:expr, $T:ident => $body:expr, bytes => $bytes:expr) => {{
        use $crate::DataType as D;
        match $dt {
            D::Bool => {
                type $T = bool;
                $body
            }
            D::Uint8 => {
                type $T = u8;
                $body
            }
            D::Uint16 => {
                type $T = u16;
                $body
            }
            D::Uint32 => {
                type $T = u32;
                $body
            }
            D::Uint64 => {
                type $T = u64;
                $body
            }
            D::Int8 => {
                type $T = i8;
                $body
            }
            D::Int16 => {
                type $T = i16;
                $body
            }
            D::Int32 => {
                type $T = i32;
                $body
            }
            D::Int64 => {
                type $T = i64;
                $body
            }
            D::Fp16 => {
                type $T = $crate::half::f16;
                $body
            }
            D::Bf16 => {
                type $T = $crate::half::bf16;
                $body
            }
            D::Fp32 => {
                type $T = f32;
                $body
            }
            D::Fp64 => {
                type $T = f64;
                $body
            }
            D::Bytes => $bytes,
        }
    }};
}

impl fmt::Display for DataType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for d in DataType::ALL {
            assert_eq!(DataType::parse(d.as_str()), Some(d));
            assert_eq!(DataType::parse(&d.config_name()), Some(d));
        }
        assert_eq!(DataType::parse("FP33"), None);
    }

    #[test]
    fn elements_convert_once_for_every_datatype() {
        for d in DataType::ALL {
            let checked = crate::dispatch!(d, T => {
                assert_eq!(T::DATATYPE, d);
                let mut buf = Vec::new();
                T::cast(1.0).put_le(&mut buf);
                assert_eq!(Some(buf.len()), d.size());
                assert_eq!(T::read_le(&buf).to_f64(), 1.0);
                true
            }, bytes => false);
            assert_eq!(checked, d != DataType::Bytes);
        }
        assert_eq!(u8::from_number(Number::Int(256)), None);
        assert_eq!(i8::from_number(Number::Int(-128)), Some(-128));
        assert_eq!(i32::from_number(Number::Float(1.0)), None);
        assert_eq!(bool::from_number(Number::Int(1)), None);
        assert_eq!(f32::from_number(Number::Int(3)), Some(3.0));
        assert_eq!(f64::from_number(Number::Bool(true)), None);
        assert_eq!(half::bf16::from_number(Number::Float(1.5)).map(|v| v.to_f64()), Some(1.5));
        assert_eq!(u64::MAX.number(), Number::Int(u64::MAX as i128));
    }
}
