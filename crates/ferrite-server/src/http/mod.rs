//! KServe V2 / Open Inference Protocol over HTTP/REST.

mod bodies;
pub(crate) mod decode;
mod error;
pub(crate) mod json;
pub(crate) mod msgpack;
pub mod openapi;
pub mod pool;
mod texts;

use axum::{
    body::Bytes,
    extract::{DefaultBodyLimit, FromRequest, Path, State},
    http::{header, HeaderMap, HeaderName, HeaderValue, StatusCode},
    response::{IntoResponse, Response},
    routing::{get, post, MethodRouter},
    Json, Router,
};
use ferrite_core::{Core, Model};

use crate::{
    auth::{Acting, Auth, Denied, Scope},
    budget::{Budget, HeldFor, Reserved},
    places::{Place, Places},
};
use serde::Deserialize;
use serde_json::Value;
use std::{sync::Arc, time::Duration};

pub use error::ApiError;

#[derive(Clone)]
pub struct AppState {
    pub core: Core,
    /// Triton's system shared-memory regions, shared with the gRPC listener.
    pub shm: Arc<crate::shm::Regions>,
    /// The bytes in flight (`HttpLimits::body_budget`): what a body decodes to beyond its bytes.
    pub budget: Arc<Budget>,
}

/// Limits the HTTP front-end applies before anything reaches the core.
#[derive(Debug, Clone)]
pub struct HttpLimits {
    /// Largest body, as sent and (gzip/deflate) once decompressed.
    pub max_body_bytes: usize,
    /// Time a client has, from accept, to send its first byte (and its TLS handshake and request
    /// head); a connection that says nothing is closed.
    pub header_timeout: Duration,
    /// Time a client has to send its whole body.
    pub body_timeout: Duration,
    /// Time a connection may stay open with no request in flight (keep-alive, HTTP/2 pings), or
    /// with its writes making no progress (a client not reading its answers).
    pub idle_timeout: Duration,
    /// Connections a listener holds at once; past it, new ones are closed at once.
    pub max_connections: usize,
    /// Concurrent HTTP/2 streams per connection.
    pub max_streams: u32,
    /// Bytes of request bodies all requests may hold at once (as sent, and again once
    /// decompressed), charged as they arrive, and of answers until written; past it (or past the
    /// request's tenant's share of it), 503 with Retry-After.
    pub body_budget: Arc<Budget>,
}

impl HttpLimits {
    pub fn new(max_body_bytes: usize) -> HttpLimits {
        HttpLimits {
            max_body_bytes,
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(60),
            max_connections: default_max_connections(),
            max_streams: 1024,
            body_budget: Budget::new(DEFAULT_BODY_BUDGET),
        }
    }
}

/// An HTTP/1 connection's read buffer, at most: also the largest request head (past it, 431).
/// hyper's default, about 400 KiB, is what each connection of a client sending large bodies kept:
/// 128 connections sending a detector's 1.2 MB images held about 100 MB more at peak than with
/// 64 KiB (`bench/results/read-buffer-ab.md`); the bodies themselves are copied out as they come.
pub const READ_BUFFER: usize = 64 << 10;

/// Bytes of bodies in flight at once, by default: 16 largest bodies (64 MiB each by default).
pub const DEFAULT_BODY_BUDGET: usize = 1 << 30;

/// Connections per listener, by default: what the open-files limit leaves room for beside the
/// other listeners, model files and the runtime (a quarter of it, at most 10,000).
pub fn default_max_connections() -> usize {
    let mut limit = libc_rlimit_nofile();
    if limit == 0 {
        limit = 1024;
    }
    (limit / 4).clamp(16, 10_000)
}

pub(crate) fn libc_rlimit_nofile() -> usize {
    // /proc/self/limits: "Max open files  <soft>  <hard>  files".
    std::fs::read_to_string("/proc/self/limits")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("Max open files"))
                .and_then(|l| l.split_whitespace().nth(3).and_then(|v| v.parse().ok()))
        })
        .unwrap_or(0)
}

/// Reads the whole body before any handler runs: within `body_timeout` (a slow sender gets 408),
/// at most `max_body_bytes` (413), and a gzip or deflate body decompressed to at most the same cap
/// (so a compression bomb costs no more memory than a plain body).
async fn read_body(
    State((limits, core)): State<(Arc<HttpLimits>, Core)>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let (mut parts, body) = req.into_parts();
    let max = limits.max_body_bytes;
    // The body's own length when the framing says it (no body at all: 0), else the header's.
    let stated = usize::try_from(axum::body::HttpBody::size_hint(&body).exact().unwrap_or(u64::MAX))
        .ok()
        .filter(|&n| n != usize::MAX)
        .or_else(|| content_length(&parts.headers));
    // The body's bytes are held in the budget of all requests as they arrive, before they are
    // kept, so many large bodies at once cannot exhaust memory; a client that states a large
    // body and trickles it holds only what it has sent (holding what it said it would send, a
    // few such heads held the whole budget for the body timeout). Within the share of the tenant
    // the request acts for (one refused by the handler later counts as no tenant's); the handler
    // reads it from the extensions.
    let acting = Acting::of(&parts.extensions, core.tenants(), |h| parts.headers.get(h).and_then(|v| v.to_str().ok()));
    let budget = &limits.body_budget;
    // A body stated larger than the budget can spare now is refused before any of it is read
    // (one stated over `max` is read up to it and refused then: clients expect an answer after
    // their body, not a connection closed while they send it).
    let stated_held = stated.unwrap_or(0).min(max);
    if !budget.fits(acting.share(), stated_held) {
        return ApiError::from(budget.refusal(acting.share(), stated_held, HeldFor::Request)).into_response();
    }
    let mut reserved = budget.taken(acting.share(), 0);
    let read = pool::BODIES.read(body, max, stated, &mut reserved);
    let bytes = match tokio::time::timeout(limits.body_timeout, read).await {
        Err(_) => {
            let msg = format!("the request body did not arrive within {} s", limits.body_timeout.as_secs());
            return ApiError::new(StatusCode::REQUEST_TIMEOUT, msg).into_response();
        }
        Ok(Err(pool::ReadError::TooLarge)) => return body_too_large(max),
        Ok(Err(pool::ReadError::OverBudget(e))) => return ApiError::from(e).into_response(),
        Ok(Err(pool::ReadError::Failed(e))) => {
            return ApiError::bad_request(format!("cannot read the request body: {e}")).into_response()
        }
        Ok(Ok(b)) => b,
    };
    let encoding = parts.headers.remove(header::CONTENT_ENCODING);
    // Decompression runs on the blocking pool, a few bodies at a time (`DECOMPRESSING`): it is
    // CPU work of up to --max-body-bytes (a few KB of gzip can ask for 64 MiB). What it writes
    // is held beside the compressed bytes as it is written. A body that comes to little (most
    // compressed requests) is decompressed here first (`INFLATED_HERE`).
    let bytes = match encoding.as_ref().map(|v| v.to_str().unwrap_or("?").trim().to_ascii_lowercase()).as_deref() {
        None | Some("identity") => Ok(bytes),
        Some(coding @ ("gzip" | "deflate")) => {
            let gzip = coding == "gzip";
            let busy = "too many compressed bodies are being decompressed on this server; retry shortly";
            let wait = limits.body_timeout;
            let (out, held, place) =
                match decompress_in_turn(gzip, bytes, max, reserved, acting.share(), wait, busy).await {
                    Ok(inflated) => inflated,
                    Err(e) => return ApiError::from(e).into_response(),
                };
            reserved = held;
            if let (Ok(_), Some(place)) = (&out, place) {
                // Kept for the handler to read the body under (`Decompressed`).
                parts.extensions.insert(Decompressed { _place: Arc::new(place) });
            }
            match out {
                Ok(out) => Ok(out),
                Err(Inflate::TooLarge) => {
                    let msg = format!("decompressed body is over {max} bytes");
                    Err(ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, msg).into_response())
                }
                Err(Inflate::OverBudget(e, _)) => Err(ApiError::from(e).into_response()),
                Err(Inflate::Corrupt(e)) => {
                    Err(ApiError::bad_request(format!("cannot decompress the request body: {e}")).into_response())
                }
                // Not read by anyone: the request's future is gone.
                Err(Inflate::Unwanted) => Err(StatusCode::REQUEST_TIMEOUT.into_response()),
            }
        }
        Some(other) => Err(ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            format!("Content-Encoding '{other}' is not accepted (gzip, deflate or identity)"),
        )
        .into_response()),
    };
    let bytes = match bytes {
        Ok(b) => b,
        Err(resp) => return resp,
    };
    // The length read (a decompressed body's, a chunked one's), unless the header says it already.
    if content_length(&parts.headers) != Some(bytes.len()) {
        parts.headers.insert(header::CONTENT_LENGTH, HeaderValue::from(bytes.len()));
    }
    parts.extensions.insert(acting);
    let resp = next.run(axum::extract::Request::from_parts(parts, axum::body::Body::from(bytes))).await;
    hold_answer(resp, reserved)
}

