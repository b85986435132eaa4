// A user's parameter set moves between scopes in one call by implementing `Movable`.
use ndscope::{root, Device, Movable, Result, Scope, Tensor};

struct Mlp<'s> {
    layers: Vec<(Tensor<'s>, Tensor<'s>)>,
}

impl<'s> Movable<'s> for Mlp<'s> {
    type Moved<'b> = Mlp<'b>;
    fn move_into<'b>(self, target: &Scope<'b>) -> Result<Mlp<'b>> {
        Ok(Mlp { layers: self.layers.move_into(target)? })
    }
}

fn main() -> Result<()> {
    root(Device::Cpu, |model| {
        let mlp = model.scope(|init| {
            let layers = vec![(init.randn(&[4, 8])?, init.zeros(&[8])?), (init.randn(&[8, 2])?, init.zeros(&[2])?)];
            init.ret(Mlp { layers })
        })?;
        assert_eq!(mlp.layers.len(), 2);
        assert_eq!(model.stats().live_tensors, 4);
        Ok(())
    })
}
