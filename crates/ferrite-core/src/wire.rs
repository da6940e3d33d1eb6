//! What every front-end shares about the V2 protocol beyond tensors: the request parameters the
//! core honours, read the same way whichever wire they came over. (Shapes as clients see them,
//! with the batch dim, are [`ModelSpec::wire_shape`](crate::engine::spec::ModelSpec::wire_shape).)

use std::time::Duration;

use crate::{data::tensor::element_count, DataType, Error, Result};

/// Input elements one request may carry unless the server is told otherwise
/// (`--max-request-elements`).
pub const DEFAULT_MAX_ELEMENTS: usize = 1 << 23;

/// How long a client refused for a full queue or a limit is told to wait.
pub const RETRY_AFTER: Duration = Duration::from_secs(1);

/// The protocol extensions the server metadata lists (Triton's names), over every front-end.
pub const EXTENSIONS: &[&str] = &[
    "classification",
    "model_repository",
    "schedule_policy",
    "model_configuration",
    "binary_tensor_data",
    "parameters",
    "statistics",
];

/// Ferrite's version.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// One request parameter as a front-end decoded it (JSON, MessagePack or protobuf).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Param<'a> {
    Bool(bool),
    Int(i64),
    Uint(u64),
    Double(f64),
    Str(&'a str),
}

/// The request parameters the core honours: `priority` (1 highest, 0 the model's default),
/// `timeout` (µs; may only shorten the model's) and `cache` (false skips the response cache).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RequestParams {
    pub priority: u32,
    pub timeout_us: Option<u64>,
    pub skip_cache: bool,
}

impl RequestParams {
    /// Reads the parameters through `get`, which looks one up by name. Other names are ignored,
    /// as Triton does; a known name with a value of the wrong type is refused.
    pub fn parse<'a>(get: impl Fn(&str) -> Option<Param<'a>>) -> Result<RequestParams> {
        let priority = unsigned(&get, "priority")?
            .map(|p| u32::try_from(p).map_err(|_| Error::invalid("parameter 'priority' is too large")))
            .transpose()?
            .unwrap_or(0);
        let skip_cache = match get("cache") {
            None => false,
            Some(Param::Bool(b)) => !b,
            Some(_) => return Err(Error::invalid("parameter 'cache' must be a boolean")),
        };
        Ok(RequestParams { priority, timeout_us: unsigned(&get, "timeout")?, skip_cache })
    }
}

/// Request parameters as one JSON object (what a Python model's `request.parameters()` gives), keys
/// sorted, a key given twice with its last value. `None` when there are none. Written straight out:
/// most requests carry one or two (`binary_data_output`), so no map is built for them.
pub fn parameters_json<'a>(params: impl IntoIterator<Item = (&'a str, Param<'a>)>) -> Option<String> {
    let mut params: Vec<_> = params.into_iter().collect();
    if params.is_empty() {
        return None;
    }
    // Latest first, then a stable sort: each key's first entry is its last value.
    params.reverse();
    params.sort_by_key(|(k, _)| *k);
    params.dedup_by_key(|(k, _)| *k);
    let mut out = Vec::with_capacity(16 * params.len() + 2);
    out.push(b'{');
    for (i, (k, v)) in params.into_iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        let written = serde_json::to_writer(&mut out, k).and_then(|()| {
            out.push(b':');
            match v {
                Param::Bool(b) => serde_json::to_writer(&mut out, &b),
                Param::Int(n) => serde_json::to_writer(&mut out, &n),
                Param::Uint(n) => serde_json::to_writer(&mut out, &n),
                Param::Double(x) => serde_json::to_writer(&mut out, &x),
                Param::Str(s) => serde_json::to_writer(&mut out, s),
            }
        });
        written.expect("writing JSON into a Vec cannot fail");
    }
    out.push(b'}');
    Some(String::from_utf8(out).expect("serde_json writes UTF-8"))
}

/// An output's `classification` parameter (Triton's classification extension): the number of
/// classes to answer it with, when asked.
pub fn classification<'a>(get: impl Fn(&str) -> Option<Param<'a>>) -> Result<Option<usize>> {
    Ok(unsigned(&get, "classification")?.map(|k| usize::try_from(k).unwrap_or(usize::MAX)))
}

