//! How fast the quantization kernels run on one core: encode, decode, and decode-and-add of a
//! float32 buffer, in GB/s of float32 input.
//!
//! `cargo run --release -p shoal-collective --example quant [MiB] [rounds]`
// An example that times the kernels from outside: the crate itself reads no clock.
#![allow(clippy::disallowed_methods)]

use shoal_collective::{DType, Quantization, ReduceOp};
use std::time::Instant;

fn main() {
    let args: Vec<usize> = std::env::args().skip(1).map(|a| a.parse().expect("a number")).collect();
    let mib = args.first().copied().unwrap_or(64);
    let rounds = args.get(1).copied().unwrap_or(5);
    let elems = mib << 18;
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let x: Vec<f32> = (0..elems)
        .map(|_| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            (rng >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        })
        .collect();
    let plain: &[u8] = bytemuck::cast_slice(&x);
    let mut out = vec![0f32; elems];
    let mut copy = vec![0u8; plain.len()];
    let t = (0..rounds)
        .map(|_| {
            let t = Instant::now();
            copy.copy_from_slice(plain);
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min);
    println!("{mib} MiB of float32, best of {rounds}: GB/s of float32 on one core");
    println!("(a plain copy of the buffer: {:.2} GB/s)", plain.len() as f64 / 1e9 / t);
    println!("{:>6} {:>8} {:>8} {:>8} {:>10} {:>6}", "format", "encode", "decode", "add", "enc+dec", "ratio");
    for name in ["fp16", "bf16", "int8", "int4"] {
        let codec = Quantization::parse(name, None).unwrap().codec(DType::F32, Some(ReduceOp::Sum)).unwrap().unwrap();
        // Aligned, as the engine's buffers are.
        let mut words = vec![0u64; codec.encoded_len(elems).div_ceil(8)];
        let enc = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut words)[..codec.encoded_len(elems)];
        let best = |f: &mut dyn FnMut()| {
            (0..rounds)
                .map(|_| {
                    let t = Instant::now();
                    f();
                    t.elapsed().as_secs_f64()
                })
                .fold(f64::INFINITY, f64::min)
        };
        let e = best(&mut || codec.encode(plain, enc).unwrap());
        let d = best(&mut || codec.decode(enc, bytemuck::cast_slice_mut(&mut out)).unwrap());
        let a = best(&mut || codec.add_decoded(enc, bytemuck::cast_slice_mut(&mut out)).unwrap());
        let gb = plain.len() as f64 / 1e9;
        let ratio = plain.len() as f64 / enc.len() as f64;
        println!("{name:>6} {:>8.2} {:>8.2} {:>8.2} {:>10.2} {ratio:>6.2}", gb / e, gb / d, gb / a, gb / (e + d));
    }
}
