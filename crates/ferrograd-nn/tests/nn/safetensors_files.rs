//! `load_safetensors` / `save_safetensors` (issue 17 item 2): the CPU path against the
//! `safetensors` crate's own reading, every dtype we hold, tensors at odd offsets, typed errors for
//! malformed files, streamed saves equal to the in-memory serialisation; and on a GPU, the device
//! path (pinned and cuFile) byte for byte equal to the host path, checkpoint loads into a CUDA
//! model equal to CPU loads, non-finite values found on the device as on the host.

use crate::common::*;
use ferrograd_core::{bf16, f16, DType, Device, Rng, Tensor};
use ferrograd_nn::checkpoint::{
    self, load_safetensors, load_safetensors_with, save_safetensors, CheckpointError, LoadOptions, ReadOptions,
    ReadPath, TrainState,
};
use ferrograd_nn::*;
use std::collections::HashMap;
use std::path::Path;

type R = std::result::Result<(), Box<dyn std::error::Error>>;

const QUIET: ReadOptions<'static> = ReadOptions { only: None, allow_cufile: true, log: false };

/// Bytes of a tensor, little-endian row-major (the file's representation).
fn bytes_of(t: &Tensor) -> Vec<u8> {
    fn raw<T: ferrograd_core::WithDType>(t: &Tensor) -> Vec<u8> {
        bytemuck::cast_slice(&t.to_vec::<T>().expect("readable")).to_vec()
    }
    match t.dtype() {
        DType::F32 => raw::<f32>(t),
        DType::F64 => raw::<f64>(t),
        DType::F16 => raw::<f16>(t),
        DType::BF16 => raw::<bf16>(t),
        DType::I32 => raw::<i32>(t),
        DType::U32 => raw::<u32>(t),
        DType::U8 => raw::<u8>(t),
        DType::I8 => raw::<i8>(t),
    }
}

/// One tensor of every dtype, odd sizes (3, 5, 7 elements ...) so that offsets are not multiples
/// of 8, random non-zero values.
fn all_dtypes(device: Device) -> ferrograd_core::Result<Vec<(String, Tensor)>> {
    let mut rng = Rng::new(17);
    let mut out = Vec::new();
    for (i, d) in [DType::F32, DType::F64, DType::F16, DType::BF16, DType::I32, DType::U32, DType::U8, DType::I8]
        .into_iter()
        .enumerate()
    {
        let n = 3 + 2 * i;
        let f = Tensor::rand_with(&mut rng, 1.0, 100.0, (n, 3), DType::F32, device)?;
        out.push((format!("t.{d}"), f.to_dtype(d)?));
    }
    // A scalar-shaped and an empty tensor ride along.
    out.push(("scalar".into(), Tensor::from_vec(vec![2.5f32], Vec::<usize>::new(), device)?));
    out.push(("empty".into(), Tensor::zeros((0, 4), DType::F32, device)?));
    Ok(out)
}

fn save_all(path: &Path, ts: &[(String, Tensor)]) -> Result<(), CheckpointError> {
    let named: Vec<(&str, &Tensor)> = ts.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let meta = HashMap::from([("k".to_string(), "v".to_string())]);
    save_safetensors(path, &named, meta)
}

/// A file from a header JSON (padded to 8 bytes) and a data section.
fn raw_file(path: &Path, json: &str, data: &[u8]) -> std::io::Result<()> {
    let mut h = json.as_bytes().to_vec();
    h.resize(h.len().next_multiple_of(8), b' ');
    let mut b = (h.len() as u64).to_le_bytes().to_vec();
    b.extend(h);
    b.extend(data);
    std::fs::write(path, b)
}

