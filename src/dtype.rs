//! Element types.
//!
//! `f32` is the first-class type; `f64` serves reference computations and `i64` holds indices and
//! labels. `bf16` and `f16` are storage types: every op loads them into `f32`, computes there (sums,
//! softmax and losses accumulate in `f32` too) and rounds the result once when it stores it, so a
//! 16-bit op differs from the `f32` op on the same values by that one rounding. Comparisons return a
//! tensor of the operands' dtype holding `1` and `0`, so masks multiply directly into float
//! computations.

use std::fmt;
use std::str::FromStr;

pub use half::{bf16, f16};

/// The element type of a tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// 32-bit float, the first-class type.
    F32,
    /// 64-bit float.
    F64,
    /// 64-bit signed integer, for indices and labels.
    I64,
    /// bfloat16: `f32`'s 8-bit exponent with an 8-bit significand (about 2-3 decimal digits, the
    /// range of `f32`). The 16-bit type to train in without loss scaling.
    BF16,
    /// IEEE 754 half precision: 5-bit exponent, 11-bit significand (largest finite value 65504).
    /// Training in `f16` needs loss scaling (`optim::LossScaler`) so small gradients do not flush to 0.
    F16,
}

impl DType {
    /// The dtype kernels compute a float dtype in: `f64` for `f64`, `f32` otherwise (the 16-bit types
    /// widen to it); per-row statistics such as attention's log-sums are kept in it.
    pub(crate) fn compute(self) -> DType {
        if self == DType::F64 {
            DType::F64
        } else {
            DType::F32
        }
    }

    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            DType::BF16 | DType::F16 => 2,
            DType::F32 => 4,
            DType::F64 | DType::I64 => 8,
        }
    }

    /// Whether the type is a floating-point type.
    pub const fn is_float(self) -> bool {
        !matches!(self, DType::I64)
    }

    /// Whether the type is a 16-bit float, stored in 16 bits and computed in `f32`.
    pub const fn is_half(self) -> bool {
        matches!(self, DType::BF16 | DType::F16)
    }

    /// The smallest `e` with `1 + e != 1`: what one rounding to this type may cost, relative to the
    /// value (`2^-7` for `bf16`, `2^-10` for `f16`, `2^-23` for `f32`, `2^-52` for `f64`; 0 for `i64`).
    pub const fn epsilon(self) -> f64 {
        match self {
            DType::BF16 => 0.0078125,
            DType::F16 => 0.0009765625,
            DType::F32 => f32::EPSILON as f64,
            DType::F64 => f64::EPSILON,
            DType::I64 => 0.0,
        }
    }

    /// Every dtype, in declaration order.
    pub const ALL: [DType; 5] = [DType::F32, DType::F64, DType::I64, DType::BF16, DType::F16];
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::I64 => "i64",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
        })
    }
}

/// Why a string names no dtype.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParseDTypeError(String);

impl fmt::Display for ParseDTypeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "`{}` names no dtype; use one of f32, f64, i64, bf16, f16",
            self.0
        )
    }
}

impl std::error::Error for ParseDTypeError {}

impl FromStr for DType {
    type Err = ParseDTypeError;