/// An answer holds its bytes of the budget (its request's reservation, and more if the answer is
/// larger: the request's bytes are gone by now; at least a KiB) until written or its connection
/// closed: answers a client does not read (or, over HTTP/2, opens no window for) count against
/// what all requests (and its tenant's) may hold, so many of them, large or small, cannot exhaust
/// memory. One the budget cannot take is not kept: 503, its memory freed at once (413 when it is
/// more than the budget could ever hold).
fn hold_answer(resp: Response, mut held: Reserved) -> Response {
    let bytes =
        axum::body::HttpBody::size_hint(resp.body()).exact().map_or(0, |n| usize::try_from(n).unwrap_or(usize::MAX));
    if let Err(e) = held.hold(bytes, HeldFor::Answer) {
        return ApiError::from(e).into_response();
    }
    if held.is_empty() {
        return resp;
    }
    resp.map(|inner| axum::body::Body::new(Holding { inner, held: Some(held) }))
}

/// Why an answer was refused (HTTP and gRPC).
pub(crate) const ANSWERS_OVER_BUDGET: &str =
    "too many answer bytes in flight on this server, held for clients that have not taken them; retry shortly";

/// A body whose bytes hold its bytes of the budget until the last of them has been written (or
/// its connection is gone): hyper drops a body once it has its last bytes, before they are sent.
/// Its last frame carries the reservation (`budget::holding`): a connection writes a body's
/// frames in order, so the earlier ones are gone before it.
struct Holding {
    inner: axum::body::Body,
    held: Option<Reserved>,
}

impl axum::body::HttpBody for Holding {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, axum::Error>>> {
        let this = self.get_mut();
        let frame = std::task::ready!(std::pin::Pin::new(&mut this.inner).poll_frame(cx));
        let last = this.inner.is_end_stream();
        let held = &mut this.held;
        std::task::Poll::Ready(frame.map(|f| {
            f.map(|f| {
                f.map_data(|b| match held.take_if(|_| last) {
                    Some(held) => crate::budget::holding(b, held),
                    None => b,
                })
            })
        }))
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// The Content-Length header's value, when it is a number.
fn content_length(headers: &axum::http::HeaderMap) -> Option<usize> {
    headers.get(header::CONTENT_LENGTH)?.to_str().ok()?.parse().ok()
}

/// Bodies larger than this are decoded, and responses larger than this encoded, on the blocking
/// pool, so a few large requests cannot hold the async I/O threads every other request needs.
pub(crate) const OFFLOAD_BYTES: usize = 256 << 10;

/// Runs `work` on the blocking pool when `large`, else here (HTTP's and gRPC's large bodies and
/// shared-memory tensors alike), at most as many at once as there are cores (`WORKING`), the
/// requests of one `share` (`Acting::share`) at most half of them.
pub(crate) async fn off_io<T: Send + 'static>(
    large: bool,
    share: Option<&str>,
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<T, ferrite_core::Error> {
    if !large {
        return Ok(work());
    }
    let place = WORKING.take(share).await;
    tokio::task::spawn_blocking(move || {
        let _place = place;
        work()
    })
    .await
    .map_err(|e| ferrite_core::Error::internal(format!("a blocking task failed: {e}")))
}

/// Large bodies decoded (and answers encoded) at once: one a core. What a body decodes to may be
/// many times its bytes (8 MiB of JSON empty strings is a BYTES tensor of 90 MB), and the bytes in
/// flight bound how many bodies are held, not how many are decoded at once: sixteen such bodies
/// decoded together took 1 GB, one a core 0.29 GB, in the same time; more at once than there are
/// cores are no faster. The work holds its place (not the future awaiting it, which its client
/// may drop); a tenant's flood of them waits behind itself (`Places`).
static WORKING: std::sync::LazyLock<Places> =
    std::sync::LazyLock::new(|| Places::new(std::thread::available_parallelism().map_or(1, |n| n.get())));

/// What a compressed body (or gRPC message) may come to and be decompressed on the I/O thread, at
/// once, without a place among those decompressing (about 0.1 ms of a core): a small request would
/// otherwise wait for the body in progress, whatever it costs (another tenant's gzip body of 64 MiB
/// of JSON held the one place of two cores for 0.44 s). One that comes to more is decompressed
/// again, from the start, in its turn.
const INFLATED_HERE: usize = 64 << 10;

/// Bodies decompressed at once: a quarter of the cores, at least one. A few KB of gzip can ask for
/// `--max-body-bytes` of output (64 MiB: about 0.05 s of a core, release build), so a flood of
/// them, far cheaper to send than to decompress, must leave the models most of the cores (one of
/// two): past these, bodies wait their turn (within the body timeout; 503 after), a tenant's
/// behind its own (`Places`).
static DECOMPRESSING: std::sync::LazyLock<Places> =
    std::sync::LazyLock::new(|| Places::new(std::thread::available_parallelism().map_or(1, |n| n.get()) / 4));

/// Why compressed bytes could not be decompressed.
pub(crate) enum Inflate {
    /// Past `max` bytes.
    TooLarge,
    /// Past the bytes in flight all requests (or its tenant's) may hold, now or ever: why, and
    /// the bytes it asked to hold.
    OverBudget(ferrite_core::Error, usize),
    Corrupt(std::io::Error),
    /// Stopped: no one awaits the output any more (its client left).
    Unwanted,
}

/// A decompressed body's place among those decompressing (`DECOMPRESSING`), in its request's
/// extensions: a handler that reads the body (V2 infer) holds it until it has, so the work
/// proportional to the decompressed bytes is bound with the decompression (a body of 64 MiB of
/// JSON whitespace, a few KB of gzip, took longer to read than to decompress, and the reads ran
/// as many at once as bodies came); handlers that do not take it let it go with the request's
/// parts.
#[derive(Clone)]
pub(crate) struct Decompressed {
    _place: Arc<Place>,
}

/// A JSON API's body (the text and repository APIs', a region's registration), with its
/// decompression place: parsed off the I/O threads when large, under that place, as V2 infer
/// bodies are (a 64 MiB text API body took seconds of an I/O thread to parse).
pub(crate) struct JsonBody {
    body: Bytes,
    place: Option<Decompressed>,
    /// Whose place its parse takes (`Acting::share`).
    share: Option<String>,
}

impl<S: Send + Sync> FromRequest<S> for JsonBody {
    type Rejection = Response;

