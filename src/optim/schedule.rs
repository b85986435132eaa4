//! Learning-rate schedules: the rate for each step, set on an optimizer before the step.

use crate::error::{Error, Result};

/// A learning rate per optimizer step (counted from 0). Implement it for a schedule of your own.
///
/// ```
/// use ndscope::optim::{Schedule, WarmupCosine};
///
/// let schedule = WarmupCosine::new(1e-3, 100, 1000)?.with_min(1e-5);
/// assert!(schedule.lr(0) < schedule.lr(50)); // warming up
/// assert_eq!(schedule.lr(100), 1e-3); // the peak
/// assert_eq!(schedule.lr(1000), 1e-5); // decayed to the floor, and stays there
/// # Ok::<(), ndscope::Error>(())
/// ```
///
/// In a loop: `opt.set_learning_rate(schedule.lr(step))` before `opt.step(..)`.
pub trait Schedule {
    /// The learning rate of step `step`.
    fn lr(&self, step: u64) -> f64;
}

/// The same rate at every step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Constant(pub f64);

impl Schedule for Constant {
    fn lr(&self, _step: u64) -> f64 {
        self.0
    }
}

/// Linear warm-up from `peak / warmup` to `peak` over the first `warmup` steps, then a half cosine
/// from `peak` down to `min` at step `total`, and `min` after that (Loshchilov and Hutter, 2017,
/// without restarts; the schedule GPT-style models train with).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WarmupCosine {
    peak: f64,
    min: f64,
    warmup: u64,
    total: u64,
}

impl WarmupCosine {
    /// Warm up for `warmup` steps to `peak`, decay to 0 by step `total`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a peak that is not positive and finite, or `warmup > total`.
    pub fn new(peak: f64, warmup: u64, total: u64) -> Result<WarmupCosine> {
        if !(peak.is_finite() && peak > 0.0) || warmup > total {
            return Err(Error::InvalidArgument {
                op: "WarmupCosine::new",
                reason: format!(
                    "needs a positive finite peak and warmup <= total, got peak {peak}, warmup {warmup}, total {total}"
                ),
            });
        }
        Ok(WarmupCosine {
            peak,
            min: 0.0,
            warmup,
            total,
        })
    }

    /// The same schedule decaying to `min` instead of 0 (clamped to `[0, peak]`).
    #[must_use]
    pub fn with_min(self, min: f64) -> WarmupCosine {
        WarmupCosine {
            min: if min.is_finite() {
                min.clamp(0.0, self.peak)
            } else {
                0.0
            },
            ..self
        }
    }
}

impl Schedule for WarmupCosine {
    fn lr(&self, step: u64) -> f64 {
        if step < self.warmup {
            return self.peak * (step + 1) as f64 / self.warmup as f64;
        }
        if step >= self.total {
            return self.min;
        }
        let progress = (step - self.warmup) as f64 / (self.total - self.warmup).max(1) as f64;
        self.min + 0.5 * (self.peak - self.min) * (1.0 + (std::f64::consts::PI * progress).cos())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_is_linear_and_the_decay_a_half_cosine() {
        let s = WarmupCosine::new(2.0, 4, 14).unwrap().with_min(0.5);
        let rates: Vec<f64> = (0..4).map(|i| s.lr(i)).collect();
        assert_eq!(rates, vec![0.5, 1.0, 1.5, 2.0]);
        assert_eq!(s.lr(4), 2.0);
        // Half way through the decay: the mean of peak and floor.
        assert!((s.lr(9) - 1.25).abs() < 1e-12);
        assert_eq!(s.lr(14), 0.5);
        assert_eq!(s.lr(1_000), 0.5);
        for i in 4..14 {
            assert!(s.lr(i + 1) <= s.lr(i), "the decay never rises");
        }
    }

    #[test]
    fn bad_schedules_are_refused() {
        assert!(WarmupCosine::new(0.0, 0, 10).is_err());
        assert!(WarmupCosine::new(f64::NAN, 0, 10).is_err());
        assert!(WarmupCosine::new(1.0, 11, 10).is_err());
        let no_warmup = WarmupCosine::new(1.0, 0, 10).unwrap();
        assert_eq!(no_warmup.lr(0), 1.0);
        assert_eq!(Constant(0.3).lr(7), 0.3);
    }
}
