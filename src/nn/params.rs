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
}

impl<'m> Parameters<'m> for Tensor<'m> {
    fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor<'m>)) {
        f(prefix, self);
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
