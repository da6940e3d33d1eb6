//! Ferrite's network front-ends. Each translates its wire types to and from the core's, and maps
//! the core's errors once; nothing else lives here.

pub mod auth;
pub mod grpc;
pub mod http;
pub mod serve;
pub mod telemetry;
pub mod tls;

#[cfg(test)]
mod fuzz;