    async fn from_request(req: axum::extract::Request, state: &S) -> Result<Self, Response> {
        let place = req.extensions().get::<Decompressed>().cloned();
        let share = req.extensions().get::<Acting>().and_then(|a| a.share().map(str::to_string));
        let body = Bytes::from_request(req, state).await.map_err(IntoResponse::into_response)?;
        Ok(JsonBody { body, place, share })
    }
}

impl JsonBody {
    /// The body as a `T`, or 400 with serde's reason.
    pub(crate) async fn parse<T: serde::de::DeserializeOwned + Send + 'static>(self) -> Result<T, ApiError> {
        self.read("invalid request body", None).await
    }

    /// `parse`, a body that may be left out (empty or whitespace: the type's default), 400 saying
    /// `what` it is.
    async fn parse_optional<T: serde::de::DeserializeOwned + Default + Send + 'static>(
        self,
        what: &'static str,
    ) -> Result<T, ApiError> {
        self.read(what, Some(T::default)).await
    }

    async fn read<T: serde::de::DeserializeOwned + Send + 'static>(
        self,
        what: &'static str,
        left_out: Option<fn() -> T>,
    ) -> Result<T, ApiError> {
        let JsonBody { body, place, share } = self;
        off_io(body.len() > OFFLOAD_BYTES, share.as_deref(), move || {
            let _place = place;
            match left_out {
                Some(default) if body.iter().all(u8::is_ascii_whitespace) => Ok(default()),
                _ => serde_json::from_slice(&body).map_err(|e| ApiError::bad_request(format!("{what}: {e}"))),
            }
        })
        .await?
    }
}

/// Held by the future that awaits work on the blocking pool: dropped with it (its client left),
/// it tells the work, which holds the flag, to stop. A decompression's slot is held by the work,
/// not the future: freed with a dropped future, it let the next body start while the first still
/// ran, so bodies whose clients sent them and left ran two cores of two.
pub(crate) struct Awaited(Arc<std::sync::atomic::AtomicBool>);

impl Awaited {
    /// The guard, and the flag for the work: true while the guard lives.
    pub(crate) fn new() -> (Awaited, Arc<std::sync::atomic::AtomicBool>) {
        let wanted = Arc::new(std::sync::atomic::AtomicBool::new(true));
        (Awaited(wanted.clone()), wanted)
    }
}

impl Drop for Awaited {
    fn drop(&mut self) {
        self.0.store(false, std::sync::atomic::Ordering::Relaxed);
    }
}

/// gzip (else zlib's deflate) `compressed` bytes decompressed (`decompress`), at once if they come to
/// at most `INFLATED_HERE`, else in their turn among those decompressing (`DECOMPRESSING`, a
/// `share`'s behind its own), on the blocking pool: with `held`, and the place taken, held by the
/// work until it is done (an HTTP body is read under it). No place within `wait`: unavailable,
/// saying `busy` (HTTP bodies and gRPC messages).
pub(crate) async fn decompress_in_turn<B: AsRef<[u8]> + Send + 'static>(
    gzip: bool,
    compressed: B,
    max: usize,
    mut held: Reserved,
    share: Option<&str>,
    wait: Duration,
    busy: &str,
) -> Result<(Result<Bytes, Inflate>, Reserved, Option<Place>), ferrite_core::Error> {
    let here = max.min(INFLATED_HERE);
    match decompress(gzip, compressed.as_ref(), here, &mut held, &std::sync::atomic::AtomicBool::new(true)) {
        Err(Inflate::TooLarge) if here < max => {}
        out => return Ok((out, held, None)),
    }
    let place = tokio::time::timeout(wait, DECOMPRESSING.take(share))
        .await
        .map_err(|_| ferrite_core::Error::unavailable(busy, Some(ferrite_core::wire::RETRY_AFTER)))?;
    let (_awaited, wanted) = Awaited::new();
    off_io(true, share, move || {
        let out = decompress(gzip, compressed.as_ref(), max, &mut held, &wanted);
        (out, held, Some(place))
    })
    .await
}

/// gzip (else zlib's deflate) `compressed` bytes decompressed, at most `max` bytes, each buffer it
/// grows into held in `held` (beside the compressed bytes) before it is written, while `wanted`
/// (see `Awaited`; HTTP bodies and gRPC messages).
pub(crate) fn decompress(
    gzip: bool,
    compressed: &[u8],
    max: usize,
    held: &mut Reserved,
    wanted: &std::sync::atomic::AtomicBool,
) -> Result<Bytes, Inflate> {
    let len = compressed.len();
    if gzip {
        inflate(flate2::read::GzDecoder::new(compressed), max, len, held, wanted)
    } else {
        inflate(flate2::read::ZlibDecoder::new(compressed), max, len, held, wanted)
    }
}

fn inflate(
    decoder: impl std::io::Read,
    max: usize,
    compressed: usize,
    held: &mut Reserved,
    wanted: &std::sync::atomic::AtomicBool,
) -> Result<Bytes, Inflate> {
    use std::io::Read;
    const STEP: usize = 64 << 10;
    let mut decoder = decoder.take(max as u64 + 1);
    let mut out = Vec::new();
    loop {
        let at = out.len();
        if out.capacity() == at {
            // Doubled, up to what `max` allows (a byte past it tells a body over it).
            out.reserve_exact(at.max(STEP).min(max + 1 - at));
            let want = compressed + out.capacity();
            held.hold(want, HeldFor::Request).map_err(|e| Inflate::OverBudget(e, want))?;
        }
        out.resize(out.capacity().min(at + STEP), 0);
        let n = decoder.read(&mut out[at..]).map_err(Inflate::Corrupt)?;
        out.truncate(at + n);
        if n == 0 {
            break;
        }
        if out.len() > max {
            return Err(Inflate::TooLarge);
        }
        if !wanted.load(std::sync::atomic::Ordering::Relaxed) {
            return Err(Inflate::Unwanted);
        }
    }
    Ok(out.into())
}

