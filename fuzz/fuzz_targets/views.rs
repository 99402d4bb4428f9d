//! Bytes as a program of tensor constructions and views: dims (small, empty or huge), then view
//! ops. Every step returns Ok or a typed error; every tensor's storage covers its layout, and a
//! small view reads the values its layout says.
#![no_main]

use ferrograd_core::{DType, Device, Tensor};
use libfuzzer_sys::fuzz_target;

fn dim(b: u8) -> usize {
    match b % 16 {
        0 => usize::MAX,
        1 => 1 << 40,
        2 => 6_148_914_691_236_517_206,
        3 => 0,
        n => (n as usize) % 5,
    }
}

fuzz_target!(|data: &[u8]| {
    let (rank, rest) = match data.split_first() {
        Some((r, rest)) => ((*r % 4) as usize, rest),
        None => return,
    };
    if rest.len() < rank {
        return;
    }
    let dims: Vec<usize> = rest[..rank].iter().map(|&b| dim(b)).collect();
    let ops = &rest[rank..];
    let n = ferrograd_core::Shape::from(&dims).elem_count().min(1 << 12);
    let base = match Tensor::arange(0.0, n as f64, 1.0, DType::F32, Device::Cpu).and_then(|a| a.reshape(dims)) {
        Ok(t) => t,
        Err(e) => {
            assert!(!e.to_string().is_empty());
            return;
        }
    };
    let mut t = base;
    for w in ops.chunks(4).take(8) {
        let (op, a, b, c) = (w[0] % 10, *w.get(1).unwrap_or(&0), *w.get(2).unwrap_or(&0), *w.get(3).unwrap_or(&0));
        let r = match op {
            0 => t.transpose(a as usize % 5, b as usize % 5),
            1 => t.narrow(a as usize % 5, b as usize % 6, c as usize % 6),
            2 => t.reshape(vec![dim(a), dim(b)]),
            3 => t.unsqueeze(a as isize % 5 - 2),
            4 => t.squeeze(a as usize % 5),
            5 => t.broadcast_as(vec![dim(a), dim(b), dim(c)]),
            6 => t.permute(&[a as usize % 4, b as usize % 4, c as usize % 4][..t.rank().min(3)]),
            7 => t.flatten_all(),
            8 if t.elem_count() <= 1 << 16 => t.contiguous(),
            9 if t.elem_count() <= 1 << 16 => t.relu(),
            _ => continue,
        };
        match r {
            Ok(next) => {
                let need = next.layout().required_len().expect("reach overflows");
                assert!(need <= next.storage_len(), "{:?} past a storage of {}", next.layout(), next.storage_len());
                if next.elem_count() <= 1 << 12 {
                    assert_eq!(next.to_vec::<f32>().map(|v| v.len()).ok(), Some(next.elem_count()));
                }
                t = next;
            }
            Err(e) => assert!(!e.to_string().is_empty()),
        }
    }
});
