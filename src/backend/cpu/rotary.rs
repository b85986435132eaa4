//! Rotary position embedding on the host: each (token, head) row of `dim` values is rotated in
//! `dim / 2` planes `(i, i + dim/2)` by the angle whose cosine and sine the tables hold for the
//! token's position (the op's semantics are stated on `Tensor::rotary`).

use rayon::prelude::*;

use super::PARALLEL_MIN;
use super::rows::Real;
use crate::backend::op::Math;
use crate::backend::{Dst, Src};
use crate::dtype::{DType, bf16, f16};

/// `out = rotate(x)` for `x` `[tokens, heads, dim]`, tables `[positions, dim / 2]` in the compute
/// type, `positions` `[tokens]` (checked in range by the op); by `-θ` when `inverse`.
pub(super) fn rotary(
    dtype: DType,
    x: Src,
    [cos, sin, positions]: [Src; 3],
    inverse: bool,
    out: Dst,
) {
    match dtype {
        DType::F32 => rotate::<f32>(x, [cos, sin, positions], inverse, out),
        DType::F64 => rotate::<f64>(x, [cos, sin, positions], inverse, out),
        DType::BF16 => rotate::<bf16>(x, [cos, sin, positions], inverse, out),
        DType::F16 => rotate::<f16>(x, [cos, sin, positions], inverse, out),
        DType::I64 => unreachable!("rotary refuses integer dtypes before computing"),
    }
}

fn rotate<T: Math>(x: Src, [cos, sin, positions]: [Src; 3], inverse: bool, out: Dst)
where
    T::Compute: Real + std::ops::Neg<Output = T::Compute>,
{
    let dim = *x.layout.shape().last().expect("rank 3");
    let half = dim / 2;
    if x.layout.numel() == 0 || half == 0 {
        return;
    }
    let heads = x.layout.shape()[1];
    let (x, o) = (x.contiguous_host::<T>(), out.contiguous_host::<T>());
    let (cos, sin) = (
        cos.contiguous_host::<T::Compute>(),
        sin.contiguous_host::<T::Compute>(),
    );
    let positions = positions.contiguous_host::<i64>();
    let token = |t: usize, x: &[T], o: &mut [T]| {
        let p = positions[t] as usize * half;
        let (c, s) = (&cos[p..p + half], &sin[p..p + half]);
        for (x, o) in x.chunks_exact(dim).zip(o.chunks_exact_mut(dim)) {
            let (x1, x2) = x.split_at(half);
            let (o1, o2) = o.split_at_mut(half);
            for i in 0..half {
                let (a, b) = (x1[i].load(), x2[i].load());
                let (c, s) = (c[i], if inverse { -s[i] } else { s[i] });
                o1[i] = T::store(a * c - b * s);
                o2[i] = T::store(b * c + a * s);
            }
        }
    };
    let row = heads * dim;
    if x.len() >= PARALLEL_MIN {
        o.par_chunks_mut(row)
            .zip(x.par_chunks(row))
            .enumerate()
            .for_each(|(t, (o, x))| token(t, x, o));
    } else {
        o.chunks_mut(row)
            .zip(x.chunks(row))
            .enumerate()
            .for_each(|(t, (o, x))| token(t, x, o));
    }
}
