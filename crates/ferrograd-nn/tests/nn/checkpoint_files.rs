//! Checkpoint files that are not what they claim (issue 11): non-finite values are refused unless
//! allowed, a FIFO or a directory is refused without blocking, a huge file is rejected from its
//! header alone, an unreadable file is named as such, and writes are atomic and never follow a
//! planted symlink.

use crate::common::*;
use ferrograd_core::{Error, Rng, Tensor};
use ferrograd_nn::checkpoint::{self, CheckpointError, LoadOptions, TrainState};
use ferrograd_nn::*;
use std::collections::HashMap;

type R = std::result::Result<(), Box<dyn std::error::Error>>;

fn layer() -> ferrograd_core::Result<Linear> {
    Linear::new(3, 2, true, &mut Rng::new(4), CPU)
}

#[test]
fn nan_and_inf_weights_are_refused_unless_allowed() -> R {
    let dir = tempfile::tempdir()?;
    for (bad, want) in [(f32::NAN, "NaN"), (f32::INFINITY, "inf"), (f32::NEG_INFINITY, "-inf")] {
        let path = dir.path().join("bad.safetensors");
        let lin = layer()?;
        let mut w = lin.weight.to_vec::<f32>()?;
        w[4] = bad;
        let w = Tensor::from_vec(w, (2, 3), CPU)?;
        checkpoint::save_safetensors(
            &path,
            &[("weight", &w), ("bias", lin.bias.as_ref().ok_or("bias")?)],
            HashMap::new(),
        )?;
        let target = layer()?;
        let before = target.weight.to_vec::<f32>()?;
        match checkpoint::load(&path, &target, None) {
            Err(e @ CheckpointError::NonFinite { .. }) => {
                assert_eq!(e.tensor_name(), Some("weight"));
                let msg = e.to_string();
                assert!(msg.contains("element 4") && msg.contains(want), "{msg}");
                // Converted for core callers, it stays a non-finite error.
                assert!(matches!(Error::from(e), Error::NonFinite { index: 4, .. }));
            }
            other => panic!("expected a non-finite error, got {other:?}"),
        }
        assert_eq!(target.weight.to_vec::<f32>()?, before, "nothing written on error");
        checkpoint::load_with(&path, &target, None, LoadOptions { allow_nonfinite: true })?;
        let got = target.weight.to_vec::<f32>()?[4];
        assert!(got.is_nan() == bad.is_nan() && (bad.is_nan() || got == bad), "{got}");
    }
    Ok(())
}

#[test]
fn directories_and_fifos_are_refused_without_blocking() -> R {
    let dir = tempfile::tempdir()?;
    let e = checkpoint::load(dir.path(), &layer()?, None).unwrap_err().to_string();
    assert!(e.contains("is a directory"), "{e}");
    #[cfg(unix)]
    {
        let fifo = dir.path().join("pipe");
        let ok = std::process::Command::new("mkfifo").arg(&fifo).status().is_ok_and(|s| s.success());
        if ok {
            // Before issue 11's fix this read blocked forever waiting for a writer.
            let e = checkpoint::load(&fifo, &layer()?, None).unwrap_err().to_string();
            assert!(e.contains("not a regular file"), "{e}");
        }
    }
    let e = checkpoint::load(dir.path().join("missing"), &layer()?, None).unwrap_err().to_string();
    assert!(e.contains("no such file"), "{e}");
    Ok(())
}

#[test]
fn a_huge_file_is_rejected_from_its_header() -> R {
    // A valid header for a 2x3 + 2 layer followed by 4 GiB (sparse) of nothing: the old loader
    // read all of it before looking; now the header's sizes disagree with the file's and nothing
    // past the header is read.
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("huge.safetensors");
    let lin = layer()?;
    checkpoint::save(&path, &lin, None, &TrainState::default())?;
    let f = std::fs::OpenOptions::new().write(true).open(&path)?;
    f.set_len(4 << 30)?;
    drop(f);
    let e = checkpoint::load(&path, &layer()?, None).unwrap_err();
    assert!(matches!(e, CheckpointError::Corrupt { .. }), "{e}");
    assert!(e.to_string().contains("data section"), "{e}");
    Ok(())
}

#[test]
fn an_unreadable_file_is_named_as_such() -> R {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir()?;
        let sub = dir.path().join("locked");
        std::fs::create_dir(&sub)?;
        let path = sub.join("w.safetensors");
        checkpoint::save(&path, &layer()?, None, &TrainState::default())?;
        std::fs::set_permissions(&sub, std::fs::Permissions::from_mode(0o000))?;
        if std::fs::metadata(&path).is_ok() {
            println!("running as root: permissions are not enforced, nothing to check");
        } else {
            // Issue 11: an unreadable directory was reported as "no such file".
            let e = checkpoint::load(&path, &layer()?, None).unwrap_err().to_string();
            assert!(e.contains("permission denied"), "{e}");
        }
        std::fs::set_permissions(&sub, std::fs::Permissions::from_mode(0o755))?;
    }
    Ok(())
}

#[test]
fn saving_never_follows_a_planted_symlink() -> R {
    #[cfg(unix)]
    {
        let dir = tempfile::tempdir()?;
        let victim = dir.path().join("victim.txt");
        std::fs::write(&victim, b"precious")?;
        let path = dir.path().join("model.safetensors");
        // The old models-crate writer used the predictable name `.model.safetensors.tmp<pid>`
        // and `File::create`, which follows a symlink planted there. Plant one under every name
        // this process could predict.
        let pid = std::process::id();
        for name in [format!(".model.safetensors.tmp{pid}"), format!(".model.safetensors.tmp-{pid}-0")] {
            std::os::unix::fs::symlink(&victim, dir.path().join(name))?;
        }
        checkpoint::save(&path, &layer()?, None, &TrainState::default())?;
        assert_eq!(std::fs::read(&victim)?, b"precious");
        checkpoint::load(&path, &layer()?, None)?;
    }
    Ok(())
}
