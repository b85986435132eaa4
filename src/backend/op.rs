//! What each kernel computes, stated once: the identity of every elementwise map, binary op,
//! reduction and fused update, with its host math and the name its GPU kernel switches on.
//!
//! The host backend runs the math given here; the CUDA backend passes the op's number to the
//! kernels, which implement the same function under the `#define` named here (`kernels/common.cuh`;
//! a test compares the two lists). Ops refuse what an op cannot take (integer dtypes for float-only
//! maps) before any backend sees it, using [`Unary::float_only`].
//!
//! Host math is handed to a backend loop through a visitor ([`MapFn`], [`ZipFn`], [`UpdateFn`]):
//! the `match` on the op runs once per call, and each arm instantiates the loop with its own closure,
//! so the inner loop is as tight as if it had been written for that op alone.

use crate::dtype::{Element, Float};

/// Element math for every element type, so one generic host loop serves every dtype. The `i64`
/// versions of float functions go through `f64`, like the kernels' integer instances; ops never
/// call them (float-only maps refuse integer tensors first).
///
/// Kernels compute in [`Math::Compute`]: a 16-bit element is loaded into `f32`, the whole op (a GELU's
/// chain, a row's sum, a softmax) runs there, and the result is rounded once when it is stored.
pub(crate) trait Math: Element {
    /// The type kernels compute in: `f32` for the 16-bit types, the type itself otherwise.
    type Compute: Math<Compute = Self::Compute>;
    /// Widens to the compute type (exact).
    fn load(self) -> Self::Compute;
    /// Rounds a computed value to the element type (to nearest, ties to even).
    fn store(c: Self::Compute) -> Self;
    fn exp(self) -> Self;
    fn ln(self) -> Self;
    fn ln_1p(self) -> Self;
    fn exp_m1(self) -> Self;
    fn sqrt(self) -> Self;
    fn tanh(self) -> Self;
    fn sin(self) -> Self;
    fn cos(self) -> Self;
    fn powf(self, e: Self) -> Self;
    fn recip(self) -> Self;
    fn erf(self) -> Self;
    fn is_nan(self) -> bool;
}

macro_rules! float_math {
    ($t:ty, $erf:path) => {
        impl Math for $t {
            type Compute = $t;
            #[inline(always)]
            fn load(self) -> Self {
                self
            }
            #[inline(always)]
            fn store(c: Self) -> Self {
                c
            }
            #[inline(always)]
            fn exp(self) -> Self {
                Float::exp(self)
            }
            #[inline(always)]
            fn ln(self) -> Self {
                Float::ln(self)
            }
            #[inline(always)]
            fn ln_1p(self) -> Self {
                Float::ln_1p(self)
            }
            #[inline(always)]
            fn exp_m1(self) -> Self {
                Float::exp_m1(self)
            }
            #[inline(always)]
            fn sqrt(self) -> Self {
                Float::sqrt(self)
            }
            #[inline(always)]
            fn tanh(self) -> Self {
                Float::tanh(self)
            }
            #[inline(always)]
            fn sin(self) -> Self {
                Float::sin(self)
            }
            #[inline(always)]
            fn cos(self) -> Self {
                Float::cos(self)
            }
            #[inline(always)]
            fn powf(self, e: Self) -> Self {
                Float::powf(self, e)
            }
            #[inline(always)]
            fn recip(self) -> Self {
                Float::recip(self)
            }
            #[inline(always)]
            fn erf(self) -> Self {
                $erf(self)
            }
            #[inline(always)]
            fn is_nan(self) -> bool {
                Float::is_nan(self)
            }
        }
    };
}
float_math!(f32, libm::erff);
float_math!(f64, libm::erf);

macro_rules! via_f64 {
    ($($name:ident),*) => {$(
        #[inline(always)]
        fn $name(self) -> Self {
            (self as f64).$name() as i64
        }
    )*};
}

/// The 16-bit types compute in `f32`; their own math (never called by kernels, which compute in
/// `f32`) rounds after each function.
macro_rules! half_math {
    ($t:ty, store: $store:path) => {
        impl Math for $t {
            type Compute = f32;
            #[inline(always)]
            fn load(self) -> f32 {
                self.to_f32()
            }
            #[inline(always)]
            fn store(c: f32) -> Self {
                $store(c)
            }
            via_compute!(exp, ln, ln_1p, exp_m1, sqrt, tanh, sin, cos, recip, erf);
            #[inline(always)]
            fn powf(self, e: Self) -> Self {
                Self::store(Math::powf(self.load(), e.load()))
            }
            #[inline(always)]
            fn is_nan(self) -> bool {
                <$t>::is_nan(self)
            }
        }
    };
}

