//! What the JSON and MessagePack bodies share: request parameters, and decoding a tensor's `data`
//! straight into typed little-endian bytes once its datatype and shape are known.

use std::{
    collections::HashMap,
    fmt,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
};

use bytes::Bytes;
use ferrite_core::{
    dispatch,
    wire::{self, Param as WireParam, RequestParams},
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

/// How many entries a kind of list in a request body may hold, and what they are called.
pub trait Most {
    const MOST: usize;
    const WHAT: &'static str;
}

/// A request's inputs, or its requested outputs.
pub struct Tensors;
impl Most for Tensors {
    const MOST: usize = wire::MAX_TENSORS_PER_REQUEST;
    const WHAT: &'static str = "inputs or outputs";
}

/// A tensor's shape.
pub struct Dims;
impl Most for Dims {
    const MOST: usize = wire::MAX_RANK;
    const WHAT: &'static str = "dims in a shape";
}

/// A list read with at most `most` entries, refused as it is read past them (the rest unread):
/// read whole, a body's lists of small entries took ten to twenty times its bytes of memory
/// before they were counted.
pub fn capped<'de, A: SeqAccess<'de>, T: Deserialize<'de>>(
    mut seq: A,
    most: usize,
    what: &str,
) -> Result<Vec<T>, A::Error> {
    let mut kept = Vec::new();
    while let Some(x) = seq.next_element()? {
        if kept.len() == most {
            return Err(serde::de::Error::custom(format!("more than {most} {what}")));
        }
        kept.push(x);
    }
    Ok(kept)
}

/// `deserialize_with` for a list of at most `M::MOST` entries (`capped`).
pub fn at_most<'de, D: Deserializer<'de>, T: Deserialize<'de>, M: Most>(d: D) -> Result<Vec<T>, D::Error> {
    struct V<T, M>(std::marker::PhantomData<(T, M)>);
    impl<'de, T: Deserialize<'de>, M: Most> Visitor<'de> for V<T, M> {
        type Value = Vec<T>;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            write!(f, "a list of at most {} {}", M::MOST, M::WHAT)
        }
        fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Vec<T>, A::Error> {
            capped(seq, M::MOST, M::WHAT)
        }
    }
    d.deserialize_seq(V::<T, M>(std::marker::PhantomData))
}

/// `at_most` for a list that may be left out.
pub fn some_at_most<'de, D: Deserializer<'de>, T: Deserialize<'de>, M: Most>(d: D) -> Result<Option<Vec<T>>, D::Error> {
    at_most::<D, T, M>(d).map(Some)
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
                    if params.len() == wire::MAX_PARAMETERS {
                        let most = wire::MAX_PARAMETERS;
                        return Err(serde::de::Error::custom(format!("more than {most} parameters")));
                    }
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

/// The shared-memory place a tensor's `parameters` name, if any.
pub fn place(tensor: &str, params: &Params) -> Result<Option<crate::shm::Place>, Error> {
    crate::shm::Place::of(tensor, |k| wire(params, k))
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

/// See `Watch::check`.
pub type Check<'a> = dyn Fn(&str, DataType, &[usize]) -> Result<(), Error> + Send + 'a;

/// What reading a large body's inputs (off the I/O threads) answers to as it goes; small bodies
/// are read at once, where they are.
pub struct Watch<'a> {
    /// Asked of each input's name, datatype and shape before its data is decoded
    /// (`Core::check_input`): data that the model would refuse is refused unread.
    pub check: &'a Check<'a>,
    /// False once the request's client has left (`http::Awaited`): its data's decoding stops
    /// within `WATCHED` elements.
    pub wanted: &'a Arc<AtomicBool>,
    /// Set when an input was refused by its header: the body is not read again for the words of
    /// its error.
    pub refused: std::cell::Cell<bool>,
}

/// An input's datatype, shape and element count, from its header (`wire::parse_header`).
pub type Header = (DataType, Vec<usize>, usize);

