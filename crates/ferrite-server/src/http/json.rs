//! The V2 JSON body: decoding requests straight into typed tensor bytes, and writing responses.
//!
//! Tensor `data` is kept as raw JSON until the input's datatype and shape are known, so decoding
//! allocates exactly what the (already capped) shape calls for and stops at the first extra value.

use std::{collections::HashMap, fmt};

use bytes::Bytes;
use ferrite_core::{tensor::element_count, DataType, Error, InferRequest, InferResponse, Tensor, TensorData};
use serde::{
    de::{DeserializeSeed, SeqAccess, Visitor},
    Deserialize, Deserializer,
};
use serde_json::{value::RawValue, Value};

#[derive(Deserialize)]
pub struct JsonRequest<'a> {
    #[serde(default)]
    pub id: Option<String>,
    #[serde(default)]
    pub parameters: HashMap<String, Value>,
    #[serde(borrow)]
    pub inputs: Vec<JsonInput<'a>>,
    #[serde(default)]
    pub outputs: Option<Vec<JsonOutput>>,
}

#[derive(Deserialize)]
pub struct JsonInput<'a> {
    pub name: String,
    pub shape: Vec<i64>,
    pub datatype: String,
    #[serde(default)]
    pub parameters: HashMap<String, Value>,
    #[serde(borrow, default)]
    pub data: Option<&'a RawValue>,
}

#[derive(Deserialize)]
pub struct JsonOutput {
    pub name: String,
}

fn param_u64(params: &HashMap<String, Value>, key: &str) -> Result<Option<u64>, Error> {
    match params.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .map(Some)
            .ok_or_else(|| Error::invalid(format!("parameter '{key}' must be a non-negative integer"))),
    }
}

/// Turns a parsed JSON body into the core's request.
pub fn to_core(
    model: &str,
    version: Option<String>,
    req: JsonRequest<'_>,
    max_elements: usize,
) -> Result<InferRequest, Error> {
    let inputs = req.inputs.into_iter().map(|i| decode_input(i, max_elements)).collect::<Result<Vec<_>, _>>()?;
    Ok(InferRequest {
        model_name: model.to_string(),
        model_version: version,
        id: req.id,
        inputs,
        outputs: req.outputs.map(|o| o.into_iter().map(|o| o.name).collect()),
        priority: param_u64(&req.parameters, "priority")?
            .map(|p| u32::try_from(p).map_err(|_| Error::invalid("parameter 'priority' is too large")))
            .transpose()?
            .unwrap_or(0),
        timeout_us: param_u64(&req.parameters, "timeout")?,
    })
}

