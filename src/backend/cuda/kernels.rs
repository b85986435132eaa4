//! The kernel sources (compiled by NVRTC once per GPU), the operand geometry they take, and launch
//! shapes.

use cudarc::driver::{DeviceRepr, LaunchConfig};

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::layout::Layout;

/// The kernel files in compilation order (`.ci/check-kernels` reads this list).
pub(crate) const SOURCES: [&str; 12] = [
    include_str!("../../../kernels/common.cuh"),
    include_str!("../../../kernels/elementwise.cu"),
    include_str!("../../../kernels/reduce.cu"),
    include_str!("../../../kernels/softmax.cu"),
    include_str!("../../../kernels/index.cu"),
    include_str!("../../../kernels/window.cu"),
    include_str!("../../../kernels/random.cu"),
    include_str!("../../../kernels/optim.cu"),
    include_str!("../../../kernels/attention.cu"),
    include_str!("../../../kernels/paged.cu"),
    include_str!("../../../kernels/rotary.cu"),
    include_str!("../../../kernels/quant.cu"),
];

/// The largest rank a GPU kernel takes (`MAX_RANK` in `kernels/common.cuh`).
pub(crate) const MAX_RANK: usize = 8;

/// An operand's layout as the kernels read it (`struct Geo` in `kernels/common.cuh`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct Geo {
    shape: [i64; MAX_RANK],
    stride: [i64; MAX_RANK],
    offset: i64,
    rank: i32,
    contiguous: i32,
}

// SAFETY: `Geo` is `repr(C)` plain data with the field order, types and alignment of the kernels'
// `struct Geo` (8-byte integers, then two 4-byte ones), so it can be passed by value as a kernel
// argument.
unsafe impl DeviceRepr for Geo {}

impl Geo {
    /// The geometry of `layout`.
    ///
    /// # Errors
    /// [`Error::InvalidShape`] for a rank above [`MAX_RANK`].
    pub(crate) fn of(op: &'static str, layout: &Layout) -> Result<Geo> {
        let rank = layout.rank();
        if rank > MAX_RANK {
            return Err(Error::InvalidShape {
                op,
                shape: layout.shape().to_vec(),
                reason: format!("GPU kernels take tensors of rank up to {MAX_RANK}"),
            });
        }
        let mut g = Geo {
            shape: [1; MAX_RANK],
            stride: [0; MAX_RANK],
            offset: layout.offset() as i64,
            rank: rank as i32,
            contiguous: i32::from(layout.is_contiguous()),
        };
        for (d, (&n, &s)) in layout.shape().iter().zip(layout.strides()).enumerate() {
            g.shape[d] = n as i64;
            g.stride[d] = s as i64;
        }
        Ok(g)
    }
}

/// Threads per block of every kernel (`ROW_THREADS` in `kernels/common.cuh` for the row kernels).
const THREADS: u32 = 256;
/// Enough blocks to fill any current GPU several times over; grid-stride loops cover the rest.
const MAX_BLOCKS: usize = 65_535;

/// A launch over `n` (> 0) independent elements.
pub(crate) fn elementwise_launch(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(THREADS as usize).min(MAX_BLOCKS) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// A launch with one block per row (blocks stride over more rows than the grid holds).
pub(crate) fn rows_launch(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows.clamp(1, MAX_BLOCKS) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The dtype instances of a kernel family compiled for every dtype: `family!("unary")`. Float-only
/// families use [`float_family!`], which has no `_i64` name to ask for (`.ci/nvrtc-check.py` checks
/// that every name either macro gives is compiled).
macro_rules! family {
    ($base:literal) => {
        [
            concat!($base, "_f32"),
            concat!($base, "_f64"),
            concat!($base, "_i64"),
            concat!($base, "_bf16"),
            concat!($base, "_f16"),
        ]
    };
}
/// The instances of a float-only kernel family (no `_i64` kernel exists, so none can be asked for):
/// `float_family!("attention_fwd")`.
macro_rules! float_family {
    ($base:literal) => {
        [
            concat!($base, "_f32"),
            concat!($base, "_f64"),
            concat!($base, "_bf16"),
            concat!($base, "_f16"),
        ]
    };
}

/// The name of float-only kernel `family` for `dtype`.
///
/// # Errors
/// [`Error::UnsupportedDType`] for `i64` (ops refuse it first; this keeps an integer instance from
/// being looked up even so).
pub(crate) fn float_kernel(
    op: &'static str,
    family: [&'static str; 4],
    dtype: DType,
) -> Result<&'static str> {
    Ok(match dtype {
        DType::F32 => family[0],
        DType::F64 => family[1],
        DType::BF16 => family[2],
        DType::F16 => family[3],
        DType::I64 => {
            return Err(Error::UnsupportedDType {
                op,
                dtype,
                expected: "a float dtype (f32, f64, bf16 or f16)",
            });
        }
    })
}

/// Where `dtype`'s instance sits in a [`family!`].
fn instance(dtype: DType) -> usize {
    match dtype {
        DType::F32 => 0,
        DType::F64 => 1,
        DType::I64 => 2,
        DType::BF16 => 3,
        DType::F16 => 4,
    }
}

/// The name of kernel `family` (one of `unary`, `binary`, ...) for `dtype`.
pub(crate) fn kernel(family: [&'static str; 5], dtype: DType) -> &'static str {
    family[instance(dtype)]
}

/// The conversions (and same-type strided copies), `cast_<from>_<to>` in `kernels/elementwise.cu`.
const CASTS: [[&str; 5]; 5] = [
    family!("cast_f32"),
    family!("cast_f64"),
    family!("cast_i64"),
    family!("cast_bf16"),
    family!("cast_f16"),
];

/// The name of the kernel that converts `from` to `to`.
pub(crate) fn cast_kernel(from: DType, to: DType) -> &'static str {
    CASTS[instance(from)][instance(to)]
}

pub(crate) use {family, float_family};