fn body_too_large(max: usize) -> Response {
    ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, format!("request body is over {max} bytes")).into_response()
}

/// Why a request body was refused before or while it was read.
pub(crate) const BODIES_OVER_BUDGET: &str = "too many request bytes in flight on this server; retry shortly";

/// `GET /metrics` in the Prometheus text format (served on its own port, and on the HTTP port
/// when asked).
pub fn metrics_app(core: Core) -> Router {
    let budget = Budget::new(0);
    let shm = Arc::new(crate::shm::Regions::new(false, 0, budget.clone()));
    Router::new().route("/metrics", get(metrics)).with_state(AppState { core, shm, budget })
}

/// Requires a bearer token with the route's scope on every route of `router`: `/metrics` and the
/// statistics need `metrics`, the repository API `admin`, health nothing when `allow_health`, everything else
/// `infer`.
pub fn protect(router: Router, auth: Arc<Auth>) -> Router {
    router.layer(axum::middleware::from_fn(move |req: axum::extract::Request, next: axum::middleware::Next| {
        let auth = auth.clone();
        async move {
            let path = req.uri().path();
            // Statistics count every tenant's requests and cache hits: an operator's view, not a
            // client's (with per-tenant cache keys they no longer tell what another sent, but they
            // still tell when and how much).
            let scope = if path == "/metrics" || path == "/dashboard/metrics" || path.ends_with("/stats") {
                Scope::Metrics
            } else if path.starts_with("/v2/repository") {
                Scope::Admin
            } else if (is_health(&req) && auth.allow_health) || path == "/dashboard" {
                // The dashboard is a static page with no data in it: a browser cannot send a
                // token to load it, and the page sends the one its operator types on its own calls.
                return next.run(req).await;
            } else {
                Scope::Infer
            };
            let header = req.headers().get(header::AUTHORIZATION).and_then(|v| v.to_str().ok());
            match auth.check(header, scope) {
                Ok(principal) => {
                    let mut req = req;
                    req.extensions_mut().insert(principal);
                    next.run(req).await
                }
                Err(Denied::Unauthenticated) => {
                    let mut resp =
                        ApiError::new(StatusCode::UNAUTHORIZED, "a valid bearer token is required").into_response();
                    resp.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
                    resp
                }
                Err(Denied::Forbidden) => {
                    ApiError::new(StatusCode::FORBIDDEN, "the token lacks the scope this route needs").into_response()
                }
            }
        }
    }))
}

/// The health routes: the V2 protocol's, and TEI's (`GET /health`, `/ping`, `/`).
fn is_health(req: &axum::extract::Request) -> bool {
    let path = req.uri().path();
    path.starts_with("/v2/health/")
        || (req.method() == axum::http::Method::GET && matches!(path, "/health" | "/ping" | "/"))
}

async fn metrics(State(s): State<AppState>) -> Response {
    let body = s.core.metrics();
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], body).into_response()
}

