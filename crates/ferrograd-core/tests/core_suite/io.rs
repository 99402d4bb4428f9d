//! `ferrograd_core::io`: the one atomic write, output-path checks and safe input files (issue 11:
//! a report truncated to 0 bytes by a kill during `fs::write`, a temp name that followed a planted
//! symlink, bench JSON truncated before failing, `--save X --report X`, a FIFO `--init` that hung).

use ferrograd_core::io::{self, check_output, check_outputs, read_input, write_atomic, write_atomic_with};
use ferrograd_core::Error;
use std::path::Path;

type R = std::result::Result<(), Box<dyn std::error::Error>>;

fn tmpdir(tag: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("fg-io-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

fn entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> =
        std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    v.sort();
    v
}

#[test]
fn writes_replace_the_file_whole_and_leave_nothing_behind() -> R {
    let d = tmpdir("whole");
    let p = d.join("report.json");
    write_atomic(&p, b"first")?;
    write_atomic(&p, b"second, longer")?;
    assert_eq!(std::fs::read(&p)?, b"second, longer");
    assert_eq!(entries(&d), vec!["report.json"]);
    // A write that fails half way (a crash, a full disk) leaves the old file as it was.
    let e = write_atomic_with(&p, |w| {
        use std::io::Write;
        w.write_all(b"half a rep")?;
        Err(std::io::Error::other("simulated crash"))
    })
    .unwrap_err();
    assert!(e.to_string().contains("simulated crash"), "{e}");
    assert_eq!(std::fs::read(&p)?, b"second, longer");
    assert_eq!(entries(&d), vec!["report.json"]);
    std::fs::remove_dir_all(&d)?;
    Ok(())
}

#[test]
fn temp_files_of_dead_processes_are_cleaned() -> R {
    let d = tmpdir("stale");
    let p = d.join("w.safetensors");
    // pid_max is at most 2^22 on Linux: this pid cannot be alive.
    let stale = io::temp_name_for(&p, 4_000_000_000, "abcdefghijkl")?;
    std::fs::write(&stale, b"left by a kill -9")?;
    let mine = io::temp_name_for(&p, std::process::id(), "mnopqrstuvwx")?;
    std::fs::write(&mine, b"ours: a live process")?;
    write_atomic(&p, b"new")?;
    assert!(!stale.exists(), "a dead process's temp file is removed");
    if Path::new("/proc/self").exists() {
        assert!(mine.exists(), "a live process's temp file is left alone");
    }
    std::fs::remove_file(&mine)?;
    assert_eq!(io::temp_files_of(&p), Vec::<std::ffi::OsString>::new());
    std::fs::remove_dir_all(&d)?;
    Ok(())
}

#[cfg(unix)]
#[test]
fn symlinks_are_replaced_never_followed() -> R {
    let d = tmpdir("link");
    let victim = d.join("victim");
    std::fs::write(&victim, b"precious")?;
    let p = d.join("out.json");
    // The models crate's old writer: `.out.json.tmp<pid>` created with File::create.
    std::os::unix::fs::symlink(&victim, d.join(format!(".out.json.tmp{}", std::process::id())))?;
    // A symlink at the target itself is replaced by the new file, not written through.
    let target_link = d.join("linked.json");
    std::os::unix::fs::symlink(&victim, &target_link)?;
    write_atomic(&p, b"{}")?;
    write_atomic(&target_link, b"{}")?;
    assert_eq!(std::fs::read(&victim)?, b"precious");
    assert_eq!(std::fs::read(&p)?, b"{}");
    assert!(!std::fs::symlink_metadata(&target_link)?.file_type().is_symlink());
    std::fs::remove_dir_all(&d)?;
    Ok(())
}

#[test]
fn output_paths_are_checked_before_any_work() -> R {
    let d = tmpdir("check");
    let good = d.join("r.json");
    check_output("--report", &good)?;
    assert!(!good.exists(), "the check leaves nothing behind");
    assert_eq!(entries(&d), Vec::<String>::new());

    let e = check_output("--report", &d.join("no/such/dir/r.json")).unwrap_err().to_string();
    assert!(e.contains("--report") && e.contains("does not exist"), "{e}");
    let e = check_output("--json", &d).unwrap_err().to_string();
    assert!(e.contains("is a directory"), "{e}");
    std::fs::write(d.join("file"), b"x")?;
    let e = check_output("--plot", &d.join("file/inside.png")).unwrap_err().to_string();
    assert!(e.contains("not a directory"), "{e}");

    // The same file under two flags, however it is spelled.
    let e = check_outputs(&[("--save", &good), ("--report", &good)]).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    assert!(e.to_string().contains("--save and --report name the same file"), "{e}");
    let dotted = d.join(".").join("r.json");
    assert!(check_outputs(&[("--json", &good), ("--plot", &dotted)]).is_err());
    check_outputs(&[("--json", &good), ("--plot", &d.join("r.png"))])?;
    std::fs::remove_dir_all(&d)?;
    Ok(())
}

#[test]
fn inputs_must_be_regular_files_within_a_size_cap() -> R {
    let d = tmpdir("input");
    let p = d.join("in.bin");
    std::fs::write(&p, vec![7u8; 1000])?;
    assert_eq!(read_input(&p, 1000, "test file")?.len(), 1000);
    let e = read_input(&p, 999, "test file").unwrap_err().to_string();
    assert!(e.contains("more than") && e.contains("test file"), "{e}");
    let e = read_input(&d, 10, "test file").unwrap_err().to_string();
    assert!(e.contains("is a directory"), "{e}");
    let e = read_input(&d.join("missing"), 10, "test file").unwrap_err().to_string();
    assert!(e.contains("no such file"), "{e}");
    #[cfg(unix)]
    {
        let fifo = d.join("fifo");
        if std::process::Command::new("mkfifo").arg(&fifo).status().is_ok_and(|s| s.success()) {
            let e = read_input(&fifo, 10, "test file").unwrap_err().to_string();
            assert!(e.contains("not a regular file"), "{e}");
            let e = check_output("--report", &fifo).unwrap_err().to_string();
            assert!(e.contains("not a regular file"), "{e}");
        }
    }
    std::fs::remove_dir_all(&d)?;
    Ok(())
}
