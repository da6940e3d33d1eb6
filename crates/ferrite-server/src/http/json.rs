//! The V2 JSON body, with Triton's binary tensor extension: decoding requests, writing responses.
//!
//! Tensor `data` is decoded once the input's datatype and shape are known (from its JSON text,
//! kept until they are), so decoding allocates exactly what the (already capped) shape calls for
//! and stops at the first extra value. Binary inputs are slices of the request body, not copies.

use bytes::Bytes;
use ferrite_core::{dispatch, DataType, Element, Error, InferRequest, InferResponse, Number, Tensor, TensorData};
use serde::Deserialize;
use serde_json::value::RawValue;

pub use super::decode::BinaryOutputs;
use super::decode::{at_most, param_bool, param_u64, request_params, some_at_most, Dims, Params, Sink, Tensors, Watch};
use crate::shm::{Access, Regions};
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
    #[serde(borrow, deserialize_with = "at_most::<_, _, Tensors>")]
    pub inputs: Vec<JsonInput<'a>>,
    #[serde(default, deserialize_with = "some_at_most::<_, _, Tensors>")]
    pub outputs: Option<Vec<JsonOutput>>,
}

/// An input of a V2 inference request: `data` row-major (nested lists are accepted), or
/// `parameters.binary_data_size` bytes after the JSON (the binary extension). `data` is its text,
/// decoded once the input's datatype and shape are known, whatever order the fields came in; when
/// `parse` reads it apart from the rest of the body, the text is a number standing for its place.
#[derive(Deserialize, utoipa::ToSchema)]
#[schema(as = RequestInput)]
pub struct JsonInput<'a> {
    pub name: String,
    #[serde(deserialize_with = "at_most::<_, _, Dims>")]
    pub shape: Vec<i64>,
    #[schema(value_type = super::bodies::Datatype)]
    pub datatype: String,
    #[serde(default)]
    #[schema(value_type = Object, required = false)]
    pub parameters: Params,
    #[serde(borrow, default)]
    #[schema(value_type = Option<Vec<Value>>)]
    pub data: Option<&'a RawValue>,
}

pub use super::bodies::JsonOutput;

/// `json` with every bare `NaN`, `Infinity` and `-Infinity` token (outside strings) quoted, or
/// `None` when it has none. A body with neither word is passed over at memchr's speed: the
/// quoting pass, a byte at a time, was paid by every body serde refused (a few KB of gzip
/// decompressed to 16 MiB of zeros cost a core 2-3 s in a debug build, and a quarter of the
/// cores bound only the decompression).
fn quote_non_finite(json: &[u8]) -> Option<Vec<u8>> {
    memchr::memmem::find(json, b"NaN").or_else(|| memchr::memmem::find(json, b"Infinity"))?;
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
///
/// The inputs' `data`, most of a body's bytes, is read apart from the rest when it can be: the
/// body is passed once to find where each input's `data` lies (`data_spans`), serde reads the body
/// without it, and each `data` is read from its own text: about 175 instructions a number of the
/// MLP's 512, where serde's visitor took 370 and a RawValue pass then our reading as many
/// (`bench/results/instructions-json-data.md`). A body that fails this way is refused with the
/// words serde's whole reading gives: read the whole way again only where some `data` is not JSON
/// (or its NaN tokens need quoting), the one failure that reading would find first.
pub fn parse(
    model: &str,
    version: Option<String>,
    json: &[u8],
    binary: Option<Bytes>,
    max_elements: usize,
    shm: Option<&Access>,
    watch: Option<&Watch>,
) -> Result<(InferRequest, BinaryOutputs), Error> {
    // A binary extension's header has no `data` to read apart: not worth the pass. The finder
    // is built once: building one a request cost half as much as searching the MLP's 4 KB body.
    static DATA: std::sync::LazyLock<memchr::memmem::Finder<'static>> =
        std::sync::LazyLock::new(|| memchr::memmem::Finder::new(b"\"data\""));
    let spans = DATA.find(json).and_then(|_| data_spans(json));
    if let Some(spans) = spans.filter(|s| !s.is_empty()) {
        let mut rest = Vec::with_capacity(json.len().min(4096));
        let mut from = 0;
        for (k, (start, end)) in spans.iter().enumerate() {
            rest.extend_from_slice(&json[from..*start]);
            // A space ends the index: what follows a `data` value (digits, where the body is not
            // JSON) cannot join it into another index.
            rest.extend_from_slice(itoa::Buffer::new().format(k).as_bytes());
            rest.push(b' ');
            from = *end;
        }
        rest.extend_from_slice(&json[from..]);
        if let Ok(req) = serde_json::from_slice::<JsonRequest<'_>>(&rest) {
            let data = DataText::Spans(json, &spans);
            match build(model, version.clone(), req, data, binary.clone(), max_elements, shm, watch) {
                Ok(parsed) => return Ok(parsed),
                // Refused by the model before any data was read, or no one to say it to.
                Err(e) if watch.is_some_and(Watch::settled) => return Err(e),
                // Every `data` is JSON as serde's whole reading takes it (no recursion limit in a
                // RawValue): that reading would refuse the body for the same reason, after
                // decoding it all again.
                Err(e) if spans.iter().all(|&(start, end)| is_json(&json[start..end])) => return Err(e),
                Err(_) => {}
            }
        }
    }
    read_whole(model, version, json, binary, max_elements, shm, watch)
}

