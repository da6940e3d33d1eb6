//! The control plane: which models and versions are served, and how that changes. The repository
//! on disk, model configs, the registry that is swapped atomically on every change, the lifecycle
//! that builds a model's next state beside the running one, and canary rollouts. Nothing here is
//! on the path of a request except `Registry::route` and the canary's record of each outcome. The
//! operations on these (`Core::load_model`, polling, external configs) are `Core`'s, in `core::models`.

pub mod canary;
pub mod config;
pub mod hugging_face;
pub(crate) mod lifecycle;
pub mod registry;
pub mod repository;
pub mod triton;

pub(crate) use lifecycle::Lifecycle;
pub use registry::{IndexEntry, Registry};
pub use repository::{LoadOptions, Repository};
