//! Moving values between scopes: what `ret`, `move_to` and `scope_moved` accept.

use crate::error::Result;
use crate::scope::Scope;

/// A value whose tensors, all branded `'a`, can be moved to another scope in one call, re-branding
/// them with that scope's lifetime. Implemented for [`Tensor`](crate::Tensor), tuples (up to four), arrays, `Vec`, `Option`, `()` and plain
/// values that hold no tensor. Implement it for your own types (a model's parameter set) by moving each
/// field. `'a` is the brand of the value's tensors: [`Child::ret`](crate::Child::ret) only accepts
/// values branded with the child's lifetime (or a longer one), so a sibling scope's tensor cannot be
/// returned through it.
///
///
/// ```
/// use ndscope::{Movable, Result, Scope, Tensor};
///
/// struct Linear<'s> { weight: Tensor<'s>, bias: Tensor<'s> }
///
/// impl<'s> Movable<'s> for Linear<'s> {
///     type Moved<'b> = Linear<'b>;
///     fn move_into<'b>(self, target: &Scope<'b>) -> Result<Linear<'b>> {
///         Ok(Linear { weight: self.weight.move_into(target)?, bias: self.bias.move_into(target)? })
///     }
/// }
///
/// ndscope::root(ndscope::Device::Cpu, |model| {
///     let layer = model.scope(|init| {
///         let layer = Linear { weight: init.randn(&[3, 2])?, bias: init.zeros(&[2])? };
///         init.ret(layer) // both tensors now belong to `model`
///     })?;
///     assert_eq!(layer.weight.shape(), &[3, 2]);
///     Ok::<_, ndscope::Error>(())
/// })?;
/// # Ok::<(), ndscope::Error>(())
/// ```
pub trait Movable<'a>: Sized {
    /// The same value, branded with the target scope's lifetime `'b`.
    type Moved<'b>;

    /// Moves every tensor of `self` to `target`.
    ///
    /// # Errors
    /// When `target` is capped or over budget, or a needed copy cannot be allocated. Tensors moved
    /// before the failing one are dropped with the rest of the value.
    fn move_into<'b>(self, target: &Scope<'b>) -> Result<Self::Moved<'b>>;
}

macro_rules! plain_movable {
    ($($t:ty),*) => {$(
        impl<'a> Movable<'a> for $t {
            type Moved<'b> = $t;
            fn move_into<'b>(self, _: &Scope<'b>) -> Result<$t> {
                Ok(self)
            }
        }
    )*};
}

plain_movable!((), bool, f32, f64, i64, i32, u32, u64, usize, String);

macro_rules! tuple_movable {
    ($($name:ident),+) => {
        impl<'a, $($name: Movable<'a>),+> Movable<'a> for ($($name,)+) {
            type Moved<'b> = ($($name::Moved<'b>,)+);
            #[allow(non_snake_case)]
            fn move_into<'b>(self, target: &Scope<'b>) -> Result<Self::Moved<'b>> {
                let ($($name,)+) = self;
                Ok(($($name.move_into(target)?,)+))
            }
        }
    };
}

tuple_movable!(A);
tuple_movable!(A, B);
tuple_movable!(A, B, C);
tuple_movable!(A, B, C, D);

impl<'a, T: Movable<'a>> Movable<'a> for Option<T> {
    type Moved<'b> = Option<T::Moved<'b>>;
    fn move_into<'b>(self, target: &Scope<'b>) -> Result<Self::Moved<'b>> {
        self.map(|v| v.move_into(target)).transpose()
    }
}

impl<'a, T: Movable<'a>> Movable<'a> for Vec<T> {
    type Moved<'b> = Vec<T::Moved<'b>>;
    fn move_into<'b>(self, target: &Scope<'b>) -> Result<Self::Moved<'b>> {
        // For tensors the element layout is unchanged, so std collects in place without allocating.
        self.into_iter().map(|v| v.move_into(target)).collect()
    }
}

impl<'a, T: Movable<'a>, const N: usize> Movable<'a> for [T; N] {
    type Moved<'b> = [T::Moved<'b>; N];
    fn move_into<'b>(self, target: &Scope<'b>) -> Result<Self::Moved<'b>> {
        let moved: Vec<T::Moved<'b>> = self
            .into_iter()
            .map(|v| v.move_into(target))
            .collect::<Result<_>>()?;
        Ok(moved
            .try_into()
            .unwrap_or_else(|_| unreachable!("an array of N moves to N values")))
    }
}

/// A value whose tensors can all leave their scope tree ([`Tensor::move_out`](crate::Tensor::move_out)),
/// re-branded `'static`: a model loaded once and then shared read-only by threads, each serving its
/// own requests in scopes of its own tree. Implemented for tensors, `Option`, `Vec`, the layers of
/// [`nn`](crate::nn) and the models of [`models`](crate::models).
pub trait MoveOut<'a>: Movable<'a> {
    /// Moves every tensor of `self` out of its tree.
    ///
    /// # Errors
    /// When the system allocator refuses a needed copy.
    fn move_out(self) -> Result<Self::Moved<'static>>;
}

impl<'a, T: MoveOut<'a>> MoveOut<'a> for Option<T> {
    fn move_out(self) -> Result<Self::Moved<'static>> {
        self.map(MoveOut::move_out).transpose()
    }
}

impl<'a, T: MoveOut<'a>> MoveOut<'a> for Vec<T> {
    fn move_out(self) -> Result<Self::Moved<'static>> {
        self.into_iter().map(MoveOut::move_out).collect()
    }
}
