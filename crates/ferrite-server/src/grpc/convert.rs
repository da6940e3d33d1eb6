//! Protobuf messages to core types and back.

use std::collections::HashMap;

use bytes::Bytes;
use ferrite_core::{
    dispatch,
    engine::spec::TensorSpec,
    telemetry::stats::StatsSnapshot,
    wire::parse_header,
    wire::{Param, RequestParams},
    DataType, Element, Error, InferRequest, InferResponse, Model, Number, Tensor, TensorData,
};

use crate::shm::{Access, Place, Regions};

use super::pb::{
    self, infer_parameter::ParameterChoice, model_infer_request::InferInputTensor, InferParameter, InferTensorContents,
};

/// A parameter of a protobuf map as the core's wire module reads it.
fn param<'a>(params: &'a HashMap<String, InferParameter>, key: &str) -> Option<Param<'a>> {
    params.get(key).and_then(as_wire)
}

fn as_wire(p: &InferParameter) -> Option<Param<'_>> {
    p.parameter_choice.as_ref().map(|c| match c {
        ParameterChoice::BoolParam(b) => Param::Bool(*b),
        ParameterChoice::Int64Param(v) => Param::Int(*v),
        ParameterChoice::Uint64Param(v) => Param::Uint(*v),
        ParameterChoice::DoubleParam(v) => Param::Double(*v),
        ParameterChoice::StringParam(s) => Param::Str(s),
    })
}

/// The request parameters the core honours, read as every front-end reads them.
fn request_params(params: &HashMap<String, InferParameter>) -> Result<RequestParams, Error> {
    RequestParams::parse(|key| param(params, key))
}

/// Whether the client asked for Triton's final-response flag (perf_analyzer does on streams).
pub fn wants_final_response(req: &pb::ModelInferRequest) -> bool {
    matches!(
        req.parameters.get("triton_enable_empty_final_response").and_then(|p| p.parameter_choice.as_ref()),
        Some(ParameterChoice::BoolParam(true))
    )
}

/// A request in the core's terms; inputs that name a shared-memory place (`shm`'s regions) are
/// read from it and take no `raw_input_contents` entry (as Triton: the entries are the other
/// inputs', in order).
pub fn to_core(req: pb::ModelInferRequest, max_elements: usize, shm: Option<&Access>) -> Result<InferRequest, Error> {
    ferrite_core::wire::check_tensor_counts(req.inputs.len(), req.outputs.len())?;
    let places =
        req.inputs.iter().map(|i| Place::of(&i.name, |k| param(&i.parameters, k))).collect::<Result<Vec<_>, _>>()?;
    let raw = req.raw_input_contents;
    if !raw.is_empty() {
        let wanted = places.iter().filter(|p| p.is_none()).count();
        if raw.len() != wanted {
            return Err(Error::invalid(format!(
                "{} raw_input_contents for {wanted} inputs not in shared memory; there must be one per input",
                raw.len(),
            )));
        }
        if let Some(i) = req.inputs.iter().find(|i| i.contents.is_some()) {
            return Err(Error::invalid(format!(
                "input '{}' has typed contents while raw_input_contents is used",
                i.name
            )));
        }
    }
    let mut raw = raw.into_iter();
    let inputs = req
        .inputs
        .into_iter()
        .zip(places)
        .map(|(i, place)| match place {
            Some(place) => {
                if i.contents.is_some() {
                    return Err(Error::invalid(format!("input '{}' is in shared memory and has contents", i.name)));
                }
                let (datatype, shape, count) = parse_header(&i.name, &i.datatype, &i.shape, max_elements)?;
                let data = shm.ok_or_else(Regions::off)?.read(&i.name, &place, datatype, count)?;
                Ok(Tensor::new(i.name, datatype, shape, data))
            }
            None => {
                let r = raw.next();
                input(i, r, max_elements)
            }
        })
        .collect::<Result<Vec<_>, _>>()?;
    let params = request_params(&req.parameters)?;
    let parameters =
        ferrite_core::wire::parameters_json(req.parameters.iter().filter_map(|(k, v)| Some((k.as_str(), as_wire(v)?))));
    Ok(InferRequest {
        model_name: req.model_name,
        model_version: Some(req.model_version).filter(|v| !v.is_empty()),
        id: Some(req.id).filter(|v| !v.is_empty()),
        inputs,
        classification: req
            .outputs
            .iter()
            .filter_map(|o| {
                ferrite_core::wire::classification(|k| param(&o.parameters, k))
                    .map(|k| k.map(|k| (o.name.clone(), k)))
                    .transpose()
            })
            .collect::<Result<_, _>>()?,
        outputs: if req.outputs.is_empty() { None } else { Some(req.outputs.into_iter().map(|o| o.name).collect()) },
        priority: params.priority,
        timeout_us: params.timeout_us,
        skip_cache: params.skip_cache,
        tenant: None,
        share: None,
        canary: Default::default(),
        parameters,
    })
}