    /// Parses the names [`Display`](fmt::Display) writes: `f32`, `f64`, `i64`, `bf16`, `f16`.
    fn from_str(s: &str) -> Result<DType, ParseDTypeError> {
        DType::ALL
            .into_iter()
            .find(|d| d.to_string() == s)
            .ok_or_else(|| ParseDTypeError(s.to_string()))
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for f64 {}
    impl Sealed for i64 {}
    impl Sealed for super::bf16 {}
    impl Sealed for super::f16 {}
}

/// A Rust type that can be the element of a tensor. Sealed: implemented for `f32`, `f64`, `i64`,
/// [`bf16`](struct@bf16) and [`f16`](struct@f16) (the `half` crate's types, re-exported here).
///
/// Arithmetic on `i64` wraps on overflow instead of panicking, as tensor libraries do.
pub trait Element:
    sealed::Sealed + Copy + Send + Sync + PartialOrd + fmt::Debug + fmt::Display + Default + 'static
{
    /// The matching [`DType`].
    const DTYPE: DType;
    /// Converts from `f64` (integers truncate and saturate; NaN becomes 0).
    fn from_f64(v: f64) -> Self;
    /// Converts to `f64`.
    fn to_f64(self) -> f64;
    /// The additive identity.
    fn zero() -> Self;
    /// The multiplicative identity.
    fn one() -> Self;
    /// The identity of `max` (`-inf` for floats).
    fn lowest() -> Self;
    /// The identity of `min` (`+inf` for floats).
    fn highest() -> Self;
    /// Addition (wrapping for integers).
    fn add(self, o: Self) -> Self;
    /// Subtraction (wrapping for integers).
    fn sub(self, o: Self) -> Self;
    /// Multiplication (wrapping for integers).
    fn mul(self, o: Self) -> Self;
    /// Division; for integers the caller has checked that `o != 0`.
    fn div(self, o: Self) -> Self;
    /// Negation (wrapping for integers).
    fn neg(self) -> Self;
    /// Absolute value (wrapping for `i64::MIN`).
    fn abs(self) -> Self;
    /// `max` that propagates NaN (a NaN operand gives NaN), as PyTorch does.
    fn max_nan(self, o: Self) -> Self;
    /// `min` that propagates NaN.
    fn min_nan(self, o: Self) -> Self;
}

/// `x` rounded to the nearest `bf16` (ties to even): `bf16::from_f32`, in a form loops vectorise.
#[inline(always)]
pub(crate) fn bf16_of_f32(x: f32) -> bf16 {
    bf16::from_bits(crate::fastmath::bf16_bits_of_f32(x))
}

/// Floating-point elements: the transcendental functions. For `f32`, `exp` and `tanh` are
/// branch-free approximations that vectorise (within 2 and 3 ulp of the correctly rounded result);
/// the rest, and everything for `f64`, are the platform's functions.
pub trait Float: Element {
    /// `e^self`.
    fn exp(self) -> Self;
    /// Natural logarithm.
    fn ln(self) -> Self;
    /// `ln(1 + self)`, accurate near 0.
    fn ln_1p(self) -> Self;
    /// `e^self - 1`, accurate near 0.
    fn exp_m1(self) -> Self;
    /// Square root.
    fn sqrt(self) -> Self;
    /// Hyperbolic tangent.
    fn tanh(self) -> Self;
    /// Sine.
    fn sin(self) -> Self;
    /// Cosine.
    fn cos(self) -> Self;
    /// `self^e`.
    fn powf(self, e: Self) -> Self;
    /// `1 / self`.
    fn recip(self) -> Self;
    /// Whether the value is NaN.
    fn is_nan(self) -> bool;
}

macro_rules! float_element {
    ($t:ty, $d:expr, exp: $exp:path, tanh: $tanh:path) => {
        impl Element for $t {
            const DTYPE: DType = $d;
            #[inline(always)]
            fn from_f64(v: f64) -> Self {
                v as $t
            }
            #[inline(always)]
            fn to_f64(self) -> f64 {
                self as f64
            }
            #[inline(always)]
            fn zero() -> Self {
                0.0
            }
            #[inline(always)]
            fn one() -> Self {
                1.0
            }
            #[inline(always)]
            fn lowest() -> Self {
                <$t>::NEG_INFINITY
            }
            #[inline(always)]
            fn highest() -> Self {
                <$t>::INFINITY
            }
            #[inline(always)]
            fn add(self, o: Self) -> Self {
                self + o
            }
            #[inline(always)]
            fn sub(self, o: Self) -> Self {
                self - o
            }
            #[inline(always)]
            fn mul(self, o: Self) -> Self {
                self * o
            }
            #[inline(always)]
            fn div(self, o: Self) -> Self {
                self / o
            }
            #[inline(always)]
            fn neg(self) -> Self {
                -self
            }
            #[inline(always)]
            fn abs(self) -> Self {
                <$t>::abs(self)
            }
            #[inline(always)]
            fn max_nan(self, o: Self) -> Self {
                if self.is_nan() || o.is_nan() {
                    <$t>::NAN
                } else if o > self {
                    o
                } else {
                    self
                }
            }
            #[inline(always)]
            fn min_nan(self, o: Self) -> Self {
                if self.is_nan() || o.is_nan() {
                    <$t>::NAN
                } else if o < self {
                    o
                } else {
                    self
                }
            }
        }
        impl Float for $t {
            #[inline(always)]
            fn exp(self) -> Self {
                $exp(self)
            }
            #[inline(always)]
            fn ln(self) -> Self {
                <$t>::ln(self)
            }
            #[inline(always)]
            fn ln_1p(self) -> Self {
                <$t>::ln_1p(self)
            }
            #[inline(always)]
            fn exp_m1(self) -> Self {
                <$t>::exp_m1(self)
            }
            #[inline(always)]
            fn sqrt(self) -> Self {
                <$t>::sqrt(self)
            }
            #[inline(always)]
            fn tanh(self) -> Self {
                $tanh(self)
            }
            #[inline(always)]
            fn sin(self) -> Self {
                <$t>::sin(self)
            }
            #[inline(always)]
            fn cos(self) -> Self {
                <$t>::cos(self)
            }
            #[inline(always)]
            fn powf(self, e: Self) -> Self {
                <$t>::powf(self, e)
            }
            #[inline(always)]
            fn recip(self) -> Self {
                1.0 / self
            }
            #[inline(always)]
            fn is_nan(self) -> bool {
                <$t>::is_nan(self)
            }
        }
    };
}

// f32 `exp` and `tanh` are the vectorisable versions of `fastmath` (within 2 and 3 ulp); f64 keeps the
// platform's functions.
float_element!(f32, DType::F32, exp: crate::fastmath::exp_f32, tanh: crate::fastmath::tanh_f32);
float_element!(f64, DType::F64, exp: f64::exp, tanh: f64::tanh);

impl Element for i64 {
    const DTYPE: DType = DType::I64;
    #[inline(always)]
    fn from_f64(v: f64) -> Self {
        // `as` saturates and maps NaN to 0: defined for every input.
        v as i64
    }
    #[inline(always)]
    fn to_f64(self) -> f64 {
        self as f64
    }
    #[inline(always)]
    fn zero() -> Self {
        0
    }
    #[inline(always)]
    fn one() -> Self {
        1
    }
    #[inline(always)]
    fn lowest() -> Self {
        i64::MIN
    }
    #[inline(always)]
    fn highest() -> Self {
        i64::MAX
    }
    #[inline(always)]
    fn add(self, o: Self) -> Self {
        self.wrapping_add(o)
    }
    #[inline(always)]
    fn sub(self, o: Self) -> Self {
        self.wrapping_sub(o)
    }
    #[inline(always)]
    fn mul(self, o: Self) -> Self {
        self.wrapping_mul(o)
    }
    #[inline(always)]
    fn div(self, o: Self) -> Self {
        // The caller rejects zero divisors; wrapping_div covers i64::MIN / -1.
        self.wrapping_div(o)
    }
    #[inline(always)]
    fn neg(self) -> Self {
        self.wrapping_neg()
    }
    #[inline(always)]
    fn abs(self) -> Self {
        self.wrapping_abs()
    }
    #[inline(always)]
    fn max_nan(self, o: Self) -> Self {
        self.max(o)
    }
    #[inline(always)]
    fn min_nan(self, o: Self) -> Self {
        self.min(o)
    }
}

/// A 16-bit float's one-argument functions: the `f32` function of the widened value, rounded back.
macro_rules! through_f32 {
    ($($name:ident => $f32:expr),*) => {$(
        #[inline(always)]
        fn $name(self) -> Self {
            Self::from_f32(($f32)(self.to_f32()))
        }
    )*};
}

/// 16-bit floats: each operation converts to `f32`, computes and rounds back, so one operation
/// rounds once. Kernels do better for chains (`op::Math::Compute`): they load once, run the whole
/// op in `f32` and store once. A value converts to a 16-bit type through `f32` (`from_f64` too), on
/// every backend, so the host and the GPU round the same way.
macro_rules! half_element {
    ($t:ty, $d:expr) => {
        impl Element for $t {
            const DTYPE: DType = $d;
            #[inline(always)]
            fn from_f64(v: f64) -> Self {
                <$t>::from_f32(v as f32)
            }
            #[inline(always)]
            fn to_f64(self) -> f64 {
                <$t>::to_f64(self)
            }
            #[inline(always)]
            fn zero() -> Self {
                <$t>::ZERO
            }
            #[inline(always)]
            fn one() -> Self {
                <$t>::ONE
            }
            #[inline(always)]
            fn lowest() -> Self {
                <$t>::NEG_INFINITY
            }
            #[inline(always)]
            fn highest() -> Self {
                <$t>::INFINITY
            }
            #[inline(always)]
            fn add(self, o: Self) -> Self {
                <$t>::from_f32(self.to_f32() + o.to_f32())
            }
            #[inline(always)]
            fn sub(self, o: Self) -> Self {
                <$t>::from_f32(self.to_f32() - o.to_f32())
            }
            #[inline(always)]
            fn mul(self, o: Self) -> Self {
                <$t>::from_f32(self.to_f32() * o.to_f32())
            }
            #[inline(always)]
            fn div(self, o: Self) -> Self {
                <$t>::from_f32(self.to_f32() / o.to_f32())
            }
            #[inline(always)]
            fn neg(self) -> Self {
                -self
            }
            #[inline(always)]
            fn abs(self) -> Self {
                <$t>::from_bits(self.to_bits() & 0x7fff)
            }
            #[inline(always)]
            fn max_nan(self, o: Self) -> Self {
                <$t>::from_f32(self.to_f32().max_nan(o.to_f32()))
            }
            #[inline(always)]
            fn min_nan(self, o: Self) -> Self {
                <$t>::from_f32(self.to_f32().min_nan(o.to_f32()))
            }
        }
        impl Float for $t {
            through_f32!(
                exp => <f32 as Float>::exp,
                ln => f32::ln,
                ln_1p => f32::ln_1p,
                exp_m1 => f32::exp_m1,
                sqrt => f32::sqrt,
                tanh => <f32 as Float>::tanh,
                sin => f32::sin,
                cos => f32::cos,
                recip => f32::recip
            );
            #[inline(always)]
            fn powf(self, e: Self) -> Self {
                <$t>::from_f32(self.to_f32().powf(e.to_f32()))
            }
            #[inline(always)]
            fn is_nan(self) -> bool {
                <$t>::is_nan(self)
            }
        }
    };
}

half_element!(bf16, DType::BF16);
half_element!(f16, DType::F16);

/// Runs `$body` with `$T` bound to the Rust type of `$dtype`.
macro_rules! with_dtype {
    ($dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            $crate::dtype::DType::F32 => {
                type $T = f32;
                $body
            }
            $crate::dtype::DType::F64 => {
                type $T = f64;
                $body
            }
            $crate::dtype::DType::I64 => {
                type $T = i64;
                $body
            }
            $crate::dtype::DType::BF16 => {
                type $T = $crate::dtype::bf16;
                $body
            }
            $crate::dtype::DType::F16 => {
                type $T = $crate::dtype::f16;
                $body
            }
        }
    };
}

