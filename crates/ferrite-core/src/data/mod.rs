//! The ground floor: the data every layer above speaks — datatypes, tensors, and the request and
//! response types the front-ends hand the core. Nothing here imports any module above it.

pub mod dtype;
pub mod request;
pub mod tensor;
