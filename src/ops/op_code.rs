//! Names for the elementwise and reduction ops, shared by the host kernels' dispatch and the CUDA
//! backend, whose kernels take them as numbers (`kernels/common.cuh` defines the same numbers; a test
//! compares the lists).

macro_rules! op_codes {
    ($(#[$doc:meta])* $name:ident { $($(#[$vdoc:meta])* $variant:ident = $code:literal => $define:literal,)* }) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        #[repr(i32)]
        pub(crate) enum $name {
            $($(#[$vdoc])* $variant = $code,)*
        }

        impl $name {
            /// Every op with the name its number has in `kernels/common.cuh`.
            #[cfg(test)]
            pub(crate) const DEFINES: &[(&str, i32)] = &[$(($define, $code),)*];

            /// The number the kernels switch on.
            #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
            pub(crate) fn code(self) -> i32 {
                self as i32
            }
        }
    };
}

op_codes! {
    /// A unary map, with up to two scalar parameters.
    Unary {
        Neg = 1 => "U_NEG",
        Abs = 2 => "U_ABS",
        Square = 3 => "U_SQUARE",
        Relu = 4 => "U_RELU",
        Exp = 5 => "U_EXP",
        Log = 6 => "U_LOG",
        Sqrt = 7 => "U_SQRT",
        Recip = 8 => "U_RECIP",
        Tanh = 9 => "U_TANH",
        Sin = 10 => "U_SIN",
        Cos = 11 => "U_COS",
        Sigmoid = 12 => "U_SIGMOID",
        Gelu = 13 => "U_GELU",
        AddScalar = 14 => "U_ADD_SCALAR",
        MulScalar = 15 => "U_MUL_SCALAR",
        DivScalar = 16 => "U_DIV_SCALAR",
        Powf = 17 => "U_POWF",
        Clamp = 18 => "U_CLAMP",
        Fill = 19 => "U_FILL",
    }
}

op_codes! {
    /// A binary op over broadcast operands (`Axpy` is `a + p0 * b`, `Assign` gives `b`), or a
    /// derivative autograd chains: `a` is the incoming gradient, `b` the op's input or output.
    Binary {
        Add = 0 => "B_ADD",
        Sub = 1 => "B_SUB",
        Mul = 2 => "B_MUL",
        Div = 3 => "B_DIV",
        Maximum = 4 => "B_MAXIMUM",
        Minimum = 5 => "B_MINIMUM",
        Eq = 6 => "B_EQ",
        Ne = 7 => "B_NE",
        Lt = 8 => "B_LT",
        Le = 9 => "B_LE",
        Gt = 10 => "B_GT",
        Ge = 11 => "B_GE",
        Pow = 12 => "B_POW",
        Axpy = 13 => "B_AXPY",
        Assign = 14 => "B_ASSIGN",
        NegGrad = 15 => "B_NEG_GRAD",
        AbsGrad = 16 => "B_ABS_GRAD",
        SquareGrad = 17 => "B_SQUARE_GRAD",
        SinGrad = 18 => "B_SIN_GRAD",
        CosGrad = 19 => "B_COS_GRAD",
        ReluGrad = 20 => "B_RELU_GRAD",
        GeluGrad = 21 => "B_GELU_GRAD",
        SqrtGrad = 22 => "B_SQRT_GRAD",
        RecipGrad = 23 => "B_RECIP_GRAD",
        TanhGrad = 24 => "B_TANH_GRAD",
        SigmoidGrad = 25 => "B_SIGMOID_GRAD",
        PowfGrad = 26 => "B_POWF_GRAD",
        ClampGrad = 27 => "B_CLAMP_GRAD",
        MaskNot = 28 => "B_MASK_NOT",
        ExpMul = 29 => "B_EXP_MUL",
    }
}

op_codes! {
    /// A reduction of rows.
    Reduction {
        Sum = 0 => "R_SUM",
        Max = 1 => "R_MAX",
        Min = 2 => "R_MIN",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `#define`s of one prefix in `kernels/common.cuh`.
    fn defines(prefix: &str) -> Vec<(String, i32)> {
        include_str!("../../kernels/common.cuh")
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
            .collect()
    }

    fn owned(list: &[(&str, i32)]) -> Vec<(String, i32)> {
        list.iter().map(|&(n, c)| (n.to_string(), c)).collect()
    }

    #[test]
    fn kernel_op_codes_match_the_rust_names() {
        assert_eq!(defines("U_"), owned(Unary::DEFINES));
        assert_eq!(defines("B_"), owned(Binary::DEFINES));
        assert_eq!(defines("R_"), owned(Reduction::DEFINES));
    }
}
