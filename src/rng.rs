//! Random numbers. Tensors (`rand`, `randn`, dropout masks, initialisers) come from a counter-based
//! generator, Philox 4x32-10 (Salmon et al., 2011, as in cuRAND, PyTorch and JAX): element `i` of a
//! draw is a pure function of the seed and the draw's offset plus `i`, so every element is computed
//! independently — in parallel on the host and on the GPU — and every device gives the same numbers
//! for the same seed. Each scope tree keeps a seed and an offset ([`Stream`]), seeded with
//! [`DEFAULT_SEED`] when the root opens and by `Scope::set_seed`.
//!
//! Shuffles of host data use a sequential xoshiro256** ([`Rng`]).

/// The seed every tree starts with.
pub const DEFAULT_SEED: u64 = 0x5EED_CAFE_F00D;

/// A tree's tensor generator: the seed and how many elements earlier draws used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Stream {
    /// The Philox key.
    pub(crate) seed: u64,
    /// The counter of the next draw's first element.
    pub(crate) offset: u64,
}

impl Stream {
    pub(crate) fn new(seed: u64) -> Stream {
        Stream { seed, offset: 0 }
    }

    /// Reserves `n` counters for a draw and returns the first.
    pub(crate) fn reserve(&mut self, n: usize) -> u64 {
        let first = self.offset;
        self.offset = self.offset.wrapping_add(n as u64);
        first
    }
}

const PHILOX_M: [u32; 2] = [0xD251_1F53, 0xCD9E_8D57];
const PHILOX_W: [u32; 2] = [0x9E37_79B9, 0xBB67_AE85];

/// Philox 4x32 with 10 rounds: four 32-bit outputs from a 128-bit counter and a 64-bit key
/// (`kernels/random.cu` computes the same function).
#[inline(always)]
pub(crate) fn philox4x32_10(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let [mut c, mut k] = [counter, [key[0], key[1], 0, 0]];
    for round in 0..10 {
        if round > 0 {
            k[0] = k[0].wrapping_add(PHILOX_W[0]);
            k[1] = k[1].wrapping_add(PHILOX_W[1]);
        }
        let p0 = u64::from(PHILOX_M[0]) * u64::from(c[0]);
        let p1 = u64::from(PHILOX_M[1]) * u64::from(c[2]);
        c = [
            (p1 >> 32) as u32 ^ c[1] ^ k[0],
            p1 as u32,
            (p0 >> 32) as u32 ^ c[3] ^ k[1],
            p0 as u32,
        ];
    }
    c
}

/// What a random kernel draws.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Distribution {
    /// Uniform in `[0, 1)`.
    Uniform,
    /// Standard normal.
    Normal,
}

impl Distribution {
    /// The number the kernels switch on (`RANDOM_*` in `kernels/random.cu`).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))] // only GPU kernels take numbers
    pub(crate) fn code(self) -> i32 {
        match self {
            Distribution::Uniform => 0,
            Distribution::Normal => 1,
        }
    }