impl Watch<'_> {
    /// An input's header as read (`wire::parse_header`), then checked against the model
    /// (`check`); a refusal is remembered.
    pub fn header(&self, name: &str, read: Result<Header, Error>) -> Result<Header, Error> {
        let checked = read.and_then(|h| (self.check)(name, h.0, &h.1).map(|()| h));
        self.refused.set(checked.is_err());
        checked
    }

    /// Whether what failed need not be read again (see `json::parse`): an input refused by its
    /// header, before its data was read, or a client gone.
    pub fn settled(&self) -> bool {
        self.refused.get() || !self.wanted.load(Ordering::Relaxed)
    }
}

/// Elements decoded between looks at whether the client still waits (8 M of them, the most a
/// request holds, took 1-2 s of a core in a debug build, about 0.2 s in a release one).
const WATCHED: usize = 1 << 16;

const LEFT: &str = "the request's client left while its data was decoded";

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
    /// See `Watch::wanted`; `left` once it was found false.
    wanted: Option<Arc<AtomicBool>>,
    left: bool,
}

#[derive(Clone, Copy)]
enum Scalar<'s> {
    Bool(bool),
    I64(i64),
    U64(u64),
    F64(f64),
    Str(&'s str),
}

impl Sink {
    /// For `expected` elements, room made for at most `sent` of them: the most the bytes sent
    /// could hold (a body of a few bytes stating 8 M BYTES elements reserved 256 MiB for them).
    pub fn new(name: &str, datatype: DataType, expected: usize, sent: usize) -> Self {
        let room = expected.min(sent);
        let raw = Vec::with_capacity(room * datatype.size().unwrap_or(0));
        let strings = if datatype == DataType::Bytes { Vec::with_capacity(room) } else { Vec::new() };
        Sink {
            name: name.to_string(),
            datatype,
            expected,
            count: 0,
            raw,
            strings,
            error: None,
            wanted: None,
            left: false,
        }
    }

    /// Stops decoding once `wanted` is false (see `Watch`).
    pub fn watch(&mut self, wanted: &Arc<AtomicBool>) {
        self.wanted = Some(wanted.clone());
    }

    /// Whether the client left, looked at every `WATCHED` elements.
    fn gone(&mut self) -> bool {
        if self.count.is_multiple_of(WATCHED) && self.wanted.as_ref().is_some_and(|w| !w.load(Ordering::Relaxed)) {
            self.left = true;
        }
        self.left
    }

    /// Decodes `data` (a scalar, a nested array, or MessagePack `bin`) with `de`.
    pub fn fill<'de, D: Deserializer<'de>>(&mut self, de: D) -> Result<(), Error> {
        let result = Seed(self).deserialize(de);
        if let Err(e) = result {
            return Err(self.reason().unwrap_or_else(|| Error::invalid(format!("input '{}': {e}", self.name))));
        }
        self.check_end()
    }

    /// Decodes JSON `data` (a scalar or nested arrays), given as its text. Numbers are read
    /// straight from the text when it is a number or arrays of numbers for this datatype, the
    /// common case; anything else (strings, booleans, text that is not JSON) and data that is
    /// wrong go through serde's reading (`fill`), which says precisely what is wrong.
    pub fn fill_json(&mut self, text: &str) -> Result<(), Error> {
        if dispatch!(self.datatype, T => self.numbers::<T>(text.as_bytes()), bytes => false) {
            return self.check_end();
        }
        self.raw.clear();
        self.count = 0;
        let mut de = serde_json::Deserializer::from_str(text);
        self.fill(&mut de)?;
        de.end().map_err(|e| Error::invalid(format!("input '{}': {e}", self.name)))
    }