/// A parameter that must be a non-negative integer, when given.
pub fn unsigned<'a>(get: &impl Fn(&str) -> Option<Param<'a>>, key: &str) -> Result<Option<u64>> {
    match get(key) {
        None => Ok(None),
        Some(Param::Uint(v)) => Ok(Some(v)),
        Some(Param::Int(v)) if v >= 0 => Ok(Some(v as u64)),
        Some(_) => Err(Error::invalid(format!("parameter '{key}' must be a non-negative integer"))),
    }
}

/// Tensors one request may name (inputs, and requested outputs, each). Far above any model's
/// count; it bounds the work a request can cause before the model is consulted.
pub const MAX_TENSORS_PER_REQUEST: usize = 256;

/// Dims of one tensor's shape (a cached value's too).
pub const MAX_RANK: usize = 64;

/// Entries of one `parameters` object of a request or of one of its tensors.
pub const MAX_PARAMETERS: usize = 256;

/// Refuses a request that names more inputs or outputs than `MAX_TENSORS_PER_REQUEST`.
pub fn check_tensor_counts(inputs: usize, outputs: usize) -> Result<()> {
    if inputs.max(outputs) > MAX_TENSORS_PER_REQUEST {
        return Err(Error::invalid(format!(
            "a request may name at most {MAX_TENSORS_PER_REQUEST} inputs and {MAX_TENSORS_PER_REQUEST} outputs"
        )));
    }
    Ok(())
}

/// Checks a wire tensor's header before anything is allocated for it: the datatype's V2 name, a
/// shape without negative dims, and an element count within `max_elements`.
pub fn parse_header(
    name: &str,
    datatype: &str,
    shape: &[i64],
    max_elements: usize,
) -> Result<(DataType, Vec<usize>, usize)> {
    let dt = DataType::parse(datatype)
        .ok_or_else(|| Error::invalid(format!("input '{name}': unknown datatype '{datatype}'")))?;
    let dims = shape
        .iter()
        .map(|&d| {
            usize::try_from(d).map_err(|_| Error::invalid(format!("input '{name}': negative dim in shape {shape:?}")))
        })
        .collect::<Result<Vec<_>>>()?;
    let count = element_count(&dims, max_elements).map_err(|e| Error::invalid(format!("input '{name}': {e}")))?;
    Ok((dt, dims, count))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(params: &[(&str, Param<'static>)]) -> Result<RequestParams> {
        RequestParams::parse(|k| params.iter().find(|(n, _)| *n == k).map(|(_, v)| *v))
    }

    #[test]
    fn known_parameters_are_read_and_others_ignored() {
        assert_eq!(parse(&[]).unwrap(), RequestParams::default());
        let p = parse(&[
            ("priority", Param::Uint(2)),
            ("timeout", Param::Int(500)),
            ("cache", Param::Bool(false)),
            ("other", Param::Str("x")),
        ])
        .unwrap();
        assert_eq!(p, RequestParams { priority: 2, timeout_us: Some(500), skip_cache: true });
        assert!(!parse(&[("cache", Param::Bool(true))]).unwrap().skip_cache);
    }

    #[test]
    fn wrong_types_and_ranges_are_refused_with_the_name() {
        for (k, v) in [
            ("priority", Param::Int(-1)),
            ("priority", Param::Uint(u64::from(u32::MAX) + 1)),
            ("timeout", Param::Double(1.5)),
            ("timeout", Param::Str("10")),
            ("cache", Param::Uint(0)),
        ] {
            let e = parse(&[(k, v)]).unwrap_err().to_string();
            assert!(e.contains(k), "{k}: {e}");
        }
    }

    #[test]
    fn parameters_are_one_json_object_with_sorted_keys_and_each_key_s_last_value() {
        assert_eq!(parameters_json([]), None);
        let json = parameters_json([
            ("z\"q", Param::Str("a\nb")),
            ("b", Param::Int(-1)),
            ("a", Param::Uint(u64::MAX)),
            ("b", Param::Bool(true)),
            ("x", Param::Double(0.25)),
            ("n", Param::Double(f64::NAN)),
        ])
        .unwrap();
        assert_eq!(json, r#"{"a":18446744073709551615,"b":true,"n":null,"x":0.25,"z\"q":"a\nb"}"#);
        let back: serde_json::Value = serde_json::from_str(&json).unwrap();
        assert_eq!(back["z\"q"], "a\nb");
    }
}