/// Whether `text` is one JSON value as a RawValue reads it (checked, not decoded).
fn is_json(text: &[u8]) -> bool {
    std::str::from_utf8(text).is_ok_and(|t| serde_json::from_str::<serde::de::IgnoredAny>(t).is_ok())
}

/// The bytes a V2 JSON request's inputs ask to be read from shared memory, as their parameters
/// say (all there may be, when the body cannot be read this way).
pub fn shared_input_bytes(json: &[u8]) -> u64 {
    #[derive(Deserialize)]
    struct Request {
        #[serde(deserialize_with = "at_most::<_, _, Tensors>")]
        inputs: Vec<Input>,
    }
    #[derive(Deserialize)]
    struct Input {
        #[serde(default)]
        parameters: Params,
    }
    let Ok(req) = serde_json::from_slice::<Request>(json) else { return u64::MAX };
    let size = |i: &Input| param_u64(&i.parameters, "shared_memory_byte_size").ok().flatten().unwrap_or(0);
    req.inputs.iter().map(size).fold(0, u64::saturating_add)
}

/// `parse` with serde reading the whole body.
pub(crate) fn read_whole(
    model: &str,
    version: Option<String>,
    json: &[u8],
    binary: Option<Bytes>,
    max_elements: usize,
    shm: Option<&Access>,
    watch: Option<&Watch>,
) -> Result<(InferRequest, BinaryOutputs), Error> {
    let req: JsonRequest<'_> = match serde_json::from_slice(json) {
        Ok(req) => req,
        // Python's `json` (and so tritonclient) writes non-finite floats as bare NaN/Infinity
        // tokens, as our responses do; accept them by quoting them, off the hot path.
        Err(e) => match quote_non_finite(json) {
            Some(quoted) => return read_whole(model, version, &quoted, binary, max_elements, shm, watch),
            None => return Err(Error::invalid(format!("invalid JSON request: {e}"))),
        },
    };
    build(model, version, req, DataText::Read, binary, max_elements, shm, watch)
}