    /// Reads `text`, a JSON number or arrays of numbers nested to any depth serde allows, as
    /// `T`s in row-major order (the brackets' shape is not checked against the tensor's, as
    /// `Flatten` does not); `false` at the first thing it leaves to `fill`: text that is not
    /// that JSON, more numbers than the shape holds, a number out of an `f64`'s range, or, for an
    /// integer type, a number that is not a plain integer in `T`'s range. A float type reads
    /// each number as an `f64` first, as the visitor does (and Triton: a double, then cast).
    fn numbers<T: Element>(&mut self, b: &[u8]) -> bool {
        const MAX_DEPTH: usize = 127; // serde_json's recursion limit is 128 containers
        let float = T::DATATYPE.is_float();
        if !float && T::DATATYPE == DataType::Bool {
            return false;
        }
        let skip = |i: &mut usize| {
            while matches!(b.get(*i), Some(b' ' | b'\n' | b'\r' | b'\t')) {
                *i += 1;
            }
        };
        let (mut i, mut depth) = (0, 0);
        loop {
            // A value is expected: an array (maybe empty) or a number.
            skip(&mut i);
            match b.get(i) {
                Some(b'[') if depth < MAX_DEPTH => {
                    depth += 1;
                    i += 1;
                    skip(&mut i);
                    if b.get(i) != Some(&b']') {
                        continue;
                    }
                    i += 1;
                    depth -= 1;
                }
                Some(b'-' | b'0'..=b'9') if self.count < self.expected => {
                    let value = if float {
                        // Out of an f64's range: JSON's parser refuses it, and `fill` says so.
                        json_float::<T>(b, &mut i)
                    } else {
                        json_i128(b, &mut i).and_then(|n| T::from_number(Number::Int(n)))
                    };
                    let Some(value) = value else { return false };
                    value.put_le(&mut self.raw);
                    self.count += 1;
                    if self.gone() {
                        return true;
                    }
                }
                _ => return false,
            }
            // After a value: the end, or its array's next value or end.
            loop {
                skip(&mut i);
                match b.get(i) {
                    None if depth == 0 => return true,
                    Some(b',') if depth > 0 => {
                        i += 1;
                        break;
                    }
                    Some(b']') if depth > 0 => {
                        i += 1;
                        depth -= 1;
                    }
                    _ => return false,
                }
            }
        }
    }

    /// Why reading failed, when the data itself was wrong (not the JSON around it).
    fn reason(&mut self) -> Option<Error> {
        if self.left {
            return Some(Error::unavailable(LEFT, None));
        }
        self.error.take().map(Error::invalid)
    }

