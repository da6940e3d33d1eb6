//! The V2 JSON body, with Triton's binary tensor extension: decoding requests, writing responses.
//!
//! Tensor `data` is decoded once the input's datatype and shape are known (as it is read when they
//! come before it, else from the raw JSON kept until they do), so decoding allocates exactly what
//! the (already capped) shape calls for and stops at the first extra value. Binary inputs are
//! slices of the request body, not copies.

use bytes::Bytes;
use ferrite_core::{dispatch, DataType, Element, Error, InferRequest, InferResponse, Number, Tensor, TensorData};
use serde::Deserialize;
use serde_json::value::RawValue;

pub use super::decode::BinaryOutputs;
use super::decode::{param_bool, param_u64, request_params, Params, Sink};
use ferrite_core::wire::{check_tensor_counts, parse_header};

/// A V2 inference request (JSON; the same fields in MessagePack, with tensors as bytes).
#[derive(Deserialize, utoipa::ToSchema)]
#[schema(as = InferenceRequest)]
pub struct JsonRequest<'a> {
    #[serde(default)]
    pub id: Option<String>,
    /// `priority`, `timeout`, `binary_data_output`, `ferrite_skip_cache`.
    #[serde(default)]
    #[schema(value_type = Object)]
    pub parameters: Params,
    #[serde(borrow)]
    pub inputs: Vec<JsonInput<'a>>,
    #[serde(default)]
    pub outputs: Option<Vec<JsonOutput>>,
}

/// An input of a V2 inference request: `data` row-major (nested lists are accepted), or
/// `parameters.binary_data_size` bytes after the JSON (the binary extension).
#[derive(utoipa::ToSchema)]
#[schema(as = RequestInput)]
pub struct JsonInput<'a> {
    pub name: String,
    pub shape: Vec<i64>,
    #[schema(value_type = super::bodies::Datatype)]
    pub datatype: String,
    #[schema(value_type = Object, required = false)]
    pub parameters: Params,
    #[schema(value_type = Option<Vec<Value>>)]
    pub data: Option<InputData<'a>>,
}

/// An input's `data`: decoded as it was read, when the input's name, datatype and shape came
/// before it (as clients write them) and `parse` gave the element limit; otherwise kept as the raw
/// JSON, decoded once they are known. Reading it raw is a whole pass over the numbers (a third of
/// decoding a 512-float input).
pub enum InputData<'a> {
    Read(TensorData),
    Raw(&'a RawValue),
}

thread_local! {
    /// While `parse` reads a body on this thread: the element limit an input's data is decoded
    /// under, and the precise reason when that data was wrong (serde would wrap it in positions).
    static READING: std::cell::RefCell<Option<(usize, Option<Error>)>> = const { std::cell::RefCell::new(None) };
}

