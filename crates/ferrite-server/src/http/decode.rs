//! What the JSON and MessagePack bodies share: request parameters, and decoding a tensor's `data`
//! straight into typed little-endian bytes once its datatype and shape are known.

use std::{collections::HashMap, fmt};

use bytes::Bytes;
use ferrite_core::{
    dispatch,
    wire::{Param as WireParam, RequestParams},
    DataType, Element, Error, Number, TensorData,
};
use serde::{
    de::{DeserializeSeed, SeqAccess, Visitor},
    Deserialize, Deserializer,
};

/// A request, input or output parameter value: a boolean, a whole number (`U64` when it is not
/// negative), a float or a string; anything else is refused.
#[derive(Debug, Clone, PartialEq)]
pub enum Param {
    Bool(bool),
    U64(u64),
    I64(i64),
    F64(f64),
    Str(String),
}

/// Read by its own visitor rather than `#[serde(untagged)]`, which buffers each value and builds an
/// error for every variant it tries first: two parameters a request, on the hot path.
impl<'de> Deserialize<'de> for Param {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct ParamVisitor;
        impl Visitor<'_> for ParamVisitor {
            type Value = Param;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a boolean, number or string")
            }
            fn visit_bool<E>(self, v: bool) -> Result<Param, E> {
                Ok(Param::Bool(v))
            }
            fn visit_u64<E>(self, v: u64) -> Result<Param, E> {
                Ok(Param::U64(v))
            }
            fn visit_i64<E>(self, v: i64) -> Result<Param, E> {
                Ok(u64::try_from(v).map_or(Param::I64(v), Param::U64))
            }
            fn visit_f64<E>(self, v: f64) -> Result<Param, E> {
                Ok(Param::F64(v))
            }
            fn visit_str<E>(self, v: &str) -> Result<Param, E> {
                Ok(Param::Str(v.to_owned()))
            }
            fn visit_string<E>(self, v: String) -> Result<Param, E> {
                Ok(Param::Str(v))
            }
            fn visit_bytes<E: serde::de::Error>(self, v: &[u8]) -> Result<Param, E> {
                std::str::from_utf8(v)
                    .map(|s| Param::Str(s.to_owned()))
                    .map_err(|_| E::invalid_value(serde::de::Unexpected::Bytes(v), &self))
            }
        }
        d.deserialize_any(ParamVisitor)
    }
}

/// A body's `parameters`, in the order sent: a handful a request, so a list looked through beats a
/// hashed map. A key sent twice counts as its last value, as when a JSON object is read into a map.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Params(Vec<(String, Param)>);

impl Params {
    pub fn get(&self, key: &str) -> Option<&Param> {
        self.0.iter().rev().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    /// Every entry in the order sent, a key sent twice included twice (the core's
    /// `parameters_json` keeps its last value, in one sort rather than a search per entry).
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Param)> {
        self.0.iter().map(|(k, v)| (k.as_str(), v))
    }
}

impl<'de> Deserialize<'de> for Params {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct ParamsVisitor;
        impl<'de> Visitor<'de> for ParamsVisitor {
            type Value = Params;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an object of parameters")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Params, A::Error> {
                let mut params = Vec::with_capacity(map.size_hint().unwrap_or(0).min(16));
                while let Some(entry) = map.next_entry::<String, Param>()? {
                    params.push(entry);
                }
                Ok(Params(params))
            }
        }
        d.deserialize_map(ParamsVisitor)
    }
}

pub fn param_u64(params: &Params, key: &str) -> Result<Option<u64>, Error> {
    match params.get(key) {
        None => Ok(None),
        Some(Param::U64(v)) => Ok(Some(*v)),
        Some(_) => Err(Error::invalid(format!("parameter '{key}' must be a non-negative integer"))),
    }
}

pub fn param_bool(params: &Params, key: &str) -> Result<Option<bool>, Error> {
    match params.get(key) {
        None => Ok(None),
        Some(Param::Bool(v)) => Ok(Some(*v)),
        Some(_) => Err(Error::invalid(format!("parameter '{key}' must be a boolean"))),
    }
}

/// A parameter as the core's wire module reads it.
fn wire<'a>(params: &'a Params, key: &str) -> Option<WireParam<'a>> {
    params.get(key).map(as_wire)
}

fn as_wire(p: &Param) -> WireParam<'_> {
    match p {
        Param::Bool(b) => WireParam::Bool(*b),
        Param::U64(v) => WireParam::Uint(*v),
        Param::I64(v) => WireParam::Int(*v),
        Param::F64(v) => WireParam::Double(*v),
        Param::Str(s) => WireParam::Str(s),
    }
}

/// The request's parameters as one JSON object (see the core's `wire::parameters_json`).
pub fn parameters_json(params: &Params) -> Option<String> {
    ferrite_core::wire::parameters_json(params.iter().map(|(k, v)| (k, as_wire(v))))
}

/// The request parameters the core honours, read as every front-end reads them.
pub fn request_params(params: &Params) -> Result<RequestParams, Error> {
    RequestParams::parse(|key| wire(params, key))
}