    /// Element `index` of the stream `seed`: the Philox block of counter `index` (low and high
    /// words first) under the key `seed`. Uniform: the top 24 bits of the first word, `/ 2^24` (exact in
    /// `f32`). Normal: Box-Muller in `f64` of `u1 = (top 24 bits of word 0 + 1) / 2^24` (never 0)
    /// and `u2 = top 24 bits of word 1 / 2^24`, `sqrt(-2 ln u1) cos(2π u2)`.
    #[inline(always)]
    pub(crate) fn sample(self, seed: u64, index: u64) -> f64 {
        let r = philox4x32_10(
            [index as u32, (index >> 32) as u32, 0, 0],
            [seed as u32, (seed >> 32) as u32],
        );
        const SCALE: f64 = 1.0 / (1u32 << 24) as f64;
        match self {
            Distribution::Uniform => f64::from(r[0] >> 8) * SCALE,
            Distribution::Normal => {
                let u1 = f64::from((r[0] >> 8) + 1) * SCALE;
                let u2 = f64::from(r[1] >> 8) * SCALE;
                (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
            }
        }
    }
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct Rng {
    s: [u64; 4],
}

impl Rng {
    pub(crate) fn new(seed: u64) -> Rng {
        let mut x = seed;
        let mut next = || {
            x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        Rng {
            s: [next(), next(), next(), next()],
        }
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        let result = self.s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = self.s[1] << 17;
        self.s[2] ^= self.s[0];
        self.s[3] ^= self.s[1];
        self.s[1] ^= self.s[2];
        self.s[0] ^= self.s[3];
        self.s[2] ^= t;
        self.s[3] = self.s[3].rotate_left(45);
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Random123's published known answers for Philox4x32-10.
    #[test]
    fn philox_matches_the_reference_vectors() {
        assert_eq!(
            philox4x32_10([0; 4], [0; 2]),
            [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8]
        );
        assert_eq!(
            philox4x32_10([u32::MAX; 4], [u32::MAX; 2]),
            [0x408f_276d, 0x41c8_3b0e, 0xa20b_c7c6, 0x6d54_51fd]
        );
    }

    #[test]
    fn a_stream_hands_out_disjoint_counters() {
        let mut s = Stream::new(9);
        assert_eq!(s.reserve(10), 0);
        assert_eq!(s.reserve(3), 10);
        assert_eq!(s.offset, 13);
        assert_eq!(
            Distribution::Uniform.sample(9, 12),
            Distribution::Uniform.sample(9, 12)
        );
        assert_ne!(
            Distribution::Uniform.sample(9, 12),
            Distribution::Uniform.sample(10, 12)
        );
    }

    #[test]
    fn the_shuffle_generator_repeats_with_its_seed() {
        let (mut a, mut b) = (Rng::new(7), Rng::new(7));
        assert_eq!(a.next_u64(), b.next_u64());
        assert_ne!(a.next_u64(), Rng::new(8).next_u64());
    }

    /// The Kolmogorov–Smirnov distance between `samples` and the distribution function `cdf`.
    fn ks_distance(mut samples: Vec<f64>, cdf: impl Fn(f64) -> f64) -> f64 {
        samples.sort_by(f64::total_cmp);
        let n = samples.len() as f64;
        samples
            .iter()
            .enumerate()
            .map(|(i, &x)| {
                let f = cdf(x);
                (f - i as f64 / n).abs().max(((i + 1) as f64 / n - f).abs())
            })
            .fold(0.0, f64::max)
    }

    #[test]
    fn draws_have_the_right_moments_and_pass_a_kolmogorov_smirnov_test() {
        let n = 100_000;
        // The critical distance at the 0.1 % level is 1.95 / sqrt(n).
        let critical = 1.95 / (n as f64).sqrt();
        let uniform: Vec<f64> = (0..n)
            .map(|i| Distribution::Uniform.sample(11, i))
            .collect();
        assert!(uniform.iter().all(|&u| (0.0..1.0).contains(&u)));
        let mean = uniform.iter().sum::<f64>() / n as f64;
        assert!((mean - 0.5).abs() < 0.005, "uniform mean {mean}");
        let d = ks_distance(uniform, |x| x.clamp(0.0, 1.0));
        assert!(d < critical, "uniform KS distance {d} >= {critical}");

        let normal: Vec<f64> = (0..n)
            .map(|i| Distribution::Normal.sample(12, (i + 1) << 40))
            .collect();
        assert!(normal.iter().all(|x| x.is_finite()));
        let mean = normal.iter().sum::<f64>() / n as f64;
        let var = normal.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n as f64;
        assert!(
            mean.abs() < 0.015 && (var - 1.0).abs() < 0.02,
            "normal mean {mean} var {var}"
        );
        let d = ks_distance(normal, |x| {
            0.5 * (1.0 + libm::erf(x / std::f64::consts::SQRT_2))
        });
        assert!(d < critical, "normal KS distance {d} >= {critical}");
    }
}
