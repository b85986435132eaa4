//! Choosing the next token from a row of logits: greedy, or drawn with temperature, top-k and top-p
//! (nucleus) filtering from a seeded generator, on the host, so every device draws the same tokens
//! from the same logits.

use crate::error::{Error, Result};
use crate::ops::host_logits::{first_largest, log_sum_exp_below};
use crate::rng::Rng;

/// How the next token is chosen.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    /// Divides the logits before the softmax; `0` chooses the most likely token (greedy).
    pub temperature: f64,
    /// Keeps the `top_k` most likely tokens (`0`: all).
    pub top_k: usize,
    /// Keeps the fewest most likely tokens whose probabilities sum to at least `top_p` (`1`: all;
    /// Holtzman et al., 2020).
    pub top_p: f64,
}

impl Sampling {
    /// The most likely token every step (the first of equal ones).
    pub const GREEDY: Sampling = Sampling {
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
    };

    /// Drawn from the softmax of the logits divided by `temperature`, unfiltered.
    pub fn with_temperature(temperature: f64) -> Sampling {
        Sampling {
            temperature,
            ..Sampling::GREEDY
        }
    }

    /// Checks the numbers.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a negative or non-finite temperature, or `top_p` outside
    /// `(0, 1]`.
    pub fn check(&self) -> Result<()> {
        let problem = if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            Some(format!(
                "the temperature must be a finite number >= 0 (0 is greedy), got {}",
                self.temperature
            ))
        } else if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            Some(format!(
                "top_p must be in (0, 1] (1 keeps every token), got {}",
                self.top_p
            ))
        } else {
            None
        };
        match problem {
            Some(reason) => Err(Error::InvalidArgument {
                op: "Sampling",
                reason,
            }),
            None => Ok(()),
        }
    }
}

impl Default for Sampling {
    fn default() -> Sampling {
        Sampling::GREEDY
    }
}

/// A token and its log-probability under the model (before temperature and filters).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Choice {
    pub(crate) token: i64,
    pub(crate) logprob: f32,
}

/// Draws tokens with one sampling rule from one seeded stream.
#[derive(Debug)]
pub(crate) struct Sampler {
    sampling: Sampling,
    rng: Rng,
    /// Candidates reused across steps: (token, weight).
    scratch: Vec<(usize, f64)>,
}

impl Sampler {
    pub(crate) fn new(sampling: Sampling, seed: u64) -> Result<Sampler> {
        sampling.check()?;
        Ok(Sampler {
            sampling,
            rng: Rng::new(seed),
            scratch: Vec::new(),
        })
    }