impl<'de: 'a, 'a> Deserialize<'de> for JsonInput<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(field_identifier, rename_all = "lowercase")]
        enum Field {
            Name,
            Shape,
            Datatype,
            Parameters,
            Data,
            #[serde(other)]
            Other,
        }
        struct InputVisitor<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> serde::de::Visitor<'de> for InputVisitor<'a> {
            type Value = JsonInput<'a>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an input object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<JsonInput<'a>, A::Error> {
                use serde::de::Error as _;
                fn once<T, E: serde::de::Error>(slot: &mut Option<T>, value: T, field: &'static str) -> Result<(), E> {
                    match slot.replace(value) {
                        Some(_) => Err(E::duplicate_field(field)),
                        None => Ok(()),
                    }
                }
                let (mut name, mut shape, mut datatype, mut parameters, mut data) = (None, None, None, None, None);
                while let Some(field) = map.next_key::<Field>()? {
                    match field {
                        Field::Name => once(&mut name, map.next_value::<String>()?, "name")?,
                        Field::Shape => once(&mut shape, map.next_value::<Vec<i64>>()?, "shape")?,
                        Field::Datatype => once(&mut datatype, map.next_value::<String>()?, "datatype")?,
                        Field::Parameters => once(&mut parameters, map.next_value::<Params>()?, "parameters")?,
                        Field::Data => {
                            if data.is_some() {
                                return Err(A::Error::duplicate_field("data"));
                            }
                            let limit = READING.with(|r| r.borrow().as_ref().map(|(max, _)| *max));
                            let sink = match (&name, &datatype, &shape, limit) {
                                (Some(n), Some(dt), Some(s), Some(max)) => {
                                    parse_header(n, dt, s, max).ok().map(|(dt, _, count)| Sink::new(n, dt, count))
                                }
                                // Not known yet, or wrong (decode_input says how, in input order).
                                _ => None,
                            };
                            data = Some(match sink {
                                None => InputData::Raw(map.next_value::<&'de RawValue>()?),
                                Some(mut sink) => {
                                    let failed = match map.next_value_seed(sink.seed()) {
                                        Err(e) => match sink.reason() {
                                            Some(reason) => Some((reason, e)),
                                            // The JSON around the numbers (or a bare NaN): parse's to say.
                                            None => return Err(e),
                                        },
                                        Ok(()) => sink.check_end().err().map(|reason| {
                                            let e = A::Error::custom(&reason);
                                            (reason, e)
                                        }),
                                    };
                                    if let Some((reason, e)) = failed {
                                        READING.with(|r| {
                                            if let Some((_, why)) = r.borrow_mut().as_mut() {
                                                *why = Some(reason);
                                            }
                                        });
                                        return Err(e);
                                    }
                                    InputData::Read(sink.finish())
                                }
                            });
                        }
                        Field::Other => {
                            map.next_value::<serde::de::IgnoredAny>()?;
                        }
                    }
                }
                Ok(JsonInput {
                    name: name.ok_or_else(|| A::Error::missing_field("name"))?,
                    shape: shape.ok_or_else(|| A::Error::missing_field("shape"))?,
                    datatype: datatype.ok_or_else(|| A::Error::missing_field("datatype"))?,
                    parameters: parameters.unwrap_or_default(),
                    data,
                })
            }
        }
        d.deserialize_map(InputVisitor(std::marker::PhantomData))
    }
}

pub use super::bodies::JsonOutput;

/// `json` with every bare `NaN`, `Infinity` and `-Infinity` token (outside strings) quoted, or
/// `None` when it has none.
fn quote_non_finite(json: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(json.len() + 16);
    let (mut in_string, mut escaped, mut found) = (false, false, false);
    let mut i = 0;
    while i < json.len() {
        let c = json[i];
        if in_string {
            in_string = escaped || c != b'"';
            escaped = !escaped && c == b'\\';
        } else if c == b'"' {
            in_string = true;
        } else if let Some(token) =
            [&b"NaN"[..], b"Infinity", b"-Infinity"].into_iter().find(|t| json[i..].starts_with(t))
        {
            out.push(b'"');
            out.extend_from_slice(token);
            out.push(b'"');
            i += token.len();
            found = true;
            continue;
        }
        out.push(c);
        i += 1;
    }
    found.then_some(out)
}