    /// Whether the data read holds whole elements, as many as the shape says.
    pub fn check_end(&self) -> Result<(), Error> {
        if self.left {
            return Err(Error::unavailable(LEFT, None));
        }
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
        if self.gone() {
            return Err(LEFT.into());
        }
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

/// The digits at `b[*i..]`, moving `*i` past them: their value (wrapping past 19 digits) and
/// count.
#[inline]
fn json_digits(b: &[u8], i: &mut usize, mut value: u64) -> (u64, usize) {
    let start = *i;
    while let Some(d) = b.get(*i).map(|c| c.wrapping_sub(b'0')).filter(|d| *d < 10) {
        value = value.wrapping_mul(10).wrapping_add(u64::from(d));
        *i += 1;
    }
    (value, *i - start)
}

/// `json_digits` for a run that may be long, a fraction's: eight at a time while eight are
/// digits, when its second and fifth bytes are. A float32's value as Python writes it has 17
/// digits, one at a time most of the cost of reading it (`bench/results/instructions-json-digits-f32.md`:
/// the MLP's 512 such numbers 157k → 126k instructions); a short run pays the look at two bytes,
/// where looking at eight on every run cost the bench's 4-decimal bodies 12k a request more.
#[inline]
fn json_long_digits(b: &[u8], i: &mut usize, mut value: u64) -> (u64, usize) {
    let start = *i;
    if b.get(*i + 4).is_some_and(u8::is_ascii_digit) && b.get(*i + 1).is_some_and(u8::is_ascii_digit) {
        while let Some(eight) = b.get(*i..*i + 8).map(|e| u64::from_le_bytes(e.try_into().expect("eight bytes"))) {
            if !eight_digits(eight) {
                break;
            }
            // Wrapping, as one digit at a time: the same value modulo 2^64.
            value = value.wrapping_mul(100_000_000).wrapping_add(eight_digits_value(eight));
            *i += 8;
        }
    }
    let (value, _) = json_digits(b, i, value);
    (value, *i - start)
}

const EIGHT_LOW: u64 = 0x0101_0101_0101_0101;

/// Whether the eight bytes of `eight` are all ASCII digits: each byte and each byte plus 6 lie in
/// 0x30..=0x3F (0x3A..=0x3F go past it; adding 6 carries into the next byte only from 0xFA
/// up, where the byte itself already fails).
#[inline]
fn eight_digits(eight: u64) -> bool {
    let high = 0xF0 * EIGHT_LOW;
    (eight & high) | ((eight.wrapping_add(6 * EIGHT_LOW) & high) >> 4) == 0x33 * EIGHT_LOW
}

/// The eight digits of `eight` (the first in its low byte) as one number, combined in pairs,
/// fours and eights the way fast_float and simdjson read eight digits.
#[inline]
fn eight_digits_value(eight: u64) -> u64 {
    let v = eight.wrapping_sub(0x30 * EIGHT_LOW);
    let v = v.wrapping_mul(10).wrapping_add(v >> 8);
    let pairs = 0x0000_00FF_0000_00FF;
    let v = (v & pairs)
        .wrapping_mul(100 + (1_000_000 << 32))
        .wrapping_add(((v >> 16) & pairs).wrapping_mul(1 + (10_000 << 32)))
        >> 32;
    v & 0xFFFF_FFFF
}

/// Reads a JSON number at `b[*i..]` as a `T`: the nearest `f64` to it, cast (as serde's reading
/// and Triton do), moving `*i` past it; `None` when the text there is not a JSON number or is out
/// of an `f64`'s range. Most numbers clients send have at most 19 digits and no exponent: with a
/// mantissa up to 2^53 one exact quotient of two exact f64s gives the nearest f64 (Clinger's fast
/// path: one rounding); with a longer one, as Python writes a float32's value (17 digits), the
/// quotient is within two ulps of it, which is enough when every f64 that near casts to the same
/// `T`. std's parser reads the rest.
#[inline(always)]
fn json_float<T: Element>(b: &[u8], i: &mut usize) -> Option<T> {
    const POW10: [f64; 23] = [
        1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10, 1e11, 1e12, 1e13, 1e14, 1e15, 1e16, 1e17, 1e18, 1e19,
        1e20, 1e21, 1e22,
    ];
    let start = *i;
    let negative = b.get(start) == Some(&b'-');
    let signed = |f: f64| if negative { -f } else { f };
    let mut j = start + usize::from(negative);
    let (mut mantissa, mut digits) = json_digits(b, &mut j, 0);
    // JSON: one digit at least, no leading zero.
    if digits == 0 || (digits > 1 && b[j - digits] == b'0') {
        return None;
    }
    let mut after_point = 0;
    if b.get(j) == Some(&b'.') {
        j += 1;
        (mantissa, after_point) = json_long_digits(b, &mut j, mantissa);
        if after_point == 0 {
            return None;
        }
        digits += after_point;
    }
    if !matches!(b.get(j), Some(b'e' | b'E')) {
        *i = j;
        if digits <= 19 && after_point <= 22 {
            // Each of the conversion and the quotient rounds once (half an ulp each).
            let f = mantissa as f64 / POW10[after_point];
            if mantissa <= 1 << 53 {
                return Some(T::cast(signed(f)));
            }
            let (low, high) =
                (T::cast(signed(f64::from_bits(f.to_bits() - 4))), T::cast(signed(f64::from_bits(f.to_bits() + 4))));
            if low.to_f64().to_bits() == high.to_f64().to_bits() {
                return Some(low);
            }
        }
    } else {
        j += 1;
        j += usize::from(matches!(b.get(j), Some(b'+' | b'-')));
        if json_digits(b, &mut j, 0).1 == 0 {
            return None;
        }
        *i = j;
    }
    let f: f64 = std::str::from_utf8(&b[start..j]).ok()?.parse().ok()?;
    f.is_finite().then(|| T::cast(f))
}

/// Reads a JSON integer at `b[*i..]`, moving `*i` past it; `None` when the text there is not one
/// in `i64` or `u64` range, or is a number with a fraction or exponent, or JSON's -0: those read as
/// floats, which an integer type refuses (serde's reading says so).
fn json_i128(b: &[u8], i: &mut usize) -> Option<i128> {
    let start = *i;
    let negative = b.get(start) == Some(&b'-');
    let mut j = start + usize::from(negative);
    let (value, digits) = json_digits(b, &mut j, 0);
    if digits == 0
        || digits > 19
        || (digits > 1 && b[j - digits] == b'0')
        || matches!(b.get(j), Some(b'.' | b'e' | b'E'))
    {
        // Past 19 digits (or out of range below): std's reading, for u64's 20 and the refusals.
        return None;
    }
    *i = j;
    match (negative, value) {
        (true, 0) => None,
        (true, v) => Some(-i128::from(v)),
        (false, v) => Some(i128::from(v)),
    }
}

/// Visits `data` with the visitor for the sink's datatype: `Numbers` for a fixed-size type,
/// `Flatten` for strings.
struct Seed<'s>(&'s mut Sink);

impl<'de> DeserializeSeed<'de> for Seed<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        dispatch!(self.0.datatype, T => d.deserialize_any(Numbers::<T>(self.0, std::marker::PhantomData)),
            bytes => d.deserialize_any(Flatten(self.0)))
    }
}

