//! `Tensor::backward_into_with_hook`: each leaf variable is reported once, with its final
//! gradient, as soon as the walk has finished it, in reverse order of use (what data-parallel
//! training overlaps its gradient communication with).

use ferrograd_core::{DType, Device, Error, GradStore, Result, Rng, Tensor};

/// A 3-layer chain x -> l0 -> l1 -> l2 -> loss, weights used transposed as Linear does, those of
/// l1 twice.
fn chain(rng: &mut Rng) -> Result<(Vec<Tensor>, Tensor)> {
    let p = |rng: &mut Rng, r: usize, c: usize| -> Result<Tensor> {
        Ok(Tensor::randn_with(rng, 0.0, 0.5, (r, c), DType::F64, Device::Cpu)?.requires_grad())
    };
    let w = vec![p(rng, 4, 5)?, p(rng, 5, 5)?, p(rng, 5, 3)?];
    let x = Tensor::randn_with(rng, 0.0, 1.0, (6, 4), DType::F64, Device::Cpu)?;
    let h0 = x.matmul(&w[0].t()?.t()?)?.tanh()?;
    let h1 = h0.matmul(&w[1].t()?.t()?)?.tanh()?.matmul(&w[1])?.tanh()?;
    let loss = h1.matmul(&w[2].t()?.t()?)?.sqr()?.sum_all()?;
    Ok((w, loss))
}

#[test]
fn hook_sees_each_leaf_once_with_its_final_gradient_last_layer_first() -> Result<()> {
    let mut rng = Rng::new(3);
    let (w, loss) = chain(&mut rng)?;
    let mut seen: Vec<(usize, Vec<f64>)> = vec![];
    // (leaf, a fresh tensor id when the hook ran, the id of the gradient it got): ids count
    // tensor creations, so they tell what the walk had computed at each moment.
    let mut when = vec![];
    let mut store = GradStore::default();
    loss.backward_into_with_hook(&mut store, &mut |leaf, g| {
        let i = w.iter().position(|p| p.id() == leaf.id()).expect("hook got a tensor that is not a leaf");
        seen.push((i, g.to_f64_vec()?));
        when.push((i, Tensor::zeros(1, DType::F32, Device::Cpu)?.id(), g.id()));
        Ok(())
    })?;
    let order: Vec<usize> = seen.iter().map(|(i, _)| *i).collect();
    assert_eq!(order, vec![2, 1, 0], "leaves must finish last layer first, each once");
    // Each weight was reported before the walk computed the next (earlier) layer's gradient.
    for k in 0..2 {
        assert!(
            when[k].1 < when[k + 1].2,
            "w{} reported only after w{}'s gradient existed: {when:?}",
            when[k].0,
            when[k + 1].0
        );
    }
    let plain = loss.backward()?;
    for (i, g) in &seen {
        assert_eq!(g, &plain.get(&w[*i]).unwrap().to_f64_vec()?, "w{i}: hook saw a partial gradient");
        assert_eq!(g, &store.get(&w[*i]).unwrap().to_f64_vec()?);
    }
    Ok(())
}

#[test]
fn hook_sees_the_accumulated_sum_and_its_error_stops_the_walk() -> Result<()> {
    let mut rng = Rng::new(4);
    let (w, loss) = chain(&mut rng)?;
    let mut store = GradStore::default();
    loss.backward_into(&mut store)?;
    let once = store.get(&w[0]).unwrap().to_f64_vec()?;
    let mut got = vec![];
    loss.backward_into_with_hook(&mut store, &mut |leaf, g| {
        if leaf.id() == w[0].id() {
            got = g.to_f64_vec()?;
        }
        Ok(())
    })?;
    let twice: Vec<f64> = once.iter().map(|v| 2.0 * v).collect();
    assert_eq!(got, twice);

    let mut calls = 0;
    let r = loss.backward_into_with_hook(&mut GradStore::default(), &mut |_, _| {
        calls += 1;
        Err(Error::InvalidArgument("stop".into()))
    });
    assert!(matches!(r, Err(Error::InvalidArgument(m)) if m == "stop"));
    assert_eq!(calls, 1);
    Ok(())
}

#[test]
fn seeded_hook_reports_the_gradients_backward_into_with_stores() -> Result<()> {
    let mut rng = Rng::new(5);
    let (w, loss) = chain(&mut rng)?;
    // A non-scalar root seeded with a given gradient (the fused classifier's case: the logits'
    // gradient formed before the walk), using w0 directly and through the chain.
    let y = w[0].clone();
    let seed = Tensor::randn_with(&mut rng, 0.0, 1.0, y.dims().to_vec(), DType::F64, Device::Cpu)?;
    let root = y.mul_scalar(3.0)?.tanh()?.mul(&loss.broadcast_as(y.dims().to_vec())?)?;
    let mut plain = GradStore::default();
    root.backward_into_with(&seed, &mut plain)?;
    let mut store = GradStore::default();
    let mut seen = vec![];
    root.backward_into_with_seed_hook(&seed, &mut store, &mut |leaf, g| {
        let i = w.iter().position(|p| p.id() == leaf.id()).expect("hook got a tensor that is not a leaf");
        seen.push(i);
        assert_eq!(g.to_f64_vec()?, plain.get(leaf).unwrap().to_f64_vec()?, "w{i}: partial gradient");
        Ok(())
    })?;
    seen.sort();
    assert_eq!(seen, vec![0, 1, 2], "every leaf once");
    for p in &w {
        assert_eq!(store.get(p).unwrap().to_f64_vec()?, plain.get(p).unwrap().to_f64_vec()?);
    }
    // A seed of the wrong shape is an error, not a panic.
    let bad = Tensor::zeros(3, DType::F64, Device::Cpu)?;
    assert!(root.backward_into_with_seed_hook(&bad, &mut GradStore::default(), &mut |_, _| Ok(())).is_err());
    Ok(())
}

/// `backward_consume` (the walk takes the root) gives the same gradients, reported in the same
/// order, as the borrowing walk.
#[test]
fn consuming_walk_gives_the_same_gradients() -> Result<()> {
    let (w, loss) = chain(&mut Rng::new(41))?;
    let seed = loss.ones_like()?;
    let (mut kept, mut taken) = (GradStore::default(), GradStore::default());
    let (mut order_kept, mut order_taken) = (vec![], vec![]);
    loss.backward_into_with_seed_hook(&seed, &mut kept, &mut |leaf, _| {
        order_kept.push(leaf.id());
        Ok(())
    })?;
    loss.backward_consume(
        &seed,
        &mut taken,
        Some(&mut |leaf, _| {
            order_taken.push(leaf.id());
            Ok(())
        }),
    )?;
    assert_eq!(order_kept, order_taken);
    for p in &w {
        assert_eq!(kept.get(p).expect("kept").to_f64_vec()?, taken.get(p).expect("taken").to_f64_vec()?);
    }
    Ok(())
}