/// Every route of the HTTP API, each with its description: `app` serves these, and
/// `/v2/openapi.json` describes exactly these (and `/metrics`, served by `metrics_app`).
fn routes() -> Vec<(openapi::Doc, MethodRouter<AppState>)> {
    use bodies as b;
    use openapi::{json, Body, Doc};
    let doc = |method, path, summary: &str, scope, body, answer| Doc {
        method,
        path,
        summary: summary.to_string(),
        scope,
        body,
        answer,
        error: json::<b::Error>(),
    };
    let (user, admin) = (Some("infer"), Some("admin"));
    let tei = |path, summary: &str, body, answer| Doc {
        error: json::<b::TeiError>(),
        ..doc("post", path, summary, user, Some(body), answer)
    };
    let tei_get = |path, summary: &str| Doc {
        error: json::<b::TeiError>(),
        ..doc("get", path, summary, user, None, Body::Empty)
    };
    let live = || async { axum::Json(b::Live { live: true }) };
    let mut routes = vec![
        (doc("get", "/v2", "Server metadata: name, version, extensions", user, None, json::<b::ServerMetadata>()), get(server_metadata)),
        (doc("get", "/v2/health/live", "Liveness: 200 while the process serves (no token with --auth-allow-health)", user, None, json::<b::Live>()), get(live)),
        (doc("get", "/v2/health/ready", "Readiness: 200 when the models are loaded, 503 while loading or draining (no token with --auth-allow-health)", user, None, json::<b::Ready>()), get(server_ready)),
        (doc("get", "/v2/models/stats", "Statistics of every model (Triton's statistics extension)", user, None, json::<b::Statistics>()), get(all_stats)),
        (doc("post", "/v2/repository/index", "Every model on disk or served: each version's state and reason", admin, Some(json::<b::RepositoryIndexRequest>()), json::<b::RepositoryIndex>()), post(repository_index)),
        (doc("post", "/v2/repository/models/{model}/load", "Loads or reloads a model from the repository (explicit mode)", admin, Some(json::<b::RepositoryRequest>()), json::<b::Empty>()), post(repository_load)),
        (doc("post", "/v2/repository/models/{model}/unload", "Stops serving a model (explicit mode)", admin, Some(json::<b::RepositoryRequest>()), json::<b::Empty>()), post(repository_unload)),
        (doc("post", "/v2/repository/models/{model}/promote", "Makes a model's canary candidate its stable version (explicit mode)", admin, None, json::<b::Empty>()), post(repository_promote)),
        (Doc { error: json::<b::OpenAiError>(), ..doc("post", "/v1/embeddings", "OpenAI's embeddings API, answered by a text pipeline of task embed (model = its name)", user, Some(json::<texts::OpenAiRequest>()), json::<b::OpenAiEmbeddingResponse>()) }, post(texts::openai)),
        (Doc { error: json::<b::OpenAiError>(), ..doc("post", "/v1/rerank", "Cohere's and Jina's rerank API, answered by a text pipeline of task rerank (model optional with one)", user, Some(json::<texts::CohereRerankRequest>()), json::<b::RerankResponse>()) }, post(texts::cohere_rerank)),
        (tei("/embed", "Hugging Face TEI's embed API, answered by the one pipeline of task embed (or the one named in model)", json::<texts::TeiEmbedRequest>(), json::<b::TeiEmbedResponse>()), post(texts::embed)),
        (tei("/embed_sparse", "TEI's sparse embed API: the entries of each text's SPLADE vector that are not zero, from a Hugging Face *ForMaskedLM directory (424 from another model)", json::<texts::TeiEmbedTextsRequest>(), json::<b::TeiEmbedSparseResponse>()), post(texts::embed_sparse)),
        (tei("/embed_all", "TEI's token embeddings API: per text, the hidden state of each token it took (special tokens included), from a text pipeline that pools them (424 from a SPLADE model)", json::<texts::TeiEmbedTextsRequest>(), json::<b::TeiEmbedAllResponse>()), post(texts::embed_all)),
        (tei("/rerank", "TEI's rerank API: passages scored for a query by a pipeline of task rerank, highest first", json::<texts::TeiRerankRequest>(), json::<b::TeiRerankResponse>()), post(texts::rerank)),
        (tei("/predict", "TEI's predict API: a text or pair classified by a pipeline of task classify", json::<texts::TeiPredictRequest>(), json::<b::TeiPredictResponse>()), post(texts::predict)),
        (tei("/similarity", "TEI's similarity API: cosine similarity of sentences to a source sentence", json::<texts::TeiSimilarityRequest>(), json::<b::TeiSimilarityResponse>()), post(texts::similarity)),
        (tei("/tokenize", "TEI's tokenize API: a text model's tokens, with byte offsets, never cut", json::<texts::TeiTokenizeRequest>(), json::<b::TeiTokenizeResponse>()), post(texts::tokenize)),
        (tei("/decode", "TEI's decode API: token ids back to text", json::<texts::TeiDecodeRequest>(), json::<b::TeiDecodeResponse>()), post(texts::decode)),
        (Doc { error: json::<b::TeiError>(), ..doc("get", "/info", "TEI's info: the text model (?model= when several), its task and limits", user, None, json::<b::TeiInfo>()) }, get(texts::info)),
        (tei_get("/health", "TEI's health: 200 with no body when the models are loaded, 503 (Unhealthy) while loading or draining (no token with --auth-allow-health)"), get(texts::health)),
        (tei_get("/", "TEI's health on its Inference Endpoints' images, as /health"), get(texts::health)),
        (tei_get("/ping", "TEI's health on its SageMaker images, as /health"), get(texts::health)),
        (tei("/", "TEI's default route: the call of the one task the served text models have, as /embed (whose bodies are shown), /rerank or /predict", json::<texts::TeiEmbedRequest>(), json::<b::TeiEmbedResponse>()), post(texts::invocations)),
        (tei("/invocations", "TEI's default route on its SageMaker images, as POST /", json::<texts::TeiEmbedRequest>(), json::<b::TeiEmbedResponse>()), post(texts::invocations)),
        (Doc { error: json::<b::OpenAiError>(), ..doc("post", "/embeddings", "OpenAI's embeddings API without its version prefix, as TEI serves it: as /v1/embeddings", user, Some(json::<texts::OpenAiRequest>()), json::<b::OpenAiEmbeddingResponse>()) }, post(texts::openai)),
        (doc("get", "/v2/systemsharedmemory/status", "Every system shared-memory region this client's tenant registered", user, None, json::<b::RegionsStatus>()), get(shm_status)),
        (doc("get", "/v2/systemsharedmemory/region/{name}/status", "One registered system shared-memory region", user, None, json::<b::RegionsStatus>()), get(shm_status)),
        (doc("post", "/v2/systemsharedmemory/region/{name}/register", "Registers a POSIX shared-memory object as a region that inputs and outputs name (--shared-memory system)", user, Some(json::<b::RegisterRegion>()), json::<b::Empty>()), post(shm_register)),
        (doc("post", "/v2/systemsharedmemory/unregister", "Unregisters every system shared-memory region of this client's tenant", user, None, json::<b::Empty>()), post(shm_unregister)),
        (doc("post", "/v2/systemsharedmemory/region/{name}/unregister", "Unregisters one system shared-memory region", user, None, json::<b::Empty>()), post(shm_unregister)),
        (doc("get", "/v2/cudasharedmemory/status", "CUDA shared-memory regions: none on a server without a GPU", user, None, json::<b::RegionsStatus>()), get(cuda_status)),
        (doc("post", "/v2/cudasharedmemory/unregister", "Unregisters CUDA shared-memory regions: there are none", user, None, json::<b::Empty>()), post(cuda_unregister)),
        (doc("post", "/v2/cudasharedmemory/region/{name}/unregister", "Unregisters a CUDA shared-memory region: there are none", user, None, json::<b::Empty>()), post(cuda_unregister)),
        (doc("post", "/v2/cudasharedmemory/region/{name}/register", "CUDA shared memory: refused, this server has no GPU", user, None, json::<b::Empty>()), post(cuda_register)),
        (doc("get", "/v2/openapi.json", "This description of the HTTP API (OpenAPI 3)", user, None, json::<b::OpenApi>()), get(openapi_json)),
        (doc("get", "/docs", "The HTTP API's documentation page, rendered from /v2/openapi.json", user, None, Body::Html), get(docs_page)),
        (doc("get", "/dashboard/metrics", "The Prometheus metrics, for the live page on this port (the same text as /metrics)", Some("metrics"), None, Body::Text), get(metrics)),
        (doc("get", "/dashboard", "A live page of this replica: per model version its state, rate, p50/p99, queue and compute time, batch sizes, cache hits, plan and refusals (static: no token; its data calls need a metrics token)", None, None, Body::Html), get(dashboard_page)),
    ];
    // Each model route, for the model's default version and for a named one.
    for (prefix, metadata, ready, config, stats, infer_path) in [
        (
            "",
            "/v2/models/{model}",
            "/v2/models/{model}/ready",
            "/v2/models/{model}/config",
            "/v2/models/{model}/stats",
            "/v2/models/{model}/infer",
        ),
        (
            " (of one version)",
            "/v2/models/{model}/versions/{version}",
            "/v2/models/{model}/versions/{version}/ready",
            "/v2/models/{model}/versions/{version}/config",
            "/v2/models/{model}/versions/{version}/stats",
            "/v2/models/{model}/versions/{version}/infer",
        ),
    ] {
        let summary = |s: &str| format!("{s}{prefix}");
        routes.extend([
            (
                doc(
                    "get",
                    metadata,
                    &summary("Model metadata: inputs, outputs, versions"),
                    user,
                    None,
                    json::<b::ModelMetadata>(),
                ),
                get(model_metadata),
            ),
            (
                doc("get", ready, &summary("Model readiness: 200 when ready"), user, None, json::<b::ModelReady>()),
                get(model_ready),
            ),
            (
                doc(
                    "get",
                    config,
                    &summary("The resolved model configuration, in Triton's JSON shape"),
                    user,
                    None,
                    json::<b::ModelConfig>(),
                ),
                get(model_config),
            ),
            (
                doc(
                    "get",
                    stats,
                    &summary("Model statistics (Triton's statistics extension)"),
                    user,
                    None,
                    json::<b::Statistics>(),
                ),
                get(model_stats),
            ),
            (
                doc(
                    "post",
                    infer_path,
                    &summary("Inference: JSON, binary tensors (Inference-Header-Content-Length) or MessagePack"),
                    user,
                    Some(json::<json::JsonRequest<'_>>()),
                    json::<b::InferenceResponse>(),
                ),
                post(infer),
            ),
        ]);
    }
    routes
}

/// The OpenAPI description of `routes()` and `/metrics`, made once.
fn openapi_document() -> &'static str {
    static DOC: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    DOC.get_or_init(|| {
        let mut docs: Vec<openapi::Doc> = routes().into_iter().map(|(d, _)| d).collect();
        docs.push(openapi::Doc {
            method: "get",
            path: "/metrics",
            summary: "Prometheus metrics (on --metrics-port; on the HTTP port too with --metrics-on-http)".into(),
            scope: Some("metrics"),
            body: None,
            answer: openapi::Body::Text,
            error: openapi::json::<bodies::Error>(),
        });
        openapi::document(&docs).to_string()
    })
}

