//! Bytes as a command line (arguments separated by NUL): parsed and checked (`Job::check`, which
//! opens no device and writes nothing). Any outcome but a panic is fine.
#![no_main]

use ferrograd_cli::{Cli, Job};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let args = std::iter::once("ferrograd".to_string())
        .chain(data.split(|&b| b == 0).map(|a| String::from_utf8_lossy(a).into_owned()))
        .take(16);
    let Ok(cli) = Cli::parse_from_args(args) else { return };
    match Job::from_cli(cli).and_then(|j| j.check().map(|()| j)) {
        Ok(job) => {
            let _ = job.outputs();
        }
        Err(e) => assert!(!e.to_string().is_empty()),
    }
});