/// Like [`with_dtype!`] for float-only ops: `$err` is returned for integer dtypes.
macro_rules! with_float_dtype {
    ($dtype:expr, $T:ident => $body:expr, else $err:expr) => {
        match $dtype {
            $crate::dtype::DType::F32 => {
                type $T = f32;
                $body
            }
            $crate::dtype::DType::F64 => {
                type $T = f64;
                $body
            }
            $crate::dtype::DType::BF16 => {
                type $T = $crate::dtype::bf16;
                $body
            }
            $crate::dtype::DType::F16 => {
                type $T = $crate::dtype::f16;
                $body
            }
            $crate::dtype::DType::I64 => $err,
        }
    };
}

pub(crate) use {with_dtype, with_float_dtype};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dtypes_parse_their_names_and_report_their_sizes() {
        for d in DType::ALL {
            assert_eq!(d.to_string().parse::<DType>(), Ok(d));
        }
        let err = "float16".parse::<DType>().unwrap_err().to_string();
        assert!(err.contains("bf16, f16"), "{err}");
        assert_eq!([DType::BF16.size(), DType::F16.size()], [2, 2]);
        assert!(DType::BF16.is_float() && DType::BF16.is_half() && !DType::F32.is_half());
        assert_eq!(
            1.0 + DType::BF16.epsilon() as f32,
            bf16::from_bits(0x3f81).to_f32()
        );
        assert_eq!(
            1.0 + DType::F16.epsilon() as f32,
            f16::from_bits(0x3c01).to_f32()
        );
    }

    #[test]
    fn half_elements_round_each_operation_once_and_convert_through_f32() {
        let (a, b) = (bf16::from_f32(1.0), bf16::from_f32(0.00390625)); // 2^-8: half an ulp of 1
        assert_eq!(a.add(b), a, "a tie rounds to even");
        assert_eq!(a.add(b).add(b), a, "each operation rounds");
        assert_eq!(Element::abs(f16::from_f32(-2.5)), f16::from_f32(2.5));
        assert!(bf16::from_f32(f32::NAN).max_nan(a).is_nan());
        // f64 -> 16-bit goes through f32, as the GPU kernels convert.
        let v = 1.0 + 2f64.powi(-8) + 2f64.powi(-40);
        assert_eq!(<bf16 as Element>::from_f64(v), bf16::from_f32(v as f32));
        assert_eq!(<f16 as Element>::to_f64(f16::from_f32(0.5)), 0.5);
    }
}