async fn openapi_json() -> Response {
    ([(header::CONTENT_TYPE, "application/json")], openapi_document()).into_response()
}

async fn dashboard_page() -> Response {
    ([(header::CONTENT_TYPE, "text/html; charset=utf-8")], openapi::DASHBOARD_PAGE).into_response()
}

async fn docs_page() -> Response {
    ([(header::CONTENT_TYPE, "text/html; charset=utf-8")], openapi::DOCS_PAGE).into_response()
}

/// The whole V2 REST surface.
pub fn app(core: Core, limits: &HttpLimits, shm: Arc<crate::shm::Regions>) -> Router {
    let mut router = Router::new();
    for (doc, handler) in routes() {
        router = router.route(doc.path, handler);
    }
    router
        .fallback(|| async { ApiError::new(StatusCode::NOT_FOUND, "no such endpoint") })
        .layer(DefaultBodyLimit::max(limits.max_body_bytes))
        .layer(axum::middleware::from_fn_with_state((Arc::new(limits.clone()), core.clone()), read_body))
        .with_state(AppState { core, shm, budget: limits.body_budget.clone() })
}

#[derive(Deserialize)]
struct ModelPath {
    model: String,
    version: Option<String>,
}

impl AppState {
    fn model(&self, p: &ModelPath) -> Result<Arc<Model>, ApiError> {
        Ok(self.core.model(&p.model, p.version.as_deref())?)
    }
}

async fn server_metadata(State(s): State<AppState>) -> Json<bodies::ServerMetadata> {
    Json(bodies::ServerMetadata {
        name: "ferrite".into(),
        version: ferrite_core::wire::VERSION.into(),
        extensions: s.shm.extensions(),
        onnxruntime_version: ferrite_core::engine::onnx::runtime_version().unwrap_or_default().to_string(),
    })
}

/// The V2 protocol's health bodies (`{"ready": bool}`, read by KServe's SDK) with the status codes
/// Triton's clients read.
async fn server_ready(State(s): State<AppState>) -> Response {
    let ready = s.core.is_ready();
    let status = if ready { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    (status, axum::Json(bodies::Ready { ready })).into_response()
}

async fn model_ready(State(s): State<AppState>, Path(p): Path<ModelPath>) -> Response {
    match s.core.model(&p.model, p.version.as_deref()) {
        Ok(_) => {
            let ready = s.core.is_ready();
            let status = if ready { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
            (status, axum::Json(bodies::ModelReady { name: p.model, ready })).into_response()
        }
        Err(e) => ApiError::from(e).into_response(),
    }
}

async fn model_metadata(
    State(s): State<AppState>,
    Path(p): Path<ModelPath>,
) -> Result<Json<bodies::ModelMetadata>, ApiError> {
    let m = s.model(&p)?;
    let tensors = |specs: &[ferrite_core::engine::spec::TensorSpec]| {
        specs
            .iter()
            .map(|t| bodies::MetadataTensor {
                name: t.name.clone(),
                datatype: t.datatype.as_str(),
                shape: m.spec.wire_shape(t),
            })
            .collect()
    };
    Ok(Json(bodies::ModelMetadata {
        name: m.spec.name.clone(),
        versions: s.core.versions(&p.model).iter().map(u64::to_string).collect(),
        platform: m.spec.platform.to_string(),
        inputs: tensors(&m.spec.inputs),
        outputs: tensors(&m.spec.outputs),
    }))
}

async fn model_config(State(s): State<AppState>, Path(p): Path<ModelPath>) -> Result<Json<Value>, ApiError> {
    let m = s.model(&p)?;
    Ok(Json(ferrite_core::control::triton::json(&ferrite_core::control::triton::resolved(&m.spec))))
}

async fn model_stats(
    State(s): State<AppState>,
    Path(p): Path<ModelPath>,
) -> Result<Json<bodies::Statistics>, ApiError> {
    let m = s.model(&p)?;
    Ok(Json(stats_body(&s.core, vec![m.stats.snapshot(&m.spec.name, m.spec.version)])))
}

async fn all_stats(State(s): State<AppState>) -> Json<bodies::Statistics> {
    let stats: Vec<_> = s.core.models().iter().map(|m| m.stats.snapshot(&m.spec.name, m.spec.version)).collect();
    Json(stats_body(&s.core, stats))
}

/// Triton's statistics object, plus the response cache's state under `cache` when there is one.
fn stats_body(core: &Core, model_stats: Vec<ferrite_core::telemetry::stats::StatsSnapshot>) -> bodies::Statistics {
    bodies::Statistics { model_stats, cache: core.cache().map(|c| c.snapshot()) }
}

/// `POST /v2/repository/index`: `[{"name", "version", "state", "reason"}]`, `{"ready": true}`
/// for the ready ones only.
async fn repository_index(
    State(s): State<AppState>,
    body: JsonBody,
) -> Result<Json<bodies::RepositoryIndex>, ApiError> {
    let req: bodies::RepositoryIndexRequest = body.parse_optional("invalid index request").await?;
    let rows = s
        .core
        .index()
        .into_iter()
        .filter(|e| !req.ready || e.state == ferrite_core::control::registry::State::Ready)
        .map(|e| bodies::IndexRow {
            name: e.name,
            version: e.version.map(|v| v.to_string()),
            state: e.state.as_str(),
            reason: e.reason,
        })
        .collect();
    Ok(Json(bodies::RepositoryIndex(rows)))
}

/// The parameter names of a load or unload request body (`{"parameters": {...}}`, or none).
async fn parameter_names(body: JsonBody) -> Result<Vec<String>, ApiError> {
    let req: bodies::RepositoryRequest = body.parse_optional("invalid request").await?;
    Ok(req.parameters.into_keys().collect())
}

async fn blocking(
    f: impl FnOnce() -> ferrite_core::Result<()> + Send + 'static,
) -> Result<Json<bodies::Empty>, ApiError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))??;
    Ok(Json(bodies::Empty {}))
}

async fn repository_load(
    State(s): State<AppState>,
    Path(model): Path<String>,
    body: JsonBody,
) -> Result<Json<bodies::Empty>, ApiError> {
    let names = parameter_names(body).await?;
    blocking(move || s.core.load_model(&model, names.iter().map(String::as_str))).await
}

async fn repository_unload(
    State(s): State<AppState>,
    Path(model): Path<String>,
    body: JsonBody,
) -> Result<Json<bodies::Empty>, ApiError> {
    let names = parameter_names(body).await?;
    blocking(move || s.core.unload_model(&model, names.iter().map(String::as_str))).await
}

