use ferrograd_core::{DType, Device, Result, Tensor};

#[test]
fn smoke() -> Result<()> {
    let d = Device::Cpu;
    let a = Tensor::from_vec(vec![1f32, 2., 3., 4., 5., 6.], (2, 3), d)?;
    let b = Tensor::from_vec(vec![1f32, 0., 0., 1., 1., 1.], (3, 2), d)?;
    assert_eq!(a.matmul(&b)?.to_vec2::<f32>()?, vec![vec![4., 5.], vec![10., 11.]]);
    assert_eq!(a.t()?.matmul(&a)?.dims(), &[3, 3]);
    assert_eq!(a.sum(1, false)?.to_vec::<f32>()?, vec![6., 15.]);
    assert_eq!(a.sum(0, true)?.to_vec2::<f32>()?, vec![vec![5., 7., 9.]]);
    assert_eq!(a.t()?.sum(0, false)?.to_vec::<f32>()?, vec![6., 15.]);
    assert_eq!(a.max(1, false)?.to_vec::<f32>()?, vec![3., 6.]);
    assert_eq!(a.argmax(0, false)?.to_vec::<u32>()?, vec![1, 1, 1]);
    let row = Tensor::from_vec(vec![10f32, 20., 30.], 3, d)?;
    assert_eq!(a.add(&row)?.to_vec::<f32>()?, vec![11., 22., 33., 14., 25., 36.]);
    let col = Tensor::from_vec(vec![1f32, 2.], (2, 1), d)?;
    assert_eq!(a.mul(&col)?.to_vec::<f32>()?, vec![1., 2., 3., 8., 10., 12.]);
    let s = a.softmax(1)?.sum(1, false)?.to_vec::<f32>()?;
    assert!(s.iter().all(|v| (v - 1.0).abs() < 1e-6));
    let c = Tensor::cat(&[a.clone(), a.clone()], 1)?;
    assert_eq!(c.to_vec2::<f32>()?, vec![vec![1., 2., 3., 1., 2., 3.], vec![4., 5., 6., 4., 5., 6.]]);
    let x = Tensor::randn(0.0, 1.0, (3, 4), DType::F64, d)?.requires_grad();
    let w = Tensor::randn(0.0, 1.0, (4, 2), DType::F64, d)?.requires_grad();
    let loss = x.matmul(&w)?.tanh()?.sum_all()?;
    let g = loss.backward()?;
    assert_eq!(g.get(&x).unwrap().dims(), &[3, 4]);
    assert_eq!(g.get(&w).unwrap().dims(), &[4, 2]);
    let logits = Tensor::randn(0.0, 1.0, (4, 5), DType::F32, d)?;
    let t = Tensor::from_vec(vec![0u32, 4, 2, 1], 4, d)?;
    let l = logits.cross_entropy(&t, None)?.item::<f32>()?;
    assert!(l > 0.0);
    Ok(())
}
