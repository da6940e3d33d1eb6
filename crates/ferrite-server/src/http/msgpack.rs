//! MessagePack bodies (`application/msgpack`): the same request and response objects as JSON.
//! Tensor `data` is an array (flat or nested) or `bin` holding raw little-endian elements; a BYTES
//! tensor's elements are `str` or `bin`. Responses carry fixed-size data as one `bin` and BYTES as
//! an array of `bin`.
//!
//! Decoding takes two passes over the body: the first reads every input's name, datatype and
//! shape (skipping `data`), the second decodes each `data` into a buffer of exactly the size that
//! the checked shape calls for. So key order does not matter and no generic value tree is built.
//!
//! Tensors in system shared memory are named by the same `parameters` as in JSON
//! (`shared_memory_region`, `shared_memory_byte_size`, `shared_memory_offset`): such an input has
//! no `data`, and such an output's `data` is left out of the response.

use std::fmt;

use ferrite_core::{Error, InferRequest, InferResponse, TensorData};
use serde::{
    de::{DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor},
    Deserialize, Deserializer, Serialize,
};

use super::{
    decode::{at_most, place, request_params, some_at_most, Dims, Params, Sink, Tensors, Watch},
    json::BinaryOutputs,
};
use crate::shm::{Access, Regions};
use ferrite_core::wire::parse_header;

pub const CONTENT_TYPE: &str = "application/msgpack";

#[derive(Deserialize)]
struct Header {
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    parameters: Params,
    #[serde(deserialize_with = "at_most::<_, _, Tensors>")]
    inputs: Vec<InputHeader>,
    #[serde(default, deserialize_with = "some_at_most::<_, _, Tensors>")]
    outputs: Option<Vec<OutputHeader>>,
}

#[derive(Deserialize)]
struct InputHeader {
    name: String,
    #[serde(deserialize_with = "at_most::<_, _, Dims>")]
    shape: Vec<i64>,
    datatype: String,
    #[serde(default)]
    parameters: Params,
}

#[derive(Deserialize)]
struct OutputHeader {
    name: String,
    #[serde(default)]
    parameters: Params,
}

/// The outputs asked for as their top k classes.
fn classes(outputs: &[OutputHeader]) -> Result<Vec<(String, usize)>, Error> {
    let mut out = Vec::new();
    for o in outputs {
        if let Some(k) = super::decode::classification(&o.parameters)? {
            out.push((o.name.clone(), k));
        }
    }
    Ok(out)
}

fn bad(e: impl fmt::Display) -> Error {
    Error::invalid(format!("invalid MessagePack request: {e}"))
}