/// Where each input's `data` value lies in a V2 JSON body (`{"inputs": [{"data": ...}]}`), found
/// by one pass that follows only strings and nesting; `None` when a key it reads has an escape
/// (serde would read it unescaped) or the brackets close more than they open. It checks nothing
/// else: serde reads the body without these values, `Sink::fill_json` each value, and either
/// refuses what is not JSON.
fn data_spans(json: &[u8]) -> Option<Vec<(usize, usize)>> {
    let mut spans = Vec::new();
    // The containers open at the first three levels, the key read last at levels 1 and 3.
    let (mut open, mut depth, mut key1, mut key3, mut expect_key) = ([0u8; 3], 0usize, &b""[..], &b""[..], false);
    let mut i = 0;
    while let Some(&c) = json.get(i) {
        match c {
            b'"' => {
                let end = string_end(json, i + 1)?;
                if expect_key {
                    let key = &json[i + 1..end];
                    if (depth == 1 || depth == 3) && key.contains(&b'\\') {
                        return None;
                    }
                    match depth {
                        1 => key1 = key,
                        3 => key3 = key,
                        _ => {}
                    }
                    expect_key = false;
                }
                i = end;
            }
            b'{' | b'[' => {
                if let Some(slot) = open.get_mut(depth) {
                    *slot = c;
                }
                depth += 1;
                expect_key = c == b'{';
            }
            b'}' | b']' => {
                depth = depth.checked_sub(1)?;
                expect_key = false;
            }
            b',' => expect_key = depth > 0 && open.get(depth - 1).is_none_or(|&o| o == b'{'),
            b':' if depth == 3 && open == *b"{[{" && key1 == b"inputs" && key3 == b"data" => {
                let mut start = i + 1;
                while matches!(json.get(start), Some(b' ' | b'\n' | b'\r' | b'\t')) {
                    start += 1;
                }
                let end = value_end(json, start)?;
                // Past one `data` an input: serde refuses the body (read whole, its lists capped).
                if spans.len() == ferrite_core::wire::MAX_TENSORS_PER_REQUEST {
                    return None;
                }
                spans.push((start, end));
                i = end;
                continue;
            }
            _ => {}
        }
        i += 1;
    }
    Some(spans)
}

/// The index of the quote that ends the string whose text starts at `start`.
fn string_end(json: &[u8], mut i: usize) -> Option<usize> {
    loop {
        match json.get(i)? {
            b'"' => return Some(i),
            b'\\' => i += 2,
            _ => i += 1,
        }
    }
}

/// The end of the JSON value at `start`: past its closing bracket (strings followed), its string's
/// closing quote, or a scalar's last character.
fn value_end(json: &[u8], start: usize) -> Option<usize> {
    match json.get(start)? {
        b'"' => string_end(json, start + 1).map(|end| end + 1),
        // Brackets and strings are all that matter in an array (an object inside one is not
        // tensor data, and its brackets balance in JSON; what is not JSON, `fill_json` refuses):
        // the array's bytes are searched for them, most often found only at its end.
        b'[' => {
            let (mut i, mut depth) = (start, 0usize);
            loop {
                i += memchr::memchr3(b'"', b'[', b']', json.get(i..)?)?;
                match json[i] {
                    b'"' => i = string_end(json, i + 1)?,
                    b'[' => depth += 1,
                    _ => {
                        depth -= 1;
                        if depth == 0 {
                            return Some(i + 1);
                        }
                    }
                }
                i += 1;
            }
        }
        b'{' => {
            let (mut i, mut depth) = (start, 0usize);
            loop {
                match json.get(i)? {
                    b'"' => i = string_end(json, i + 1)?,
                    b'{' => depth += 1,
                    b'}' => {
                        depth -= 1;
                        if depth == 0 {
                            return Some(i + 1);
                        }
                    }
                    _ => {}
                }
                i += 1;
            }
        }
        _ => {
            let mut i = start;
            while !matches!(json.get(i), None | Some(b',' | b']' | b'}' | b' ' | b'\n' | b'\r' | b'\t')) {
                i += 1;
            }
            Some(i)
        }
    }
}

/// Where an input's `data` text is: the value serde read, or the body's text it stands for.
#[derive(Clone, Copy)]
enum DataText<'j> {
    Read,
    Spans(&'j [u8], &'j [(usize, usize)]),
}

