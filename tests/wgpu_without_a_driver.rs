//! A machine whose Vulkan loader finds no driver: the wgpu devices are listed as absent, and
//! asking for one is a clear error, not a panic inside CubeCL's runtime.
//!
//! The loader reads its driver list once per process, from the environment: so this binary runs
//! itself again with the variables that hide every driver, and checks what the child printed.
//! It has no test harness (`harness = false`): `main` is the test.

use burn_gemma::{
    backends::{dispatch, list_devices, BackendKind, BackendTask},
    GemmaBackend,
};
use std::process::{Command, ExitCode};

/// Set in the child's environment.
const CHILD: &str = "BURN_GEMMA_NO_DRIVER_CHILD";

struct Name;

impl BackendTask for Name {
    type Output = String;
    fn run<B: GemmaBackend>(self, _device: B::Device, name: &str) -> String {
        name.to_string()
    }
}

/// What the child prints: the device list, then what asking for wgpu gives.
fn child() {
    for line in list_devices() {
        println!("{line}");
    }
    match dispatch(BackendKind::Wgpu, Name, &mut |_| {}) {
        Ok(name) => println!("ran on {name}"),
        Err(e) => println!("error: {e}"),
    }
}

fn main() -> ExitCode {
    if std::env::var_os(CHILD).is_some() {
        child();
        return ExitCode::SUCCESS;
    }
    let exe = std::env::current_exe().expect("this test's own path");
    let out = Command::new(exe)
        .env(CHILD, "1")
        // The first is the loader's older name for the variable, the second its newer one.
        .env("VK_ICD_FILENAMES", "/nonexistent/icd.json")
        .env("VK_DRIVER_FILES", "/nonexistent/icd.json")
        .output()
        .expect("run the child");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let mut failures = Vec::new();
    if !out.status.success() {
        failures.push(format!("the child exited with {}", out.status));
    }
    if stderr.contains("panicked") {
        failures.push("the child panicked".to_string());
    }
    for line in [
        "wgpu discrete GPU: none",
        "wgpu integrated GPU: none",
        "wgpu CPU adapter (software): none",
        "error: backend: the wgpu backend is compiled in but found no usable device",
    ] {
        if !stdout.lines().any(|l| l == line) {
            failures.push(format!("missing the line {line:?}"));
        }
    }
    if failures.is_empty() {
        println!("test wgpu_without_a_driver ... ok");
        // The line libtest ends with, which the CI's tally reads.
        println!("\ntest result: ok. 1 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out");
        ExitCode::SUCCESS
    } else {
        println!("test wgpu_without_a_driver ... FAILED");
        println!("\ntest result: FAILED. 0 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out");
        println!("{}\nstdout:\n{stdout}\nstderr:\n{stderr}", failures.join("\n"));
        ExitCode::FAILURE
    }
}