    /// A uniform draw in `[0, 1)` with 53 random bits.
    fn uniform(&mut self) -> f64 {
        (self.rng.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// The next token from `logits` (one row; NaN counts as `-inf`).
    pub(crate) fn choose(&mut self, logits: &[f32]) -> Choice {
        self.choose_summarized(logits, Summary::of(logits))
    }

    /// [`choose`](Self::choose) with the row's [`Summary`] computed already.
    pub(crate) fn choose_summarized(&mut self, logits: &[f32], summary: Summary) -> Choice {
        let Summary {
            best,
            largest,
            log_sum,
        } = summary;
        let best_value = f64::from(largest);
        let logprob = |i: usize| (value(logits[i]) - log_sum) as f32;
        let s = self.sampling;
        if s.temperature == 0.0 || !best_value.is_finite() {
            return Choice {
                token: best as i64,
                logprob: logprob(best),
            };
        }
        // Weights relative to the best token, tempered: the best has weight 1.
        let mut candidates = std::mem::take(&mut self.scratch);
        candidates.clear();
        candidates.extend(
            logits
                .iter()
                .enumerate()
                .map(|(i, &x)| (i, ((value(x) - best_value) / s.temperature).exp()))
                .filter(|&(_, w)| w > 0.0),
        );
        let by_weight =
            |a: &(usize, f64), b: &(usize, f64)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if s.top_k > 0 && s.top_k < candidates.len() {
            candidates.select_nth_unstable_by(s.top_k - 1, by_weight);
            candidates.truncate(s.top_k);
        }
        if s.top_p < 1.0 {
            candidates.sort_unstable_by(by_weight);
            let total: f64 = candidates.iter().map(|c| c.1).sum();
            let (mut kept, mut mass) = (0, 0.0);
            for c in &candidates {
                kept += 1;
                mass += c.1;
                if mass >= s.top_p * total {
                    break;
                }
            }
            candidates.truncate(kept);
        } else {
            // A fixed order, so the draw depends on the logits only.
            candidates.sort_unstable_by_key(|c| c.0);
        }
        let total: f64 = candidates.iter().map(|c| c.1).sum();
        let mut target = self.uniform() * total;
        let mut token = candidates.last().map_or(best, |c| c.0);
        for c in &candidates {
            if target < c.1 {
                token = c.0;
                break;
            }
            target -= c.1;
        }
        self.scratch = candidates;
        Choice {
            token: token as i64,
            logprob: logprob(token),
        }
    }
}

/// What every choice from a row of logits needs first, whatever the sampling: the first largest
/// logit and the log of the softmax's denominator. A function of the row alone (two passes over
/// it, the cost of a greedy choice), so that the engine can summarise a step's rows on every
/// thread and then choose from them in order.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Summary {
    /// The index of the first largest logit.
    best: usize,
    /// That logit.
    largest: f32,
    /// `ln Σ e^x` over the row, in `f64`.
    log_sum: f64,
}

impl Summary {
    /// The summary of `logits` (one row; NaN counts as `-inf`).
    pub(crate) fn of(logits: &[f32]) -> Summary {
        let (best, largest) = first_largest(logits);
        let best_value = f64::from(largest);
        let log_sum = if largest.is_finite() {
            best_value + log_sum_exp_below(logits, largest).ln()
        } else {
            // Every logit NaN or infinite: the plain sum, whatever it makes of them.
            best_value
                + logits
                    .iter()
                    .map(|&x| (value(x) - best_value).exp())
                    .sum::<f64>()
                    .ln()
        };
        Summary {
            best,
            largest,
            log_sum,
        }
    }
}

/// A logit as the softmax counts it: in `f64`, NaN as `-inf`.
fn value(x: f32) -> f64 {
    if x.is_nan() {
        f64::NEG_INFINITY
    } else {
        f64::from(x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sampler(sampling: Sampling) -> Sampler {
        Sampler::new(sampling, 7).unwrap()
    }

    #[test]
    fn greedy_takes_the_first_largest_and_reports_its_log_probability() {
        let c = sampler(Sampling::GREEDY).choose(&[1.0, 3.0, 3.0, f32::NAN]);
        assert_eq!(c.token, 1);
        let want = 3.0 - (1f64.exp() + 2.0 * 3f64.exp()).ln();
        assert!((f64::from(c.logprob) - want).abs() < 1e-6);
    }

    #[test]
    fn a_long_row_s_log_probability_is_the_f64_softmax_s() {
        // A vocabulary's worth of logits over a wide range, some NaN and -inf, and a tail that is
        // not a whole group of lanes.
        let logits = crate::ops::host_logits::awkward_logits(128_257);
        let best = logits
            .iter()
            .filter(|x| !x.is_nan())
            .fold(f64::NEG_INFINITY, |m, &x| m.max(f64::from(x)));
        let exact: f64 = logits
            .iter()
            .filter(|x| !x.is_nan())
            .map(|&x| (f64::from(x) - best).exp())
            .sum();
        let got = log_sum_exp_below(&logits, best as f32);
        assert!((got / exact - 1.0).abs() < 1e-6, "{got} vs {exact}");
        let c = sampler(Sampling::GREEDY).choose(&logits);
        assert!((f64::from(c.logprob) + exact.ln()).abs() < 1e-6, "{c:?}");
    }

    #[test]
    fn the_largest_is_the_first_of_equals_and_skips_nan() {
        let mut logits = vec![f32::NAN; 40];
        assert_eq!(first_largest(&logits), (0, f32::NEG_INFINITY));
        logits[3] = f32::NEG_INFINITY;
        assert_eq!(first_largest(&logits), (0, f32::NEG_INFINITY));
        // Equal largest values in two lanes and in the tail: the first wins.
        for (i, v) in [(5, 2.0), (21, 7.5), (37, 7.5), (38, -1.0), (30, 7.5)] {
            logits[i] = v;
        }
        assert_eq!(first_largest(&logits), (21, 7.5));
        logits[39] = f32::INFINITY;
        assert_eq!(first_largest(&logits), (39, f32::INFINITY));
        assert_eq!(first_largest(&[]), (0, f32::NEG_INFINITY));
    }

    #[test]
    fn draws_follow_the_tempered_filtered_distribution() {
        let logits = [0.0f32, 1.0, 2.0, 3.0];
        let count = |sampling: Sampling| {
            let mut s = sampler(sampling);
            let mut n = [0usize; 4];
            for _ in 0..20_000 {
                n[s.choose(&logits).token as usize] += 1;
            }
            n.map(|c| c as f64 / 20_000.0)
        };
        // Temperature 2: p ∝ e^(x/2).
        let z: f64 = (0..4).map(|i| (i as f64 / 2.0).exp()).sum();
        let got = count(Sampling::with_temperature(2.0));
        for i in 0..4 {
            assert!(
                (got[i] - (i as f64 / 2.0).exp() / z).abs() < 0.015,
                "{got:?}"
            );
        }
        // Top-2 keeps tokens 3 and 2 only.
        let got = count(Sampling {
            top_k: 2,
            ..Sampling::with_temperature(1.0)
        });
        assert_eq!((got[0], got[1]), (0.0, 0.0));
        assert!((got[3] - 1f64.exp() / (1.0 + 1f64.exp())).abs() < 0.015);
        // Top-p 0.5: token 3 alone holds 64 % of the mass.
        let got = count(Sampling {
            top_p: 0.5,
            ..Sampling::with_temperature(1.0)
        });
        assert_eq!(got[3], 1.0);
    }

    #[test]
    fn the_same_seed_draws_the_same_tokens() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let draw = || {
            let mut s = sampler(Sampling::with_temperature(1.0));
            (0..100)
                .map(|_| s.choose(&logits).token)
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(), draw());
    }

    #[test]
    fn bad_numbers_are_refused() {
        for s in [
            Sampling::with_temperature(-1.0),
            Sampling::with_temperature(f64::NAN),
            Sampling {
                top_p: 0.0,
                ..Sampling::GREEDY
            },
            Sampling {
                top_p: 1.5,
                ..Sampling::GREEDY
            },
        ] {
            assert!(Sampler::new(s, 0).is_err(), "{s:?}");
        }
    }
}
