//! Any bytes as a checkpoint for a small MLP and its Adam state: the loader returns Ok or a typed
//! error with a message, never panics, never allocates more than the input justifies.
#![no_main]

use ferrograd_core::Rng;
use ferrograd_nn::checkpoint::{self, LoadOptions};
use ferrograd_nn::optim::Adam;
use ferrograd_nn::{mlp, Activation, Module};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(model) = mlp(&[3, 5, 2], Activation::Tanh, &mut Rng::new(5)) else { return };
    let Ok(mut opt) = Adam::new(model.named_parameters(), Default::default()) else { return };
    let allow = data.first().is_some_and(|b| b & 1 == 1);
    for optim in [true, false] {
        let o: Option<&mut dyn ferrograd_nn::optim::Optimizer> = if optim { Some(&mut opt) } else { None };
        if let Err(e) = checkpoint::from_bytes_with(data, "fuzz", &model, o, LoadOptions { allow_nonfinite: allow }) {
            assert!(!e.to_string().is_empty());
        }
    }
});