impl<'j> DataText<'j> {
    fn get<'a>(self, raw: &'a RawValue) -> Option<&'a str>
    where
        'j: 'a,
    {
        match self {
            DataText::Read => Some(raw.get()),
            DataText::Spans(json, spans) => {
                let &(start, end) = spans.get(raw.get().parse::<usize>().ok()?)?;
                std::str::from_utf8(&json[start..end]).ok()
            }
        }
    }
}

/// A request from what serde read of its body; `data` gives an input's `data` text.
#[allow(clippy::too_many_arguments)]
fn build(
    model: &str,
    version: Option<String>,
    req: JsonRequest<'_>,
    data: DataText<'_>,
    binary: Option<Bytes>,
    max_elements: usize,
    shm: Option<&Access>,
    watch: Option<&Watch>,
) -> Result<(InferRequest, BinaryOutputs), Error> {
    check_tensor_counts(req.inputs.len(), req.outputs.as_ref().map_or(0, Vec::len))?;
    let mut rest = binary.unwrap_or_default();
    let inputs = req
        .inputs
        .into_iter()
        .map(|i| decode_input(i, data, &mut rest, max_elements, shm, watch))
        .collect::<Result<Vec<_>, _>>()?;
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
                if let Some(place) = super::decode::place(&o.name, &o.parameters)? {
                    binary_outputs.shared.push((o.name.clone(), place));
                }
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
        share: None,
        canary: Default::default(),
        parameters: super::decode::parameters_json(&req.parameters),
    };
    Ok((req, binary_outputs))
}