fn input(i: InferInputTensor, raw: Option<Bytes>, max_elements: usize) -> Result<Tensor, Error> {
    let name = i.name;
    let (datatype, shape, count) = parse_header(&name, &i.datatype, &i.shape, max_elements)?;
    let data = match (raw, i.contents) {
        (Some(raw), _) => TensorData::from_wire(&name, datatype, count, raw)?,
        (None, Some(c)) => typed(&name, datatype, count, c)?,
        (None, None) => return Err(Error::invalid(format!("input '{name}' has no contents"))),
    };
    Ok(Tensor::new(name, datatype, shape, data))
}

/// Typed contents: the repeated field the protocol gives the datatype, its length checked against
/// the shape's before a value is converted, range-checked, to little-endian.
fn typed(name: &str, dt: DataType, count: usize, c: InferTensorContents) -> Result<TensorData, Error> {
    fn given(name: &str, count: usize, len: usize) -> Result<(), Error> {
        match len == count {
            true => Ok(()),
            false => {
                Err(Error::invalid(format!("input '{name}': its shape holds {count} elements, contents have {len}")))
            }
        }
    }
    fn pack<U: Copy + Into<Number>>(name: &str, dt: DataType, count: usize, values: &[U]) -> Result<TensorData, Error> {
        given(name, count, values.len())?;
        let out = dispatch!(dt, T => {
            let mut out = Vec::with_capacity(values.len() * std::mem::size_of::<T>());
            for &v in values {
                T::from_number(v.into())
                    .ok_or_else(|| Error::invalid(format!("input '{name}': a value is out of range for {dt}")))?
                    .put_le(&mut out);
            }
            out
        }, bytes => unreachable!("BYTES have their own field"));
        Ok(TensorData::Fixed(out.into()))
    }
    match dt {
        DataType::Bool => pack(name, dt, count, &c.bool_contents),
        DataType::Int8 | DataType::Int16 | DataType::Int32 => pack(name, dt, count, &c.int_contents),
        DataType::Int64 => pack(name, dt, count, &c.int64_contents),
        DataType::Uint8 | DataType::Uint16 | DataType::Uint32 => pack(name, dt, count, &c.uint_contents),
        DataType::Uint64 => pack(name, dt, count, &c.uint64_contents),
        DataType::Fp32 => pack(name, dt, count, &c.fp32_contents),
        DataType::Fp64 => pack(name, dt, count, &c.fp64_contents),
        DataType::Bytes => {
            given(name, count, c.bytes_contents.len())?;
            Ok(TensorData::Strings(c.bytes_contents))
        }
        DataType::Fp16 | DataType::Bf16 => {
            Err(Error::invalid(format!("input '{name}': {dt} has no typed contents; send raw_input_contents")))
        }
    }
}

/// The bytes a request's inputs carry in the message (raw or typed).
pub fn input_bytes(req: &pb::ModelInferRequest) -> u64 {
    let typed = |c: &InferTensorContents| {
        let narrow = c.int_contents.len() + c.uint_contents.len() + c.fp32_contents.len();
        let wide = c.int64_contents.len() + c.uint64_contents.len() + c.fp64_contents.len();
        let strings = c.bytes_contents.iter().map(|b| 4 + b.len()).sum::<usize>();
        (c.bool_contents.len() + 4 * narrow + 8 * wide + strings) as u64
    };
    let raw = req.raw_input_contents.iter().map(|r| r.len() as u64).sum::<u64>();
    let typed = req.inputs.iter().filter_map(|i| i.contents.as_ref()).map(typed).sum::<u64>();
    raw.saturating_add(typed)
}

/// Checks each input's name, datatype and shape with `check` (the model's), before any input's
/// contents are converted or read from shared memory.
pub fn check_headers(
    req: &pb::ModelInferRequest,
    max_elements: usize,
    check: impl Fn(&str, DataType, &[usize]) -> Result<(), Error>,
) -> Result<(), Error> {
    ferrite_core::wire::check_tensor_counts(req.inputs.len(), req.outputs.len())?;
    for i in &req.inputs {
        let (datatype, shape, _) = parse_header(&i.name, &i.datatype, &i.shape, max_elements)?;
        check(&i.name, datatype, &shape)?;
    }
    Ok(())
}

