//! The collective calls tensor parallelism needs, behind one trait: the in-process double
//! here (N ranks on threads of one process, host buffers), NCCL in `nccl.rs` (device
//! buffers). Every rank makes the same calls in the same order, as NCCL requires.

use std::sync::{Condvar, Mutex};

#[derive(Debug, thiserror::Error)]
pub enum CollectiveError {
    #[error("collective buffers disagree: {0}")]
    Shape(String),
    #[error("rank {root} cannot be the root of a group of {world}")]
    Root { root: usize, world: usize },
    #[error("{0}")]
    Nccl(String),
    #[error("another rank of the group failed")]
    Aborted,
}

/// One rank's end of a communicator over `world_size` ranks. `Buf` is where the data lives:
/// `[f32]` on the host for the in-process double, a device buffer for NCCL.
pub trait Collective: Send {
    type Buf: ?Sized;
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;
    /// Every rank's `buf` becomes the element-wise sum of all ranks' `buf`s.
    fn all_reduce_sum(&self, buf: &mut Self::Buf) -> Result<(), CollectiveError>;
    /// `all` (`world_size` times `part`'s length) becomes every rank's `part`, rank 0 first.
    fn all_gather(&self, part: &Self::Buf, all: &mut Self::Buf) -> Result<(), CollectiveError>;
    /// Every rank's `buf` becomes rank `root`'s.
    fn broadcast(&self, buf: &mut Self::Buf, root: usize) -> Result<(), CollectiveError>;
}

/// A collective over host buffers: what the CPU backend's ranks take.
pub type HostCollective = dyn Collective<Buf = [f32]>;

/// The state the ranks of one in-process group share: one slot per rank and a barrier.
struct Shared {
    slots: Vec<Mutex<Vec<f32>>>,
    barrier: Gate,
}

/// A barrier that a failing rank can break, so that the ranks waiting for it return an
/// error instead of waiting forever (`std::sync::Barrier` cannot be broken).
struct Gate {
    state: Mutex<GateState>,
    turned: Condvar,
    n: usize,
}

#[derive(Default)]
struct GateState {
    arrived: usize,
    /// Counts the times every rank arrived, so a rank can tell its wait is over.
    generation: u64,
    broken: bool,
}

impl Gate {
    fn wait(&self) -> Result<(), CollectiveError> {
        let mut s = self.state.lock().expect("gate lock");
        if s.broken {
            return Err(CollectiveError::Aborted);
        }
        let generation = s.generation;
        s.arrived += 1;
        if s.arrived == self.n {
            s.arrived = 0;
            s.generation += 1;
            self.turned.notify_all();
            return Ok(());
        }
        while s.generation == generation && !s.broken {
            s = self.turned.wait(s).expect("gate lock");
        }
        if s.broken {
            return Err(CollectiveError::Aborted);
        }
        Ok(())
    }

    fn set_broken(&self, broken: bool) {
        let mut s = self.state.lock().expect("gate lock");
        *s = GateState {
            broken,
            ..GateState::default()
        };
        self.turned.notify_all();
    }
}

/// The in-process communicator: `world_size` ranks, each on its own thread, exchanging
/// through shared slots. Each rank publishes its data in its slot, all wait, each reads
/// the slots in rank order (so every rank computes the same sum in the same order: the
/// result is the same on every rank and from run to run), all wait again before a slot
/// may be overwritten. The test double of NCCL, and the CPU's tensor-parallel transport.
pub struct InProcess {
    shared: std::sync::Arc<Shared>,
    rank: usize,
}

impl InProcess {
    /// The `n` ranks of a new group, rank `i` at index `i`; hand each to its own thread.
    pub fn group(n: usize) -> Vec<InProcess> {
        assert!(n > 0, "a group needs a rank");
        let shared = std::sync::Arc::new(Shared {
            slots: (0..n).map(|_| Mutex::new(Vec::new())).collect(),
            barrier: Gate {
                state: Mutex::new(GateState::default()),
                turned: Condvar::new(),
                n,
            },
        });
        (0..n)
            .map(|rank| InProcess {
                shared: shared.clone(),
                rank,
            })
            .collect()
    }

    /// Breaks the group: every rank waiting in an exchange, and every later exchange,
    /// fails with [`CollectiveError::Aborted`] until [`InProcess::reset`]. What a rank
    /// that fails (or panics) mid-pass calls, so the others do not wait for it forever.
    pub fn abort(&self) {
        self.shared.barrier.set_broken(true);
    }

    /// Makes a broken group usable again; only once no rank is inside an exchange (after
    /// every rank's thread of the failed pass is joined).
    pub fn reset(&self) {
        self.shared.barrier.set_broken(false);
    }

    fn publish(&self, data: &[f32]) {
        let mut slot = self.shared.slots[self.rank].lock().expect("slot lock");
        slot.clear();
        slot.extend_from_slice(data);
    }

    /// Runs `read` over every rank's published slot in rank order, between the barriers
    /// that make the exchange safe. A length mismatch is reported by every rank alike.
    fn exchange(
        &self,
        data: &[f32],
        mut read: impl FnMut(usize, &[f32]),
    ) -> Result<(), CollectiveError> {
        self.publish(data);
        self.shared.barrier.wait()?;
        let mismatch = self
            .shared
            .slots
            .iter()
            .map(|s| s.lock().expect("slot lock").len())
            .find(|&len| len != data.len());
        if mismatch.is_none() {
            for (rank, slot) in self.shared.slots.iter().enumerate() {
                read(rank, &slot.lock().expect("slot lock"));
            }
        }
        self.shared.barrier.wait()?;
        match mismatch {
            Some(len) => Err(CollectiveError::Shape(format!(
                "rank {} has {} elements, another rank {len}",
                self.rank,
                data.len()
            ))),
            None => Ok(()),
        }
    }
}