fn decode_input(input: JsonInput<'_>, max_elements: usize) -> Result<Tensor, Error> {
    let name = input.name;
    let datatype = DataType::parse(&input.datatype)
        .ok_or_else(|| Error::invalid(format!("input '{name}': unknown datatype '{}'", input.datatype)))?;
    let shape = input
        .shape
        .iter()
        .map(|&d| {
            usize::try_from(d)
                .map_err(|_| Error::invalid(format!("input '{name}': negative dim in shape {:?}", input.shape)))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let count = element_count(&shape, max_elements).map_err(|e| Error::invalid(format!("input '{name}': {e}")))?;
    if input.parameters.contains_key("binary_data_size") {
        return Err(Error::Unsupported(format!(
            "input '{name}': binary tensor data needs the Inference-Header-Content-Length header"
        )));
    }
    let raw = input.data.ok_or_else(|| Error::invalid(format!("input '{name}' has no 'data'")))?;
    let mut sink = Sink::new(&name, datatype, count);
    let mut de = serde_json::Deserializer::from_str(raw.get());
    Flatten(&mut sink)
        .deserialize(&mut de)
        .map_err(|e| Error::invalid(sink.error.take().unwrap_or_else(|| format!("input '{name}': {e}"))))?;
    if sink.count != count {
        return Err(Error::invalid(format!(
            "input '{name}': shape {shape:?} needs {count} elements, 'data' has {}",
            sink.count
        )));
    }
    let data = sink.finish();
    Ok(Tensor::new(name, datatype, shape, data))
}

/// Collects scalars of one datatype into little-endian bytes (or BYTES elements).
struct Sink<'n> {
    name: &'n str,
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

impl<'n> Sink<'n> {
    fn new(name: &'n str, datatype: DataType, expected: usize) -> Self {
        let raw = Vec::with_capacity(expected * datatype.size().unwrap_or(0));
        let strings = if datatype == DataType::Bytes { Vec::with_capacity(expected) } else { Vec::new() };
        Sink { name, datatype, expected, count: 0, raw, strings, error: None }
    }

    fn finish(self) -> TensorData {
        match self.datatype {
            DataType::Bytes => TensorData::Bytes(self.strings),
            _ => TensorData::Raw(self.raw.into()),
        }
    }

    fn push(&mut self, v: Scalar<'_>) -> Result<(), String> {
        if self.count == self.expected {
            return Err(format!(
                "input '{}': 'data' has more than the {} elements its shape holds",
                self.name, self.expected
            ));
        }
        self.count += 1;
        let dt = self.datatype;
        let bad = |what: &str| format!("input '{}': {what} is not a valid {dt} value", self.name);
        macro_rules! int {
            ($t:ty) => {{
                let x: $t = match v {
                    Scalar::I64(i) => <$t>::try_from(i).map_err(|_| bad(&i.to_string()))?,
                    Scalar::U64(u) => <$t>::try_from(u).map_err(|_| bad(&u.to_string()))?,
                    _ => return Err(bad("a non-integer")),
                };
                self.raw.extend_from_slice(&x.to_le_bytes());
            }};
        }
        let float = |v: Scalar<'_>| -> Result<f64, String> {
            Ok(match v {
                Scalar::F64(f) => f,
                Scalar::I64(i) => i as f64,
                Scalar::U64(u) => u as f64,
                Scalar::Str("NaN") => f64::NAN,
                Scalar::Str("Infinity") => f64::INFINITY,
                Scalar::Str("-Infinity") => f64::NEG_INFINITY,
                _ => return Err(bad("a non-number")),
            })
        };
        match dt {
            DataType::Bool => match v {
                Scalar::Bool(b) => self.raw.push(b as u8),
                _ => return Err(bad("a non-boolean")),
            },
            DataType::Uint8 => int!(u8),
            DataType::Uint16 => int!(u16),
            DataType::Uint32 => int!(u32),
            DataType::Uint64 => int!(u64),
            DataType::Int8 => int!(i8),
            DataType::Int16 => int!(i16),
            DataType::Int32 => int!(i32),
            DataType::Int64 => int!(i64),
            DataType::Fp16 => self.raw.extend_from_slice(&half::f16::from_f64(float(v)?).to_le_bytes()),
            DataType::Bf16 => self.raw.extend_from_slice(&half::bf16::from_f64(float(v)?).to_le_bytes()),
            DataType::Fp32 => self.raw.extend_from_slice(&(float(v)? as f32).to_le_bytes()),
            DataType::Fp64 => self.raw.extend_from_slice(&float(v)?.to_le_bytes()),
            DataType::Bytes => match v {
                Scalar::Str(s) => self.strings.push(Bytes::copy_from_slice(s.as_bytes())),
                _ => return Err(bad("a non-string")),
            },
        }
        Ok(())
    }
}

/// Visits `data`, flat or nested to any depth serde_json allows, pushing each scalar in row-major order.
struct Flatten<'s, 'n>(&'s mut Sink<'n>);

impl<'de> DeserializeSeed<'de> for Flatten<'_, '_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Flatten<'_, '_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a scalar or a (nested) array of scalars")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element_seed(Flatten(self.0))?.is_some() {}
        Ok(())
    }

    fn visit_bool<E: serde::de::Error>(self, v: bool) -> Result<(), E> {
        self.put(Scalar::Bool(v))
    }
    fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<(), E> {
        self.put(Scalar::I64(v))
    }
    fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<(), E> {
        self.put(Scalar::U64(v))
    }
    fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<(), E> {
        self.put(Scalar::F64(v))
    }
    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<(), E> {
        self.put(Scalar::Str(v))
    }
}

