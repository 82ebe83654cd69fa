//! The generate example as a user runs it: bad flags fail with a clear message and exit code,
//! never a panic; a good run prints exactly the generated text on stdout.

use crate::common;

use std::{path::PathBuf, process::Command};

fn generate_bin() -> PathBuf {
    // target/<profile>/deps/cli-<hash> -> target/<profile>/examples/generate
    let exe = std::env::current_exe().unwrap();
    let bin = exe
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("examples")
        .join(format!("generate{}", std::env::consts::EXE_SUFFIX));
    assert!(bin.exists(), "{} not built (cargo test builds examples)", bin.display());
    bin
}

fn run(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(generate_bin())
        .args(args)
        .env("BURN_GEMMA_CACHE", std::env::temp_dir().join("burn-gemma-cli-empty-cache"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!stderr.contains("panicked") && !stderr.contains("RUST_BACKTRACE"), "panic: {stderr}");
    (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stdout).into_owned(), stderr)
}

fn tiny() -> String {
    common::fixtures().join("tiny-gemma/gemma3").display().to_string()
}

#[test]
fn bad_flags_fail_cleanly() {
    let model = tiny();
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["--temperature", "NaN"], "temperature"),
        (vec!["--temperature", "inf"], "temperature"),
        (vec!["--temperature=-1"], "temperature"),
        (vec!["--top-p", "0"], "top-p"),
        (vec!["--top-p", "1.5"], "top-p"),
        (vec!["--top-k", "0"], "top-k"),
        (vec!["--min-p", "1.5"], "min-p"),
        (vec!["--repeat-penalty", "0"], "repeat penalty"),
        (vec!["--max-new-tokens", "0"], "max-new-tokens"),
        (vec!["--backend", "tpu"], "unknown backend"),
        (vec!["--dtype", "f8"], "unknown dtype"),
        (vec!["--thinking"], "add --chat"),
        (vec!["--system", "Be brief."], "add --chat"),
        (vec!["--draft", "assistant:/nonexistent/assistant"], "does not exist"),
        (vec!["--draft", "model:/nonexistent/draft.gguf"], "does not exist"),
        (vec!["--image", "/nonexistent/picture.png"], "does not exist"),
        (vec!["--mmproj", "/nonexistent/mmproj.gguf"], "does not exist"),
    ];
    for (flags, needle) in cases {
        let mut args = vec!["--model", model.as_str(), "--prompt", "hi"];
        args.extend(flags.iter());
        let (code, stdout, stderr) = run(&args);
        assert_eq!(code, 1, "{flags:?}: {stderr}");
        assert!(stdout.is_empty(), "{flags:?}: stdout {stdout:?}");
        assert!(stderr.contains("error:") && stderr.contains(needle), "{flags:?}: {stderr}");
    }
    // A Gemma 4 assistant given as the model: said so, with where it goes.
    let assistant = common::fixtures().join("tiny-gemma-assistant/gemma4-e").display().to_string();
    let (code, _, stderr) = run(&["--model", &assistant, "--prompt", "hi", "--backend", "ndarray"]);
    assert_eq!(code, 1, "{stderr}");
    assert!(stderr.contains("Gemma 4 assistant") && stderr.contains("--draft assistant:PATH"), "{stderr}");
    // Pictures for a text model.
    let picture = common::fixtures().join("tiny-gemma-vision/gemma3/image.png").display().to_string();
    let (code, _, stderr) = run(&["--model", &model, "--prompt", "hi", "--backend", "ndarray", "--image", &picture]);
    assert_eq!(code, 1, "{stderr}");
    assert!(stderr.contains("--image needs a multimodal model"), "{stderr}");
    let (code, _, stderr) = run(&["--model", "/nonexistent/model.gguf", "--prompt", "hi"]);
    assert_eq!(code, 1);
    assert!(stderr.contains("does not exist"), "{stderr}");
    let (code, _, stderr) = run(&["--model", &model, "--prompt", ""]);
    assert_eq!(code, 1);
    assert!(stderr.contains("prompt is empty"), "{stderr}");
    let (code, _, stderr) = run(&["--bogus-flag"]);
    assert_eq!(code, 2, "clap usage error");
    assert!(stderr.contains("--bogus-flag"), "{stderr}");
}

#[test]
fn not_a_model_and_missing_backend() {
    let junk = crate::common::Scratch::new("cli").file("junk.gguf");
    std::fs::write(&junk, "definitely not a model").unwrap();
    let (code, _, stderr) = run(&["--model", junk.to_str().unwrap(), "--prompt", "hi", "--backend", "ndarray"]);
    assert_eq!(code, 1);
    assert!(stderr.contains("not a GGUF file"), "{stderr}");
    #[cfg(not(feature = "cuda"))]
    {
        let (code, _, stderr) = run(&["--model", &tiny(), "--prompt", "hi", "--backend", "cuda"]);
        assert_eq!(code, 1);
        assert!(stderr.contains("not compiled in") && stderr.contains("--features cuda"), "{stderr}");
    }
    // The tiny checkpoint has no tokenizer.json: a clear error, not a panic.
    let (code, _, stderr) = run(&["--model", &tiny(), "--prompt", "hi", "--backend", "ndarray"]);
    assert_eq!(code, 1);
    assert!(stderr.contains("tokenizer.json"), "{stderr}");
    let (code, _, stderr) = run(&["--model", &tiny(), "--prompt", "hi", "--backend", "ndarray", "--dtype", "bf16"]);
    assert_eq!(code, 1);
    assert!(stderr.contains("does not support dtype BF16"), "{stderr}");
    let (code, stdout, _) = run(&["--list-devices"]);
    assert_eq!(code, 0);
    assert!(stdout.contains("ndarray"), "{stdout}");
}

#[test]
fn real_model_generation_and_context_limit() {
    let model = common::real_model();
    let model = model.display().to_string();
    let (code, stdout, stderr) =
        run(&["--model", &model, "--prompt", "The capital of France is", "--max-new-tokens", "8"]);
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(stdout, " the capital of the country of France.", "stdout must be exactly the generated text");
    for field in ["backend:", "prompt tokens: 6", "time to first token", "prefill", "generated tokens: 8", "decode"] {
        assert!(stderr.contains(field), "missing {field:?} in {stderr}");
    }
    let (code, stdout, stderr) = run(&["--model", &model, "--prompt", "Hello", "--max-new-tokens", "40000"]);
    assert_eq!(code, 1);
    assert!(stdout.is_empty());
    assert!(stderr.contains("40000") && stderr.contains("32768"), "{stderr}");
}