/// The request, and which of its outputs go to shared memory (through `shm`, which reads the
/// inputs that name a region; `None` where the extension is off).
pub fn parse(
    model: &str,
    version: Option<String>,
    body: &[u8],
    max_elements: usize,
    shm: Option<&Access>,
    watch: Option<&Watch>,
) -> Result<(InferRequest, BinaryOutputs), Error> {
    let header: Header = rmp_serde::from_slice(body).map_err(bad)?;
    ferrite_core::wire::check_tensor_counts(header.inputs.len(), header.outputs.as_ref().map_or(0, Vec::len))?;
    let mut slots = Vec::with_capacity(header.inputs.len());
    let mut shapes = Vec::with_capacity(header.inputs.len());
    for i in &header.inputs {
        let header = parse_header(&i.name, &i.datatype, &i.shape, max_elements);
        let (dt, shape, count) = match watch {
            Some(watch) => watch.header(&i.name, header)?,
            None => header?,
        };
        let shared = place(&i.name, &i.parameters)?;
        // An input read from shared memory takes no room in the body's pass.
        // An element takes a byte of MessagePack at least.
        let mut sink = Sink::new(&i.name, dt, if shared.is_some() { 0 } else { count }, body.len());
        if let Some(watch) = watch {
            sink.watch(watch.wanted);
        }
        slots.push(Slot { sink, error: None, shared });
        shapes.push((dt, shape, count));
    }
    let mut de = rmp_serde::Deserializer::from_read_ref(body);
    let pass = DataPass { slots: &mut slots };
    if let Err(e) = pass.deserialize(&mut de) {
        // A data error recorded by a slot is the precise reason.
        return Err(slots.iter_mut().find_map(|s| s.error.take()).unwrap_or_else(|| bad(e)));
    }
    let mut inputs = Vec::with_capacity(slots.len());
    for (slot, (i, (dt, shape, count))) in slots.into_iter().zip(header.inputs.into_iter().zip(shapes)) {
        let data = match slot.shared {
            Some(place) => shm.ok_or_else(Regions::off)?.read(&i.name, &place, dt, count)?,
            None => slot.sink.finish(),
        };
        inputs.push(ferrite_core::Tensor::new(i.name, dt, shape, data));
    }
    let mut outputs = BinaryOutputs::default();
    for o in header.outputs.iter().flatten() {
        if let Some(place) = place(&o.name, &o.parameters)? {
            outputs.shared.push((o.name.clone(), place));
        }
    }
    let params = request_params(&header.parameters)?;
    let req = InferRequest {
        model_name: model.to_string(),
        model_version: version,
        id: header.id,
        inputs,
        classification: classes(header.outputs.as_deref().unwrap_or_default())?,
        outputs: header.outputs.map(|o| o.into_iter().map(|o| o.name).collect()),
        priority: params.priority,
        timeout_us: params.timeout_us,
        skip_cache: params.skip_cache,
        tenant: None,
        share: None,
        canary: Default::default(),
        parameters: super::decode::parameters_json(&header.parameters),
    };
    Ok((req, outputs))
}

/// An input's place in the second pass: where its `data` goes, the precise error its data caused,
/// and where in shared memory it is instead (and so has no `data`).
struct Slot {
    sink: Sink,
    error: Option<Error>,
    shared: Option<crate::shm::Place>,
}

/// Second pass: the request map, of which only `inputs` is read.
struct DataPass<'s> {
    slots: &'s mut [Slot],
}

impl<'de> DeserializeSeed<'de> for DataPass<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for DataPass<'_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a request map")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while let Some(key) = map.next_key::<String>()? {
            if key == "inputs" {
                map.next_value_seed(Inputs { slots: &mut *self.slots })?;
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(())
    }
}

struct Inputs<'s> {
    slots: &'s mut [Slot],
}

impl<'de> DeserializeSeed<'de> for Inputs<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for Inputs<'_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an array of inputs")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        for slot in self.slots.iter_mut() {
            if seq.next_element_seed(Input { slot })?.is_none() {
                break;
            }
        }
        Ok(())
    }
}

struct Input<'s> {
    slot: &'s mut Slot,
}

impl<'de> DeserializeSeed<'de> for Input<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for Input<'_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an input map")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let mut seen = false;
        let fail = |slot: &mut Slot, err: Error| {
            slot.error = Some(err.clone());
            serde::de::Error::custom(err)
        };
        while let Some(key) = map.next_key::<String>()? {
            if key == "data" && self.slot.shared.is_some() {
                let err =
                    Error::invalid(format!("input '{}' is in shared memory and in the body", self.slot.sink.name()));
                return Err(fail(self.slot, err));
            } else if key == "data" {
                seen = true;
                map.next_value_seed(Data { slot: &mut *self.slot })?;
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        if !seen && self.slot.shared.is_none() {
            let err = Error::invalid(format!("input '{}' has no 'data'", self.slot.sink.name()));
            return Err(fail(self.slot, err));
        }
        Ok(())
    }
}

struct Data<'s> {
    slot: &'s mut Slot,
}

impl<'de> DeserializeSeed<'de> for Data<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        self.slot.sink.fill(d).map_err(|e| {
            self.slot.error = Some(e.clone());
            serde::de::Error::custom(e)
        })
    }
}

#[derive(Serialize)]
struct Response<'a> {
    model_name: &'a str,
    model_version: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    id: Option<&'a str>,
    outputs: Vec<Output<'a>>,
}