/// An output's `classification` parameter, read as every front-end reads it.
pub fn classification(params: &Params) -> Result<Option<usize>, Error> {
    ferrite_core::wire::classification(|key| wire(params, key))
}

/// Collects the scalars (or raw bytes) of one input into its datatype's little-endian layout.
pub struct Sink {
    name: String,
    datatype: DataType,
    expected: usize,
    count: usize,
    raw: Vec<u8>,
    strings: Vec<Bytes>,
    /// The precise reason, kept because serde wraps custom errors with positions.
    error: Option<String>,
}

enum Scalar<'s> {
    Bool(bool),
    I64(i64),
    U64(u64),
    F64(f64),
    Str(&'s str),
}

impl Sink {
    pub fn new(name: &str, datatype: DataType, expected: usize) -> Self {
        let raw = Vec::with_capacity(expected * datatype.size().unwrap_or(0));
        let strings = if datatype == DataType::Bytes { Vec::with_capacity(expected) } else { Vec::new() };
        Sink { name: name.to_string(), datatype, expected, count: 0, raw, strings, error: None }
    }

    /// Decodes `data` (a scalar, a nested array, or MessagePack `bin`) with `de`.
    pub fn fill<'de, D: Deserializer<'de>>(&mut self, de: D) -> Result<(), Error> {
        let result = self.seed().deserialize(de);
        if let Err(e) = result {
            return Err(self.reason().unwrap_or_else(|| Error::invalid(format!("input '{}': {e}", self.name))));
        }
        self.check_end()
    }

    /// What reads `data` into this sink, for a deserializer that is already inside the input (a
    /// map's next value); then `check_end`, or `reason` when it fails.
    pub fn seed(&mut self) -> impl for<'de> DeserializeSeed<'de, Value = ()> + '_ {
        Flatten(self)
    }

    /// Why reading failed, when the data itself was wrong (not the JSON around it).
    pub fn reason(&mut self) -> Option<Error> {
        self.error.take().map(Error::invalid)
    }

    /// Whether the data read holds whole elements, as many as the shape says.
    pub fn check_end(&self) -> Result<(), Error> {
        if let Some(size) = self.datatype.size().filter(|&s| !self.raw.len().is_multiple_of(s)) {
            return Err(Error::invalid(format!(
                "input '{}': {} raw bytes are not whole {} elements ({size} bytes each)",
                self.name,
                self.raw.len(),
                self.datatype
            )));
        }
        if self.count != self.expected {
            return Err(Error::invalid(format!(
                "input '{}': its shape holds {} elements, 'data' has {}",
                self.name, self.expected, self.count
            )));
        }
        Ok(())
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn finish(self) -> TensorData {
        match self.datatype {
            DataType::Bytes => TensorData::Strings(self.strings),
            _ => TensorData::Fixed(self.raw.into()),
        }
    }

    fn room(&self, n: usize) -> Result<(), String> {
        if self.count + n > self.expected {
            return Err(format!(
                "input '{}': 'data' has more than the {} elements its shape holds",
                self.name, self.expected
            ));
        }
        Ok(())
    }

    /// MessagePack `bin`: one BYTES element, or little-endian elements of a fixed-size type. The
    /// `bin`s of an array are joined byte by byte (an element may span two); whether the bytes make
    /// whole elements is checked at the end.
    fn push_bin(&mut self, b: &[u8]) -> Result<(), String> {
        let Some(size) = self.datatype.size() else {
            self.room(1)?;
            self.count += 1;
            self.strings.push(Bytes::copy_from_slice(b));
            return Ok(());
        };
        let whole = (self.raw.len() + b.len()) / size;
        if whole > self.expected || (whole == self.expected && !(self.raw.len() + b.len()).is_multiple_of(size)) {
            return Err(format!(
                "input '{}': 'data' has more than the {} elements its shape holds",
                self.name, self.expected
            ));
        }
        self.raw.extend_from_slice(b);
        self.count = whole;
        Ok(())
    }

    fn push(&mut self, v: Scalar<'_>) -> Result<(), String> {
        if self.datatype.size().is_some_and(|s| !self.raw.len().is_multiple_of(s)) {
            return Err(format!("input '{}': a number follows raw bytes that are not whole elements", self.name));
        }
        self.room(1)?;
        self.count += 1;
        let dt = self.datatype;
        let bad = |what: &str| format!("input '{}': {what} is not a valid {dt} value", self.name);
        if dt == DataType::Bytes {
            let Scalar::Str(s) = v else { return Err(bad("a non-string")) };
            self.strings.push(Bytes::copy_from_slice(s.as_bytes()));
            return Ok(());
        }
        let n = match v {
            Scalar::Bool(b) => Some(Number::Bool(b)),
            Scalar::I64(i) => Some(Number::Int(i.into())),
            Scalar::U64(u) => Some(Number::Int(u.into())),
            Scalar::F64(f) => Some(Number::Float(f)),
            Scalar::Str("NaN") => Some(Number::Float(f64::NAN)),
            Scalar::Str("Infinity") => Some(Number::Float(f64::INFINITY)),
            Scalar::Str("-Infinity") => Some(Number::Float(f64::NEG_INFINITY)),
            Scalar::Str(_) => None,
        };
        let raw = &mut self.raw;
        let put = dispatch!(dt, T => n.and_then(T::from_number).map(|x| x.put_le(raw)), bytes => None);
        if put.is_none() {
            return Err(match n {
                _ if dt == DataType::Bool => bad("a non-boolean"),
                _ if dt.is_float() => bad("a non-number"),
                Some(Number::Int(i)) => bad(&i.to_string()),
                _ => bad("a non-integer"),
            });
        }
        Ok(())
    }
}

