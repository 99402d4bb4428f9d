//! The `ferrograd` binary: everything lives in the library (`lib.rs`), so that the argument
//! parsing and validation can be fuzzed and tested without starting a process.

fn main() -> std::process::ExitCode {
    ferrograd_cli::main()
}
