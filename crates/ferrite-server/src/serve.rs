//! Runs both listeners over one core until told to stop, then shuts down in the order a balancer
//! can follow: readiness off while requests are still served for the stop's grace (HTTP/1.1
//! responses say `Connection: close`, HTTP/2 connections get GOAWAY, so kept-alive clients move
//! between requests, never under one); then new work refused (the HTTP listeners stay open and
//! answer 503 meanwhile; the gRPC listener sends GOAWAY and takes no more connections), queued and
//! running work finished until the exit timeout, what is left failed; then the listeners close.

use std::{
    future::Future,
    io,
    net::{IpAddr, SocketAddr, ToSocketAddrs},
    sync::atomic::{AtomicUsize, Ordering},
    task::Poll,
    time::Duration,
};

use ferrite_core::Core;
use hyper_util::{
    rt::{TokioExecutor, TokioIo, TokioTimer},
    server::conn::auto,
    service::TowerToHyperService,
};
use tokio::net::TcpListener;

use crate::{grpc, http, tls::Tls};

#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// The addresses to listen on, each listener on all of them (`addresses` of `--host`).
    pub host: Vec<IpAddr>,
    /// 0 picks a free port.
    pub http_port: u16,
    pub grpc_port: u16,
    pub http: http::HttpLimits,
    pub grpc: grpc::GrpcLimits,
    pub grpc_max_concurrent_streams: u32,
    pub exit_timeout: Duration,
    /// Port of the Prometheus `/metrics` listener; `None` serves none.
    pub metrics_port: Option<u16>,
    /// Also serve `/metrics` on the HTTP port.
    pub metrics_on_http: bool,
    /// How `ferrite_desired_replicas` is computed, and over what window.
    pub scale: ferrite_core::telemetry::scale::ScalePolicy,
    pub scale_window: Duration,
    /// Bearer tokens required on every listener, when set.
    pub auth: Option<std::sync::Arc<crate::auth::Auth>>,
    /// TLS (and client certificates, when mutual) on every listener, when set.
    pub tls: Option<Tls>,
    /// Triton's system shared-memory regions, one set for both listeners (`--shared-memory`).
    pub shm: std::sync::Arc<crate::shm::Regions>,
    /// Whether stopping shuts the engine down with the listeners (readiness off, queues closed and
    /// drained): the binary's, which exits after. Off where the engine is the application's
    /// (`ferrite.serve` in Python): the listeners finish the requests they hold and close, and the
    /// engine goes on serving the application's own calls, or a later server.
    pub owns_core: bool,
}

/// The addresses `host` names: an IP address (IPv6 in brackets or not), or a host name and every
/// address it resolves to (`localhost`: 127.0.0.1, and ::1 where the hosts file lists it), so that
/// a client reaching the name by any of them is answered.
pub fn addresses(host: &str) -> io::Result<Vec<IpAddr>> {
    let bare = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host);
    if let Ok(ip) = bare.parse() {
        return Ok(vec![ip]);
    }
    let cannot =
        |why: &dyn std::fmt::Display| io::Error::new(io::ErrorKind::InvalidInput, format!("host '{host}': {why}"));
    let mut ips: Vec<IpAddr> = Vec::new();
    for a in (bare, 0).to_socket_addrs().map_err(|e| cannot(&e))? {
        if !ips.contains(&a.ip()) {
            ips.push(a.ip());
        }
    }
    if ips.is_empty() {
        return Err(cannot(&"the name resolves to no address"));
    }
    Ok(ips)
}

/// One listener's sockets: one per address of the host, all on one port.
struct Listeners {
    sockets: Vec<TcpListener>,
    /// Which socket is asked first next time, so that a busy one cannot starve the others.
    next: AtomicUsize,
}

