//! The 16-bit sum that MPI calls back during an all-reduce of `bf16` or `f16` tensors (MPI has no
//! 16-bit float types; [`super::mpi`] registers it with `MPI_Op_create`).
//!
//! It takes no MPI type: the datatype parameter MPI passes, and this function ignores, is generic.
//! So it builds, and its unit test runs, without the `mpi` feature: in the plain `cargo test` and
//! under valgrind, not only in a build of the library's tests with MPI linked in.
#![cfg_attr(not(feature = "mpi"), allow(dead_code))]

use std::ffi::{c_int, c_void};

use crate::dtype::{bf16, f16};

/// A 16-bit float that the sums widen to `f32`.
pub(crate) trait Half: Copy {
    fn to_f32(self) -> f32;
    fn from_f32(x: f32) -> Self;
}

impl Half for bf16 {
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
}

impl Half for f16 {
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
}

/// `inout[i] = in[i] + inout[i]`, each pair widened to `f32` and rounded back once (as NCCL sums
/// 16-bit floats): MPI's signature for a user-defined reduction, with `D = MPI_Datatype`.
pub(crate) unsafe extern "C" fn sum_halves<T: Half, D>(
    input: *mut c_void,
    inout: *mut c_void,
    len: *mut c_int,
    _datatype: *mut D,
) {
    // SAFETY: MPI passes a valid pointer to the element count.
    let n = usize::try_from(unsafe { *len }).unwrap_or(0);
    // An empty reduction may come with null (or dangling) buffers, which no slice may be made of.
    if n == 0 || input.is_null() || inout.is_null() {
        return;
    }
    // SAFETY: MPI passes two buffers of `n` elements of the datatype the reduction was started
    // with (16-bit), suitably aligned, the second one writable, not overlapping; neither is null
    // (checked above).
    let (a, b) = unsafe {
        (
            std::slice::from_raw_parts(input.cast::<T>(), n),
            std::slice::from_raw_parts_mut(inout.cast::<T>(), n),
        )
    };
    for (x, y) in a.iter().zip(b.iter_mut()) {
        *y = T::from_f32(x.to_f32() + y.to_f32());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_16_bit_sum_adds_elementwise_and_takes_empty_null_buffers() {
        let mut acc = [bf16::from_f32(1.0), bf16::from_f32(2.5)];
        let mut input = [bf16::from_f32(0.5), bf16::from_f32(-4.0)];
        let mut len: c_int = 2;
        // SAFETY: two buffers of `len` bf16 elements, as MPI passes them.
        unsafe {
            sum_halves::<bf16, c_void>(
                input.as_mut_ptr().cast(),
                acc.as_mut_ptr().cast(),
                &mut len,
                std::ptr::null_mut(),
            )
        };
        assert_eq!(acc.map(bf16::to_f32), [1.5, -1.5]);
        let mut none: c_int = 0;
        // SAFETY: an empty reduction with null buffers, which MPI may pass: nothing is read.
        unsafe {
            sum_halves::<f16, c_void>(
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                &mut none,
                std::ptr::null_mut(),
            )
        };
    }
}
