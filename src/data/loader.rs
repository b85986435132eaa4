//! Shuffled batches of a [`Dataset`], prepared on the calling thread or on a background thread.

use std::sync::mpsc;

use super::{Dataset, shuffled};
use crate::error::{Error, Result};

/// One batch on the host: `rows()` examples of `dim()` features, and their labels.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    features: Vec<f32>,
    labels: Vec<i64>,
    dim: usize,
    index: usize,
}

impl Batch {
    /// Features, row-major (`rows() * dim()` values).
    pub fn features(&self) -> &[f32] {
        &self.features
    }

    /// Labels (`rows()` values).
    pub fn labels(&self) -> &[i64] {
        &self.labels
    }

    /// Number of examples.
    pub fn rows(&self) -> usize {
        self.labels.len()
    }

    /// Features per example.
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// Position of the batch in its epoch.
    pub fn index(&self) -> usize {
        self.index
    }

    /// The shape of the feature tensor, `[rows, dim]`.
    pub fn feature_shape(&self) -> [usize; 2] {
        [self.rows(), self.dim]
    }

    /// Refills this batch (reusing its buffers) with the examples at `rows` of `data`.
    fn fill(&mut self, data: &Dataset, rows: &[usize], index: usize) {
        self.features.clear();
        self.labels.clear();
        for &r in rows {
            self.features.extend_from_slice(data.row(r));
            self.labels.push(data.labels()[r]);
        }
        self.dim = data.dim();
        self.index = index;
    }

    fn empty() -> Batch {
        Batch {
            features: Vec::new(),
            labels: Vec::new(),
            dim: 0,
            index: 0,
        }
    }
}

/// Batches of a data set, in a seeded random order per epoch (or in order), optionally one rank's
/// shard of each epoch ([`shard`](Self::shard)).
#[derive(Debug, Clone)]
pub struct Loader<'d> {
    data: &'d Dataset,
    batch_size: usize,
    seed: Option<u64>,
    drop_last: bool,
    /// This loader's rank and the number of ranks sharing each epoch (0 and 1: the whole epoch).
    rank: usize,
    world: usize,
}

/// Batches prepared ahead of the training loop by the background thread.
const PREFETCH_DEPTH: usize = 2;

impl<'d> Loader<'d> {
    /// Batches of `batch_size` examples of `data`, in order.
    ///
    /// # Errors
    /// [`Error::InvalidShape`] for a zero batch size.
    pub fn new(data: &'d Dataset, batch_size: usize) -> Result<Loader<'d>> {
        if batch_size == 0 {
            return Err(Error::InvalidShape {
                op: "Loader::new",
                shape: vec![batch_size],
                reason: "the batch size must be at least 1".into(),
            });
        }
        Ok(Loader {
            data,
            batch_size,
            seed: None,
            drop_last: false,
            rank: 0,
            world: 1,
        })
    }

    /// Shuffles every epoch; epoch `e` with seed `s` always gives the same order.
    pub fn shuffle(self, seed: u64) -> Loader<'d> {
        Loader {
            seed: Some(seed),
            ..self
        }
    }

