//! Admission: what a request must pass before it may queue. Caps on what one request may make
//! the server hold, the process-wide concurrency cap, and per-tenant limits. (The estimate that
//! refuses a request whose deadline cannot be met is the batcher's own: `engine::deadline`.)

pub mod tenant;

use std::sync::{
    atomic::{AtomicUsize, Ordering},
    Arc,
};

use crate::{wire::RETRY_AFTER, Error, Result};

/// Caps on what one request may make the server hold.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Elements in all the input tensors of one request together.
    pub max_elements: usize,
    /// Requests in the engine at once (queued, running or in a cache lookup); past it, new ones
    /// are refused with `Overloaded`. 0: no limit.
    pub max_concurrent_requests: usize,
    /// Inputs (texts, pairs, passages) one call of TEI's API may carry: TEI's
    /// `max_client_batch_size`, 32 by default as in TEI.
    pub max_client_batch_size: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_elements: crate::wire::DEFAULT_MAX_ELEMENTS,
            max_concurrent_requests: 0,
            max_client_batch_size: 32,
        }
    }
}

/// Holds one place under `max_concurrent_requests` while a request is in the engine.
pub(crate) struct Admitted(Arc<AtomicUsize>);

impl Admitted {
    /// Takes a place, or refuses when `limits` caps the requests in flight and all are taken.
    pub(crate) fn enter(in_flight: &Arc<AtomicUsize>, limits: &Limits) -> Result<Admitted> {
        let now = in_flight.fetch_add(1, Ordering::AcqRel) + 1;
        let admitted = Admitted(in_flight.clone());
        let cap = limits.max_concurrent_requests;
        if cap > 0 && now > cap {
            return Err(Error::Overloaded {
                message: format!("over max_concurrent_requests ({cap} requests in flight)"),
                retry_after: Some(RETRY_AFTER),
            });
        }
        Ok(admitted)
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}
