//! Runs both listeners over one core until told to stop, then drains: readiness off, new work
//! refused, queued and running work finished until the exit timeout, what is left failed.

use std::{future::Future, io, net::SocketAddr, time::Duration};

use axum::serve::ListenerExt;
use ferrite_core::Core;
use tokio::net::TcpListener;

use crate::{grpc, http};

#[derive(Debug, Clone)]
pub struct ServeConfig {
    pub host: std::net::IpAddr,
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
    /// Bearer tokens required on every listener, when set.
    pub auth: Option<std::sync::Arc<crate::auth::Auth>>,
}

/// Listening sockets, bound before the server runs so callers learn the ports.
pub struct Bound {
    pub http_addr: SocketAddr,
    pub grpc_addr: SocketAddr,
    pub metrics_addr: Option<SocketAddr>,
    http: TcpListener,
    grpc: TcpListener,
    metrics: Option<TcpListener>,
}

pub async fn bind(cfg: &ServeConfig) -> io::Result<Bound> {
    let listen = |port| async move {
        let addr = SocketAddr::new(cfg.host, port);
        TcpListener::bind(addr).await.map_err(|e| io::Error::new(e.kind(), format!("cannot listen on {addr}: {e}")))
    };
    let http = listen(cfg.http_port).await?;
    let grpc = listen(cfg.grpc_port).await?;
    let metrics = match cfg.metrics_port {
        Some(port) => Some(listen(port).await?),
        None => None,
    };
    let metrics_addr = metrics.as_ref().map(|m| m.local_addr()).transpose()?;
    Ok(Bound { http_addr: http.local_addr()?, grpc_addr: grpc.local_addr()?, metrics_addr, http, grpc, metrics })
}

type InferenceServer = grpc::pb::grpc_inference_service_server::GrpcInferenceServiceServer<grpc::Service>;

/// Serves until `stop` completes, then shuts down as the module says. Returns how many queued
/// requests had to be failed at the deadline.
pub async fn run(
    core: Core,
    bound: Bound,
    cfg: &ServeConfig,
    stop: impl Future<Output = ()> + Send + 'static,
) -> usize {
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let (health, health_service) = tonic_health::server::health_reporter();
    health.set_serving::<InferenceServer>().await;
    let shutdown_core = core.clone();
    tokio::spawn(async move {
        stop.await;
        tracing::info!("shutting down: readiness off, draining");
        shutdown_core.begin_shutdown();
        health.set_not_serving::<InferenceServer>().await;
        health.set_service_status("", tonic_health::ServingStatus::NotServing).await;
        let _ = stop_tx.send(true);
    });
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|&s| s).await;
    };

    let grpc_server = tonic::transport::Server::builder()
        .max_concurrent_streams(cfg.grpc_max_concurrent_streams)
        .http2_keepalive_interval(Some(grpc::KEEPALIVE))
        .add_service(tonic::service::interceptor::InterceptedService::new(
            health_service,
            grpc::interceptor(cfg.auth.clone().filter(|a| !a.allow_health), crate::auth::Scope::Infer),
        ))
        .add_service(tonic::service::interceptor::InterceptedService::new(
            grpc::service(core.clone(), &cfg.grpc),
            grpc::interceptor(cfg.auth.clone(), crate::auth::Scope::Infer),
        ))
        .serve_with_incoming_shutdown(
            tonic::transport::server::TcpIncoming::from(bound.grpc).with_nodelay(Some(true)),
            stopped(stop_rx.clone()),
        );
    let grpc_server = tokio::spawn(grpc_server);
    // Small responses would otherwise wait on delayed ACKs.
    let listener = bound.http.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    // Every route of every listener, aliases and the 404 fallback included, behind the tokens.
    let guard = |router: axum::Router| match &cfg.auth {
        Some(auth) => http::protect(router, auth.clone()),
        None => router,
    };
    let mut app = http::app(core.clone(), &cfg.http);
    if cfg.metrics_on_http {
        app = app.merge(http::metrics_app(core.clone()));
    }
    let app = guard(app);
    let metrics_server = bound.metrics.map(|listener| {
        let server = axum::serve(listener, guard(http::metrics_app(core.clone())))
            .with_graceful_shutdown(stopped(stop_rx.clone()));
        tokio::spawn(async move { server.await })
    });
    let http_server = axum::serve(listener, app).with_graceful_shutdown(stopped(stop_rx.clone()));
    let http_server = tokio::spawn(async move { http_server.await });

    stopped(stop_rx).await;
    let drain_core = core.clone();
    let exit_timeout = cfg.exit_timeout;
    let failed = tokio::task::spawn_blocking(move || drain_core.drain(exit_timeout)).await.unwrap_or(0);
    if failed > 0 {
        tracing::warn!(failed, "requests failed at shutdown");
    }
    // Give in-flight responses a moment to be written.
    let _ = tokio::time::timeout(Duration::from_secs(2), async {
        let _ = tokio::join!(http_server, grpc_server);
        if let Some(m) = metrics_server {
            let _ = m.await;
        }
    })
    .await;
    tracing::info!("stopped");
    failed
}
