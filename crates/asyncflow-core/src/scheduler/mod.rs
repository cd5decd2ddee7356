//! Proactive load balancing. Dynamic balancing comes free from pull-based claims (a faster
//! worker claims more often); this module adds what pulling cannot: splitting one training step's
//! rows evenly over data-parallel ranks, cutting a rank's rows into token-bounded micro-batches,
//! and routing prompt groups to the least-loaded rollout engine. Pure functions and state
//! machines: no clock (time is passed in), no I/O.

mod cost;
mod differencing;
mod greedy;
mod micro_batch;
mod partition;
mod refine;
mod router;

pub use cost::CostModel;
pub use micro_batch::{MicroBatchOptions, micro_batches};
pub use partition::{Method, PartitionOptions, part_costs, partition};
pub use router::{EngineLoad, EngineState, Rerouted, Router};