macro_rules! via_compute {
    ($($name:ident),*) => {$(
        #[inline(always)]
        fn $name(self) -> Self {
            Self::store(Math::$name(self.load()))
        }
    )*};
}

half_math!(crate::dtype::bf16, store: crate::dtype::bf16_of_f32);
half_math!(crate::dtype::f16, store: crate::dtype::f16::from_f32);

impl Math for i64 {
    type Compute = i64;
    #[inline(always)]
    fn load(self) -> i64 {
        self
    }
    #[inline(always)]
    fn store(c: i64) -> i64 {
        c
    }
    via_f64!(exp, ln, ln_1p, exp_m1, sqrt, tanh, sin, cos);
    #[inline(always)]
    fn erf(self) -> Self {
        libm::erf(self as f64) as i64
    }
    #[inline(always)]
    fn powf(self, e: Self) -> Self {
        (self as f64).powf(e as f64) as i64
    }
    #[inline(always)]
    fn recip(self) -> Self {
        (1.0 / self as f64) as i64
    }
    #[inline(always)]
    fn is_nan(self) -> bool {
        false
    }
}

/// Receives the host function of a unary op and runs it over some elements.
pub(crate) trait MapFn<T> {
    fn call(self, f: impl Fn(T) -> T + Sync + Copy);
}

/// Receives the host function of a binary op and runs it over pairs of elements.
pub(crate) trait ZipFn<T> {
    fn call(self, f: impl Fn(T, T) -> T + Sync + Copy);
}

/// Receives the host function of a fused update (`M` targets rewritten from one source element).
pub(crate) trait UpdateFn<T> {
    fn call<const M: usize>(self, f: impl Fn([&mut T; M], T) + Sync + Copy);
}

fn bool_of<T: Element>(v: bool) -> T {
    if v { T::one() } else { T::zero() }
}

/// Whether a domain keyword names float-only ops.
macro_rules! float_only {
    (float) => {
        true
    };
    (any) => {
        false
    };
}