/// `Flatten` for a sink of `T`s, with each number put as a `T` straight away: the general `push`
/// (which checks the sink's state and dispatches on its datatype for every element) was a third of
/// the server's cost of decoding a 512-float JSON input. What is not a number in `T`'s range, or
/// does not fit the sink, goes through `push`, which says what is wrong.
struct Numbers<'s, T>(&'s mut Sink, std::marker::PhantomData<T>);

impl<'de, T: Element> DeserializeSeed<'de> for Numbers<'_, T> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<T: Element> Numbers<'_, T> {
    #[inline]
    fn number<E: serde::de::Error>(self, n: Number, scalar: Scalar<'_>) -> Result<(), E> {
        let sink = self.0;
        if sink.count < sink.expected && sink.raw.len() == sink.count * std::mem::size_of::<T>() {
            if let Some(x) = T::from_number(n) {
                x.put_le(&mut sink.raw);
                sink.count += 1;
                return Ok(());
            }
        }
        let r = sink.push(scalar);
        Flatten(sink).put(r)
    }
}

impl<'de, T: Element> Visitor<'de> for Numbers<'_, T> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a scalar or a (nested) array of scalars")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element_seed(Numbers::<T>(&mut *self.0, std::marker::PhantomData))?.is_some() {}
        Ok(())
    }

    fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<(), E> {
        self.number(Number::Int(v.into()), Scalar::I64(v))
    }
    fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<(), E> {
        self.number(Number::Int(v.into()), Scalar::U64(v))
    }
    fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<(), E> {
        self.number(Number::Float(v), Scalar::F64(v))
    }
    fn visit_bool<E: serde::de::Error>(self, v: bool) -> Result<(), E> {
        Flatten(self.0).visit_bool(v)
    }
    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<(), E> {
        Flatten(self.0).visit_str(v)
    }
    fn visit_bytes<E: serde::de::Error>(self, v: &[u8]) -> Result<(), E> {
        Flatten(self.0).visit_bytes(v)
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

/// Which outputs go back as binary: per output `binary_data`, else request `binary_data_output`;
/// and which go to shared memory instead.
#[derive(Debug, Default)]
pub struct BinaryOutputs {
    pub default: bool,
    pub named: HashMap<String, bool>,
    pub shared: Vec<(String, crate::shm::Place)>,
}

impl BinaryOutputs {
    pub fn is_binary(&self, name: &str) -> bool {
        self.named.get(name).copied().unwrap_or(self.default)
    }

    /// Whether the output goes to shared memory (and so has no data in the response).
    pub fn is_shared(&self, name: &str) -> bool {
        self.shared.iter().any(|(n, _)| n == name)
    }
}

/// The forms of numbers the tests of JSON `data` read: every integer type's limits and one past,
/// `-0`, fractions, exponents, float limits, and more digits than the fast path takes.
#[cfg(test)]
pub(crate) const NUMBER_FORMS: &[&str] = &[
    "0",
    "-0",
    "7",
    "-7",
    "255",
    "256",
    "-129",
    "65535",
    "65536",
    "2147483647",
    "2147483648",
    "-2147483649",
    "9223372036854775807",
    "9223372036854775808",
    "-9223372036854775808",
    "-9223372036854775809",
    "18446744073709551615",
    "18446744073709551616",
    "1.5",
    "-0.0",
    "1e3",
    "1E+3",
    "2.5e-3",
    "-0.4897",
    "0.5488135218620300",
    "3.4028235e38",
    "3.5e38",
    "1e-50",
    "1e-400",
    "1e400",
    "65504",
    "65520",
    "123456789",
    "1.0",
    "0.1",
    "123.456e-5",
    "-1.7976931348623157e308",
    "4.9e-324",
    "9007199254740993",
    "0.30000000000000004",
    "1e22",
    "1e23",
    "12345678901234567890",
    "1E-0022",
    "1.00000000000000011102230246251565404236316680908203125",
    "0.0000000000000000000001234",
];

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
    fn what_json_refuses_as_a_number_is_not_read_as_one() {
        for bad in ["01", "-01", "1.", ".5", "1e", "1e+", "1.e5", "-", "+1", "00.5", "-x", "", "e5"] {
            assert_eq!(json_float::<f64>(bad.as_bytes(), &mut 0), None, "{bad}");
            assert_eq!(json_i128(bad.as_bytes(), &mut 0), None, "{bad}");
        }
        for (text, int) in [("-0", None), ("1.5", None), ("2e3", None), ("-12", Some(-12)), ("0", Some(0))] {
            assert_eq!(json_i128(text.as_bytes(), &mut 0), int, "{text}");
        }
        // A number ends where JSON's would: what follows is the array's to read.
        let mut end = 0;
        assert_eq!((json_float::<f64>(b"-2.5e-1,", &mut end), end), (Some(-0.25), 7));
    }

    proptest::proptest! {
        /// A JSON number's text reads as std's parser reads it (the nearest f64), cast to each
        /// float type, in the forms clients write: shortest round-trip (Python's, 17 digits for a
        /// float32's value), fixed, exponent, and cut to fewer digits.
        #[test]
        fn json_numbers_read_as_the_nearest_f64_cast(bits in proptest::prelude::any::<u64>(), small in -1e6f64..1e6, digits in 0usize..20) {
            // And the f64s next to a midpoint between two float32s, where the cast's rounding turns.
            let below = f32::from_bits((bits as u32) & 0x7f7f_ffff);
            let mid = (f64::from(below) + f64::from(f32::from_bits(below.to_bits() + 1))) / 2.0;
            let near_mid = (0..7).map(|k| f64::from_bits(mid.to_bits() + k - 3));
            let floats = [f64::from_bits(bits), small, f64::from(small as f32), f64::from(f32::from_bits(bits as u32))];
            for f in floats.into_iter().chain(near_mid).filter(|f| f.is_finite()) {
                let mut buf = ryu::Buffer::new();
                for text in [buf.format_finite(f).to_string(), format!("{f}"), format!("{f:e}"), format!("{f:.digits$}"), format!("{f:.digits$e}")] {
                    let Ok(nearest) = text.parse::<f64>() else { continue };
                    for dt in [DataType::Fp16, DataType::Bf16, DataType::Fp32, DataType::Fp64] {
                        let mut end = 0;
                        let (read, expected) = dispatch!(dt, T => (
                            super::json_float::<T>(text.as_bytes(), &mut end).map(|x| x.to_f64().to_bits()),
                            Some(T::cast(nearest).to_f64().to_bits()).filter(|_| nearest.is_finite()),
                        ), bytes => unreachable!());
                        proptest::prop_assert_eq!((read, end), (expected, text.len()), "{} as {}", text, dt);
                    }
                }
            }
        }

        /// Digits read eight bytes at a time are what reading them one at a time makes of them:
        /// their count and value (wrapping past 19 digits), whatever bytes follow, from any start.
        #[test]
        fn digits_read_eight_at_a_time_are_read_as_one_at_a_time(
            digits in proptest::collection::vec(0u8..10, 0..30),
            after in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..10),
            start in 0usize..3,
            carried in proptest::prelude::any::<u64>(),
        ) {
            let mut b: Vec<u8> = std::iter::repeat_n(b'7', start).chain(digits.iter().map(|d| b'0' + d)).collect();
            b.extend(&after);
            let mut expected = (carried, start);
            while let Some(d) = b.get(expected.1).map(|c| c.wrapping_sub(b'0')).filter(|d| *d < 10) {
                expected = (expected.0.wrapping_mul(10).wrapping_add(u64::from(d)), expected.1 + 1);
            }
            let mut i = start;
            let (value, count) = super::json_long_digits(&b, &mut i, carried);
            proptest::prop_assert_eq!((value, i, count), (expected.0, expected.1, expected.1 - start));
        }
    }

    /// What a sink reserves is what the bytes sent could hold, not what the shape states: a body
    /// of a few bytes stating 8 M elements reserved 256 MiB (BYTES) or 64 MiB (FP64) for them.
    #[test]
    fn a_sink_reserves_what_the_bytes_sent_could_hold() {
        for (dt, text) in [(DataType::Bytes, r#"["", ""]"#), (DataType::Fp64, "[1, 2]")] {
            let mut sink = Sink::new("x", dt, 8 << 20, text.len() / 2 + 1);
            assert!(sink.raw.capacity() <= 40 && sink.strings.capacity() <= 5, "{dt}");
            let e = sink.fill_json(text).unwrap_err();
            assert!(e.to_string().contains("its shape holds 8388608 elements, 'data' has 2"), "{e}");
        }
        // Within what was sent, the room made is all the data needs.
        let mut sink = Sink::new("x", DataType::Fp32, 3, "[1,2,3]".len() / 2 + 1);
        let room = sink.raw.as_ptr();
        sink.fill_json("[1,2,3]").unwrap();
        assert_eq!(sink.raw.as_ptr(), room, "not grown");
    }

    /// Numbers read as the sink's type are what the general reading (`push`, which also says what
    /// is wrong) makes of them, for every datatype and the forms JSON writes a number in.
    #[test]
    fn numbers_read_as_their_type_are_what_the_general_reading_makes_of_them() {
        let numbers = NUMBER_FORMS;
        let (mut read, mut refused) = (0, 0);
        for dt in DataType::ALL.into_iter().filter(|d| *d != DataType::Bytes) {
            for n in numbers {
                for (data, count) in [(n.to_string(), 1), (format!("[[{n}],[{n}]]"), 2), (format!("[{n},{n}]"), 1)] {
                    let mut typed = Sink::new("x", dt, count, count);
                    let typed = typed.fill(&mut serde_json::Deserializer::from_str(&data)).map(|()| typed.finish());
                    let mut general = Sink::new("x", dt, count, count);
                    let Ok(number) = serde_json::from_str::<serde_json::Number>(n) else {
                        // Out of an f64's range (1e400): refused either way.
                        assert!(typed.is_err(), "{dt} {data}");
                        continue;
                    };
                    let scalar = match number {
                        v if v.is_u64() => Scalar::U64(v.as_u64().unwrap()),
                        v if v.is_i64() => Scalar::I64(v.as_i64().unwrap()),
                        v => Scalar::F64(v.as_f64().unwrap()),
                    };
                    let pushed = (0..data.matches(n).count())
                        .try_for_each(|_| general.push(scalar))
                        .and_then(|()| general.check_end().map_err(|e| e.to_string()));
                    match (&typed, pushed) {
                        (Ok(t), Ok(())) => {
                            assert_eq!(t, &general.finish(), "{dt} {data}");
                            read += 1;
                        }
                        (Err(_), Err(_)) => refused += 1,
                        (t, p) => panic!("{dt} {data}: typed {t:?}, general {p:?}"),
                    }
                }
            }
        }
        assert!(read > 100 && refused > 100, "{read} read, {refused} refused");
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