#[test]
fn cpu_load_matches_the_safetensors_crate_for_every_dtype() -> R {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("all.safetensors");
    let ts = all_dtypes(CPU)?;
    save_all(&path, &ts)?;
    let file = std::fs::read(&path)?;
    let st = safetensors::SafeTensors::deserialize(&file)?;
    let got = load_safetensors_with(&path, CPU, QUIET)?;
    assert_eq!(got.read, ReadPath::Host);
    assert_eq!(got.metadata.get("k").map(String::as_str), Some("v"));
    assert_eq!(got.tensors.len(), ts.len());
    for (name, t) in &ts {
        let l = &got.tensors[name];
        assert_eq!((l.dtype(), l.dims()), (t.dtype(), t.dims()), "{name}");
        assert_eq!(bytes_of(l), bytes_of(t), "{name}: loaded bytes");
        assert_eq!(st.tensor(name)?.data(), bytes_of(t).as_slice(), "{name}: the crate reads what we wrote");
    }
    assert_eq!(got.bytes, ts.iter().map(|(_, t)| (t.elem_count() * t.dtype().size_in_bytes()) as u64).sum::<u64>());
    assert!(got.summary().contains("host reads"), "{}", got.summary());
    Ok(())
}

#[test]
fn streamed_saves_equal_the_in_memory_serialisation() -> R {
    let dir = tempfile::tempdir()?;
    // A checkpoint: `save` streams, `to_bytes` serialises in memory; the files must be identical.
    let m = mlp(&[3, 5, 2], Activation::Tanh, &mut Rng::new(3))?;
    let mut opt = optim::Adam::new(m.named_parameters(), Default::default())?;
    let x = Tensor::randn_with(&mut Rng::new(9), 0.0, 1.0, (4, 3), DType::F32, CPU)?;
    optim::Optimizer::step(&mut opt, &m.forward(&x)?.sqr()?.mean_all()?.backward()?)?;
    let state = TrainState { step: 7, ..Default::default() };
    let path = dir.path().join("ckpt.safetensors");
    checkpoint::save(&path, &m, Some(&opt), &state)?;
    assert_eq!(std::fs::read(&path)?, checkpoint::to_bytes(&m, Some(&opt), &state, "x")?);
    // Plain tensors of mixed dtypes: the same as serialising their bytes.
    let ts = all_dtypes(CPU)?;
    let p2 = dir.path().join("plain.safetensors");
    save_all(&p2, &ts)?;
    struct B(safetensors::Dtype, Vec<usize>, Vec<u8>);
    impl safetensors::View for &B {
        fn dtype(&self) -> safetensors::Dtype {
            self.0
        }
        fn shape(&self) -> &[usize] {
            &self.1
        }
        fn data(&self) -> std::borrow::Cow<'_, [u8]> {
            std::borrow::Cow::Borrowed(&self.2)
        }
        fn data_len(&self) -> usize {
            self.2.len()
        }
    }
    let st_dtype = |d: DType| -> safetensors::Dtype {
        serde_json::from_value(serde_json::Value::String(d.to_string().to_uppercase())).expect("dtype name")
    };
    let blobs: Vec<(String, B)> =
        ts.iter().map(|(n, t)| (n.clone(), B(st_dtype(t.dtype()), t.dims().to_vec(), bytes_of(t)))).collect();
    let meta = HashMap::from([("k".to_string(), "v".to_string())]);
    let want = checkpoint::serialize_safetensors(blobs.iter().map(|(n, b)| (n.as_str(), b)), Some(meta))?;
    assert_eq!(std::fs::read(&p2)?, want);
    // Duplicate names are refused before anything is written.
    let t = &ts[0].1;
    let e = save_safetensors(dir.path().join("dup"), &[("a", t), ("a", t)], HashMap::new()).unwrap_err();
    assert!(matches!(e, CheckpointError::Metadata { .. }), "{e}");
    assert!(!dir.path().join("dup").exists());
    Ok(())
}

