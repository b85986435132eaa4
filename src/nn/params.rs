//! Visiting a model's parameters: what optimizers and checkpoints need from a model.

use crate::error::Result;
use crate::tensor::Tensor;

/// A set of named parameters branded `'m`, visited in a fixed order.
///
/// Implement it for your own model by visiting each field with a prefix (see [`Linear`](super::Linear)'s
/// implementation); optimizers rely on the order being the same on every call.
pub trait Parameters<'m> {
    /// Calls `f(name, parameter)` for every parameter; names start with `prefix`.
    fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor<'m>));

    /// Calls `f` on every parameter, mutably, in the order of [`visit`](Self::visit); stops at the
    /// first error.
    ///
    /// # Errors
    /// Whatever `f` returns.
    fn visit_mut(&mut self, f: &mut dyn FnMut(&mut Tensor<'m>) -> Result<()>) -> Result<()>;

    /// Number of parameter tensors.
    fn parameter_count(&self) -> usize {
        let mut n = 0;
        self.visit("", &mut |_, _| n += 1);
        n
    }

    /// Total number of scalar parameters.
    fn parameter_elements(&self) -> usize {
        let mut n = 0;
        self.visit("", &mut |_, t| n += t.numel());
        n
    }

    /// Names every parameter in dumps by its path, as [`visit`](Self::visit) gives it with
    /// `prefix` (PyTorch's `named_parameters`): `"0.weight"`, `"encoder.blocks.3.mlp.up.weight"`,
    /// instead of the layer's own `"weight"`. Each distinct path is kept once for the process, so
    /// call it on a model, not on per-step tensors. A model loaded from a checkpoint is already
    /// named by the checkpoint's names.
    ///
    /// ```
    /// use ndscope::nn::{self, Activation, Init, Parameters};
    /// # ndscope::root(ndscope::Device::Cpu, |m| {
    /// let model = nn::mlp(m, &[4, 8, 2], Activation::Relu, Init::KaimingUniform)?;
    /// model.name_by_path("classifier.");
    /// let mut names = Vec::new();
    /// model.visit("", &mut |_, p| names.push(p.name()));
    /// assert_eq!(names[0], Some("classifier.0.weight"));
    /// assert!(m.dump().contains("tensor \"classifier.2.bias\""));
    /// # Ok::<_, ndscope::Error>(()) })?; Ok::<(), ndscope::Error>(())
    /// ```
    fn name_by_path(&self, prefix: &str) {
        self.visit(prefix, &mut |name, p| {
            let _ = p.clone().named_path(name);
        });
    }
}

/// A bare tensor is one parameter named by its prefix: a field `w` of a [`model!`](crate::model)
/// struct is `w`, an element of a `Vec` field `ws` is `ws.0` (the separator a container adds before
/// its items is not part of the name).
impl<'m> Parameters<'m> for Tensor<'m> {
    fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor<'m>)) {
        f(prefix.strip_suffix('.').unwrap_or(prefix), self);
    }

    fn visit_mut(&mut self, f: &mut dyn FnMut(&mut Tensor<'m>) -> Result<()>) -> Result<()> {
        f(self)
    }
}

/// A list of layers, named `{prefix}{index}.` like PyTorch's `ModuleList`.
impl<'m, T: Parameters<'m>> Parameters<'m> for Vec<T> {
    fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor<'m>)) {
        for (i, item) in self.iter().enumerate() {
            item.visit(&format!("{prefix}{i}."), f);
        }
    }

    fn visit_mut(&mut self, f: &mut dyn FnMut(&mut Tensor<'m>) -> Result<()>) -> Result<()> {
        self.iter_mut().try_for_each(|item| item.visit_mut(f))
    }
}

/// An optional part (a bias, a layer switched off): nothing when `None`.
impl<'m, T: Parameters<'m>> Parameters<'m> for Option<T> {
    fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor<'m>)) {
        if let Some(item) = self {
            item.visit(prefix, f);
        }
    }

    fn visit_mut(&mut self, f: &mut dyn FnMut(&mut Tensor<'m>) -> Result<()>) -> Result<()> {
        match self {
            Some(item) => item.visit_mut(f),
            None => Ok(()),
        }
    }
}

/// Implements [`Parameters`], [`Movable`](crate::Movable) and [`MoveOut`](crate::MoveOut) for a layer struct `$ty<'m>` from its
/// fields: `tensors` are parameters named `{prefix}{field}`, `layers` are nested layers visited under
/// `{prefix}{field}.`, `plain` are copied as they are when the layer moves. Visits follow the order
/// given (tensors, then layers), which fixes checkpoint names and optimizer state order.
macro_rules! layer_parts {
    ($ty:ident { tensors: [$($t:ident),*], layers: [$($l:ident),*], plain: [$($p:ident),*] }) => {
        impl<'m> $crate::nn::Parameters<'m> for $ty<'m> {
            fn visit(
                &self,
                prefix: &str,
                f: &mut dyn FnMut(&str, &$crate::tensor::Tensor<'m>),
            ) {
                $(f(&format!(concat!("{}", stringify!($t)), prefix), &self.$t);)*
                $($crate::nn::Parameters::visit(
                    &self.$l,
                    &format!(concat!("{}", stringify!($l), "."), prefix),
                    f,
                );)*
            }

            fn visit_mut(
                &mut self,
                f: &mut dyn FnMut(&mut $crate::tensor::Tensor<'m>) -> $crate::error::Result<()>,
            ) -> $crate::error::Result<()> {
                $(f(&mut self.$t)?;)*
                $($crate::nn::Parameters::visit_mut(&mut self.$l, f)?;)*
                Ok(())
            }
        }

        impl<'m> $crate::scope::Movable<'m> for $ty<'m> {
            type Moved<'b> = $ty<'b>;
            fn move_into<'b>(
                self,
                target: &$crate::scope::Scope<'b>,
            ) -> $crate::error::Result<$ty<'b>> {
                Ok($ty {
                    $($t: $crate::scope::Movable::move_into(self.$t, target)?,)*
                    $($l: $crate::scope::Movable::move_into(self.$l, target)?,)*
                    $($p: self.$p,)*
                })
            }
        }

        impl<'m> $crate::scope::MoveOut<'m> for $ty<'m> {
            fn move_out(self) -> $crate::error::Result<$ty<'static>> {
                Ok($ty {
                    $($t: $crate::scope::MoveOut::move_out(self.$t)?,)*
                    $($l: $crate::scope::MoveOut::move_out(self.$l)?,)*
                    $($p: self.$p,)*
                })
            }
        }
    };
}
pub(crate) use layer_parts;
