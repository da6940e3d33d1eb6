//! Ferrite's network front-ends. Each translates its wire types to and from the core's, and maps
//! the core's errors once; nothing else lives here.

pub mod auth;
pub mod budget;
pub mod check;
pub mod config_source;
pub mod grpc;
pub mod http;
mod idle;
pub mod places;
pub mod serve;
pub mod shm;
pub mod telemetry;
pub mod tls;

#[cfg(test)]
mod fuzz;

/// The request header (HTTP) and metadata key (gRPC) that steers an unversioned request to or
/// away from a model's canary: `always`, `never` or `auto`.
pub const CANARY_HEADER: &str = "x-ferrite-canary";