impl Listeners {
    /// Binds `port` on every address; 0 picks a port free on the first and takes it on the others.
    /// An address of a family this host has switched off (IPv6 in many containers) is passed over
    /// while another one binds.
    async fn bind(host: &[IpAddr], mut port: u16) -> io::Result<Listeners> {
        let mut sockets = Vec::new();
        let mut passed_over = None;
        for &ip in host {
            let addr = SocketAddr::new(ip, port);
            match TcpListener::bind(addr).await {
                Ok(socket) => {
                    port = socket.local_addr()?.port();
                    sockets.push(socket);
                }
                Err(e)
                    if host.len() > 1
                        && matches!(e.kind(), io::ErrorKind::AddrNotAvailable | io::ErrorKind::Unsupported) =>
                {
                    tracing::warn!(%addr, error = %e, "cannot listen on this address of the host; listening on its others");
                    passed_over = Some(io::Error::new(e.kind(), format!("cannot listen on {addr}: {e}")));
                }
                Err(e) => return Err(io::Error::new(e.kind(), format!("cannot listen on {addr}: {e}"))),
            }
        }
        match (sockets.is_empty(), passed_over) {
            (true, Some(e)) => Err(e),
            (true, None) => Err(io::Error::new(io::ErrorKind::InvalidInput, "no address to listen on")),
            _ => Ok(Listeners { sockets, next: AtomicUsize::new(0) }),
        }
    }

    /// The first address listened on (where port 0 was asked for, the port chosen).
    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.sockets[0].local_addr()
    }

    async fn accept(&self) -> io::Result<tokio::net::TcpStream> {
        std::future::poll_fn(|cx| {
            let n = self.sockets.len();
            let first = self.next.fetch_add(1, Ordering::Relaxed) % n;
            for i in 0..n {
                if let Poll::Ready(r) = self.sockets[(first + i) % n].poll_accept(cx) {
                    return Poll::Ready(r.map(|(tcp, _)| tcp));
                }
            }
            Poll::Pending
        })
        .await
    }
}

/// Listening sockets, bound before the server runs so callers learn the ports.
pub struct Bound {
    /// The addresses of `--host` the listeners took (one it resolved to may have been passed over).
    pub addresses: Vec<IpAddr>,
    pub http_addr: SocketAddr,
    pub grpc_addr: SocketAddr,
    pub metrics_addr: Option<SocketAddr>,
    http: Listeners,
    grpc: Listeners,
    metrics: Option<Listeners>,
}

pub async fn bind(cfg: &ServeConfig) -> io::Result<Bound> {
    let http = Listeners::bind(&cfg.host, cfg.http_port).await?;
    let grpc = Listeners::bind(&cfg.host, cfg.grpc_port).await?;
    let metrics = match cfg.metrics_port {
        Some(port) => Some(Listeners::bind(&cfg.host, port).await?),
        None => None,
    };
    let metrics_addr = metrics.as_ref().map(|m| m.local_addr()).transpose()?;
    let addresses = http.sockets.iter().map(|s| s.local_addr().map(|a| a.ip())).collect::<io::Result<_>>()?;
    Ok(Bound {
        addresses,
        http_addr: http.local_addr()?,
        grpc_addr: grpc.local_addr()?,
        metrics_addr,
        http,
        grpc,
        metrics,
    })
}

/// Keeps `ferrite_desired_replicas` up to date: a reading of the request metrics every tenth of
/// the window (at least every second), the rule applied to the window's rate and p99.
fn desired_replicas(policy: ferrite_core::telemetry::scale::ScalePolicy, window: Duration) {
    use ferrite_core::telemetry::{metrics, scale};
    let m = metrics::global();
    m.desired_replicas.set(scale::desired_replicas(&policy, 0.0, None) as i64);
    tokio::spawn(async move {
        let mut readings = scale::Window::default();
        let mut tick = tokio::time::interval((window / 10).min(Duration::from_secs(1)));
        loop {
            tick.tick().await;
            readings.push(std::time::Instant::now(), m.request_reading(), window);
            let (rps, p99) = readings.rate_and_p99();
            m.desired_replicas.set(scale::desired_replicas(&policy, rps, p99).min(i64::MAX as u64) as i64);
        }
    });
}

/// How often memory freed by a burst is handed back to the system.
const TRIM_EVERY: Duration = Duration::from_secs(20);