#[derive(Serialize)]
struct Output<'a> {
    name: &'a str,
    datatype: &'static str,
    shape: &'a [usize],
    #[serde(skip_serializing_if = "Option::is_none")]
    data: Option<OutputData<'a>>,
}

#[derive(Serialize)]
#[serde(untagged)]
enum OutputData<'a> {
    Raw(&'a serde_bytes::Bytes),
    Items(Vec<&'a serde_bytes::Bytes>),
}

/// The response; an output written to shared memory has no `data`.
pub fn write_response(resp: &InferResponse, binary: &BinaryOutputs) -> Vec<u8> {
    let outputs = resp
        .outputs
        .iter()
        .map(|t| Output {
            name: &t.name,
            datatype: t.datatype.as_str(),
            shape: &t.shape,
            data: (!binary.is_shared(&t.name)).then(|| match &t.data {
                TensorData::Fixed(b) => OutputData::Raw(serde_bytes::Bytes::new(b)),
                TensorData::Strings(items) => {
                    OutputData::Items(items.iter().map(|b| serde_bytes::Bytes::new(b)).collect())
                }
            }),
        })
        .collect();
    let r =
        Response { model_name: &resp.model_name, model_version: &resp.model_version, id: resp.id.as_deref(), outputs };
    // Serializing plain structs of strings, numbers and bytes into a Vec cannot fail.
    rmp_serde::to_vec_named(&r).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferrite_core::{DataType, Tensor};
    use serde_json::json;

    fn pack(v: &serde_json::Value) -> Vec<u8> {
        rmp_serde::to_vec(v).unwrap()
    }

    #[test]
    fn arrays_and_bin_decode_alike_in_any_key_order() {
        let floats: Vec<u8> = [1.5f32, -2.0].iter().flat_map(|f| f.to_le_bytes()).collect();
        // `data` before `datatype`: a bin built by hand, since json! cannot hold one.
        let mut body = Vec::new();
        rmp::encode::write_map_len(&mut body, 1).unwrap();
        rmp::encode::write_str(&mut body, "inputs").unwrap();
        rmp::encode::write_array_len(&mut body, 2).unwrap();
        rmp::encode::write_map_len(&mut body, 4).unwrap();
        rmp::encode::write_str(&mut body, "data").unwrap();
        rmp::encode::write_bin(&mut body, &floats).unwrap();
        for (k, v) in [("name", "x"), ("datatype", "FP32")] {
            rmp::encode::write_str(&mut body, k).unwrap();
            rmp::encode::write_str(&mut body, v).unwrap();
        }
        rmp::encode::write_str(&mut body, "shape").unwrap();
        rmp::encode::write_array_len(&mut body, 1).unwrap();
        rmp::encode::write_uint(&mut body, 2).unwrap();
        body.extend(pack(&json!({"name": "y", "shape": [1, 2], "datatype": "FP32", "data": [[1.5, -2]]})));
        let req = parse("m", None, &body, 100, None, None).unwrap().0;
        assert_eq!(req.inputs[0], Tensor::from_le("x", DataType::Fp32, vec![2], &[1.5f32, -2.0]));
        assert_eq!(req.inputs[1].data, req.inputs[0].data);
    }

    #[test]
    fn an_array_of_bins_is_joined_byte_by_byte() {
        let ints: Vec<u8> = [1i32, 2, 3].iter().flat_map(|i| i.to_le_bytes()).collect();
        let body = |parts: &[&[u8]]| {
            let v = rmpv::Value::Map(vec![(
                "inputs".into(),
                rmpv::Value::Array(vec![rmpv::Value::Map(vec![
                    ("name".into(), "x".into()),
                    ("shape".into(), rmpv::Value::Array(vec![3.into()])),
                    ("datatype".into(), "INT32".into()),
                    (
                        "data".into(),
                        rmpv::Value::Array(parts.iter().map(|p| rmpv::Value::Binary(p.to_vec())).collect()),
                    ),
                ])]),
            )]);
            let mut out = Vec::new();
            rmpv::encode::write_value(&mut out, &v).unwrap();
            out
        };
        let req = parse("m", None, &body(&[&ints[..1], &ints[1..7], &ints[7..]]), 100, None, None).unwrap().0;
        assert_eq!(req.inputs[0], Tensor::from_le("x", DataType::Int32, vec![3], &[1i32, 2, 3]));
        let e = parse("m", None, &body(&[&ints[..1], &ints[1..11]]), 100, None, None).unwrap_err().to_string();
        assert!(e.contains("11 raw bytes are not whole INT32 elements"), "{e}");
        let e = parse("m", None, &body(&[&ints, &ints[..1]]), 100, None, None).unwrap_err().to_string();
        assert!(e.contains("more than the 3 elements"), "{e}");
    }

    #[test]
    fn bad_data_names_the_input() {
        for (v, needle) in [
            (json!({"inputs": [{"name": "x", "shape": [3], "datatype": "INT32", "data": [1, 2]}]}), "holds 3 elements"),
            (json!({"inputs": [{"name": "x", "shape": [1], "datatype": "INT8", "data": [999]}]}), "999"),
            (json!({"inputs": [{"name": "x", "shape": [1], "datatype": "INT8"}]}), "no 'data'"),
            (json!({"inputs": [{"name": "x", "shape": [-1], "datatype": "INT8", "data": []}]}), "negative"),
        ] {
            let err = parse("m", None, &pack(&v), 100, None, None).unwrap_err().to_string();
            assert!(err.contains(needle) && err.contains('x'), "{v}: {err}");
        }
        assert!(parse("m", None, b"\xc1", 100, None, None).is_err());
    }

    #[test]
    fn shared_memory_tensors_are_named_by_their_parameters() {
        let shared = json!({"shared_memory_region": "r", "shared_memory_byte_size": 8});
        let v = json!({"inputs": [{"name": "x", "shape": [2], "datatype": "FP32", "parameters": shared}],
                       "outputs": [{"name": "y", "parameters": shared}, {"name": "z"}]});
        // Without the extension the input cannot be read (the server passes its regions).
        let err = parse("m", None, &pack(&v), 100, None, None).unwrap_err().to_string();
        assert!(err.contains("shared memory is off"), "{err}");
        let mut both = v.clone();
        both["inputs"][0]["data"] = json!([1, 2]);
        let err = parse("m", None, &pack(&both), 100, None, None).unwrap_err().to_string();
        assert!(err.contains("'x' is in shared memory and in the body"), "{err}");
        // The output's data is left out of the response, the other's kept.
        let y = Tensor::from_le("y", DataType::Int32, vec![1], &[7i32]);
        let resp = InferResponse {
            model_name: "m".into(),
            model_version: "1".into(),
            id: None,
            outputs: vec![y.clone(), Tensor { name: "z".into(), ..y }],
        };
        let mut to_shm = BinaryOutputs::default();
        let params: Params = serde_json::from_value(shared).unwrap();
        to_shm.shared.push(("y".into(), place("y", &params).unwrap().unwrap()));
        let v: rmpv::Value = rmp_serde::from_slice(&write_response(&resp, &to_shm)).unwrap();
        assert!(v["outputs"][0]["data"].is_nil() && v["outputs"][0]["shape"][0].as_u64() == Some(1));
        assert_eq!(v["outputs"][1]["data"].as_slice().unwrap(), &[7, 0, 0, 0]);
    }

    #[test]
    fn responses_carry_bin_data() {
        let resp = InferResponse {
            model_name: "m".into(),
            model_version: "1".into(),
            id: None,
            outputs: vec![Tensor::from_le("y", DataType::Int32, vec![2], &[7i32, 8])],
        };
        let v: rmpv::Value = rmp_serde::from_slice(&write_response(&resp, &BinaryOutputs::default())).unwrap();
        let out = &v["outputs"][0];
        assert_eq!(out["data"].as_slice().unwrap(), &[7, 0, 0, 0, 8, 0, 0, 0]);
        assert_eq!(out["datatype"].as_str(), Some("INT32"));
    }
}