/// A u8 tensor of 3 bytes first, so the f32 and f16 tensors after it start at odd offsets: the
/// safetensors crate never writes this, other writers may.
fn odd_offsets_file(path: &Path) -> std::io::Result<(Vec<u8>, Vec<f32>, Vec<f16>)> {
    let a = vec![7u8, 200, 9];
    let b: Vec<f32> = vec![1.5, -2.25, 3e-3, 7e7, -0.0];
    let c: Vec<f16> = [0.5f32, -6.0, 1e-3].iter().map(|&v| f16::from_f32(v)).collect();
    let json = r#"{"a":{"dtype":"U8","shape":[3],"data_offsets":[0,3]},"b":{"dtype":"F32","shape":[5],"data_offsets":[3,23]},"c":{"dtype":"F16","shape":[3],"data_offsets":[23,29]}}"#;
    let mut data = a.clone();
    data.extend(b.iter().flat_map(|v| v.to_le_bytes()));
    data.extend(c.iter().flat_map(|v| v.to_le_bytes()));
    raw_file(path, json, &data)?;
    Ok((a, b, c))
}

#[test]
fn tensors_at_odd_offsets_load_exactly() -> R {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("odd.safetensors");
    let (a, b, c) = odd_offsets_file(&path)?;
    // The plain call (it prints its line).
    let got = load_safetensors(&path, CPU)?;
    assert_eq!(got.tensors["a"].to_vec::<u8>()?, a);
    assert_eq!(
        got.tensors["b"].to_vec::<f32>()?.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        b.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
    );
    assert_eq!(got.tensors["c"].to_vec::<f16>()?, c);
    Ok(())
}

#[test]
fn dtypes_we_cannot_hold_are_named_and_can_be_skipped() -> R {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("i64.safetensors");
    let json = r#"{"ids":{"dtype":"I64","shape":[2],"data_offsets":[0,16]},"w":{"dtype":"F32","shape":[1],"data_offsets":[16,20]}}"#;
    let mut data: Vec<u8> = [5i64, -1].iter().flat_map(|v| v.to_le_bytes()).collect();
    data.extend(4.0f32.to_le_bytes());
    raw_file(&path, json, &data)?;
    let e = load_safetensors_with(&path, CPU, QUIET).unwrap_err();
    assert!(matches!(&e, CheckpointError::Unsupported { dtype, .. } if dtype == "I64"), "{e}");
    assert_eq!(e.tensor_name(), Some("ids"));
    let skip = |n: &str| n != "ids";
    let got = load_safetensors_with(&path, CPU, ReadOptions { only: Some(&skip), ..QUIET })?;
    assert_eq!(got.tensors.keys().collect::<Vec<_>>(), ["w"]);
    assert_eq!(got.tensors["w"].to_vec::<f32>()?, [4.0]);
    assert_eq!(got.bytes, 4);
    Ok(())
}

/// A malformed file's header, its data bytes, and the check its error must pass.
type BadCase = (&'static str, Vec<u8>, fn(&CheckpointError) -> bool);

#[test]
fn malformed_files_are_typed_errors() -> R {
    let dir = tempfile::tempdir()?;
    let p = dir.path().join("bad.safetensors");
    let f32s = |n: usize| vec![0x3fu8; 4 * n];
    let cases: Vec<BadCase> = vec![
        // The second tensor's bytes run past the end.
        (
            r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}}"#,
            f32s(3),
            |e| matches!(e, CheckpointError::Truncated { name, .. } if name == "b"),
        ),
        // Two tensors share bytes.
        (
            r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}"#,
            f32s(2),
            |e| matches!(e, CheckpointError::Corrupt { msg, .. } if msg.contains("overlapping")),
        ),
        // A gap between tensors.
        (
            r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}}"#,
            f32s(3),
            |e| matches!(e, CheckpointError::Corrupt { msg, .. } if msg.contains("gap")),
        ),
        // Shape and byte range disagree.
        (
            r#"{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#,
            f32s(2),
            |e| matches!(e, CheckpointError::Corrupt { msg, .. } if msg.contains("tensor a")),
        ),
        // Bytes beyond what the header describes.
        (r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#, f32s(2), |e| {
            matches!(e, CheckpointError::Corrupt { .. })
        }),
        // Not JSON.
        ("{not json", vec![], |e| matches!(e, CheckpointError::Corrupt { .. })),
        // An unknown dtype.
        (
            r#"{"a":{"dtype":"F5","shape":[1],"data_offsets":[0,4]}}"#,
            f32s(1),
            |e| matches!(e, CheckpointError::Corrupt { msg, .. } if msg.contains("tensor a")),
        ),
    ];
    for (json, data, ok) in cases {
        raw_file(&p, json, &data)?;
        let e = load_safetensors_with(&p, CPU, QUIET).unwrap_err();
        assert!(ok(&e), "{json}: {e:?}");
        assert!(e.to_string().contains("bad.safetensors"), "{e}");
    }
    // A header length past the end of the file, an empty file, a missing file.
    std::fs::write(&p, 1000u64.to_le_bytes())?;
    assert!(matches!(load_safetensors_with(&p, CPU, QUIET), Err(CheckpointError::Corrupt { .. })));
    std::fs::write(&p, b"")?;
    assert!(matches!(load_safetensors_with(&p, CPU, QUIET), Err(CheckpointError::Corrupt { .. })));
    let missing = dir.path().join("missing.safetensors");
    assert!(matches!(load_safetensors_with(&missing, CPU, QUIET), Err(CheckpointError::Io { .. })));
    Ok(())
}

