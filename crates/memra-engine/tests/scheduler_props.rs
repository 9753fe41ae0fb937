//! Property test of the scheduler and block manager: random arrivals, steps, cancels and
//! finishes over a small pool never leak a block, never free one twice, never lose or
//! duplicate a sequence, and every sequence that is not cancelled finishes.

use std::collections::HashSet;

use memra_engine::kv::BlockManager;
use memra_engine::scheduler::{Scheduler, SchedulerConfig, Sequence};
use proptest::prelude::*;

#[derive(Clone, Debug)]
enum Op {
    /// A request: prompt drawn from a few shared prefixes plus its own tail, and its length.
    Arrive {
        prefix: u8,
        prefix_len: u8,
        tail: u8,
        max_new: u8,
    },
    Step,
    Cancel(u8),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0u8..3, 0u8..24, 1u8..12, 1u8..10).prop_map(|(prefix, prefix_len, tail, max_new)| {
            Op::Arrive {
                prefix,
                prefix_len,
                tail,
                max_new,
            }
        }),
        Just(Op::Step),
        Just(Op::Step),
        Just(Op::Step),
        any::<u8>().prop_map(Op::Cancel),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]
    #[test]
    fn random_traffic_never_leaks_or_double_frees(
        ops in prop::collection::vec(op(), 1..120),
        blocks in 6usize..24,
        block_size in 1usize..5,
        max_running in 1usize..6,
        budget in 1usize..40,
        prompt_chunk in 1usize..40,
    ) {
        let mut s = Scheduler::new(
            SchedulerConfig { max_running, token_budget: budget, prompt_chunk },
            BlockManager::new(blocks, block_size),
        );
        // id -> (tokens still to generate)
        let mut live: std::collections::HashMap<u64, usize> = Default::default();
        let mut finished = HashSet::new();
        let mut next_id = 0u64;
        let capacity = blocks * block_size;
        let run_step = |s: &mut Scheduler, live: &mut std::collections::HashMap<u64, usize>, finished: &mut HashSet<u64>| {
            let st = s.schedule();
            let ids: Vec<u64> = st.seqs.iter().map(|q| q.id).collect();
            let unique: HashSet<_> = ids.iter().collect();
            prop_assert_eq!(unique.len(), ids.len(), "a sequence scheduled twice");
            prop_assert!(st.n_tokens() <= budget);
            s.complete(&st);
            for q in st.seqs.iter().filter(|q| q.logits) {
                let left = live.get_mut(&q.id).expect("scheduled sequences are live");
                *left -= 1;
                if *left == 0 {
                    s.remove(q.id).expect("finishing a live sequence");
                    live.remove(&q.id);
                    finished.insert(q.id);
                } else {
                    s.append(q.id, (q.id % 7) as u32);
                }
            }
            s.check().map_err(TestCaseError::fail)?;
            Ok(())
        };
        for o in ops {
            match o {
                Op::Arrive { prefix, prefix_len, tail, max_new } => {
                    let mut p: Vec<u32> = (0..prefix_len as u32).map(|i| 1000 * prefix as u32 + i).collect();
                    p.extend((0..tail as u32).map(|i| 50_000 + next_id as u32 * 100 + i));
                    // The engine refuses what can never fit the pool.
                    if p.len() + max_new as usize - 1 > capacity {
                        continue;
                    }
                    live.insert(next_id, max_new as usize);
                    s.add(Sequence::new(next_id, p));
                    next_id += 1;
                }
                Op::Step => run_step(&mut s, &mut live, &mut finished)?,
                Op::Cancel(k) => {
                    if let Some(&id) = live.keys().nth(k as usize % live.len().max(1)) {
                        s.remove(id).expect("cancelling a live sequence");
                        live.remove(&id);
                        s.check().map_err(TestCaseError::fail)?;
                    }
                }
            }
        }
        // Drain: everything left finishes within a bounded number of steps.
        let mut steps = 0;
        while !live.is_empty() {
            run_step(&mut s, &mut live, &mut finished)?;
            steps += 1;
            prop_assert!(steps < 10_000, "no progress: {} live", live.len());
        }
        prop_assert!(s.is_idle());
        prop_assert_eq!(s.blocks.num_free(), blocks, "blocks leaked");
    }
}