/// Hands memory that bursts grew and then freed back to the system: glibc keeps freed memory in
/// each thread's arena (after a burst of 2048-text calls, hundreds of megabytes stayed resident
/// with nothing in use), and only `malloc_trim` returns what sits between live allocations. The
/// buffers kept for large request bodies go too, once a period has taken none of them.
fn trim_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    tokio::spawn(async {
        let mut tick = tokio::time::interval(TRIM_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            crate::http::pool::BODIES.trim();
            // Walks the arenas (milliseconds for a heap of hundreds of megabytes): off the I/O threads.
            // SAFETY: malloc_trim has no preconditions; it only releases free memory.
            let _ = tokio::task::spawn_blocking(|| unsafe { libc::malloc_trim(0) }).await;
        }
    });
}

/// How often `--auth-token-file` is checked for a change.
const AUTH_FILE_CHECK: Duration = Duration::from_secs(2);

type InferenceServer = grpc::pb::grpc_inference_service_server::GrpcInferenceServiceServer<grpc::Service>;

/// Where the HTTP listeners' connections stand, sent to each of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Phase {
    Open,
    /// Shutting down: connections close between requests.
    Closing,
    /// The listener is closing: every connection finishes what it has and closes.
    Stopped,
}

/// Serves until `stop` completes with the grace it asks for, then shuts down as the module says.
/// Returns how many queued requests had to be failed at the deadline.
pub async fn run(
    core: Core,
    bound: Bound,
    cfg: &ServeConfig,
    stop: impl Future<Output = Duration> + Send + 'static,
) -> usize {
    // Draining starts after the grace; the listeners close only once the engine has drained, so
    // clients arriving meanwhile get a clear 503 / UNAVAILABLE rather than a refused connection.
    let (drain_tx, drain_rx) = tokio::sync::watch::channel(false);
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let (phase_tx, phase_rx) = tokio::sync::watch::channel(Phase::Open);
    if let Some(auth) = &cfg.auth {
        auth.watch(AUTH_FILE_CHECK);
    }
    desired_replicas(cfg.scale.clone(), cfg.scale_window);
    trim_memory();
    let (health, health_service) = tonic_health::server::health_reporter();
    health.set_serving::<InferenceServer>().await;
    let shutdown_core = core.clone();
    let phase = phase_tx.clone();
    let owns_core = cfg.owns_core;
    tokio::spawn(async move {
        let grace = stop.await;
        tracing::info!(grace_secs = grace.as_secs_f64(), "shutting down: readiness off, still serving for the grace");
        if owns_core {
            shutdown_core.withdraw();
        }
        health.set_not_serving::<InferenceServer>().await;
        health.set_service_status("", tonic_health::ServingStatus::NotServing).await;
        let _ = phase.send(Phase::Closing);
        tokio::time::sleep(grace).await;
        tracing::info!("grace over: refusing new requests, draining");
        if owns_core {
            shutdown_core.begin_shutdown();
        }
        let _ = drain_tx.send(true);
    });
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|&s| s).await;
    };

    let mut grpc_builder = tonic::transport::Server::builder();
    if let Some(tls) = &cfg.tls {
        grpc_builder = grpc_builder.tls_config(tls.grpc()).expect("a valid TLS configuration");
    }
    let tei = grpc::tei::services(core.clone(), &cfg.grpc, stop_rx.clone());
    let grpc_server = grpc_builder
        .max_concurrent_streams(cfg.grpc_max_concurrent_streams)
        .max_frame_size(grpc::MAX_FRAME)
        .http2_keepalive_interval(Some(grpc::KEEPALIVE))
        // Outermost first: the token is checked before the call's bytes are charged to its tenant.
        .layer(grpc::AuthLayer { auth: cfg.auth.clone() })
        .layer(grpc::calls::CallLayer {
            budget: cfg.http.body_budget.clone(),
            core: core.clone(),
            message_timeout: cfg.http.body_timeout,
            max_message: cfg.grpc.max_decoding_message_size,
        })
        .add_service(health_service)
        .add_service(grpc::service(core.clone(), &cfg.grpc, cfg.shm.clone(), stop_rx.clone()))
        .add_service(tei.info)
        .add_service(tei.embed)
        .add_service(tei.predict)
        .add_service(tei.rerank)
        .add_service(tei.tokenize)
        .serve_with_incoming_shutdown(
            grpc_incoming(bound.grpc, cfg.http.max_connections, cfg.http.header_timeout, cfg.http.idle_timeout),
            stopped(stop_rx.clone()),
        );
    let grpc_server = tokio::spawn(grpc_server);
    // Every route of every listener, aliases and the 404 fallback included, behind the tokens.
    let guard = |router: axum::Router| match &cfg.auth {
        Some(auth) => http::protect(router, auth.clone()),
        None => router,
    };
    let mut app = http::app(core.clone(), &cfg.http, cfg.shm.clone());
    if cfg.metrics_on_http {
        app = app.merge(http::metrics_app(core.clone()));
    }
    let acceptor = cfg.tls.as_ref().map(|t| t.acceptor().expect("checked when loaded"));
    let metrics_server = bound.metrics.map(|listener| {
        let app = guard(http::metrics_app(core.clone()));
        tokio::spawn(serve_http(listener, app, acceptor.clone(), cfg.http.clone(), phase_rx.clone()))
    });
    let http_server = tokio::spawn(serve_http(bound.http, guard(app), acceptor, cfg.http.clone(), phase_rx));

    stopped(drain_rx).await;
    // The gRPC listener stops taking connections and sends GOAWAY now: its calls in flight
    // finish, new ones go to another replica rather than being refused here.
    let _ = stop_tx.send(true);
    let exit_timeout = cfg.exit_timeout;
    let failed = if owns_core {
        let drain_core = core.clone();
        tokio::task::spawn_blocking(move || drain_core.drain(exit_timeout)).await.unwrap_or(0)
    } else {
        0
    };
    if failed > 0 {
        tracing::warn!(failed, "requests failed at shutdown");
    }
    let _ = phase_tx.send(Phase::Stopped);
    // Give in-flight responses a moment to be written; with the engine left open, the listeners'
    // own requests finish here, as long as the exit timeout allows.
    let written = if owns_core { Duration::from_secs(2) } else { exit_timeout };
    let _ = tokio::time::timeout(written, async {
        let _ = tokio::join!(http_server, grpc_server);
        if let Some(m) = metrics_server {
            let _ = m.await;
        }
    })
    .await;
    if owns_core {
        // Python models' workers finalize as their channel closes with this process; their shared
        // files go now.
        ferrite_core::engine::python::remove_directory();
    }
    tracing::info!("stopped");
    failed
}