impl Collective for InProcess {
    type Buf = [f32];

    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.slots.len()
    }

    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<(), CollectiveError> {
        let mut sum = vec![0f32; buf.len()];
        self.exchange(buf, |_, part| {
            sum.iter_mut().zip(part).for_each(|(s, p)| *s += p);
        })?;
        buf.copy_from_slice(&sum);
        Ok(())
    }

    fn all_gather(&self, part: &[f32], all: &mut [f32]) -> Result<(), CollectiveError> {
        let world = self.world_size();
        if all.len() != part.len() * world {
            return Err(CollectiveError::Shape(format!(
                "gathering {world} parts of {} into {}",
                part.len(),
                all.len()
            )));
        }
        let n = part.len();
        self.exchange(part, |rank, p| {
            all[rank * n..(rank + 1) * n].copy_from_slice(p)
        })
    }

    fn broadcast(&self, buf: &mut [f32], root: usize) -> Result<(), CollectiveError> {
        let world = self.world_size();
        if root >= world {
            return Err(CollectiveError::Root { root, world });
        }
        let mut from_root = Vec::new();
        self.exchange(buf, |rank, p| {
            if rank == root {
                from_root = p.to_vec();
            }
        })?;
        buf.copy_from_slice(&from_root);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `f` on every rank of an `n`-rank group, each on its own thread.
    fn on_ranks<T: Send>(n: usize, f: impl Fn(&InProcess) -> T + Sync) -> Vec<T> {
        let group = InProcess::group(n);
        std::thread::scope(|s| {
            let handles: Vec<_> = group.iter().map(|c| s.spawn(|| f(c))).collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn all_reduce_sums_in_rank_order_on_every_rank() {
        // Values whose f32 sum depends on the order: 1e8 + 1 - 1e8 is 0 in rank order
        // (the 1 is lost against 1e8); rank 2 starting from its own value would get 1.
        let out = on_ranks(3, |c| {
            let mut buf = vec![[1e8f32, 1.0, -1e8][c.rank()], c.rank() as f32 + 1.0];
            c.all_reduce_sum(&mut buf).unwrap();
            buf
        });
        for buf in &out {
            assert_eq!(buf, &vec![0.0, 6.0]);
        }
    }

    #[test]
    fn all_reduce_is_reusable_step_after_step() {
        let out = on_ranks(4, |c| {
            (0..50)
                .map(|step| {
                    let mut buf = vec![(c.rank() * step) as f32];
                    c.all_reduce_sum(&mut buf).unwrap();
                    buf[0]
                })
                .collect::<Vec<_>>()
        });
        let expected: Vec<f32> = (0..50).map(|s| (6 * s) as f32).collect();
        assert!(out.iter().all(|v| *v == expected));
    }

    #[test]
    fn all_gather_puts_parts_in_rank_order() {
        let out = on_ranks(3, |c| {
            let r = c.rank() as f32;
            let mut all = vec![0f32; 6];
            c.all_gather(&[r, 10.0 + r], &mut all).unwrap();
            all
        });
        for all in out {
            assert_eq!(all, vec![0.0, 10.0, 1.0, 11.0, 2.0, 12.0]);
        }
    }

    #[test]
    fn broadcast_copies_the_roots_buffer() {
        let out = on_ranks(4, |c| {
            let mut buf = vec![c.rank() as f32; 3];
            c.broadcast(&mut buf, 2).unwrap();
            buf
        });
        assert!(out.iter().all(|b| *b == vec![2.0; 3]));
    }

    #[test]
    fn a_failing_rank_releases_the_others_and_reset_restores_the_group() {
        let group = InProcess::group(3);
        let out: Vec<_> = std::thread::scope(|s| {
            let handles: Vec<_> = group
                .iter()
                .map(|c| {
                    s.spawn(move || {
                        if c.rank() == 1 {
                            c.abort();
                            return Err(CollectiveError::Aborted);
                        }
                        c.all_reduce_sum(&mut [1.0])
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(out
            .iter()
            .all(|r| matches!(r, Err(CollectiveError::Aborted))));
        group[0].reset();
        let sums = std::thread::scope(|s| {
            let handles: Vec<_> = group
                .iter()
                .map(|c| {
                    s.spawn(move || {
                        let mut b = [c.rank() as f32];
                        c.all_reduce_sum(&mut b).map(|_| b[0])
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap().unwrap())
                .collect::<Vec<_>>()
        });
        assert_eq!(sums, vec![3.0; 3]);
    }

    #[test]
    fn mismatched_lengths_and_bad_roots_are_errors_on_every_rank() {
        let out = on_ranks(2, |c| {
            let mut buf = vec![0f32; 1 + c.rank()];
            c.all_reduce_sum(&mut buf).map_err(|e| e.to_string())
        });
        for r in out {
            assert!(r.unwrap_err().contains("elements"), "a length mismatch");
        }
        let out = on_ranks(2, |c| {
            let mut all = vec![0f32; 3];
            c.all_gather(&[1.0], &mut all).is_err() && c.broadcast(&mut [0.0], 2).is_err()
        });
        assert!(out.iter().all(|&e| e));
    }
}