impl Flatten<'_, '_> {
    fn put<E: serde::de::Error>(self, v: Scalar<'_>) -> Result<(), E> {
        self.0.push(v).map_err(|msg| {
            self.0.error = Some(msg.clone());
            E::custom(msg)
        })
    }
}

/// Writes a V2 JSON response. Non-finite floats are written as `NaN`, `Infinity`, `-Infinity`,
/// which Python's `json` (and so tritonclient) reads.
pub fn write_response(resp: &InferResponse) -> String {
    let mut out = String::with_capacity(64 + resp.outputs.iter().map(|o| o.element_count() * 12).sum::<usize>());
    out.push_str("{\"model_name\":");
    push_str(&mut out, &resp.model_name);
    out.push_str(",\"model_version\":");
    push_str(&mut out, &resp.model_version);
    if let Some(id) = &resp.id {
        out.push_str(",\"id\":");
        push_str(&mut out, id);
    }
    out.push_str(",\"outputs\":[");
    for (i, t) in resp.outputs.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str("{\"name\":");
        push_str(&mut out, &t.name);
        out.push_str(",\"datatype\":\"");
        out.push_str(t.datatype.as_str());
        out.push_str("\",\"shape\":[");
        let mut ib = itoa::Buffer::new();
        for (j, d) in t.shape.iter().enumerate() {
            if j > 0 {
                out.push(',');
            }
            out.push_str(ib.format(*d));
        }
        out.push_str("],\"data\":[");
        push_data(&mut out, t);
        out.push_str("]}");
    }
    out.push_str("]}");
    out
}

fn push_str(out: &mut String, s: &str) {
    out.push_str(&serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into()));
}

fn push_float(out: &mut String, f: f64, single: bool) {
    if f.is_nan() {
        out.push_str("NaN");
    } else if f.is_infinite() {
        out.push_str(if f > 0.0 { "Infinity" } else { "-Infinity" });
    } else if single {
        out.push_str(ryu::Buffer::new().format_finite(f as f32));
    } else {
        out.push_str(ryu::Buffer::new().format_finite(f));
    }
}