/// The bytes the request's inputs ask to be read from shared memory (as their parameters say).
pub fn shared_input_bytes(req: &pb::ModelInferRequest) -> u64 {
    let size = |i: &InferInputTensor| match param(&i.parameters, "shared_memory_byte_size") {
        Some(Param::Uint(v)) => v,
        Some(Param::Int(v)) => v.max(0) as u64,
        _ => 0,
    };
    req.inputs.iter().map(size).fold(0, u64::saturating_add)
}

/// The requested outputs that name a shared-memory place.
pub fn shared_outputs(req: &pb::ModelInferRequest) -> Result<Vec<(String, Place)>, Error> {
    let place = |o: &pb::model_infer_request::InferRequestedOutputTensor| {
        Ok(Place::of(&o.name, |k| param(&o.parameters, k))?.map(|p| (o.name.clone(), p)))
    };
    req.outputs.iter().filter_map(|o| place(o).transpose()).collect()
}

/// The response; outputs in `shared` (already written there) come with their place's region and
/// size as parameters and an empty `raw_output_contents` entry, which keeps the entries in the
/// outputs' order (as Triton).
pub fn from_core(resp: InferResponse, final_flag: bool, shared: &[(String, Place)]) -> pb::ModelInferResponse {
    let mut parameters = HashMap::new();
    if final_flag {
        parameters.insert(
            "triton_final_response".to_string(),
            InferParameter { parameter_choice: Some(ParameterChoice::BoolParam(true)) },
        );
    }
    let place = |t: &Tensor| shared.iter().find(|(name, _)| *name == t.name).map(|(_, p)| p);
    let raw_output_contents =
        resp.outputs.iter().map(|t| if place(t).is_some() { Bytes::new() } else { t.data.to_wire() }).collect();
    let outputs = resp
        .outputs
        .iter()
        .map(|t| pb::model_infer_response::InferOutputTensor {
            parameters: place(t).map_or_else(HashMap::new, |p| {
                let string =
                    |s: &str| InferParameter { parameter_choice: Some(ParameterChoice::StringParam(s.into())) };
                let size =
                    InferParameter { parameter_choice: Some(ParameterChoice::Int64Param(t.data.wire_len() as i64)) };
                [("shared_memory_region".to_string(), string(&p.region)), ("shared_memory_byte_size".to_string(), size)]
                    .into()
            }),
            name: t.name.clone(),
            datatype: t.datatype.as_str().to_string(),
            shape: t.shape.iter().map(|&d| d as i64).collect(),
            ..Default::default()
        })
        .collect();
    pb::ModelInferResponse {
        model_name: resp.model_name,
        model_version: resp.model_version,
        id: resp.id.unwrap_or_default(),
        parameters,
        outputs,
        raw_output_contents,
    }
}

/// `versions`: every version of the model served now.
pub fn metadata(m: &Model, versions: &[u64]) -> pb::ModelMetadataResponse {
    let tensors = |specs: &[TensorSpec]| {
        specs
            .iter()
            .map(|t| pb::model_metadata_response::TensorMetadata {
                name: t.name.clone(),
                datatype: t.datatype.as_str().to_string(),
                shape: m.spec.wire_shape(t),
            })
            .collect()
    };
    pb::ModelMetadataResponse {
        name: m.spec.name.clone(),
        versions: versions.iter().map(u64::to_string).collect(),
        platform: m.spec.platform.to_string(),
        inputs: tensors(&m.spec.inputs),
        outputs: tensors(&m.spec.outputs),
    }
}

fn duration(d: ferrite_core::telemetry::stats::StatDuration) -> Option<pb::StatisticDuration> {
    Some(pb::StatisticDuration { count: d.count, ns: d.ns })
}

