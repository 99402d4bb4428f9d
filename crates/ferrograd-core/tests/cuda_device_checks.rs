//! Index and class-id range checks made on the device (issue 10, item 4): an op given an id out of
//! range returns at once without reading the ids on the host; the next host read (or
//! `synchronize`) returns `Error::IndexOutOfRange` naming the op and the bad value, and the read
//! after it works again. Without a usable GPU the test prints one line and passes.
//!
//! One test function on purpose: the flag is per device, so a bad index in one test would be
//! reported to whichever test of the same process reads the device next.

use ferrograd_core::cuda::{set_poison_allocations, CudaDevice};
use ferrograd_core::{DType, Device, Error, Result, Rng, Tensor};

fn on(t: &Tensor, d: Device) -> Tensor {
    t.to_device(d).expect("transfer")
}

/// The error the next host read reports, then proof that the flag is armed again.
fn reported(what: &str, out: &Tensor) -> Error {
    let err = match out.to_f64_vec() {
        Err(e) => e,
        Ok(_) => panic!("{what}: the read after a bad index succeeded"),
    };
    let again = out.to_f64_vec();
    assert!(again.is_ok(), "{what}: the flag was not re-armed: {again:?}");
    err
}

fn expect(what: &str, out: Result<Tensor>, op: &str, index: i64, size: usize) {
    let out = out.unwrap_or_else(|e| panic!("{what}: the op itself failed ({e}); the check belongs on the device"));
    match reported(what, &out) {
        Error::IndexOutOfRange { op: o, index: i, size: s } => {
            assert_eq!((o, i, s), (op, index, size), "{what}");
        }
        e => panic!("{what}: wrong error {e}"),
    }
}

#[test]
fn bad_ids_are_reported_at_the_next_host_read() -> Result<()> {
    let dev = match CudaDevice::get(0) {
        Ok(_) => Device::Cuda(0),
        Err(e) => {
            println!("skipping CUDA test: {e}");
            return Ok(());
        }
    };
    set_poison_allocations(true);
    let mut rng = Rng::new(11);
    let x = on(&Tensor::rand_with(&mut rng, -1.0, 1.0, (3, 5), DType::F32, Device::Cpu)?, dev);

    for (ids, bad) in [
        (Tensor::from_vec(vec![0u32, 3, 1], 3, Device::Cpu)?, 3i64),
        (Tensor::from_vec(vec![2i32, -4, 0], 3, Device::Cpu)?, -4),
        (Tensor::from_vec(vec![200u8, 1], 2, Device::Cpu)?, 200),
        (Tensor::from_vec(vec![-1i8, 1], 2, Device::Cpu)?, -1),
    ] {
        let ids = on(&ids, dev);
        expect(&format!("index_select {:?}", ids.dtype()), x.index_select(&ids, 0), "index_select", bad, 3);
        expect(&format!("embedding {:?}", ids.dtype()), x.embedding(&ids), "embedding", bad, 3);
    }

    let gi = on(&Tensor::from_vec(vec![0i32, 4, 5, 1, 2, 3], (3, 2), Device::Cpu)?, dev);
    expect("gather", x.gather(1, &gi), "gather", 5, 5);

    let ids = on(&Tensor::from_vec(vec![1u32, 9], 2, Device::Cpu)?, dev);
    let src = on(&Tensor::ones((3, 2), DType::F32, Device::Cpu)?, dev);
    expect("index_add", x.index_add(&ids, &src, 1), "index_add", 9, 5);
    let dst = on(&Tensor::zeros((3, 5), DType::F32, Device::Cpu)?, dev);
    expect("index_copy_", dst.index_copy_(1, &ids, &src).map(|()| dst.clone()), "index_copy_", 9, 5);
    let si = on(&Tensor::from_vec(vec![0u32, 1, 2, 3, 4, 7], (3, 2), Device::Cpu)?, dev);
    expect("scatter_add", x.scatter_add(1, &si, &src), "scatter_add", 7, 5);

    // Cross entropy: a class id past the classes, and a negative one that is not the ignore index.
    let t = on(&Tensor::from_vec(vec![1u32, 7, 0], 3, Device::Cpu)?, dev);
    expect("cross_entropy", x.cross_entropy(&t, None), "cross_entropy target", 7, 5);
    let t = on(&Tensor::from_vec(vec![-100i32, -5, 1], 3, Device::Cpu)?, dev);
    expect("cross_entropy ignore", x.cross_entropy(&t, Some(-100)), "cross_entropy target", -5, 5);
    // Its backward too (the targets are encoded again there or saved): the forward's read reports.
    let v = x.requires_grad();
    let loss = v.cross_entropy(&t, Some(-100))?;
    assert!(matches!(loss.to_f64_vec(), Err(Error::IndexOutOfRange { index: -5, .. })));

    // The ignore index itself is no error, and good ids after a reported error give CPU's values.
    let good = Tensor::from_vec(vec![-100i32, 4, 1], 3, Device::Cpu)?;
    let want = x.to_device(Device::Cpu)?.cross_entropy(&good, Some(-100))?.to_f64_vec()?;
    let got = x.cross_entropy(&on(&good, dev), Some(-100))?.to_f64_vec()?;
    assert!((want[0] - got[0]).abs() < 1e-5, "{want:?} vs {got:?}");

    // `synchronize` reports too, and only the first bad id of a batch of ops.
    let b1 = on(&Tensor::from_vec(vec![6u32], 1, Device::Cpu)?, dev);
    let b2 = on(&Tensor::from_vec(vec![8u32], 1, Device::Cpu)?, dev);
    let _a = x.index_select(&b1, 1)?;
    let _b = x.index_select(&b2, 1)?;
    let cd = CudaDevice::get(0)?;
    assert!(matches!(cd.synchronize(), Err(Error::IndexOutOfRange { op: "index_select", index: 6, size: 5 })));
    cd.synchronize()?;

    // The same ops on the CPU fail at once.
    let xc = x.to_device(Device::Cpu)?;
    let bad = Tensor::from_vec(vec![0u32, 3], 2, Device::Cpu)?;
    assert!(matches!(xc.index_select(&bad, 0), Err(Error::IndexOutOfRange { index: 3, size: 3, .. })));
    assert!(matches!(xc.embedding(&bad), Err(Error::IndexOutOfRange { op: "embedding", index: 3, .. })));
    Ok(())
}