fn push_data(out: &mut String, t: &Tensor) {
    let raw = match &t.data {
        TensorData::Bytes(items) => {
            for (i, b) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                push_str(out, &String::from_utf8_lossy(b));
            }
            return;
        }
        TensorData::Raw(b) => b,
    };
    let Some(size) = t.datatype.size() else {
        return;
    };
    let mut ib = itoa::Buffer::new();
    for (i, c) in raw.chunks_exact(size).enumerate() {
        if i > 0 {
            out.push(',');
        }
        match t.datatype {
            DataType::Bool => out.push_str(if c[0] != 0 { "true" } else { "false" }),
            DataType::Uint8 => out.push_str(ib.format(c[0])),
            DataType::Int8 => out.push_str(ib.format(c[0] as i8)),
            DataType::Uint16 => out.push_str(ib.format(u16::from_le_bytes([c[0], c[1]]))),
            DataType::Int16 => out.push_str(ib.format(i16::from_le_bytes([c[0], c[1]]))),
            DataType::Uint32 => out.push_str(ib.format(u32::from_le_bytes(c.try_into().unwrap_or_default()))),
            DataType::Int32 => out.push_str(ib.format(i32::from_le_bytes(c.try_into().unwrap_or_default()))),
            DataType::Uint64 => out.push_str(ib.format(u64::from_le_bytes(c.try_into().unwrap_or_default()))),
            DataType::Int64 => out.push_str(ib.format(i64::from_le_bytes(c.try_into().unwrap_or_default()))),
            DataType::Fp16 => push_float(out, half::f16::from_le_bytes([c[0], c[1]]).to_f64(), true),
            DataType::Bf16 => push_float(out, half::bf16::from_le_bytes([c[0], c[1]]).to_f64(), true),
            DataType::Fp32 => push_float(out, f32::from_le_bytes(c.try_into().unwrap_or_default()) as f64, true),
            DataType::Fp64 => push_float(out, f64::from_le_bytes(c.try_into().unwrap_or_default()), false),
            DataType::Bytes => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode(json: &str, max: usize) -> Result<Tensor, Error> {
        let input: JsonInput<'_> = serde_json::from_str(json).unwrap();
        decode_input(input, max)
    }

    #[test]
    fn flat_and_nested_data_decode_the_same() {
        let flat = decode(r#"{"name":"x","shape":[2,2],"datatype":"INT32","data":[1,2,3,4]}"#, 100).unwrap();
        let nested = decode(r#"{"name":"x","shape":[2,2],"datatype":"INT32","data":[[1,2],[3,4]]}"#, 100).unwrap();
        assert_eq!(flat, nested);
        assert_eq!(flat, Tensor::from_le("x", DataType::Int32, vec![2, 2], &[1i32, 2, 3, 4]));
    }

    #[test]
    fn wrong_counts_and_values_name_the_input() {
        for (json, needle) in [
            (r#"{"name":"x","shape":[3],"datatype":"FP32","data":[1,2]}"#, "needs 3 elements"),
            (r#"{"name":"x","shape":[1],"datatype":"FP32","data":[1,2]}"#, "more than the 1"),
            (r#"{"name":"x","shape":[1],"datatype":"UINT8","data":[300]}"#, "300 is not a valid UINT8"),
            (r#"{"name":"x","shape":[1],"datatype":"INT8","data":[1.5]}"#, "non-integer"),
            (r#"{"name":"x","shape":[1],"datatype":"BOOL","data":[1]}"#, "non-boolean"),
            (r#"{"name":"x","shape":[-1],"datatype":"FP32","data":[1]}"#, "negative"),
            (r#"{"name":"x","shape":[1],"datatype":"FP8","data":[1]}"#, "unknown datatype"),
            (r#"{"name":"x","shape":[100000,100000],"datatype":"FP32","data":[]}"#, "more than 1000"),
            (r#"{"name":"x","shape":[1],"datatype":"FP32"}"#, "no 'data'"),
        ] {
            let err = decode(json, 1000).unwrap_err().to_string();
            assert!(err.contains(needle) && err.contains('x'), "{json}: {err}");
        }
    }

    #[test]
    fn non_finite_floats_are_written_as_tokens() {
        let t = Tensor::from_le("y", DataType::Fp32, vec![3], &[f32::NAN, f32::INFINITY, -1.5f32]);
        let resp = InferResponse { model_name: "m".into(), model_version: "1".into(), id: None, outputs: vec![t] };
        let body = write_response(&resp);
        assert!(body.contains("\"data\":[NaN,Infinity,-1.5]"), "{body}");
    }

    #[test]
    fn every_datatype_round_trips_through_json() {
        for dt in DataType::ALL {
            let data = match dt {
                DataType::Bool => "[true,false]",
                DataType::Bytes => r#"["a","\u00e9"]"#,
                DataType::Uint8 | DataType::Uint16 | DataType::Uint32 | DataType::Uint64 => "[0,7]",
                _ => "[-1,2.5]",
            };
            let data = if matches!(dt, DataType::Int8 | DataType::Int16 | DataType::Int32 | DataType::Int64) {
                "[-1,2]"
            } else {
                data
            };
            let json = format!(r#"{{"name":"t","shape":[2],"datatype":"{dt}","data":{data}}}"#);
            let t = decode(&json, 10).unwrap();
            let resp =
                InferResponse { model_name: "m".into(), model_version: "1".into(), id: None, outputs: vec![t.clone()] };
            let body = write_response(&resp);
            let v: Value = serde_json::from_str(&body).unwrap();
            let out = &v["outputs"][0];
            let again = decode(&out.to_string(), 10).unwrap();
            assert_eq!(again.data, t.data, "{dt}: {body}");
        }
    }
}