/// Serves `app` on `listener` (HTTP/1.1 and HTTP/2, over TLS when `tls` is set) until `stop`, then
/// lets open connections finish their requests. A client gets `limits.header_timeout` to send its
/// request head (and TLS handshake), so slow-header connections cannot pile up.
/// The next connection, with TCP_NODELAY (small responses would otherwise wait on delayed ACKs).
/// Accept errors (out of file descriptors and the like) back off instead of spinning.
async fn accept(listener: &Listeners) -> tokio::net::TcpStream {
    loop {
        match listener.accept().await {
            Ok(tcp) => {
                let _ = tcp.set_nodelay(true);
                return tcp;
            }
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// Whether the client sends its first byte within `limit`, counted from accept (hyper's own
/// header timer starts only at the first byte, so a silent connection would be held forever).
async fn speaks_within(tcp: &tokio::net::TcpStream, limit: Duration) -> bool {
    let mut first = [0u8; 1];
    matches!(tokio::time::timeout(limit, tcp.peek(&mut first)).await, Ok(Ok(1..)))
}

/// A gRPC connection holding one place under its listener's cap, closed once idle.
struct Capped {
    io: crate::idle::IdleIo<tokio::net::TcpStream>,
    conn: grpc::calls::Conn,
    _place: tokio::sync::OwnedSemaphorePermit,
}

impl tokio::io::AsyncRead for Capped {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        std::pin::Pin::new(&mut self.get_mut().io).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for Capped {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<io::Result<usize>> {
        std::pin::Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_flush(self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<io::Result<()>> {
        std::pin::Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        std::pin::Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

impl tonic::transport::server::Connected for Capped {
    type ConnectInfo = grpc::calls::Conn;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.conn.clone()
    }
}

/// The gRPC listener's connections, taken as the HTTP listener takes its own: at most `max` at
/// once (more are closed at once), each closed if it sends nothing within `first_byte`, and
/// closed once it has had no call open for `idle`.
fn grpc_incoming(
    listener: Listeners,
    max: usize,
    first_byte: Duration,
    idle: Duration,
) -> impl tokio_stream::Stream<Item = io::Result<Capped>> {
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    let places = std::sync::Arc::new(tokio::sync::Semaphore::new(max));
    tokio::spawn(async move {
        loop {
            let tcp = tokio::select! {
                tcp = accept(&listener) => tcp,
                // The server stopped: the listener closes with this task.
                _ = tx.closed() => break,
            };
            let Ok(place) = places.clone().try_acquire_owned() else { continue };
            let tx = tx.clone();
            tokio::spawn(async move {
                if speaks_within(&tcp, first_byte).await {
                    let in_flight = std::sync::Arc::new(crate::idle::InFlight::default());
                    let tcp_info = tonic::transport::server::Connected::connect_info(&tcp);
                    let conn = grpc::calls::Conn { tcp: tcp_info, in_flight: in_flight.clone() };
                    let io = crate::idle::IdleIo::new(tcp, in_flight, idle);
                    let _ = tx.send(Ok(Capped { io, conn, _place: place })).await;
                }
            });
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

async fn serve_http(
    listener: Listeners,
    app: axum::Router,
    tls: Option<tokio_rustls::TlsAcceptor>,
    limits: http::HttpLimits,
    mut phase: tokio::sync::watch::Receiver<Phase>,
) {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder.http1().timer(TokioTimer::new()).header_read_timeout(limits.header_timeout).max_buf_size(http::READ_BUFFER);
    builder
        .http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(Some(grpc::KEEPALIVE))
        .max_concurrent_streams(limits.max_streams);
    let connections = std::sync::Arc::new(tokio::sync::Semaphore::new(limits.max_connections));
    loop {
        let tcp = tokio::select! {
            tcp = accept(&listener) => tcp,
            _ = phase.wait_for(|p| *p == Phase::Stopped) => break,
        };
        // Past the cap, close at once: a refused connection is better than a server out of files.
        let Ok(held) = connections.clone().try_acquire_owned() else {
            tracing::debug!("connection refused: --http-max-connections reached");
            drop(tcp);
            continue;
        };
        let in_flight = std::sync::Arc::new(crate::idle::InFlight::default());
        let h2 = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let service = TowerToHyperService::new(Closing {
            inner: app.clone(),
            phase: phase.clone(),
            h2: h2.clone(),
            in_flight: in_flight.clone(),
        });
        let idle = limits.idle_timeout;
        let builder = builder.clone();
        let phase = phase.clone();
        let tls = tls.clone();
        let handshake_timeout = limits.header_timeout;
        tokio::spawn(async move {
            let _held = held;
            if !speaks_within(&tcp, handshake_timeout).await {
                return;
            }
            match tls {
                None => {
                    let io = TokioIo::new(crate::idle::IdleIo::new(tcp, in_flight, idle));
                    follow(builder.serve_connection_with_upgrades(io, service), phase, &h2).await;
                }
                Some(acceptor) => {
                    let Ok(Ok(stream)) = tokio::time::timeout(handshake_timeout, acceptor.accept(tcp)).await else {
                        return;
                    };
                    let io = TokioIo::new(crate::idle::IdleIo::new(stream, in_flight, idle));
                    follow(builder.serve_connection_with_upgrades(io, service), phase, &h2).await;
                }
            }
        });
    }
    drop(listener);
    // Every connection holds a place until it has closed.
    let _ = connections.acquire_many(limits.max_connections.min(u32::MAX as usize) as u32).await;
}

/// Drives one connection to its end, closing it as the listener's phase says: an HTTP/2 one gets
/// GOAWAY once shutdown begins (its open streams finish); an HTTP/1.1 one is closed by the
/// `Connection: close` of its next response ([`Closing`]), or, when the listener stops, after the
/// request it has in hand.
async fn follow(
    conn: impl hyper_util::server::graceful::GracefulConnection,
    mut phase: tokio::sync::watch::Receiver<Phase>,
    h2: &std::sync::atomic::AtomicBool,
) {
    tokio::pin!(conn);
    let closes =
        |p: Phase| p == Phase::Stopped || (p == Phase::Closing && h2.load(std::sync::atomic::Ordering::Relaxed));
    loop {
        tokio::select! {
            _ = conn.as_mut() => return,
            changed = phase.changed() => {
                if changed.is_err() || closes(*phase.borrow_and_update()) {
                    break;
                }
            }
        }
    }
    conn.as_mut().graceful_shutdown();
    let _ = conn.await;
}

/// Counts each request in flight on its connection (so an idle one is closed, `IdleIo`), marks
/// each HTTP/1.1 response `Connection: close` once shutdown has begun, and notes whether its
/// connection speaks HTTP/2.
#[derive(Clone)]
struct Closing<S> {
    inner: S,
    phase: tokio::sync::watch::Receiver<Phase>,
    h2: std::sync::Arc<std::sync::atomic::AtomicBool>,
    in_flight: std::sync::Arc<crate::idle::InFlight>,
}

impl<S, B> tower_service::Service<axum::http::Request<B>> for Closing<S>
where
    S: tower_service::Service<axum::http::Request<B>, Response = axum::response::Response>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = std::pin::Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: axum::http::Request<B>) -> Self::Future {
        let h1 = req.version() < axum::http::Version::HTTP_2;
        if !h1 {
            self.h2.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        let phase = self.phase.clone();
        let held = self.in_flight.enter();
        let fut = self.inner.call(req);
        Box::pin(async move {
            let response = fut.await;
            drop(held);
            let mut response = response?;
            if h1 && *phase.borrow() != Phase::Open {
                response
                    .headers_mut()
                    .insert(axum::http::header::CONNECTION, axum::http::HeaderValue::from_static("close"));
            }
            Ok(response)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_are_addresses_or_names() {
        assert_eq!(addresses("0.0.0.0").unwrap(), ["0.0.0.0".parse::<IpAddr>().unwrap()]);
        assert_eq!(addresses("[::1]").unwrap(), ["::1".parse::<IpAddr>().unwrap()]);
        assert_eq!(addresses("::").unwrap(), ["::".parse::<IpAddr>().unwrap()]);
        let local = addresses("localhost").unwrap();
        assert!(local.iter().all(|ip| ip.is_loopback()), "{local:?}");
        let err = addresses("no-such-host.invalid").unwrap_err().to_string();
        assert!(err.starts_with("host 'no-such-host.invalid': "), "{err}");
    }

    #[tokio::test]
    async fn a_listener_takes_every_address_on_one_port() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let host: Vec<IpAddr> = vec!["127.0.0.1".parse().unwrap(), "::1".parse().unwrap()];
        let listeners = Listeners::bind(&host, 0).await.unwrap();
        let port = listeners.local_addr().unwrap().port();
        // Where this host has no IPv6, the second address is passed over.
        let bound: Vec<SocketAddr> = listeners.sockets.iter().map(|s| s.local_addr().unwrap()).collect();
        assert!(bound.iter().all(|a| a.port() == port), "{bound:?}");
        for addr in bound {
            let mut client = tokio::net::TcpStream::connect(addr).await.unwrap();
            client.write_all(b"x").await.unwrap();
            let mut served = listeners.accept().await.unwrap();
            let mut got = [0u8; 1];
            served.read_exact(&mut got).await.unwrap();
            assert_eq!(served.local_addr().unwrap(), addr);
        }
        // A port another process holds is an error naming the address.
        let taken = Listeners::bind(&host[..1], port).await.err().unwrap().to_string();
        assert!(taken.starts_with(&format!("cannot listen on 127.0.0.1:{port}")), "{taken}");
    }
}
