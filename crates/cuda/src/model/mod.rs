//! Every family's model description on the GPU, in the order of the CPU code (crates/models): the spine in VRAM (layers beyond
//! its budget streamed from page-locked host memory, one layer ahead), routed experts in a VRAM slot cache fed
//! from the CPU-side expert store (by DMA from its page-locked slab).

mod backend;
mod cuda_model;
mod expert_cache;
mod experts;
mod forward;
mod gqa;
mod graphs;
mod rollback;
mod session;
mod spine;
mod weights;

pub use cuda_model::{CudaModel, CudaOptions};
pub use expert_cache::CudaCounters;
pub use session::CudaSession;
pub use weights::Source;