/// Parses a JSON request; `binary` holds the bytes after the JSON when the binary extension is used.
pub fn parse(
    model: &str,
    version: Option<String>,
    json: &[u8],
    binary: Option<Bytes>,
    max_elements: usize,
) -> Result<(InferRequest, BinaryOutputs), Error> {
    let req = match read(json, max_elements) {
        Ok(req) => req,
        Err((_, Some(reason))) => return Err(reason),
        // Python's `json` (and so tritonclient) writes non-finite floats as bare NaN/Infinity
        // tokens, as our responses do; accept them by quoting them, off the hot path.
        Err((e, None)) => match quote_non_finite(json) {
            Some(quoted) => return parse(model, version, &quoted, binary, max_elements),
            None => return Err(Error::invalid(format!("invalid JSON request: {e}"))),
        },
    };
    check_tensor_counts(req.inputs.len(), req.outputs.as_ref().map_or(0, Vec::len))?;
    let mut rest = binary.unwrap_or_default();
    let inputs =
        req.inputs.into_iter().map(|i| decode_input(i, &mut rest, max_elements)).collect::<Result<Vec<_>, _>>()?;
    if !rest.is_empty() {
        return Err(Error::invalid(format!("{} bytes of binary data follow the last input", rest.len())));
    }
    let params = request_params(&req.parameters)?;
    let mut binary_outputs = BinaryOutputs {
        default: param_bool(&req.parameters, "binary_data_output")?.unwrap_or(false),
        ..Default::default()
    };
    let mut classification = Vec::new();
    let outputs = match req.outputs {
        None => None,
        Some(outs) => {
            let mut names = Vec::with_capacity(outs.len());
            for o in outs {
                if let Some(b) = param_bool(&o.parameters, "binary_data")? {
                    binary_outputs.named.insert(o.name.clone(), b);
                }
                if let Some(k) = super::decode::classification(&o.parameters)? {
                    classification.push((o.name.clone(), k));
                }
                names.push(o.name);
            }
            Some(names)
        }
    };
    let req = InferRequest {
        model_name: model.to_string(),
        model_version: version,
        id: req.id,
        inputs,
        outputs,
        classification,
        priority: params.priority,
        timeout_us: params.timeout_us,
        skip_cache: params.skip_cache,
        tenant: None,
        canary: Default::default(),
        parameters: super::decode::parameters_json(&req.parameters),
    };
    Ok((req, binary_outputs))
}

/// Reads a request, its inputs' data decoded under `max_elements` as they are read; on failure,
/// the precise reason when an input's data was wrong.
fn read(json: &[u8], max_elements: usize) -> Result<JsonRequest<'_>, (serde_json::Error, Option<Error>)> {
    READING.with(|r| *r.borrow_mut() = Some((max_elements, None)));
    let req = serde_json::from_slice(json);
    let reason = READING.with(|r| r.borrow_mut().take()).and_then(|(_, why)| why);
    req.map_err(|e| (e, reason))
}

fn decode_input(input: JsonInput<'_>, binary: &mut Bytes, max_elements: usize) -> Result<Tensor, Error> {
    let name = input.name;
    let (datatype, shape, count) = parse_header(&name, &input.datatype, &input.shape, max_elements)?;
    let data = match (param_u64(&input.parameters, "binary_data_size")?, input.data) {
        (Some(_), Some(_)) => {
            return Err(Error::invalid(format!("input '{name}' has both 'data' and binary_data_size")))
        }
        (Some(size), None) => {
            let size = usize::try_from(size).unwrap_or(usize::MAX);
            if size > binary.len() {
                return Err(Error::invalid(format!(
                    "input '{name}': binary_data_size {size} exceeds the {} bytes left in the body",
                    binary.len()
                )));
            }
            TensorData::from_wire(&name, datatype, count, binary.split_to(size))?
        }
        (None, Some(InputData::Read(data))) => data,
        (None, Some(InputData::Raw(raw))) => {
            let mut sink = Sink::new(&name, datatype, count);
            sink.fill(&mut serde_json::Deserializer::from_str(raw.get()))?;
            sink.finish()
        }
        (None, None) => return Err(Error::invalid(format!("input '{name}' has no 'data'"))),
    };
    Ok(Tensor::new(name, datatype, shape, data))
}

