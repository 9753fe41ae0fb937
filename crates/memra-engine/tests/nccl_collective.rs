//! NCCL behind the `Collective` trait on every GPU of a machine with at least 2, against
//! exact expected values (sums of small integers: exact in any order). It needs GPUs and
//! NCCL, so it runs only when asked:
//! `cargo test --release -p memra-engine --test nccl_collective -- --ignored`.
//! Written without a machine to run it on (see docs/parallel.md).

use cudarc::driver::CudaContext;
use memra_engine::parallel::nccl::NcclComm;
use memra_engine::parallel::Collective;

const LEN: usize = 1000;

#[test]
#[ignore = "needs 2 or more GPUs and NCCL"]
fn nccl_all_reduce_gather_and_broadcast_on_every_gpu() {
    let n = memra_engine::backend::cuda::gpu_count().unwrap();
    assert!(n >= 2, "needs 2 GPUs, found {n}");
    let streams: Vec<_> = (0..n)
        .map(|i| CudaContext::new(i).unwrap().new_stream().unwrap())
        .collect();
    let comms = NcclComm::init_all(&streams).unwrap();
    let streams = &streams;
    let results: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                s.spawn(move || {
                    let r = comm.rank();
                    let stream = streams[r].clone();
                    stream.context().bind_to_thread().unwrap();
                    let data: Vec<f32> = (0..LEN).map(|i| (i + r) as f32).collect();
                    let mut sum = stream.clone_htod(&data).unwrap();
                    comm.all_reduce_sum(&mut sum).unwrap();
                    let part = stream.clone_htod(&[r as f32, -(r as f32)]).unwrap();
                    let mut all = stream.alloc_zeros::<f32>(2 * comm.world_size()).unwrap();
                    comm.all_gather(&part, &mut all).unwrap();
                    let mut b = stream.clone_htod(&[r as f32; 4]).unwrap();
                    comm.broadcast(&mut b, 1).unwrap();
                    let out = (
                        stream.clone_dtoh(&sum).unwrap(),
                        stream.clone_dtoh(&all).unwrap(),
                        stream.clone_dtoh(&b).unwrap(),
                    );
                    drop(comm);
                    out
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let ranks: usize = (0..n).sum();
    let want_sum: Vec<f32> = (0..LEN).map(|i| (n * i + ranks) as f32).collect();
    let want_all: Vec<f32> = (0..n).flat_map(|r| [r as f32, -(r as f32)]).collect();
    for (sum, all, b) in results {
        assert_eq!(sum, want_sum);
        assert_eq!(all, want_all);
        assert_eq!(b, vec![1.0; 4]);
    }
}