fn decode_input(
    input: JsonInput<'_>,
    data: DataText<'_>,
    binary: &mut Bytes,
    max_elements: usize,
    shm: Option<&Access>,
    watch: Option<&Watch>,
) -> Result<Tensor, Error> {
    let name = input.name;
    let header = parse_header(&name, &input.datatype, &input.shape, max_elements);
    let (datatype, shape, count) = match watch {
        Some(watch) => watch.header(&name, header)?,
        None => header?,
    };
    if let Some(place) = super::decode::place(&name, &input.parameters)? {
        if input.data.is_some() || input.parameters.get("binary_data_size").is_some() {
            return Err(Error::invalid(format!("input '{name}' is in shared memory and in the body")));
        }
        let data = shm.ok_or_else(Regions::off)?.read(&name, &place, datatype, count)?;
        return Ok(Tensor::new(name, datatype, shape, data));
    }
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
        (None, Some(raw)) => {
            let text = data.get(raw).ok_or_else(|| Error::invalid(format!("input '{name}': 'data' is not JSON")))?;
            // An element takes two bytes of JSON at least, its separator included.
            let mut sink = Sink::new(&name, datatype, count, text.len() / 2 + 1);
            if let Some(watch) = watch {
                sink.watch(watch.wanted);
            }
            sink.fill_json(text)?;
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
        if binary.is_shared(&t.name) {
            // Its bytes went to the region (`shm::Access::write`): no data, and no parameters
            // (Triton's C++ client reads an output's parameters as a binary one's).
            out.push_str("]}");
        } else if binary.is_binary(&t.name) {
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

/// `s` as a JSON string. Names and ids are plain text as a rule, written as they are; one with
/// a character JSON escapes goes through serde's writer (a string of its own).
fn push_str(out: &mut String, s: &str) {
    if s.bytes().any(|c| c < 0x20 || c == b'"' || c == b'\\') {
        out.push_str(&serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into()));
        return;
    }
    out.push('"');
    out.push_str(s);
    out.push('"');
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

    /// Decodes one input as a request's, and its `data` both ways: its numbers read from the
    /// text, and every value by the visitor; they must agree, in what they read and what they say
    /// is wrong.
    fn decode(json: &str, max: usize) -> Result<Tensor, Error> {
        let request = format!(r#"{{"inputs":[{json}]}}"#);
        let read = parse("m", None, request.as_bytes(), None, max, None, None).map(|(mut r, _)| r.inputs.remove(0));
        let input: JsonInput<'_> = serde_json::from_str(json).unwrap();
        if let (Ok((datatype, _, count)), Some(raw)) =
            (parse_header(&input.name, &input.datatype, &input.shape, max), input.data)
        {
            let mut sink = Sink::new(&input.name, datatype, count, count);
            let visited = sink.fill(&mut serde_json::Deserializer::from_str(raw.get())).map(|()| sink.finish());
            let read_data = read.as_ref().map(|t| &t.data).map_err(ToString::to_string);
            assert_eq!(read_data, visited.as_ref().map_err(ToString::to_string), "{json}");
        }
        read
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
    fn shared_memory_reads_are_counted_before_the_body_is_parsed() {
        let body = br#"{"inputs":[{"name":"a","shape":[1],"datatype":"FP32","parameters":{"shared_memory_region":"r",
            "shared_memory_byte_size":4}},{"name":"b","shape":[2],"datatype":"FP32","parameters":{"shared_memory_region":"r",
            "shared_memory_byte_size":8,"shared_memory_offset":4}},{"name":"c","shape":[1],"datatype":"FP32","data":[1]}]}"#;
        assert_eq!(shared_input_bytes(body), 12);
        assert_eq!(shared_input_bytes(br#"{"inputs":[]}"#), 0);
        // A body this reading cannot take may still parse (bare NaN): counted as the most.
        assert_eq!(shared_input_bytes(br#"{"inputs":[{"data":[NaN]}]}"#), u64::MAX);
    }

    /// A large body's inputs are checked before their data is read; one refused so, or whose
    /// client has gone, is not read a second time (the whole-body read that gives a failed body
    /// the same words either way), and a gone client's data stops being decoded.
    #[test]
    fn a_watched_body_is_checked_first_and_read_once() {
        use std::sync::{atomic::AtomicBool, Arc};
        let body = br#"{"inputs":[{"name":"x","shape":[3],"datatype":"FP32","data":[1,2,3]}]}"#;
        let asked = std::sync::atomic::AtomicUsize::new(0);
        let check = |_: &str, dt: DataType, _: &[usize]| {
            asked.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            match dt {
                DataType::Fp64 => Ok(()),
                _ => Err(Error::invalid("input 'x': expected datatype FP64, got FP32")),
            }
        };
        let wanted = Arc::new(AtomicBool::new(true));
        let watch = Watch { check: &check, wanted: &wanted, refused: Default::default() };
        let e = parse("m", None, body, None, 100, None, Some(&watch)).unwrap_err();
        assert_eq!(
            (e.to_string().as_str(), asked.load(std::sync::atomic::Ordering::Relaxed)),
            ("input 'x': expected datatype FP64, got FP32", 1)
        );
        // Refused by its header alone (past the elements a request may hold) likewise.
        let over = br#"{"inputs":[{"name":"x","shape":[300],"datatype":"FP64","data":[1,2,3]}]}"#;
        let e = parse("m", None, over, None, 100, None, Some(&watch)).unwrap_err();
        assert!(e.to_string().contains("more than 100") && watch.settled(), "{e}");
        // Taken: read once, as before.
        let fp64 = br#"{"inputs":[{"name":"x","shape":[3],"datatype":"FP64","data":[1,2,3]}]}"#;
        assert!(parse("m", None, fp64, None, 100, None, Some(&watch)).is_ok());
        assert_eq!(asked.load(std::sync::atomic::Ordering::Relaxed), 2);
        // A client gone: its data is not decoded past the first look.
        let n = 200_000;
        let long = format!(
            r#"{{"inputs":[{{"name":"x","shape":[{n}],"datatype":"FP64","data":[{}1]}}]}}"#,
            "1,".repeat(n - 1)
        );
        wanted.store(false, std::sync::atomic::Ordering::Relaxed);
        let e = parse("m", None, long.as_bytes(), None, 1 << 20, None, Some(&watch)).unwrap_err();
        assert!(matches!(e, Error::Unavailable { .. }), "{e}");
        assert_eq!(asked.load(std::sync::atomic::Ordering::Relaxed), 3, "read once");
    }

    /// A body refused for what its data holds, all of it JSON, is refused with the words serde's
    /// whole reading gives without that reading (which decoded it all again); one whose data is
    /// not JSON, or needs its NaN tokens quoted, is still read whole.
    #[test]
    fn a_body_whose_data_is_json_is_refused_without_a_second_read() {
        use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
        let asked = AtomicUsize::new(0);
        let check = |_: &str, _: DataType, _: &[usize]| {
            asked.fetch_add(1, Relaxed);
            Ok(())
        };
        let wanted = std::sync::Arc::new(AtomicBool::new(true));
        let watch = Watch { check: &check, wanted: &wanted, refused: Default::default() };
        for (data, said, reads) in [
            ("[1,2,3]", Some("more than the 2"), 1),
            ("[1,1e400]", Some("out of range"), 1),
            (r#"[1,"a"]"#, Some("not a valid FP32 value"), 1),
            // Read whole again, which stops at the syntax error before any header is checked.
            ("[1,,2]", Some("invalid JSON request"), 1),
            ("[NaN,1]", None, 2),
        ] {
            asked.store(0, Relaxed);
            let body = format!(
                r#"{{"inputs":[{{"name":"y","shape":[1],"datatype":"FP32","data":[1]}},{{"name":"x","shape":[2],"datatype":"FP32","data":{data}}}]}}"#
            );
            let got =
                parse("m", None, body.as_bytes(), None, 100, None, Some(&watch)).map(|_| ()).map_err(|e| e.to_string());
            let whole =
                read_whole("m", None, body.as_bytes(), None, 100, None, None).map(|_| ()).map_err(|e| e.to_string());
            assert_eq!(got, whole, "{data}");
            assert_eq!(
                got.as_ref().err().map(|e| said.is_some_and(|s| e.contains(s))),
                said.map(|_| true),
                "{data}: {got:?}"
            );
            // Each reading checks both inputs' headers.
            assert_eq!(asked.load(Relaxed), 2 * reads, "{data}: read {} times", asked.load(Relaxed) / 2);
        }
    }

    #[test]
    fn binary_inputs_are_slices_of_the_body_and_lengths_are_checked() {
        let json = br#"{"inputs":[{"name":"a","shape":[2],"datatype":"INT16","parameters":{"binary_data_size":4}},
            {"name":"s","shape":[1],"datatype":"BYTES","parameters":{"binary_data_size":6}}],
            "outputs":[{"name":"y","parameters":{"binary_data":true}}],"parameters":{"binary_data_output":false}}"#;
        let body = Bytes::from_static(b"\x01\x00\x02\x00\x02\x00\x00\x00hi");
        let (req, bin) = parse("m", None, json, Some(body.clone()), 100, None, None).unwrap();
        assert_eq!(req.inputs[0], Tensor::from_le("a", DataType::Int16, vec![2], &[1i16, 2]));
        assert_eq!(req.inputs[1].data, TensorData::Strings(vec![Bytes::from_static(b"hi")]));
        assert!(bin.is_binary("y") && !bin.is_binary("z"));
        let err = parse("m", None, json, Some(body.slice(..9)), 100, None, None).unwrap_err().to_string();
        assert!(err.contains("'s'") && err.contains("exceeds"), "{err}");
        let mut long = body.to_vec();
        long.push(0);
        let err = parse("m", None, json, Some(long.into()), 100, None, None).unwrap_err().to_string();
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
    fn names_and_ids_are_written_as_json_strings_whatever_they_hold() {
        for name in ["mlp", "", "a\"b", "back\\slash", "line\nfeed", "\u{1}", "tab\t", "ünï €", "del\u{7f}"] {
            let t = Tensor::from_le(name, DataType::Fp32, vec![1], &[1.0f32]);
            let resp = InferResponse {
                model_name: name.into(),
                model_version: name.into(),
                id: Some(name.into()),
                outputs: vec![t],
            };
            let body = write(&resp);
            let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{body}: {e}"));
            for got in [&v["model_name"], &v["model_version"], &v["id"], &v["outputs"][0]["name"]] {
                assert_eq!(got.as_str(), Some(name), "{body}");
            }
            // Written as serde writes a string.
            assert!(body.contains(&format!("\"model_name\":{},", serde_json::to_string(name).unwrap())), "{body}");
        }
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
    fn data_is_read_in_any_field_order_and_wrong_data_is_refused_by_name() {
        let first = r#"{"name":"x","shape":[2],"datatype":"FP32","data":[1,2]}"#;
        let last = r#"{"data":[1,2],"datatype":"FP32","shape":[2],"name":"x"}"#;
        let expected = Tensor::from_le("x", DataType::Fp32, vec![2], &[1f32, 2.0]);
        for json in [first, last] {
            let (req, _) =
                parse("m", None, format!(r#"{{"inputs":[{json}]}}"#).as_bytes(), None, 100, None, None).unwrap();
            assert_eq!(req.inputs, std::slice::from_ref(&expected), "{json}");
        }
        // Bare non-finite tokens go through the quoting fallback.
        let (req, _) = parse(
            "m",
            None,
            br#"{"inputs":[{"name":"x","shape":[3],"datatype":"FP32","data":[NaN,-Infinity,1]}]}"#,
            None,
            100,
            None,
            None,
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
            (r#"{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[1e400]}]}"#, "out of range"),
            (r#"{"inputs":[{"name":"x","shape":[2],"datatype":"FP32","data":[1,]}]}"#, "invalid JSON request"),
            (r#"{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[01]}]}"#, "invalid JSON request"),
        ] {
            let err = parse("m", None, json.as_bytes(), Some(Bytes::from_static(&[0; 4])), 100, None, None)
                .unwrap_err()
                .to_string();
            assert!(err.contains(needle), "{json}: {err}");
        }
    }

    /// Numbers read straight from the text are the numbers the visitor reads, for every datatype,
    /// every form JSON writes a number in, nested or not, and mixed with what only the visitor
    /// reads (strings, booleans): the same values, or the same error.
    #[test]
    fn numbers_read_from_the_text_are_the_visitors() {
        let numbers = super::super::decode::NUMBER_FORMS;
        let mut all = Vec::new();
        for dt in DataType::ALL.into_iter().filter(|d| *d != DataType::Bytes) {
            for n in numbers {
                for data in [n.to_string(), format!("[{n}]"), format!("[[ {n} ],\n[\t{n}]]"), format!("[{n},true]")] {
                    let count = if data.contains(',') { 2 } else { 1 };
                    let json = format!(r#"{{"name":"x","shape":[{count}],"datatype":"{dt}","data":{data}}}"#);
                    all.push(decode(&json, 10).is_ok());
                }
            }
        }
        assert!(all.iter().any(|ok| *ok) && all.iter().any(|ok| !*ok));
    }

    /// Reading `data` apart from the rest of the body (`parse`) gives what serde reading the whole
    /// body gives, value for value and error for error: on bodies of every shape the protocol and
    /// clients write, and on every one of them cut short and with each byte deleted or changed to
    /// one of JSON's structural characters.
    #[test]
    fn data_read_apart_is_what_the_whole_reading_gives() {
        let corpus = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/json");
        let mut bodies: Vec<Vec<u8>> =
            std::fs::read_dir(corpus).unwrap().map(|e| std::fs::read(e.unwrap().path()).unwrap()).collect();
        for body in [
            r#"{"inputs":[{"name":"x","shape":[2,2],"datatype":"FP32","data":[[1.5,-2e3],[0.25, 7]]}]}"#,
            r#"{"id":"a","inputs":[{"data":[1,2],"datatype":"INT64","shape":[2],"name":"x"}],"outputs":[{"name":"y","data":[3]}]}"#,
            r#" { "inputs" : [ { "name" : "x" , "shape" : [ 3 ] , "datatype" : "FP64" , "data" : [ 1 , 2 , 3 ] } ] } "#,
            r#"{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":5},{"name":"s","shape":[2],"datatype":"BYTES","data":["a\"],","b"]}]}"#,
            r#"{"inputs":[{"name":"x","shape":[1],"datatype":"BOOL","data":[true]},{"name":"y","shape":[0],"datatype":"FP32","data":[]}]}"#,
            r#"{"inputs":[{"name":"x","shape":[2],"datatype":"FP32","data":[NaN,-Infinity]}]}"#,
            r#"{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","d\u0061ta":[1]}]}"#,
            r#"{"inp\u0075ts":[{"name":"x","shape":[1],"datatype":"FP32","data":[1]}]}"#,
            r#"{"inputs":[{"name":"d\"ata","shape":[1],"datatype":"FP32","parameters":{"data":9},"data":[1]}]}"#,
            r#"{"data":[1],"inputs":[{"name":"x","shape":[1],"datatype":"UINT8","data":[255]}],"parameters":{"a":"\"data\":[1]"}}"#,
            r#"{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[1],"data":[2]}]}"#,
            r#"{"inputs":[{"name":"x","shape":[3],"datatype":"INT32","data":[1,,2]}]}"#,
            r#"{"inputs":[{"name":"x","shape":[2],"datatype":"INT32","data":[1 2]}]}"#,
            r#"{"inputs":[{"name":"x","shape":[1],"datatype":"INT8","data":[-0]},{"name":"z","shape":[1],"datatype":"UINT64","data":[18446744073709551615]}]}"#,
            r#"{"inputs":[{"name":"x","shape":[1],"datatype":"FP16","data":[[1]},{"name":"y","shape":[1],"datatype":"FP32","data":1 2}]}"#,
            r#"{"inputs":{"name":"x","shape":[1],"datatype":"FP32","data":[1]}}"#,
            r#"{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":"[1]"}],"id":"\"data\":[2]"}"#,
            r#"{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","parameters":{"binary_data_size":4}}],"outputs":[{"name":"y","parameters":{"binary_data":true}}]}"#,
            "{\"inputs\":[{\"name\":\"\u{e9}\",\"shape\":[1],\"datatype\":\"FP32\",\"data\":[1e-400]}]}",
        ] {
            bodies.push(body.as_bytes().to_vec());
        }
        let said = |r: Result<(InferRequest, BinaryOutputs), Error>| match r {
            Ok((req, bin)) => Ok(format!("{req:?} {bin:?}")),
            Err(e) => Err(e.to_string()),
        };
        let same = |body: &[u8]| {
            let binary = body.windows(16).any(|w| w == b"binary_data_size").then(|| Bytes::from_static(&[0; 4]));
            let apart = said(parse("m", None, body, binary.clone(), 64, None, None));
            let whole = said(read_whole("m", None, body, binary, 64, None, None));
            assert_eq!(apart, whole, "{}", String::from_utf8_lossy(body));
            apart.is_ok()
        };
        let (mut read, mut tried) = (0, 0);
        for body in &bodies {
            read += usize::from(same(body));
            for n in 0..body.len() {
                let mut cut = body.clone();
                cut.remove(n);
                same(&cut);
                same(&body[..n]);
                for c in *br#"{}[]",:\0-. e"# {
                    let mut changed = body.clone();
                    changed[n] = c;
                    read += usize::from(same(&changed));
                    tried += 1;
                }
            }
        }
        assert!(read > 100 && tried > 10_000, "{read} of {tried}");
    }
}