/// Writes a V2 JSON response, and the binary outputs' bytes to append after it (in order).
/// Non-finite floats are written as `NaN`, `Infinity`, `-Infinity`, which Python's `json` (and so
/// tritonclient) reads.
pub fn write_response(resp: &InferResponse, binary: &BinaryOutputs) -> (String, Vec<Bytes>) {
    let mut blobs = Vec::new();
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
        if binary.is_binary(&t.name) {
            let blob = t.data.to_wire();
            out.push_str("],\"parameters\":{\"binary_data_size\":");
            out.push_str(ib.format(blob.len()));
            out.push_str("}}");
            blobs.push(blob);
        } else {
            out.push_str("],\"data\":[");
            push_data(&mut out, t);
            out.push_str("]}");
        }
    }
    out.push_str("]}");
    (out, blobs)
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
        TensorData::Strings(items) => {
            for (i, b) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                push_str(out, &String::from_utf8_lossy(b));
            }
            return;
        }
        TensorData::Fixed(b) => b,
    };
    let Some(size) = t.datatype.size() else {
        return;
    };
    let mut ib = itoa::Buffer::new();
    dispatch!(t.datatype, T => for (i, c) in raw.chunks_exact(size).enumerate() {
        if i > 0 {
            out.push(',');
        }
        match T::read_le(c).number() {
            Number::Bool(b) => out.push_str(if b { "true" } else { "false" }),
            Number::Int(v) => out.push_str(match i64::try_from(v) {
                Ok(v) => ib.format(v),
                Err(_) => ib.format(v),
            }),
            Number::Float(f) => push_float(out, f, T::DATATYPE != DataType::Fp64),
        }
    }, bytes => {})
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    /// Decodes one input both ways: kept raw and decoded after (as when `data` comes before the
    /// input's datatype and shape), and read as the request is parsed; they must agree.
    fn decode(json: &str, max: usize) -> Result<Tensor, Error> {
        let input: JsonInput<'_> = serde_json::from_str(json).unwrap();
        assert!(matches!(input.data, None | Some(InputData::Raw(_))));
        let raw = decode_input(input, &mut Bytes::new(), max);
        let request = format!(r#"{{"inputs":[{json}]}}"#);
        let read = parse("m", None, request.as_bytes(), None, max).map(|(mut r, _)| r.inputs.remove(0));
        assert_eq!(read.as_ref().map_err(ToString::to_string), raw.as_ref().map_err(ToString::to_string), "{json}");
        raw
    }

    fn write(resp: &InferResponse) -> String {
        write_response(resp, &BinaryOutputs::default()).0
    }

    #[test]
    fn responses_are_the_documented_type_for_every_datatype() {
        use ferrite_core::{dispatch, Element};
        let outputs: Vec<Tensor> = DataType::ALL
            .into_iter()
            .map(|d| {
                let data = dispatch!(d, T => {
                    let mut b = Vec::new();
                    for v in [1.0, 0.0, 2.0] {
                        T::cast(v).put_le(&mut b);
                    }
                    TensorData::Fixed(b.into())
                }, bytes => TensorData::Strings(vec![Bytes::from_static(b"a"); 3]));
                Tensor::new(d.as_str(), d, vec![1, 3], data)
            })
            .collect();
        let resp = InferResponse { model_name: "m".into(), model_version: "1".into(), id: Some("x".into()), outputs };
        let binary = BinaryOutputs { named: [("FP32".to_string(), true)].into(), ..Default::default() };
        for binary in [BinaryOutputs::default(), binary] {
            let (text, _) = write_response(&resp, &binary);
            let back: crate::http::bodies::InferenceResponse = serde_json::from_str(&text).unwrap();
            assert_eq!(
                (back.model_name.as_str(), back.model_version.as_str(), back.id.as_deref()),
                ("m", "1", Some("x"))
            );
            assert!(back.parameters.is_none());
            for (o, t) in back.outputs.iter().zip(&resp.outputs) {
                assert_eq!(
                    (o.name.as_str(), o.datatype.as_str(), o.shape.as_slice()),
                    (t.name.as_str(), t.datatype.as_str(), &[1u64, 3][..])
                );
                assert_eq!(o.data.is_some(), !binary.is_binary(&t.name), "{}", t.name);
                let size = o.parameters.as_ref().and_then(|p| p.get("binary_data_size"));
                assert_eq!(size.is_some(), binary.is_binary(&t.name), "{}", t.name);
                if let Some(data) = &o.data {
                    assert_eq!(data.len(), 3, "{}", t.name);
                }
            }
        }
    }

    #[test]
    fn binary_inputs_are_slices_of_the_body_and_lengths_are_checked() {
        let json = br#"{"inputs":[{"name":"a","shape":[2],"datatype":"INT16","parameters":{"binary_data_size":4}},
            {"name":"s","shape":[1],"datatype":"BYTES","parameters":{"binary_data_size":6}}],
            "outputs":[{"name":"y","parameters":{"binary_data":true}}],"parameters":{"binary_data_output":false}}"#;
        let body = Bytes::from_static(b"\x01\x00\x02\x00\x02\x00\x00\x00hi");
        let (req, bin) = parse("m", None, json, Some(body.clone()), 100).unwrap();
        assert_eq!(req.inputs[0], Tensor::from_le("a", DataType::Int16, vec![2], &[1i16, 2]));
        assert_eq!(req.inputs[1].data, TensorData::Strings(vec![Bytes::from_static(b"hi")]));
        assert!(bin.is_binary("y") && !bin.is_binary("z"));
        let err = parse("m", None, json, Some(body.slice(..9)), 100).unwrap_err().to_string();
        assert!(err.contains("'s'") && err.contains("exceeds"), "{err}");
        let mut long = body.to_vec();
        long.push(0);
        let err = parse("m", None, json, Some(long.into()), 100).unwrap_err().to_string();
        assert!(err.contains("1 bytes of binary data follow"), "{err}");
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
            (r#"{"name":"x","shape":[3],"datatype":"FP32","data":[1,2]}"#, "holds 3 elements"),
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
        let body = write(&resp);
        assert!(body.contains("\"data\":[NaN,Infinity,-1.5]"), "{body}");
        // What we write, we read.
        let quoted = super::quote_non_finite(br#"{"a":[NaN,-Infinity,"NaN \" Infinity"]}"#).unwrap();
        assert_eq!(quoted, br#"{"a":["NaN","-Infinity","NaN \" Infinity"]}"#);
        assert!(super::quote_non_finite(br#"{"a":"NaN"}"#).is_none());
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
            let body = write(&resp);
            let v: Value = serde_json::from_str(&body).unwrap();
            let out = &v["outputs"][0];
            let again = decode(&out.to_string(), 10).unwrap();
            assert_eq!(again.data, t.data, "{dt}: {body}");
        }
    }

    #[test]
    fn data_is_read_as_parsed_when_the_input_says_what_it_holds_first_and_kept_raw_otherwise() {
        let first = r#"{"name":"x","shape":[2],"datatype":"FP32","data":[1,2]}"#;
        let last = r#"{"data":[1,2],"datatype":"FP32","shape":[2],"name":"x"}"#;
        let expected = Tensor::from_le("x", DataType::Fp32, vec![2], &[1f32, 2.0]);
        for json in [first, last] {
            let (req, _) = parse("m", None, format!(r#"{{"inputs":[{json}]}}"#).as_bytes(), None, 100).unwrap();
            assert_eq!(req.inputs, std::slice::from_ref(&expected), "{json}");
        }
        READING.with(|r| *r.borrow_mut() = Some((100, None)));
        let input: JsonInput<'_> = serde_json::from_str(first).unwrap();
        assert!(matches!(input.data, Some(InputData::Read(_))));
        let input: JsonInput<'_> = serde_json::from_str(last).unwrap();
        assert!(matches!(input.data, Some(InputData::Raw(_))));
        READING.with(|r| *r.borrow_mut() = None);
        // Read as parsed: bare non-finite tokens still go through the quoting fallback, and what
        // the raw way refuses is refused alike.
        let (req, _) = parse(
            "m",
            None,
            br#"{"inputs":[{"name":"x","shape":[3],"datatype":"FP32","data":[NaN,-Infinity,1]}]}"#,
            None,
            100,
        )
        .unwrap();
        assert!(matches!(&req.inputs[0].data, TensorData::Fixed(b) if b.len() == 12));
        for (json, needle) in [
            (
                r#"{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[1],"data":[2]}]}"#,
                "duplicate field `data`",
            ),
            (
                r#"{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[1],"parameters":{"binary_data_size":4}}]}"#,
                "both 'data' and binary_data_size",
            ),
            (r#"{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[1,2]}]}"#, "more than the 1"),
            (r#"{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[1]},"#, "invalid JSON request"),
        ] {
            let err =
                parse("m", None, json.as_bytes(), Some(Bytes::from_static(&[0; 4])), 100).unwrap_err().to_string();
            assert!(err.contains(needle), "{json}: {err}");
        }
        assert!(READING.with(|r| r.borrow().is_none()), "parse leaves no limit behind");
    }
}
