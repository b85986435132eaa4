//! What `/metrics` reports, in Prometheus' text format: requests by outcome, tokens, the queue, the
//! KV pool's blocks, and histograms of the time to the first token and between tokens.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;
use std::time::Duration;

/// Upper bounds of the latency buckets, in seconds.
const BUCKETS: [f64; 14] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

#[derive(Default)]
struct Histogram {
    counts: [u64; BUCKETS.len()],
    count: u64,
    sum: f64,
}

impl Histogram {
    fn observe(&mut self, d: Duration) {
        let x = d.as_secs_f64();
        for (c, &le) in self.counts.iter_mut().zip(&BUCKETS) {
            if x <= le {
                *c += 1;
            }
        }
        self.count += 1;
        self.sum += x;
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (c, le) in self.counts.iter().zip(BUCKETS) {
            let _ = writeln!(out, "{name}_bucket{{le=\"{le}\"}} {c}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum {}\n{name}_count {}", self.sum, self.count);
    }
}

/// The KV pool's blocks, as the engine saw them after its last step.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Blocks {
    pub used: usize,
    pub free: usize,
    pub shared: usize,
    pub promised: usize,
}

#[derive(Default)]
struct Figures {
    outcomes: BTreeMap<&'static str, u64>,
    prompt_tokens: u64,
    generated_tokens: u64,
    waiting: usize,
    running: usize,
    blocks: Blocks,
    first_token: Histogram,
    between_tokens: Histogram,
}

/// The server's figures, updated by the engine thread and the handlers.
#[derive(Default)]
pub struct Metrics {
    figures: Mutex<Figures>,
}

/// How a request ended (or why it never started).
pub const OUTCOMES: [&str; 6] = [
    "stop",
    "length",
    "cancelled",
    "failed",
    "rejected",
    "overloaded",
];

impl Metrics {
    fn with<R>(&self, f: impl FnOnce(&mut Figures) -> R) -> R {
        // A handler that panicked while holding the lock left whole numbers behind.
        let mut figures = self.figures.lock().unwrap_or_else(|e| e.into_inner());
        f(&mut figures)
    }

    pub fn outcome(&self, outcome: &'static str) {
        debug_assert!(OUTCOMES.contains(&outcome));
        self.with(|f| *f.outcomes.entry(outcome).or_default() += 1);
    }

    pub fn prompt_tokens(&self, n: usize) {
        self.with(|f| f.prompt_tokens += n as u64);
    }

    /// A generated token, `first` (after its request's submission) or `after` the previous one.
    pub fn token(&self, since: Duration, first: bool) {
        self.with(|f| {
            f.generated_tokens += 1;
            if first {
                f.first_token.observe(since);
            } else {
                f.between_tokens.observe(since);
            }
        });
    }

    pub fn engine(&self, waiting: usize, running: usize, blocks: Blocks) {
        self.with(|f| {
            f.waiting = waiting;
            f.running = running;
            f.blocks = blocks;
        });
    }

    /// Everything, in Prometheus' text exposition format.
    pub fn render(&self) -> String {
        self.with(|f| {
            let mut out = String::new();
            out.push_str("# HELP ndscope_requests_total Requests by how they ended.\n");
            out.push_str("# TYPE ndscope_requests_total counter\n");
            for o in OUTCOMES {
                let n = f.outcomes.get(o).copied().unwrap_or(0);
                let _ = writeln!(out, "ndscope_requests_total{{outcome=\"{o}\"}} {n}");
            }
            let counter = |out: &mut String, name: &str, help: &str, v: u64| {
                let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}");
            };
            counter(&mut out, "ndscope_prompt_tokens_total", "Prompt tokens accepted.", f.prompt_tokens);
            counter(&mut out, "ndscope_generated_tokens_total", "Tokens generated.", f.generated_tokens);
            let gauge = |out: &mut String, name: &str, help: &str, v: usize| {
                let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
            };
            gauge(&mut out, "ndscope_queue_length", "Requests waiting to start.", f.waiting);
            gauge(&mut out, "ndscope_running", "Requests decoding.", f.running);
            out.push_str("# HELP ndscope_kv_blocks KV cache blocks by state (shared: held by several samples; promised: free, set aside for running requests).\n");
            out.push_str("# TYPE ndscope_kv_blocks gauge\n");
            let b = f.blocks;
            for (state, v) in [("used", b.used), ("free", b.free), ("shared", b.shared), ("promised", b.promised)] {
                let _ = writeln!(out, "ndscope_kv_blocks{{state=\"{state}\"}} {v}");
            }
            f.first_token.render(
                &mut out,
                "ndscope_time_to_first_token_seconds",
                "From a request's arrival at the engine to its first token.",
            );
            f.between_tokens.render(
                &mut out,
                "ndscope_inter_token_latency_seconds",
                "Between a request's consecutive tokens.",
            );
            out
        })
    }
}