    /// Skips the last batch of an epoch when it is smaller than the batch size.
    pub fn drop_last(self, drop_last: bool) -> Loader<'d> {
        Loader { drop_last, ..self }
    }

    /// Rank `rank`'s shard of every epoch when `world` ranks share the data, as PyTorch's
    /// `DistributedSampler` cuts it: every rank draws the same epoch order (give each the same
    /// [`shuffle`](Self::shuffle) seed), the order is padded with its own first examples to a
    /// multiple of `world`, and rank `r` takes positions `r, r + world, r + 2 world, …`. So the
    /// shards of an epoch are disjoint but for the padding (at most `world - 1` examples seen twice),
    /// cover every example, and hold the same number of examples, `ceil(len / world)`: every rank
    /// runs the same number of batches, which keeps data-parallel collectives in step.
    ///
    /// ```
    /// use ndscope::data::{Dataset, Loader};
    /// let data = Dataset::new((0..10).map(|v| v as f32).collect(), vec![0; 10], 1, 1)?;
    /// let mut seen = Vec::new();
    /// for rank in 0..3 {
    ///     let shard = Loader::new(&data, 2)?.shuffle(7).shard(rank, 3)?;
    ///     assert_eq!(shard.batches_per_epoch(), 2); // 4 examples each: 10 padded to 12
    ///     shard.for_each_batch(0, false, |b| Ok(seen.extend(b.features().iter().map(|&f| f as usize))))?;
    /// }
    /// seen.sort_unstable();
    /// seen.dedup();
    /// assert_eq!(seen, (0..10).collect::<Vec<_>>());
    /// # Ok::<(), ndscope::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::InvalidShape`] for no ranks or a rank outside `0..world`.
    pub fn shard(self, rank: usize, world: usize) -> Result<Loader<'d>> {
        if world == 0 || rank >= world {
            return Err(Error::InvalidShape {
                op: "Loader::shard",
                shape: vec![rank, world],
                reason: format!(
                    "needs a rank in 0..world and at least one rank, got rank {rank} of {world}"
                ),
            });
        }
        Ok(Loader {
            rank,
            world,
            ..self
        })
    }

    /// Examples in one epoch of this loader's shard (all of them without sharding).
    fn epoch_len(&self) -> usize {
        self.data.len().div_ceil(self.world)
    }

    /// Batches in one epoch (of this loader's shard).
    pub fn batches_per_epoch(&self) -> usize {
        let n = self.epoch_len();
        if self.drop_last {
            n / self.batch_size
        } else {
            n.div_ceil(self.batch_size)
        }
    }

    /// The example order of `epoch` (of this loader's shard).
    fn order(&self, epoch: u64) -> Vec<usize> {
        let all = match self.seed {
            // A different, reproducible permutation per epoch.
            Some(seed) => shuffled(
                self.data.len(),
                seed ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15),
            ),
            None => (0..self.data.len()).collect(),
        };
        if self.world == 1 {
            return all;
        }
        // Padded with the order's own first examples (cyclically, for fewer examples than ranks).
        (0..self.epoch_len())
            .map(|k| self.rank + k * self.world)
            .filter_map(|position| all.get(position % all.len().max(1)).copied())
            .collect()
    }

    /// Calls `f` with every batch of `epoch`, in order, stopping at its first error. With
    /// `background`, a second thread gathers the next batches while `f` runs; batch buffers are
    /// recycled between the threads, so a steady epoch allocates no host memory for batches.
    ///
    /// # Errors
    /// Whatever `f` returns.
    pub fn for_each_batch(
        &self,
        epoch: u64,
        background: bool,
        mut f: impl FnMut(&Batch) -> Result<()>,
    ) -> Result<()> {
        let order = self.order(epoch);
        let count = self.batches_per_epoch();
        let rows =
            |i: usize| &order[i * self.batch_size..((i + 1) * self.batch_size).min(order.len())];
        if !background {
            let mut batch = Batch::empty();
            for i in 0..count {
                batch.fill(self.data, rows(i), i);
                f(&batch)?;
            }
            return Ok(());
        }
        let (ready_tx, ready_rx) = mpsc::sync_channel::<Batch>(PREFETCH_DEPTH);
        let (spent_tx, spent_rx) = mpsc::channel::<Batch>();
        std::thread::scope(|threads| {
            threads.spawn(move || {
                for i in 0..count {
                    let mut batch = spent_rx.try_recv().unwrap_or_else(|_| Batch::empty());
                    batch.fill(self.data, rows(i), i);
                    if ready_tx.send(batch).is_err() {
                        return; // the consumer stopped early
                    }
                }
            });
            for batch in ready_rx {
                f(&batch)?;
                // The producer may have finished; then the buffer is simply dropped.
                let _ = spent_tx.send(batch);
            }
            Ok(())
        })
    }
}
