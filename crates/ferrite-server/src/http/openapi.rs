//! The OpenAPI 3 description of the HTTP API (`GET /v2/openapi.json`) and its documentation page
//! (`GET /docs`, self-contained: the page renders the description in the browser, and fetches
//! nothing else). Both come from the route table the router is built from ([`super::routes`]), so
//! every route served is described and nothing else is.

use serde_json::{json, Map, Value};

/// One route as documented: method, path (`{name}` for path parameters), summary, the token scope
/// it needs when `--auth-token-file` is set, the schema of its JSON request body and of its answer.
pub struct Doc {
    pub method: &'static str,
    pub path: &'static str,
    pub summary: String,
    pub scope: Option<&'static str>,
    pub body: Option<&'static str>,
    pub answer: &'static str,
}

/// The documentation page: plain HTML and script, rendering `/v2/openapi.json`.
pub const DOCS_PAGE: &str = include_str!("docs.html");

fn schema(name: &str) -> Value {
    match name {
        "text" => json!({"type": "string"}),
        "html" => json!({"type": "string"}),
        other => json!({"$ref": format!("#/components/schemas/{other}")}),
    }
}

/// The whole description, for the routes in `docs`.
pub fn document(docs: &[Doc]) -> Value {
    let mut paths = Map::new();
    for d in docs {
        let params: Vec<Value> = d
            .path
            .split('/')
            .filter_map(|seg| seg.strip_prefix('{').and_then(|s| s.strip_suffix('}')))
            .map(|name| json!({"name": name, "in": "path", "required": true, "schema": {"type": "string"}}))
            .collect();
        let content_type = match d.answer {
            "text" => "text/plain",
            "html" => "text/html",
            _ => "application/json",
        };
        let mut responses = Map::new();
        responses.insert(
            "200".into(),
            json!({"description": "OK", "content": {content_type: {"schema": schema(d.answer)}}}),
        );
        let error = json!({"content": {"application/json": {"schema": schema("Error")}}});
        if !params.is_empty() || d.body.is_some() {
            responses.insert("400".into(), json!({"description": "Invalid request", "content": error["content"]}));
        }
        if !params.is_empty() {
            responses
                .insert("404".into(), json!({"description": "No such model or version", "content": error["content"]}));
        }
        if d.scope.is_some() {
            responses
                .insert("401".into(), json!({"description": "No valid bearer token", "content": error["content"]}));
            responses
                .insert("403".into(), json!({"description": "The token lacks the scope", "content": error["content"]}));
        }
        let mut op = json!({
            "summary": d.summary,
            "operationId": format!("{}{}", d.method, d.path.replace(['/', '{', '}', '.'], "_")),
            "tags": [tag(d.path)],
            "parameters": params,
            "responses": responses,
        });
        if let Some(scope) = d.scope {
            op["security"] = json!([{"bearer": []}, {}]);
            op["x-ferrite-scope"] = json!(scope);
        }
        if let Some(body) = d.body {
            let mut content = json!({"application/json": {"schema": schema(body)}});
            if body == "InferenceRequest" {
                // Triton's binary tensor extension and MessagePack bodies.
                content["application/octet-stream"] = json!({"schema": {"type": "string", "format": "binary"}});
                content["application/msgpack"] = json!({"schema": {"type": "string", "format": "binary"}});
            }
            op["requestBody"] = json!({"required": body == "InferenceRequest", "content": content});
        }
        let entry = paths.entry(d.path.to_string()).or_insert_with(|| json!({}));
        entry[d.method] = op;
    }
    json!({
        "openapi": "3.0.3",
        "info": {
            "title": "Ferrite",
            "version": env!("CARGO_PKG_VERSION"),
            "description": "KServe V2 / Open Inference Protocol over HTTP, with Triton's extensions (binary tensors, classification, statistics, repository). /metrics is served on --metrics-port, and on the HTTP port with --metrics-on-http.",
        },
        "paths": paths,
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": schemas(),
        },
    })
}

fn tag(path: &str) -> &'static str {
    if path.starts_with("/v2/health") {
        "health"
    } else if path.starts_with("/v2/repository") {
        "repository"
    } else if path.starts_with("/v2/models") {
        "models"
    } else if path == "/metrics" {
        "metrics"
    } else {
        "server"
    }
}

