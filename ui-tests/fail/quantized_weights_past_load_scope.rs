// A quantized model's blocks are loaded in a scope for one experiment and kept in a cache the
// caller owns: the blocks are the load scope's tensors, freed when it closes, so the cache (which
// outlives it) cannot hold them. Returning them through `ret` (or `move_out`) is the legal way.
use ndscope::quant::QuantType;
use ndscope::{Device, QuantTensor, Result, root};

fn main() -> Result<()> {
    root(Device::Cpu, |outer| {
        let mut cache: Vec<QuantTensor<'_>> = Vec::new();
        outer.scope(|load| {
            let w = load.ones(&[4, 32])?;
            cache.push(QuantTensor::quantize(&w, QuantType::Q8_0)?);
            Ok(())
        })?;
        let _ = outer.ones(&[1])?;
        Ok(cache.len())
    })
    .map(drop)
}
