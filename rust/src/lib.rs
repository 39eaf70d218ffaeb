//! loka-stats: streaming, mergeable statistics of sampled tensors for FP8 decisions.
//!
//! The pure-Rust core ([`Sketch`], [`ErrorAccumulator`], FP8 emulation and range fit) has no
//! Python dependency; the `python` feature adds the `loka.stats._native` bindings.

pub mod codec;
pub mod error_acc;
pub mod fp8;
pub mod histogram;
pub mod ingest;
pub mod range_fit;
pub mod rows;
pub mod sketch;

pub use error_acc::ErrorAccumulator;
pub use range_fit::{optimal_scale, range_fit, RangeFit};
pub use sketch::Sketch;

#[cfg(feature = "python")]
mod python;