fn schemas() -> Value {
    let tensor = json!({
        "type": "object",
        "required": ["name", "shape", "datatype"],
        "properties": {
            "name": {"type": "string"},
            "shape": {"type": "array", "items": {"type": "integer", "format": "int64"}},
            "datatype": {"type": "string", "enum": ["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP16", "BF16", "FP32", "FP64", "BYTES"]},
            "parameters": {"$ref": "#/components/schemas/Parameters"},
            "data": {"type": "array", "items": {}, "description": "Row-major elements (nested lists are accepted)"},
        },
    });
    let meta_tensor = json!({
        "type": "object",
        "properties": {"name": {"type": "string"}, "datatype": {"type": "string"}, "shape": {"type": "array", "items": {"type": "integer"}}},
    });
    json!({
        "Parameters": {"type": "object", "additionalProperties": {}},
        "Error": {"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}},
        "Live": {"type": "object", "properties": {"live": {"type": "boolean"}}},
        "Ready": {"type": "object", "properties": {"ready": {"type": "boolean"}}},
        "ServerMetadata": {"type": "object", "properties": {
            "name": {"type": "string"}, "version": {"type": "string"}, "extensions": {"type": "array", "items": {"type": "string"}}}},
        "ModelMetadata": {"type": "object", "properties": {
            "name": {"type": "string"}, "versions": {"type": "array", "items": {"type": "string"}}, "platform": {"type": "string"},
            "inputs": {"type": "array", "items": meta_tensor}, "outputs": {"type": "array", "items": meta_tensor}}},
        "ModelConfig": {"type": "object", "description": "Triton's model configuration (model_config.proto) in JSON, resolved"},
        "Statistics": {"type": "object", "properties": {"model_stats": {"type": "array", "items": {"type": "object"}}}},
        "InferenceRequest": {"type": "object", "required": ["inputs"], "properties": {
            "id": {"type": "string"}, "parameters": {"$ref": "#/components/schemas/Parameters"},
            "inputs": {"type": "array", "items": tensor},
            "outputs": {"type": "array", "items": {"type": "object", "required": ["name"], "properties": {
                "name": {"type": "string"}, "parameters": {"$ref": "#/components/schemas/Parameters"}}}}}},
        "InferenceResponse": {"type": "object", "properties": {
            "model_name": {"type": "string"}, "model_version": {"type": "string"}, "id": {"type": "string"},
            "parameters": {"$ref": "#/components/schemas/Parameters"}, "outputs": {"type": "array", "items": tensor}}},
        "RepositoryIndexRequest": {"type": "object", "properties": {"ready": {"type": "boolean"}}},
        "RepositoryIndex": {"type": "array", "items": {"type": "object", "properties": {
            "name": {"type": "string"}, "version": {"type": "string"}, "state": {"type": "string"}, "reason": {"type": "string"}}}},
        "RepositoryRequest": {"type": "object", "properties": {"parameters": {"$ref": "#/components/schemas/Parameters"}}},
        "Empty": {"type": "object"},
        "OpenAiEmbeddingRequest": {"type": "object", "required": ["input", "model"], "properties": {
            "input": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
            "model": {"type": "string"}, "encoding_format": {"type": "string", "enum": ["float", "base64"]},
            "dimensions": {"type": "integer"}, "user": {"type": "string"}}},
        "OpenAiEmbeddingResponse": {"type": "object", "properties": {
            "object": {"type": "string"}, "model": {"type": "string"},
            "data": {"type": "array", "items": {"type": "object", "properties": {
                "object": {"type": "string"}, "index": {"type": "integer"},
                "embedding": {"oneOf": [{"type": "array", "items": {"type": "number"}}, {"type": "string"}]}}}},
            "usage": {"type": "object", "properties": {"prompt_tokens": {"type": "integer"}, "total_tokens": {"type": "integer"}}}}},
        "TeiEmbedRequest": {"type": "object", "required": ["inputs"], "properties": {
            "inputs": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
            "normalize": {"type": "boolean"}, "truncate": {"type": "boolean"}, "model": {"type": "string"}}},
        "TeiEmbedResponse": {"type": "array", "items": {"type": "array", "items": {"type": "number"}}},
        "OpenApi": {"type": "object", "description": "This document"},
    })
}