pub fn statistics(s: &StatsSnapshot) -> pb::ModelStatistics {
    let i = &s.inference_stats;
    pb::ModelStatistics {
        name: s.name.clone(),
        version: s.version.clone(),
        last_inference: s.last_inference,
        inference_count: s.inference_count,
        execution_count: s.execution_count,
        inference_stats: Some(pb::InferStatistics {
            success: duration(i.success),
            fail: duration(i.fail),
            queue: duration(i.queue),
            compute_input: duration(i.compute_input),
            compute_infer: duration(i.compute_infer),
            compute_output: duration(i.compute_output),
            cache_hit: duration(i.cache_hit),
            cache_miss: duration(i.cache_miss),
        }),
        batch_stats: s
            .batch_stats
            .iter()
            .map(|b| pb::InferBatchStatistics {
                batch_size: b.batch_size as u64,
                compute_input: duration(b.compute_input),
                compute_infer: duration(b.compute_infer),
                compute_output: duration(b.compute_output),
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pb::ModelInferRequest;

    fn tensor(name: &str, datatype: &str, shape: &[i64], contents: Option<InferTensorContents>) -> InferInputTensor {
        InferInputTensor {
            name: name.into(),
            datatype: datatype.into(),
            shape: shape.to_vec(),
            contents,
            ..Default::default()
        }
    }

    #[test]
    fn typed_and_raw_contents_give_the_same_tensor() {
        let typed = ModelInferRequest {
            inputs: vec![tensor(
                "x",
                "INT16",
                &[1, 2],
                Some(InferTensorContents { int_contents: vec![-3, 4], ..Default::default() }),
            )],
            ..Default::default()
        };
        let raw = ModelInferRequest {
            inputs: vec![tensor("x", "INT16", &[1, 2], None)],
            raw_input_contents: vec![Bytes::from_static(&[0xfd, 0xff, 4, 0])],
            ..Default::default()
        };
        assert_eq!(to_core(typed, 100, None).unwrap().inputs, to_core(raw, 100, None).unwrap().inputs);
    }

    #[test]
    fn a_requests_bytes_and_headers_are_read_without_its_contents() {
        let shared = |size: u64| {
            let choice = ParameterChoice::Uint64Param(size);
            [("shared_memory_byte_size".to_string(), InferParameter { parameter_choice: Some(choice) })].into()
        };
        let strings = InferTensorContents { bytes_contents: vec![Bytes::from_static(b"abc"); 2], ..Default::default() };
        let req = ModelInferRequest {
            inputs: vec![
                tensor("a", "BYTES", &[2], Some(strings)),
                tensor("b", "INT8", &[3], None),
                InferInputTensor { parameters: shared(1000), ..tensor("c", "FP32", &[250], None) },
                tensor(
                    "d",
                    "FP64",
                    &[2],
                    Some(InferTensorContents { fp64_contents: vec![1.0; 2], ..Default::default() }),
                ),
            ],
            raw_input_contents: vec![Bytes::from_static(&[1, 2, 3])],
            ..Default::default()
        };
        assert_eq!((input_bytes(&req), shared_input_bytes(&req)), (2 * (4 + 3) + 3 + 2 * 8, 1000));
        let seen = std::cell::RefCell::new(Vec::new());
        let check = |name: &str, dt, shape: &[usize]| {
            seen.borrow_mut().push((name.to_string(), dt, shape.to_vec()));
            match name {
                "c" => Err(Error::invalid("refused")),
                _ => Ok(()),
            }
        };
        assert_eq!(check_headers(&req, 1000, check).unwrap_err().to_string(), "refused");
        assert_eq!(
            *seen.borrow(),
            [
                ("a".into(), DataType::Bytes, vec![2]),
                ("b".into(), DataType::Int8, vec![3]),
                ("c".into(), DataType::Fp32, vec![250])
            ]
        );
        // A header the protocol refuses is refused as the conversion refuses it.
        let wide = ModelInferRequest { inputs: vec![tensor("x", "FP32", &[1000], None)], ..Default::default() };
        assert_eq!(check_headers(&wide, 100, |_, _, _| Ok(())).unwrap_err(), to_core(wide, 100, None).unwrap_err());
    }

    #[test]
    fn bad_contents_are_invalid_and_name_the_input() {
        let int8 = |v: Vec<i32>| Some(InferTensorContents { int_contents: v, ..Default::default() });
        let cases = [
            (
                ModelInferRequest { inputs: vec![tensor("x", "INT8", &[1], int8(vec![300]))], ..Default::default() },
                "out of range",
            ),
            (
                ModelInferRequest { inputs: vec![tensor("x", "INT8", &[2], int8(vec![1]))], ..Default::default() },
                "holds 2",
            ),
            // Counted before a value is converted: the count is what is wrong first.
            (
                ModelInferRequest { inputs: vec![tensor("x", "INT8", &[2], int8(vec![300]))], ..Default::default() },
                "holds 2",
            ),
            (
                ModelInferRequest { inputs: vec![tensor("x", "FP16", &[1], int8(vec![1]))], ..Default::default() },
                "raw_input_contents",
            ),
            (ModelInferRequest { inputs: vec![tensor("x", "INT8", &[1], None)], ..Default::default() }, "no contents"),
            (
                ModelInferRequest { inputs: vec![tensor("x", "INT8", &[-1], int8(vec![]))], ..Default::default() },
                "negative",
            ),
            (
                ModelInferRequest {
                    inputs: vec![tensor("x", "INT8", &[1], int8(vec![1]))],
                    raw_input_contents: vec![Bytes::from_static(&[1])],
                    ..Default::default()
                },
                "typed contents while raw",
            ),
            (
                ModelInferRequest {
                    inputs: vec![tensor("x", "INT8", &[1], None), tensor("y", "INT8", &[1], None)],
                    raw_input_contents: vec![Bytes::from_static(&[1])],
                    ..Default::default()
                },
                "one per input",
            ),
            (
                ModelInferRequest {
                    inputs: vec![tensor("x", "INT32", &[1], None)],
                    raw_input_contents: vec![Bytes::from_static(&[1, 2])],
                    ..Default::default()
                },
                "'x'",
            ),
        ];
        for (req, needle) in cases {
            let err = to_core(req, 100, None).unwrap_err();
            assert!(matches!(err, Error::InvalidInput(_)), "{err:?}");
            assert!(err.to_string().contains(needle), "{needle}: {err}");
        }
    }

    #[test]
    fn grpc_timeouts_become_microseconds() {
        let mut md = tonic::metadata::MetadataMap::new();
        for (v, us) in [
            ("5S", Some(4_998_000)),
            ("20m", Some(18_000)),
            ("7u", Some(1)),
            ("1500n", Some(1)),
            ("1H", Some(3_599_998_000)),
            ("x", None),
            ("5Q", None),
        ] {
            md.insert("grpc-timeout", v.parse().unwrap());
            assert_eq!(super::super::grpc_timeout_us(&md), us, "{v}");
        }
    }

    #[test]
    fn every_core_error_maps_to_its_code() {
        use tonic::Code;
        for (e, code) in [
            (Error::invalid("x"), Code::InvalidArgument),
            (Error::NotFound("x".into()), Code::NotFound),
            (Error::unavailable("x", None), Code::Unavailable),
            (Error::Overloaded { message: "x".into(), retry_after: None }, Code::ResourceExhausted),
            (Error::DeadlineExceeded("x".into()), Code::DeadlineExceeded),
            (Error::Unsupported("x".into()), Code::Unimplemented),
            (Error::internal("x"), Code::Internal),
        ] {
            assert_eq!(super::super::status(e).code(), code);
        }
    }

    #[test]
    fn refusals_carry_a_retry_hint() {
        use tonic_types::StatusExt;
        let after = std::time::Duration::from_secs(1);
        for e in [
            Error::unavailable("queue full", Some(after)),
            Error::Overloaded { message: "over the limit".into(), retry_after: Some(after) },
        ] {
            let s = super::super::status(e);
            assert_eq!(s.metadata().get("retry-after").unwrap(), "1");
            assert_eq!(s.get_details_retry_info().unwrap().retry_delay, Some(after));
        }
        assert!(super::super::status(Error::unavailable("x", None)).metadata().get("retry-after").is_none());
    }
}

#[cfg(test)]
mod fuzz {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

        /// Any message the wire can carry converts or is refused; it never panics.
        #[test]
        fn grpc_requests_never_panic(
            raw in proptest::collection::vec(any::<u8>(), 0..512),
            typed in proptest::collection::vec(any::<i32>(), 0..16),
            shape in proptest::collection::vec(-2i64..6, 0..4),
            dt in prop_oneof![Just("INT8"), Just("INT32"), Just("FP16"), Just("BYTES"), Just("BOOL"), Just("X")],
            use_raw in any::<bool>(),
        ) {
            // Decoding arbitrary bytes as a protobuf message must not panic either.
            let _ = <pb::ModelInferRequest as prost::Message>::decode(&raw[..]);
            let input = pb::model_infer_request::InferInputTensor {
                name: "x".into(),
                datatype: dt.into(),
                shape,
                contents: (!use_raw).then(|| InferTensorContents { int_contents: typed, ..Default::default() }),
                ..Default::default()
            };
            let req = pb::ModelInferRequest {
                inputs: vec![input],
                raw_input_contents: if use_raw { vec![Bytes::from(raw)] } else { vec![] },
                ..Default::default()
            };
            let _ = to_core(req, 1 << 16, None);
        }
    }
}