async fn repository_promote(
    State(s): State<AppState>,
    Path(model): Path<String>,
) -> Result<Json<bodies::Empty>, ApiError> {
    blocking(move || s.core.promote_canary(&model)).await
}

#[derive(Deserialize)]
struct RegionPath {
    name: Option<String>,
}

async fn shm_status(
    State(s): State<AppState>,
    Path(p): Path<RegionPath>,
    acting: Acting,
) -> Result<Json<bodies::RegionsStatus>, ApiError> {
    let tenant = tenant_of(acting)?;
    let regions = s.shm.status(tenant.as_deref(), p.name.as_deref().unwrap_or(""))?;
    Ok(Json(bodies::RegionsStatus(
        regions
            .iter()
            .map(|r| bodies::RegionStatus {
                name: r.name.clone(),
                key: r.key.clone(),
                offset: r.offset,
                byte_size: r.byte_size,
            })
            .collect(),
    )))
}

async fn shm_register(
    State(s): State<AppState>,
    Path(p): Path<RegionPath>,
    acting: Acting,
    body: JsonBody,
) -> Result<Json<bodies::Empty>, ApiError> {
    let share = acting.share().map(str::to_string);
    let tenant = tenant_of(acting)?;
    let r: bodies::RegisterRegion = body.read("invalid shared memory registration", None).await?;
    let name = p.name.unwrap_or_default();
    s.shm.register(tenant.as_deref(), share.as_deref(), &name, &r.key, r.offset, r.byte_size)?;
    Ok(Json(bodies::Empty {}))
}

async fn shm_unregister(
    State(s): State<AppState>,
    Path(p): Path<RegionPath>,
    acting: Acting,
) -> Result<Json<bodies::Empty>, ApiError> {
    let tenant = tenant_of(acting)?;
    s.shm.unregister(tenant.as_deref(), p.name.as_deref().unwrap_or(""));
    Ok(Json(bodies::Empty {}))
}

async fn cuda_status(Path(p): Path<RegionPath>) -> Result<Json<bodies::RegionsStatus>, ApiError> {
    match p.name {
        Some(name) => Err(ferrite_core::Error::NotFound(format!("no CUDA shared memory region '{name}'")).into()),
        None => Ok(Json(bodies::RegionsStatus(Vec::new()))),
    }
}

async fn cuda_unregister() -> Json<bodies::Empty> {
    Json(bodies::Empty {})
}

async fn cuda_register() -> Result<Json<bodies::Empty>, ApiError> {
    Err(ferrite_core::Error::Unsupported("CUDA shared memory: this server has no GPU".into()).into())
}

/// The header of Triton's binary tensor extension: how many body bytes are JSON.
const HEADER_LENGTH: &str = "inference-header-content-length";

fn is_msgpack(value: Option<&HeaderValue>) -> bool {
    value.and_then(|v| v.to_str().ok()).is_some_and(|v| v.contains("msgpack"))
}

/// Takes the request whole, not a `HeaderMap` and the body: axum's `HeaderMap` extractor clones
/// the request's headers.
async fn infer(
    State(s): State<AppState>,
    Path(p): Path<ModelPath>,
    acting: Acting,
    req: axum::extract::Request,
) -> Result<Response, ApiError> {
    use tracing::Instrument;
    let (mut parts, body) = req.into_parts();
    let span = crate::telemetry::request_span(
        "http",
        &p.model,
        crate::telemetry::extract(&crate::telemetry::Headers(&parts.headers)),
    );
    let decompressed = parts.extensions.remove::<Decompressed>();
    infer_inner(s, p, acting, parts.headers, body, decompressed).instrument(span).await
}

async fn infer_inner(
    s: AppState,
    p: ModelPath,
    acting: Acting,
    headers: HeaderMap,
    body: axum::body::Body,
    decompressed: Option<Decompressed>,
) -> Result<Response, ApiError> {
    // The body is whole already (`read_body`): its one frame, as it was read.
    let mut body = axum::body::to_bytes(body, usize::MAX)
        .await
        .map_err(|e| ApiError::bad_request(format!("cannot read the request body: {e}")))?;
    let sent = body.len();
    let max = s.core.limits().max_elements;
    let msgpack_in = is_msgpack(headers.get(header::CONTENT_TYPE));
    // MessagePack bodies carry their tensors inside; the binary extension is JSON's.
    let binary_part = match headers.get(HEADER_LENGTH).filter(|_| !msgpack_in) {
        None => None,
        Some(len) => {
            let len: usize =
                len.to_str().ok().and_then(|v| v.trim().parse().ok()).filter(|&n| n <= body.len()).ok_or_else(
                    || ApiError::bad_request(format!("{HEADER_LENGTH} must be a byte count within the body")),
                )?;
            Some(body.split_off(len))
        }
    };
    let (model, version) = (p.model, p.version);
    let share = acting.share().map(str::to_string);
    let tenant = tenant_of(acting)?;
    let shm = crate::shm::Access::new(s.shm.clone(), tenant.clone(), share.clone());
    // Inputs read from shared memory may be large as bodies are: off the I/O threads too.
    static SHARED: std::sync::LazyLock<memchr::memmem::Finder<'static>> =
        std::sync::LazyLock::new(|| memchr::memmem::Finder::new(b"shared_memory_region"));
    // (A MessagePack body naming a region is not sized first: it is moved off in any case.)
    let large = body.len() > OFFLOAD_BYTES
        || (SHARED.find(&body).is_some() && (msgpack_in || json::shared_input_bytes(&body) > OFFLOAD_BYTES as u64));
    // A large body's inputs are checked against the model before their data is decoded, and the
    // decoding stops if its client leaves (the guard lives in this future, dropped with it).
    let core = large.then(|| s.core.clone());
    let (_awaited, wanted) = large.then(Awaited::new).unzip();
    let parsed = off_io(large, share.as_deref(), move || -> Result<_, ApiError> {
        let _place = decompressed;
        let asked = version.clone();
        let (name, asked) = (model.as_str(), asked.as_deref());
        let check = |input: &str, datatype, shape: &[usize]| match &core {
            Some(core) => core.check_input(name, asked, input, datatype, shape),
            None => Ok(()),
        };
        let watch = wanted.as_ref().map(|wanted| decode::Watch { check: &check, wanted, refused: Default::default() });
        let watch = watch.as_ref();
        let parsed = if msgpack_in {
            msgpack::parse(&model, version, &body, max, Some(&shm), watch)?
        } else {
            json::parse(&model, version, &body, binary_part, max, Some(&shm), watch)?
        };
        Ok((parsed, shm))
    });
    let ((mut req, binary), shm) = parsed.await??;
    let _decoded = held_beyond(&s.budget, share.as_deref(), &req, sent + shm.bytes_read())?;
    req.tenant = tenant;
    req.share = share.clone();
    if let Some(v) = headers.get(crate::CANARY_HEADER) {
        req.canary = v.to_str().ok().and_then(ferrite_core::CanaryRoute::parse).ok_or_else(|| {
            ApiError::bad_request(format!("{}: expected always, never or auto", crate::CANARY_HEADER))
        })?;
    }
    let resp = s.core.infer(req).await?;
    let accept = headers.get(header::ACCEPT).and_then(|v| v.to_str().ok()).unwrap_or("");
    let msgpack_out = accept.contains("msgpack") || (msgpack_in && !accept.contains("json"));
    let large = resp.outputs.iter().map(|t| t.data.wire_len()).sum::<usize>() > OFFLOAD_BYTES;
    off_io(large, share.as_deref(), move || -> Result<Response, ApiError> {
        for (name, place) in &binary.shared {
            if let Some(t) = resp.outputs.iter().find(|t| t.name == *name) {
                shm.write(t, place)?;
            }
        }
        Ok(encode_response(&resp, &binary, msgpack_out))
    })
    .await?
}

