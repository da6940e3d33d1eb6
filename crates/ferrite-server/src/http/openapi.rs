//! The OpenAPI 3 description of the HTTP API (`GET /v2/openapi.json`) and its documentation page
//! (`GET /docs`, self-contained: the page renders the description in the browser, and fetches
//! nothing else). Both come from the route table the router is built from ([`super::routes`]), so
//! every route served is described and nothing else is.

use std::borrow::Cow;

use serde_json::{json, Map, Value};
use utoipa::{
    openapi::{schema::Schema, RefOr},
    ToSchema,
};

/// One route as documented: method, path (`{name}` for path parameters), summary, the token scope
/// it needs when `--auth-token-file` is set, its request body and its answer.
pub struct Doc {
    pub method: &'static str,
    pub path: &'static str,
    pub summary: String,
    pub scope: Option<&'static str>,
    pub body: Option<Body>,
    pub answer: Body,
    /// The body of its error answers.
    pub error: Body,
}

type Schemas = Vec<(String, RefOr<Schema>)>;

/// A body as documented: a JSON type's derived schema, or text.
#[derive(Clone, Copy)]
pub enum Body {
    Json {
        name: fn() -> Cow<'static, str>,
        schema: fn() -> RefOr<Schema>,
        nested: fn(&mut Schemas),
    },
    Text,
    Html,
    /// No body at all (TEI's health answer).
    Empty,
}

/// The body `T` is (its schema derived from the type).
pub fn json<T: ToSchema>() -> Body {
    Body::Json { name: T::name, schema: T::schema, nested: T::schemas }
}

impl Body {
    /// The `content` of an answer with this body (none for `Empty`).
    fn content(self) -> Option<Value> {
        let kind = match self {
            Body::Json { .. } => "application/json",
            Body::Text => "text/plain",
            Body::Html => "text/html",
            Body::Empty => return None,
        };
        Some(json!({kind: {"schema": self.schema()}}))
    }

    fn schema(self) -> Value {
        match self {
            Body::Json { name, .. } => json!({"$ref": format!("#/components/schemas/{}", name())}),
            Body::Text | Body::Html | Body::Empty => json!({"type": "string"}),
        }
    }

    fn is<T: ToSchema>(self) -> bool {
        matches!(self, Body::Json { name, .. } if name() == T::name())
    }

    /// This body's schema and those it refers to, into `components`.
    fn collect(self, components: &mut Map<String, Value>) {
        let Body::Json { name, schema, nested } = self else { return };
        let mut all = vec![(name().into_owned(), schema())];
        nested(&mut all);
        for (name, schema) in all {
            components.entry(name).or_insert_with(|| serde_json::to_value(schema).unwrap_or_default());
        }
    }
}

/// The documentation page: plain HTML and script, rendering `/v2/openapi.json`.
pub const DOCS_PAGE: &str = include_str!("docs.html");
/// The live page of what this replica does (`/dashboard`), self-contained like the docs page.
pub const DASHBOARD_PAGE: &str = include_str!("dashboard.html");

/// The whole description, for the routes in `docs`.
pub fn document(docs: &[Doc]) -> Value {
    let mut paths = Map::new();
    let mut components = Map::new();
    for d in docs {
        let params: Vec<Value> = d
            .path
            .split('/')
            .filter_map(|seg| seg.strip_prefix('{').and_then(|s| s.strip_suffix('}')))
            .map(|name| json!({"name": name, "in": "path", "required": true, "schema": {"type": "string"}}))
            .collect();
        let mut responses = Map::new();
        let mut ok = json!({"description": "OK"});
        if let Some(content) = d.answer.content() {
            ok["content"] = content;
        }
        responses.insert("200".into(), ok);
        d.answer.collect(&mut components);
        d.error.collect(&mut components);
        let error = json!({"content": {"application/json": {"schema": d.error.schema()}}});
        if !params.is_empty() || d.body.is_some() {
            responses.insert("400".into(), json!({"description": "Invalid request", "content": error["content"]}));
        }
        // A model named in the path, or in the body of a request to one.
        if !params.is_empty() || (d.body.is_some() && !d.path.starts_with("/v2/repository")) {
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
            body.collect(&mut components);
            let inference = body.is::<super::json::JsonRequest<'_>>();
            let mut content = json!({"application/json": {"schema": body.schema()}});
            if inference {
                // Triton's binary tensor extension and MessagePack bodies.
                content["application/octet-stream"] = json!({"schema": {"type": "string", "format": "binary"}});
                content["application/msgpack"] = json!({"schema": {"type": "string", "format": "binary"}});
            }
            op["requestBody"] = json!({"required": inference, "content": content});
        }
        let entry = paths.entry(d.path.to_string()).or_insert_with(|| json!({}));
        entry[d.method] = op;
    }
    json!({
        "openapi": "3.1.0",
        "info": {
            "title": "Ferrite",
            "version": env!("CARGO_PKG_VERSION"),
            "description": "KServe V2 / Open Inference Protocol over HTTP, with Triton's extensions (binary tensors, classification, statistics, repository). /metrics is served on --metrics-port, and on the HTTP port with --metrics-on-http.",
        },
        "paths": paths,
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": components,
        },
    })
}

fn tag(path: &str) -> &'static str {
    if path.starts_with("/v2/health") || path == "/health" || path == "/ping" {
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