/// Defines `Unary` from the list of parameterless maps below plus the maps that take scalars.
macro_rules! define_unary {
    ($($(#[$doc:meta])* $method:ident: $variant:ident = $code:literal, $define:literal, $domain:ident, |$x:ident| $body:expr;)*) => {
        /// A unary map. The first group takes no parameter and has a `Tensor` method of the same name
        /// (generated from this list by `ops::elementwise`); the second takes up to two scalars.
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        #[repr(i32)]
        pub(crate) enum Unary {
            $($(#[$doc])* $variant = $code,)*
            /// `x + p0`.
            AddScalar = 14,
            /// `x * p0`.
            MulScalar = 15,
            /// `x / p0`.
            DivScalar = 16,
            /// `x ^ p0` (floats).
            Powf = 17,
            /// `x` limited to `[p0, p1]`; NaN stays NaN.
            Clamp = 18,
            /// `p0` everywhere.
            Fill = 19,
        }

        impl Unary {
            /// Every op with the name its number has in `kernels/common.cuh`.
            #[cfg(test)]
            pub(crate) const DEFINES: &[(&str, i32)] = &[
                $(($define, $code),)*
                ("U_ADD_SCALAR", 14), ("U_MUL_SCALAR", 15), ("U_DIV_SCALAR", 16),
                ("U_POWF", 17), ("U_CLAMP", 18), ("U_FILL", 19),
            ];

            /// The op's name in errors (the `Tensor` method's name).
            pub(crate) fn name(self) -> &'static str {
                match self {
                    $(Unary::$variant => stringify!($method),)*
                    Unary::AddScalar => "add_scalar",
                    Unary::MulScalar => "mul_scalar",
                    Unary::DivScalar => "div_scalar",
                    Unary::Powf => "powf",
                    Unary::Clamp => "clamp",
                    Unary::Fill => "fill_",
                }
            }

            /// Whether the map is defined for float dtypes only.
            #[inline]
            pub(crate) fn float_only(self) -> bool {
                match self {
                    $(Unary::$variant => float_only!($domain),)*
                    Unary::Powf => true,
                    Unary::AddScalar | Unary::MulScalar | Unary::DivScalar | Unary::Clamp
                    | Unary::Fill => false,
                }
            }

            /// The number the kernels switch on.
            #[cfg_attr(not(feature = "cuda"), allow(dead_code))] // only GPU kernels take numbers
            pub(crate) fn code(self) -> i32 {
                self as i32
            }

            /// Hands the host function, with `params` converted to `T`, to `v`.
            #[inline(always)]
            pub(crate) fn host<T: Math>(self, params: [f64; 2], v: impl MapFn<T>) {
                let [p0, p1] = params.map(T::from_f64);
                match self {
                    $(Unary::$variant => v.call(|$x: T| $body),)*
                    Unary::AddScalar => v.call(move |x: T| x.add(p0)),
                    Unary::MulScalar => v.call(move |x: T| x.mul(p0)),
                    Unary::DivScalar => v.call(move |x: T| x.div(p0)),
                    Unary::Powf => v.call(move |x: T| x.powf(p0)),
                    Unary::Clamp => v.call(move |x: T| if x < p0 { p0 } else if x > p1 { p1 } else { x }),
                    Unary::Fill => v.call(move |_: T| p0),
                }
            }
        }
    };
}

/// The parameterless unary maps: `method: Variant = code, "KERNEL_DEFINE", domain, |x| host math;`.
/// `ops::elementwise` expands the same list into the `Tensor` methods, so a new map is one line here
/// (plus its kernel case and its derivative): see "Adding an op" in docs/design.md.
macro_rules! unary_maps {
    ($then:ident) => {
        $then! {
            /// `-self`.
            neg: Neg = 1, "U_NEG", any, |x| x.neg();
            /// `|self|`.
            abs: Abs = 2, "U_ABS", any, |x| x.abs();
            /// `self * self`.
            square: Square = 3, "U_SQUARE", any, |x| x.mul(x);
            /// `max(self, 0)` (NaN stays NaN).
            relu: Relu = 4, "U_RELU", any, |x| if x > T::zero() || x.is_nan() { x } else { T::zero() };
            /// `e^self` (for `f32` a vectorised approximation within 2 ulp).
            exp: Exp = 5, "U_EXP", float, |x| x.exp();
            /// Natural logarithm.
            log: Log = 6, "U_LOG", float, |x| x.ln();
            /// Square root.
            sqrt: Sqrt = 7, "U_SQRT", float, |x| x.sqrt();
            /// `1 / self`.
            recip: Recip = 8, "U_RECIP", float, |x| x.recip();
            /// Hyperbolic tangent (for `f32` a vectorised approximation within 3 ulp).
            tanh: Tanh = 9, "U_TANH", float, |x| x.tanh();
            /// Sine.
            sin: Sin = 10, "U_SIN", float, |x| x.sin();
            /// Cosine.
            cos: Cos = 11, "U_COS", float, |x| x.cos();
            /// The logistic function `1 / (1 + e^-x)`, computed without overflow for large `|x|`.
            sigmoid: Sigmoid = 12, "U_SIGMOID", float, |x| {
                // e = e^-|x| never overflows; both branches are computed so the loop stays branch-free.
                let e = x.abs().neg().exp();
                let r = T::one().div(T::one().add(e));
                if x >= T::zero() { r } else { e.mul(r) }
            };
            /// GELU with the tanh approximation: `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`.
            gelu: Gelu = 13, "U_GELU", float, |x| {
                let c = T::from_f64((2.0 / std::f64::consts::PI).sqrt());
                let inner = c.mul(x.add(T::from_f64(0.044715).mul(x).mul(x).mul(x)));
                T::from_f64(0.5).mul(x).mul(T::one().add(inner.tanh()))
            };
            /// `ln(1 + self)`, accurate for `self` near 0 (where `(1 + x).log()` loses the digits).
            log1p: Log1p = 20, "U_LOG1P", float, |x| x.ln_1p();
            /// `e^self - 1`, accurate for `self` near 0.
            expm1: Expm1 = 21, "U_EXPM1", float, |x| x.exp_m1();
            /// The error function `2/sqrt(pi) * integral from 0 to self of e^(-t²) dt`.
            erf: Erf = 22, "U_ERF", float, |x| x.erf();
            /// Exact GELU, `x Φ(x) = 0.5 x (1 + erf(x / sqrt(2)))` (PyTorch's default `gelu`; the
            /// tanh approximation is `gelu`).
            gelu_exact: GeluExact = 23, "U_GELU_EXACT", float, |x| {
                let half = T::from_f64(0.5);
                half.mul(x).mul(T::one().add(x.mul(T::from_f64(std::f64::consts::FRAC_1_SQRT_2)).erf()))
            };
            /// SiLU (swish), `x * sigmoid(x) = x / (1 + e^-x)`; `-0` rather than NaN where `e^-x`
            /// overflows.
            silu: Silu = 24, "U_SILU", float, |x| x.div(T::one().add(x.neg().exp()));
        }
    };
}
pub(crate) use unary_maps;

unary_maps!(define_unary);

/// Defines `Binary` from its list: `Variant = code, "KERNEL_DEFINE", |a, b, p0, p1| host math;`.
macro_rules! define_binary {
    ($($(#[$doc:meta])* $variant:ident = $code:literal, $define:literal, |$a:ident, $b:ident, $p0:ident, $p1:ident| $body:expr;)*) => {
        /// A binary op over operands broadcast to one shape, or a derivative that autograd chains
        /// (`a` is the incoming gradient, `b` the op's saved input or output). Up to two scalar
        /// parameters.
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        #[repr(i32)]
        pub(crate) enum Binary {
            $($(#[$doc])* $variant = $code,)*
        }

        impl Binary {
            /// Every op with the name its number has in `kernels/common.cuh`.
            #[cfg(test)]
            pub(crate) const DEFINES: &[(&str, i32)] = &[$(($define, $code),)*];

            /// The number the kernels switch on.
            #[cfg_attr(not(feature = "cuda"), allow(dead_code))] // only GPU kernels take numbers
            pub(crate) fn code(self) -> i32 {
                self as i32
            }

            /// Hands the host function, with `params` converted to `T`, to `v`.
            #[inline(always)]
            #[allow(unused_variables)]
            pub(crate) fn host<T: Math>(self, params: [f64; 2], v: impl ZipFn<T>) {
                let [p0, p1] = params.map(T::from_f64);
                match self {
                    $(Binary::$variant => {
                        let ($p0, $p1) = (p0, p1);
                        v.call(move |$a: T, $b: T| $body)
                    })*
                }
            }
        }
    };
}

define_binary! {
    /// `a + b`.
    Add = 0, "B_ADD", |a, b, _p0, _p1| a.add(b);
    /// `a - b`.
    Sub = 1, "B_SUB", |a, b, _p0, _p1| a.sub(b);
    /// `a * b`.
    Mul = 2, "B_MUL", |a, b, _p0, _p1| a.mul(b);
    /// `a / b` (IEEE 754 for floats; ops refuse integer division by zero first).
    Div = 3, "B_DIV", |a, b, _p0, _p1| a.div(b);
    /// The larger, NaN if either is NaN.
    Maximum = 4, "B_MAXIMUM", |a, b, _p0, _p1| a.max_nan(b);
    /// The smaller, NaN if either is NaN.
    Minimum = 5, "B_MINIMUM", |a, b, _p0, _p1| a.min_nan(b);
    /// `1` where `a == b`, else `0`.
    Eq = 6, "B_EQ", |a, b, _p0, _p1| bool_of::<T>(a == b);
    /// `1` where `a != b`.
    Ne = 7, "B_NE", |a, b, _p0, _p1| bool_of::<T>(a != b);
    /// `1` where `a < b`.
    Lt = 8, "B_LT", |a, b, _p0, _p1| bool_of::<T>(a < b);
    /// `1` where `a <= b`.
    Le = 9, "B_LE", |a, b, _p0, _p1| bool_of::<T>(a <= b);
    /// `1` where `a > b`.
    Gt = 10, "B_GT", |a, b, _p0, _p1| bool_of::<T>(a > b);
    /// `1` where `a >= b`.
    Ge = 11, "B_GE", |a, b, _p0, _p1| bool_of::<T>(a >= b);
    /// `a ^ b` (floats).
    Pow = 12, "B_POW", |a, b, _p0, _p1| a.powf(b);
    /// `a + p0 * b`.
    Axpy = 13, "B_AXPY", |a, b, p0, _p1| a.add(p0.mul(b));
    /// `b` (an in-place copy).
    Assign = 14, "B_ASSIGN", |_a, b, _p0, _p1| b;
    /// `-g`.
    NegGrad = 15, "B_NEG_GRAD", |g, _x, _p0, _p1| g.neg();
    /// `g * sign(x)`, 0 at 0.
    AbsGrad = 16, "B_ABS_GRAD", |g, x, _p0, _p1| if x > T::zero() { g } else if x < T::zero() { g.neg() } else { T::zero() };
    /// `2 g x`.
    SquareGrad = 17, "B_SQUARE_GRAD", |g, x, _p0, _p1| g.mul(x).mul(T::from_f64(2.0));
    /// `g cos(x)`.
    SinGrad = 18, "B_SIN_GRAD", |g, x, _p0, _p1| g.mul(x.cos());
    /// `-g sin(x)`.
    CosGrad = 19, "B_COS_GRAD", |g, x, _p0, _p1| g.mul(x.sin()).neg();
    /// `g` where `x > 0`, else 0.
    ReluGrad = 20, "B_RELU_GRAD", |g, x, _p0, _p1| if x > T::zero() { g } else { T::zero() };
    /// `g * gelu'(x)` (tanh approximation).
    GeluGrad = 21, "B_GELU_GRAD", |g, x, _p0, _p1| {
        let half = T::from_f64(0.5);
        let c = T::from_f64((2.0 / std::f64::consts::PI).sqrt());
        let k = T::from_f64(0.044715);
        let u = c.mul(x.add(k.mul(x).mul(x).mul(x)));
        let th = u.tanh();
        let du = c.mul(T::one().add(T::from_f64(3.0).mul(k).mul(x).mul(x)));
        let d = half.mul(T::one().add(th)).add(half.mul(x).mul(T::one().sub(th.mul(th))).mul(du));
        g.mul(d)
    };
    /// `g / (2 y)` for `y = sqrt(x)`.
    SqrtGrad = 22, "B_SQRT_GRAD", |g, y, _p0, _p1| g.div(y.add(y));
    /// `-g y²` for `y = 1 / x`.
    RecipGrad = 23, "B_RECIP_GRAD", |g, y, _p0, _p1| g.mul(y).mul(y).neg();
    /// `g (1 - y²)` for `y = tanh(x)`.
    TanhGrad = 24, "B_TANH_GRAD", |g, y, _p0, _p1| g.mul(T::one().sub(y.mul(y)));
    /// `g y (1 - y)` for `y = sigmoid(x)`.
    SigmoidGrad = 25, "B_SIGMOID_GRAD", |g, y, _p0, _p1| g.mul(y).mul(T::one().sub(y));
    /// `g p0 x^(p0 - 1)`.
    PowfGrad = 26, "B_POWF_GRAD", |g, x, p0, _p1| g.mul(p0).mul(x.powf(p0.sub(T::one())));
    /// `g` where `p0 <= x <= p1`, else 0.
    ClampGrad = 27, "B_CLAMP_GRAD", |g, x, p0, p1| if x >= p0 && x <= p1 { g } else { T::zero() };
    /// `g (1 - m)` for a 0/1 mask `m`.
    MaskNot = 28, "B_MASK_NOT", |g, m, _p0, _p1| g.mul(T::one().sub(m));
    /// `e^a b`.
    ExpMul = 29, "B_EXP_MUL", |a, b, _p0, _p1| a.exp().mul(b);
    /// `g 2/sqrt(pi) e^(-x²)`.
    ErfGrad = 30, "B_ERF_GRAD", |g, x, _p0, _p1| g.mul(T::from_f64(std::f64::consts::FRAC_2_SQRT_PI)).mul(x.mul(x).neg().exp());
    /// `g (Φ(x) + x φ(x))`: the derivative of exact GELU.
    GeluExactGrad = 31, "B_GELU_EXACT_GRAD", |g, x, _p0, _p1| {
        let half = T::from_f64(0.5);
        let cdf = half.mul(T::one().add(x.mul(T::from_f64(std::f64::consts::FRAC_1_SQRT_2)).erf()));
        let pdf = T::from_f64(0.3989422804014327).mul(half.mul(x).mul(x).neg().exp()); // 1/sqrt(2 pi)
        g.mul(cdf.add(x.mul(pdf)))
    };
    /// `g s (1 + x (1 - s))` for `s = sigmoid(x)`: the derivative of SiLU.
    SiluGrad = 32, "B_SILU_GRAD", |g, x, _p0, _p1| {
        let s = T::one().div(T::one().add(x.neg().exp()));
        g.mul(s).mul(T::one().add(x.mul(T::one().sub(s))))
    };
}

/// A reduction of rows: sum, mean, max or min.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(i32)]
pub(crate) enum Reduce {
    /// The sum (0 for nothing).
    Sum = 0,
    /// The maximum, NaN if any element is NaN.
    Max = 1,
    /// The minimum, NaN if any element is NaN.
    Min = 2,
    /// The sum divided by the count, in the compute type, rounded once when stored (so a 16-bit
    /// mean neither rounds twice nor overflows where its sum would); NaN for nothing.
    Mean = 3,
}

impl Reduce {
    /// Every reduction with the name its number has in `kernels/common.cuh`.
    #[cfg(test)]
    pub(crate) const DEFINES: &[(&str, i32)] =
        &[("R_SUM", 0), ("R_MAX", 1), ("R_MIN", 2), ("R_MEAN", 3)];

    /// The number the kernels switch on.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))] // only GPU kernels take numbers
    pub(crate) fn code(self) -> i32 {
        self as i32
    }

    /// The value of a reduction of nothing.
    pub(crate) fn identity<T: Element>(self) -> T {
        match self {
            Reduce::Sum | Reduce::Mean => T::zero(),
            Reduce::Max => T::lowest(),
            Reduce::Min => T::highest(),
        }
    }

    /// Combines two partial results.
    #[inline(always)]
    pub(crate) fn combine<T: Element>(self, a: T, b: T) -> T {
        match self {
            Reduce::Sum | Reduce::Mean => a.add(b),
            Reduce::Max => a.max_nan(b),
            Reduce::Min => a.min_nan(b),
        }
    }

    /// The result from the combined value of `count` elements (the mean divides).
    #[inline(always)]
    pub(crate) fn finish<T: Element>(self, combined: T, count: usize) -> T {
        match self {
            Reduce::Mean => combined.div(T::from_f64(count as f64)),
            _ => combined,
        }
    }

    /// Reduces a contiguous slice; sums use eight accumulators so the loop vectorises.
    #[inline(always)]
    pub(crate) fn slice<T: Element>(self, xs: &[T]) -> T {
        match self {
            Reduce::Sum | Reduce::Mean => {
                let mut acc = [T::zero(); 8];
                let chunks = xs.chunks_exact(8);
                let tail = chunks.remainder();
                for c in chunks {
                    for k in 0..8 {
                        acc[k] = acc[k].add(c[k]);
                    }
                }
                let mut s = acc.iter().fold(T::zero(), |a, &b| a.add(b));
                for &x in tail {
                    s = s.add(x);
                }
                s
            }
            _ => xs.iter().fold(self.identity(), |a, &b| self.combine(a, b)),
        }
    }
}

/// A fused optimizer update: one pass that rewrites a parameter and its state from a gradient
/// (`kernels/optim.cu` has the same two kernels).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum FusedUpdate {
    /// SGD with momentum; targets `[param, velocity]`.
    Sgd {
        lr: f64,
        momentum: f64,
        weight_decay: f64,
        nesterov: bool,
    },
    /// Adam and AdamW; targets `[param, first moment, second moment]`; `l2` is Adam's L2 term,
    /// `decay` AdamW's decoupled factor. The bias corrections come from the device: an `f64` tensor
    /// `[b1^t, b2^t]` that the update reads (so a replayed CUDA graph sees each step's `t`), folded
    /// into `step_size = lr / (1 - b1^t)` and `v_scale = 1 / sqrt(1 - b2^t)`, computed in `f64`.
    Adam {
        b1: f64,
        b2: f64,
        eps: f64,
        lr: f64,
        l2: f64,
        decay: f64,
    },
}

impl FusedUpdate {
    /// How many tensors the update rewrites (the parameter first).
    pub(crate) fn targets(self) -> usize {
        match self {
            FusedUpdate::Sgd { .. } => 2,
            FusedUpdate::Adam { .. } => 3,
        }
    }

    /// Whether the update reads the bias-correction powers `[b1^t, b2^t]`.
    pub(crate) fn reads_powers(self) -> bool {
        matches!(self, FusedUpdate::Adam { .. })
    }

    /// Hands the host update to `v`; `powers` are Adam's `[b1^t, b2^t]`.
    pub(crate) fn host<T: Math>(self, powers: [f64; 2], v: impl UpdateFn<T>) {
        match self {
            FusedUpdate::Sgd {
                lr,
                momentum,
                weight_decay,
                nesterov,
            } => {
                let [lr, mu, wd] = [lr, momentum, weight_decay].map(T::from_f64);
                v.call(move |[p, v]: [&mut T; 2], g: T| {
                    let d = g.add(wd.mul(*p));
                    *v = mu.mul(*v).add(d);
                    let step = if nesterov { d.add(mu.mul(*v)) } else { *v };
                    *p = p.sub(lr.mul(step));
                })
            }
            FusedUpdate::Adam {
                b1,
                b2,
                eps,
                lr,
                l2,
                decay,
            } => {
                let (step_size, v_scale) = adam_bias_corrections(lr, powers);
                let [b1, b2, eps, step_size, v_scale, l2, decay] =
                    [b1, b2, eps, step_size, v_scale, l2, decay].map(T::from_f64);
                let (one_b1, one_b2) = (T::one().sub(b1), T::one().sub(b2));
                v.call(move |[p, m, v]: [&mut T; 3], g: T| {
                    let g = g.add(l2.mul(*p));
                    *m = b1.mul(*m).add(one_b1.mul(g));
                    *v = b2.mul(*v).add(one_b2.mul(g).mul(g));
                    let denom = v.sqrt().mul(v_scale).add(eps);
                    *p = decay.mul(*p).sub(step_size.mul(*m).div(denom));
                })
            }
        }
    }
}

/// Adam's step size and second-moment scale from the learning rate and `[b1^t, b2^t]` (what
/// `adam_<dtype>` in `kernels/optim.cu` computes too, in `f64`).
pub(crate) fn adam_bias_corrections(lr: f64, [b1t, b2t]: [f64; 2]) -> (f64, f64) {
    (lr / (1.0 - b1t), 1.0 / (1.0 - b2t).sqrt())
}

/// A two-dimensional sliding window over `planes` planes of `height × width` elements (an
/// `[n, c, h, w]` tensor has `n c` planes): what `unfold2d` copies into columns and `fold2d` sums back.
///
/// Output position `(oy, ox)` and kernel offset `(ki, kj)` read input element
/// `(oy sh + ki dh - ph, ox sw + kj dw - pw)`; one outside the plane reads the padding value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Window2d {
    /// Planes (batch × channels).
    pub(crate) planes: usize,
    /// Rows and columns of a plane.
    pub(crate) input: [usize; 2],
    /// Rows and columns of the window.
    pub(crate) kernel: [usize; 2],
    /// Step between windows.
    pub(crate) stride: [usize; 2],
    /// Padding rows and columns on each side.
    pub(crate) padding: [usize; 2],
    /// Step between the window's taps.
    pub(crate) dilation: [usize; 2],
    /// Windows per column and per row: `(input + 2 padding - dilation (kernel - 1) - 1) / stride + 1`.
    pub(crate) output: [usize; 2],
}

impl Window2d {
    /// The input coordinate that output `o` reads at kernel offset `k` on axis `axis`, or `None` in
    /// the padding.
    #[inline(always)]
    pub(crate) fn source(&self, axis: usize, o: usize, k: usize) -> Option<usize> {
        (o * self.stride[axis] + k * self.dilation[axis])
            .checked_sub(self.padding[axis])
            .filter(|&i| i < self.input[axis])
    }

    /// Elements of one plane's columns: `kernel rows × kernel columns × output rows × output columns`.
    pub(crate) fn columns_per_plane(&self) -> usize {
        self.kernel[0] * self.kernel[1] * self.output[0] * self.output[1]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `#define`s of one prefix in `kernels/common.cuh`.
    fn defines(prefix: &str) -> Vec<(String, i32)> {
        let mut list: Vec<(String, i32)> = include_str!("../../kernels/common.cuh")
            .lines()
            .filter_map(|l| l.strip_prefix("#define "))
            .filter(|l| l.starts_with(prefix))
            .map(|l| {
                let (name, value) = l.split_once(' ').expect("a define has a value");
                (
                    name.to_string(),
                    value.trim().parse().expect("op codes are numbers"),
                )
            })
            .collect();
        list.sort_by_key(|&(_, code)| code);
        list
    }

    fn owned(list: &[(&str, i32)]) -> Vec<(String, i32)> {
        let mut list: Vec<(String, i32)> = list.iter().map(|&(n, c)| (n.to_string(), c)).collect();
        list.sort_by_key(|&(_, code)| code);
        list
    }

    #[test]
    fn kernel_op_codes_match_the_rust_names() {
        assert_eq!(defines("U_"), owned(Unary::DEFINES));
        assert_eq!(defines("B_"), owned(Binary::DEFINES));
        assert_eq!(defines("R_"), owned(Reduce::DEFINES));
    }

    /// Every unary map has a case in the kernel file's float switch, so a map added to the list
    /// without its kernel fails here, on any machine.
    #[test]
    fn every_op_has_a_kernel_case() {
        let kernels = include_str!("../../kernels/elementwise.cu");
        for (define, _) in Unary::DEFINES.iter().chain(Binary::DEFINES) {
            assert!(
                kernels.contains(&format!("case {define}:")),
                "kernels/elementwise.cu has no case for {define}"
            );
        }
    }
}

/// Fused scaled dot-product attention over `[batch, heads, len, width]` operands (the width's stride
/// is 1): for every batch `b`, head `h` and query `i`,
///
/// `s_j = scale · q_i · k_j`, `out_i = Σ_j softmax(s)_j v_j` over the keys `first(i) <= j < visible(b, i)`,
/// `lse_i = ln Σ_j e^(s_j)`,
///
/// computed tile by tile with a running maximum (the online softmax of Milakov and Gimelshein, 2018;
/// FlashAttention's schedule, Dao et al., 2022), so no `[queries, keys]` tensor exists. A query that
/// sees no key gets `out_i = 0` and `lse_i = -inf` (and zero gradients). The backward pass recomputes
/// `p_ij = e^(s_ij - lse_i)` from the saved `lse` and, with `D_i = dout_i · out_i`:
/// `dv_j = Σ_i p_ij dout_i`, `ds_ij = p_ij (dout_i · v_j - D_i)`, `dq_i = scale Σ_j ds_ij k_j`,
/// `dk_j = scale Σ_i ds_ij q_i`.
///
/// Precision: in the compute type (`f32` for 16-bit operands, widened exactly), rounded once when
/// stored. The `bf16` forward pass on a host with AMX tiles (`backend/cpu/attention_tiles.rs`)
/// multiplies the weights `softmax(s)_j` by `v` as two `bf16` parts (16 significant bits; scores,
/// maxima and sums in `f32`): each output within 2⁻¹⁶ of `Σ_j p_j |v_j|` of the `f32` result. The
/// `bf16` backward pass on `bf16` blocks (`backend/cpu/attention_tiles_backward.rs`) rounds `p` and
/// `ds` once to `bf16` before they multiply (as PyTorch's CPU attention and FlashAttention do):
/// each term of a gradient moves by at most 2⁻⁹ of itself.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Attention {
    /// Multiplies every score (`1/sqrt(width)` unless the caller chose another).
    pub(crate) scale: f64,
    /// Query `i` sees keys `j <= i + offset` (`Some(0)`: causal aligned at the top left; `Some(keys -
    /// queries)`: the queries are the last positions, as when decoding against a cache).
    pub(crate) causal: Option<i64>,
    /// Query heads per key and value head (grouped-query attention; 1: one each): query head `h`
    /// reads key and value head `h / group`. The backward pass writes key and value gradients per
    /// query head (`[batch, heads, keys, width]`), which the op sums over each group.
    pub(crate) group: usize,
    /// With a causal mask, the most keys a query sees, itself included (a sliding window, as
    /// Mistral's): query `i` sees keys `j` with `i + offset - window < j <= i + offset`.
    pub(crate) window: Option<usize>,
}

impl Attention {
    /// The first key query `i` sees: past the sliding window's start, or 0.
    #[inline]
    pub(crate) fn first(&self, i: usize) -> usize {
        match (self.causal, self.window) {
            (Some(offset), Some(window)) => (i as i64 + offset + 1 - window as i64).max(0) as usize,
            _ => 0,
        }
    }

    /// How many keys, from the first, query `i` sees when its batch holds `keys` keys (all of them,
    /// or the batch's key length).
    #[inline]
    pub(crate) fn visible(&self, i: usize, keys: usize) -> usize {
        match self.causal {
            None => keys,
            Some(offset) => (i as i64 + offset + 1).clamp(0, keys as i64) as usize,
        }
    }
}

/// Attention of new queries over a cache kept in pages (`backend::PageGeometry`): for sequence `s`
/// holding `n_s` tokens and `q_s` new queries (the sequence's last `q_s` positions, whose keys and
/// values are already in the cache), head `h` and query `i < q_s`,
///
/// `s_j = scale · q_i · k_j`, `out_i = Σ_j softmax(s)_j v_j` over the tokens `j < n_s - q_s + i + 1`
/// (the query's own position and every earlier one: [`Attention`]'s bottom-right causal mask), and
/// with a sliding `window`, only the last `window` of those (`j >= first(i)`),
///
/// with the keys and values of `layer`, read page by page through the sequence's page table, in the
/// compute type (16-bit values widened exactly), with a running maximum. A query that sees no token
/// gets zeros.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct PagedAttention {
    /// Multiplies every score.
    pub(crate) scale: f64,
    /// Which layer's keys and values the pages are read for.
    pub(crate) layer: usize,
    /// The most tokens a query sees, itself included (a sliding window), if any.
    pub(crate) window: Option<usize>,
}

impl PagedAttention {
    /// How many cached tokens query `i` of `queries` sees in a sequence of `tokens`.
    #[inline]
    pub(crate) fn visible(&self, i: usize, queries: usize, tokens: usize) -> usize {
        (tokens + i + 1).saturating_sub(queries).min(tokens)
    }

    /// The first cached token query `i` of `queries` sees in a sequence of `tokens`: past the
    /// sliding window's start, or 0.
    #[inline]
    pub(crate) fn first(&self, i: usize, queries: usize, tokens: usize) -> usize {
        match self.window {
            Some(window) => self.visible(i, queries, tokens).saturating_sub(window),
            None => 0,
        }
    }
}
