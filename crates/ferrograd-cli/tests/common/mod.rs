//! What the CLI's integration tests share (each `tests/*.rs` includes it with `mod common;`): where
//! the `ferrograd` binary under test is, and its output as text.
#![allow(dead_code)] // each test crate uses a different part

use std::path::PathBuf;
use std::process::Output;

/// The binary under test: $FERROGRAD_BIN, else cargo's build path, else (when the test binary was
/// carried to a GPU machine by ../shared/gpu/bundle) the bundled copy in .gpu/bin.
pub fn bin() -> PathBuf {
    if let Some(p) = std::env::var_os("FERROGRAD_BIN") {
        return p.into();
    }
    let built = PathBuf::from(env!("CARGO_BIN_EXE_ferrograd"));
    if built.exists() {
        return built;
    }
    PathBuf::from(".gpu/bin/ferrograd")
}

/// (stdout, stderr) of a finished run, lossily decoded.
pub fn text(o: &Output) -> (String, String) {
    (String::from_utf8_lossy(&o.stdout).into_owned(), String::from_utf8_lossy(&o.stderr).into_owned())
}