/// Visits `data`, flat or nested to any depth the parser allows, in row-major order.
struct Flatten<'s>(&'s mut Sink);

impl<'de> DeserializeSeed<'de> for Flatten<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl Flatten<'_> {
    fn put<E: serde::de::Error>(self, r: Result<(), String>) -> Result<(), E> {
        r.map_err(|msg| {
            self.0.error = Some(msg.clone());
            E::custom(msg)
        })
    }
}

impl<'de> Visitor<'de> for Flatten<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a scalar or a (nested) array of scalars")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element_seed(Flatten(self.0))?.is_some() {}
        Ok(())
    }

    fn visit_bool<E: serde::de::Error>(self, v: bool) -> Result<(), E> {
        let r = self.0.push(Scalar::Bool(v));
        self.put(r)
    }
    fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<(), E> {
        let r = self.0.push(Scalar::I64(v));
        self.put(r)
    }
    fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<(), E> {
        let r = self.0.push(Scalar::U64(v));
        self.put(r)
    }
    fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<(), E> {
        let r = self.0.push(Scalar::F64(v));
        self.put(r)
    }
    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<(), E> {
        let r = self.0.push(Scalar::Str(v));
        self.put(r)
    }
    fn visit_bytes<E: serde::de::Error>(self, v: &[u8]) -> Result<(), E> {
        let r = self.0.push_bin(v);
        self.put(r)
    }
}

/// Which outputs go back as binary: per output `binary_data`, else request `binary_data_output`.
#[derive(Debug, Default)]
pub struct BinaryOutputs {
    pub default: bool,
    pub named: HashMap<String, bool>,
}

impl BinaryOutputs {
    pub fn is_binary(&self, name: &str) -> bool {
        self.named.get(name).copied().unwrap_or(self.default)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_parameter_is_read_as_the_kind_of_value_it_is_and_anything_else_is_refused() {
        let json = |s: &str| serde_json::from_str::<Param>(s);
        assert_eq!(json("true").unwrap(), Param::Bool(true));
        assert_eq!(json("5").unwrap(), Param::U64(5));
        assert_eq!(json("18446744073709551615").unwrap(), Param::U64(u64::MAX));
        assert_eq!(json("-3").unwrap(), Param::I64(-3));
        assert_eq!(json("1.5").unwrap(), Param::F64(1.5));
        assert_eq!(json(r#""a\"b""#).unwrap(), Param::Str("a\"b".into()));
        for bad in ["null", "[1]", r#"{"a": 1}"#] {
            assert!(json(bad).is_err(), "{bad}");
        }
        // MessagePack: a non-negative number written as a signed one is still U64, and a string
        // sent as bin is read as text when it is UTF-8.
        let pack = |write: &dyn Fn(&mut Vec<u8>)| {
            let mut buf = Vec::new();
            write(&mut buf);
            rmp_serde::from_slice::<Param>(&buf)
        };
        assert_eq!(pack(&|b| rmp::encode::write_i64(b, 7).unwrap()).unwrap(), Param::U64(7));
        assert_eq!(pack(&|b| rmp::encode::write_i64(b, -7).unwrap()).unwrap(), Param::I64(-7));
        assert_eq!(pack(&|b| rmp::encode::write_f32(b, 0.5).unwrap()).unwrap(), Param::F64(0.5));
        assert_eq!(pack(&|b| rmp::encode::write_bin(b, b"ab").unwrap()).unwrap(), Param::Str("ab".into()));
        assert!(pack(&|b| rmp::encode::write_bin(b, &[0xff]).unwrap()).is_err());
        assert!(pack(&|b| rmp::encode::write_nil(b).unwrap()).is_err());
    }

    #[test]
    fn parameters_keep_their_order_and_a_key_sent_twice_counts_as_its_last_value() {
        let p: Params = serde_json::from_str(r#"{"b": 1, "a": true, "b": "x"}"#).unwrap();
        assert_eq!(p.get("b"), Some(&Param::Str("x".into())));
        assert_eq!(p.get("a"), Some(&Param::Bool(true)));
        assert_eq!(p.get("c"), None);
        assert_eq!(p.iter().map(|(k, _)| k).collect::<Vec<_>>(), ["b", "a", "b"]);
        assert_eq!(parameters_json(&p).as_deref(), Some(r#"{"a":true,"b":"x"}"#));
        assert!(serde_json::from_str::<Params>("[]").is_err());
    }
}
