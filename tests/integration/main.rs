//! The integration tests, one binary: each file here is one subject (tiny HF fixtures, the real
//! model, generation, the engine, the server ...). One binary instead of one per file: every file
//! instantiates the model for NdArray, Candle and wgpu, and release builds do not share those
//! instantiations between binaries, so one per file multiplied the build time of the README's
//! test command. `tests/process` (fuzzing and soak) is a binary of its own: the fuzzer
//! counts every allocation in its process and the soak compares the device memory its process
//! reserves, which other tests running beside them would disturb.

#[path = "../common/mod.rs"]
mod common;

mod assistant;
mod bad_inputs;
mod batched_step;
mod cli;
mod cuda_graph;
mod engine;
mod gemma4_gguf;
mod generation;
mod real_model;
#[cfg(feature = "server")]
mod server;
#[cfg(feature = "server")]
mod server_hostile;
mod speculative;
mod tensor_parallel;
mod tiny_models;
mod vision;