/// What a request's inputs hold beyond `charged` (its body's bytes, and those read from shared
/// memory), taken from the bytes in flight until it is answered: a body may decode to many times
/// its bytes (a BYTES element of JSON's three bytes holds 32 while queued; an INT64 of two, 8).
/// 503 when the budget, or the request's `share` of it, cannot take them now; 413 when it never
/// could.
fn held_beyond(
    budget: &Arc<Budget>,
    share: Option<&str>,
    req: &ferrite_core::InferRequest,
    charged: usize,
) -> Result<Option<Reserved>, ApiError> {
    match req.held_len().checked_sub(charged).filter(|&more| more > 0) {
        None => Ok(None),
        Some(more) => match budget.take(share, more) {
            Some(reserved) => Ok(Some(reserved)),
            None => Err(budget.refusal(share, req.held_len(), HeldFor::Request).into()),
        },
    }
}

/// The tenant a request acts for: its token's, or the tenant header's where tenants are
/// configured and the token allows (`Acting`, resolved by `read_body`); 403 for a claim refused.
fn tenant_of(acting: Acting) -> Result<Option<String>, ApiError> {
    acting.tenant.map_err(|e| ApiError::new(StatusCode::FORBIDDEN, e))
}

/// Whom a call acts for (`Acting::caller`): 403 where its claim to a tenant is refused.
fn caller_of(acting: Acting) -> Result<ferrite_core::Caller, ApiError> {
    acting.caller().map_err(|e| ApiError::new(StatusCode::FORBIDDEN, e))
}

impl axum::extract::FromRequestParts<AppState> for Acting {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(parts: &mut axum::http::request::Parts, s: &AppState) -> Result<Self, Self::Rejection> {
        Ok(match parts.extensions.remove::<Acting>() {
            Some(acting) => acting,
            None => {
                Acting::of(&parts.extensions, s.core.tenants(), |h| parts.headers.get(h).and_then(|v| v.to_str().ok()))
            }
        })
    }
}

/// The response body: MessagePack, V2 JSON, or V2 JSON followed by the binary outputs.
fn encode_response(resp: &ferrite_core::InferResponse, binary: &json::BinaryOutputs, msgpack_out: bool) -> Response {
    if msgpack_out {
        return ([(header::CONTENT_TYPE, msgpack::CONTENT_TYPE)], msgpack::write_response(resp, binary))
            .into_response();
    }
    let (text, blobs) = json::write_response(resp, binary);
    if blobs.is_empty() {
        return ([(header::CONTENT_TYPE, "application/json")], text).into_response();
    }
    let header_len = text.len();
    let mut pieces = std::collections::VecDeque::with_capacity(blobs.len() + 1);
    pieces.push_back(Bytes::from(text));
    pieces.extend(blobs);
    (
        [
            (header::CONTENT_TYPE, HeaderValue::from_static("application/octet-stream")),
            (HeaderName::from_static(HEADER_LENGTH), HeaderValue::from(header_len)),
        ],
        axum::body::Body::new(Pieces::new(pieces)),
    )
        .into_response()
}

/// A body sent as the pieces it is made of (the JSON header, then each output tensor's bytes as
/// the engine left them), with its length stated: no buffer concatenating them.
struct Pieces {
    pieces: std::collections::VecDeque<Bytes>,
    left: u64,
}

impl Pieces {
    fn new(pieces: std::collections::VecDeque<Bytes>) -> Pieces {
        let left = pieces.iter().map(|p| p.len() as u64).sum();
        Pieces { pieces, left }
    }
}

impl http_body::Body for Pieces {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        let this = self.get_mut();
        let next = this.pieces.pop_front().map(|p| {
            this.left -= p.len() as u64;
            Ok(http_body::Frame::data(p))
        });
        std::task::Poll::Ready(next)
    }

    fn is_end_stream(&self) -> bool {
        self.pieces.is_empty()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        http_body::SizeHint::with_exact(self.left)
    }
}

/// Property tests over the request parsers: whatever the bytes, parsing returns (never panics),
/// and every length the client states is checked before use. Bounded so `cargo test` stays fast.
#[cfg(test)]
mod fuzz {
    use bytes::Bytes;
    use proptest::prelude::*;

    const DTYPES: &[&str] = &["BOOL", "UINT8", "INT16", "INT64", "FP16", "BF16", "FP32", "FP64", "BYTES", "NOPE"];

    fn request() -> impl Strategy<Value = (String, Vec<u8>)> {
        let input = (
            0..DTYPES.len(),
            proptest::collection::vec(-2i64..5, 0..4),
            prop_oneof![Just(None), (0u64..64).prop_map(Some)],
            proptest::collection::vec(-300.0f64..300.0, 0..12),
        );
        (proptest::collection::vec(input, 0..4), proptest::collection::vec(any::<u8>(), 0..128)).prop_map(
            |(inputs, binary)| {
                let inputs: Vec<_> = inputs
                    .into_iter()
                    .enumerate()
                    .map(|(i, (dt, shape, size, data))| {
                        let mut v =
                            serde_json::json!({"name": format!("i{i}"), "shape": shape, "datatype": DTYPES[dt]});
                        match size {
                            Some(n) => v["parameters"] = serde_json::json!({"binary_data_size": n}),
                            None => v["data"] = serde_json::json!(data),
                        }
                        v
                    })
                    .collect();
                (serde_json::json!({"inputs": inputs, "parameters": {"binary_data_output": true}}).to_string(), binary)
            },
        )
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

        #[test]
        fn json_and_binary_bodies_never_panic((json, binary) in request()) {
            let _ = super::json::parse("m", None, json.as_bytes(), Some(Bytes::from(binary)), 1 << 16, None, None);
        }

        #[test]
        fn arbitrary_bytes_never_panic(body in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = super::json::parse("m", None, &body, None, 1 << 16, None, None);
            let _ = super::msgpack::parse("m", None, &body, 1 << 16, None, None);
        }

        #[test]
        fn msgpack_bodies_never_panic((json, _) in request()) {
            let v: serde_json::Value = serde_json::from_str(&json).unwrap();
            let body = rmp_serde::to_vec_named(&v).unwrap();
            let _ = super::msgpack::parse("m", None, &body, 1 << 16, None, None);
        }
    }
}