// ---- On a GPU (each test skips with one line without one) ----

#[test]
fn cuda_load_safetensors_equals_the_host_path_byte_for_byte() -> R {
    let Some(gpu) = cuda("cuda_load_safetensors_equals_the_host_path_byte_for_byte") else { return Ok(()) };
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("all.safetensors");
    let mut ts = all_dtypes(CPU)?;
    // A tensor spanning several pinned chunks (8 MiB each) and ending mid-chunk.
    let big = Tensor::rand_with(&mut Rng::new(5), -1.0, 1.0, 5 << 20, DType::F32, CPU)?;
    ts.push(("big".into(), big.narrow(0, 0, (5 << 20) - 3)?.contiguous()?));
    save_all(&path, &ts)?;
    let host = load_safetensors_with(&path, CPU, QUIET)?;
    for allow_cufile in [false, true] {
        let dev = load_safetensors_with(&path, gpu, ReadOptions { allow_cufile, ..QUIET })?;
        let line = dev.summary();
        eprintln!("{line}");
        if !allow_cufile {
            assert_eq!(dev.read, ReadPath::Pinned);
        }
        let named = match dev.read {
            ReadPath::Pinned => "pinned double-buffered",
            ReadPath::CuFile { .. } => "cuFile",
            ReadPath::Host => panic!("a CUDA load took the host path"),
        };
        assert!(line.contains(named) && line.contains("GB/s") && line.contains("cuda:0"), "{line}");
        for (name, h) in &host.tensors {
            let d = &dev.tensors[name];
            assert_eq!(d.device(), gpu);
            assert_eq!((d.dtype(), d.dims()), (h.dtype(), h.dims()), "{name}");
            assert_eq!(bytes_of(d), bytes_of(h), "{name} ({})", dev.read);
        }
    }
    // Odd offsets: each tensor gets its own (aligned) allocation.
    let odd = dir.path().join("odd.safetensors");
    let (a, b, _) = odd_offsets_file(&odd)?;
    let got = load_safetensors_with(&odd, gpu, ReadOptions { allow_cufile: false, ..QUIET })?;
    assert_eq!(got.tensors["a"].to_vec::<u8>()?, a);
    assert_eq!(bytes_of(&got.tensors["b"]), b.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<_>>());
    // Malformed files fail the same way on the device path.
    let bad = dir.path().join("bad.safetensors");
    raw_file(&bad, r#"{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}"#, &[1u8; 12])?;
    let e = load_safetensors_with(&bad, gpu, QUIET).unwrap_err();
    assert!(matches!(e, CheckpointError::Truncated { .. }), "{e}");
    Ok(())
}

#[test]
fn cuda_saves_equal_cpu_saves() -> R {
    let Some(gpu) = cuda("cuda_saves_equal_cpu_saves") else { return Ok(()) };
    let dir = tempfile::tempdir()?;
    let mut ts = all_dtypes(CPU)?;
    let big = Tensor::rand_with(&mut Rng::new(6), -1.0, 1.0, (3 << 20) + 5, DType::F32, CPU)?;
    ts.push(("big".into(), big));
    let on_gpu: Vec<(String, Tensor)> =
        ts.iter().map(|(n, t)| Ok((n.clone(), t.to_device(gpu)?))).collect::<ferrograd_core::Result<_>>()?;
    let (pc, pg) = (dir.path().join("cpu.safetensors"), dir.path().join("gpu.safetensors"));
    save_all(&pc, &ts)?;
    save_all(&pg, &on_gpu)?;
    assert_eq!(std::fs::read(&pc)?, std::fs::read(&pg)?);
    // A strided view on the device is written as its elements.
    let m = Tensor::rand_with(&mut Rng::new(8), -1.0, 1.0, (64, 48), DType::F32, CPU)?;
    let (tc, tg) = (m.t()?, m.to_device(gpu)?.t()?);
    save_safetensors(&pc, &[("t", &tc)], HashMap::new())?;
    save_safetensors(&pg, &[("t", &tg)], HashMap::new())?;
    assert_eq!(std::fs::read(&pc)?, std::fs::read(&pg)?);
    Ok(())
}

#[test]
fn cuda_checkpoint_loads_equal_cpu_loads_and_find_nonfinite_values() -> R {
    let Some(gpu) = cuda("cuda_checkpoint_loads_equal_cpu_loads_and_find_nonfinite_values") else { return Ok(()) };
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("ckpt.safetensors");
    let src = mlp(&[7, 33, 5], Activation::Tanh, &mut Rng::new(1))?;
    checkpoint::save(&path, &src, None, &TrainState::default())?;
    let on_cpu = mlp(&[7, 33, 5], Activation::Tanh, &mut Rng::new(2))?;
    let on_gpu = mlp_on(&[7, 33, 5], Activation::Tanh, &mut Rng::new(2), gpu)?;
    checkpoint::load(&path, &on_cpu, None)?;
    checkpoint::load(&path, &on_gpu, None)?;
    for ((n, a), (_, b)) in on_cpu.named_parameters().iter().zip(on_gpu.named_parameters()) {
        assert_eq!(bytes_of(a), bytes_of(&b), "{n}");
    }
    // A NaN at element 40 of the first layer's weight: the same error from both paths, and the
    // GPU model left as it was.
    let mut w = src.named_parameters()[0].1.to_vec::<f32>()?;
    w[40] = f32::NEG_INFINITY;
    let named = src.named_parameters();
    let bad = Tensor::from_vec(w, named[0].1.dims(), CPU)?;
    let mut list: Vec<(&str, &Tensor)> = named.iter().map(|(n, t)| (n.as_str(), t)).collect();
    list[0].1 = &bad;
    save_safetensors(&path, &list, HashMap::new())?;
    let fresh = mlp_on(&[7, 33, 5], Activation::Tanh, &mut Rng::new(3), gpu)?;
    let before: Vec<Vec<u8>> = fresh.named_parameters().iter().map(|(_, t)| bytes_of(t)).collect();
    let (ec, eg) = (
        checkpoint::load(&path, &on_cpu, None).unwrap_err().to_string(),
        checkpoint::load(&path, &fresh, None).unwrap_err().to_string(),
    );
    assert_eq!(ec, eg);
    assert!(eg.contains("element 40") && eg.contains("-inf") && eg.contains(&named[0].0), "{eg}");
    let after: Vec<Vec<u8>> = fresh.named_parameters().iter().map(|(_, t)| bytes_of(t)).collect();
    assert_eq!(before, after, "nothing written on error");
    checkpoint::load_with(&path, &fresh, None, LoadOptions { allow_nonfinite: true })?;
    assert_eq!(fresh.named_parameters()[0].1.to_vec::<f32>()?[40], f32::NEG_INFINITY);
    Ok(())
}
