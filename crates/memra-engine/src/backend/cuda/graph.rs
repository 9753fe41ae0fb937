//! The decode step as a CUDA graph: captured once, replayed for every token.
//!
//! What changes from token to token is read on the device (the token id and its position
//! live in a small buffer the host writes before each replay), except the split count of
//! the decode attention: it sets the attention kernels' grid and their `n_split` argument.
//! When it changes (every `KEYS_PER_SPLIT` positions), the attention and combine nodes of
//! the instantiated graph are rewritten in place with `cuGraphExecKernelNodeSetParams`
//! instead of capturing again.

use std::ffi::c_void;

use cudarc::driver::sys::{self, CUfunction, CUgraphNode, CUDA_KERNEL_NODE_PARAMS};
use cudarc::driver::{CudaGraph, DriverError};

use super::{CudaDevice, CudaError};

/// Arguments of `attn_decode_d*` and `attn_combine` (cu/attention.cu): their count and the
/// index of `n_split`.
const DECODE_ARGS: usize = 11;
const DECODE_SPLIT_ARG: usize = 10;
const COMBINE_ARGS: usize = 9;
const COMBINE_SPLIT_ARG: usize = 8;

struct KernelNode {
    node: CUgraphNode,
    params: CUDA_KERNEL_NODE_PARAMS,
}

pub struct DecodeGraph {
    graph: CudaGraph,
    /// Each layer's decode attention node and its combine node, in capture order.
    attention: Vec<(KernelNode, KernelNode)>,
    n_split: usize,
}

fn check(r: sys::CUresult) -> Result<(), CudaError> {
    r.result().map_err(CudaError::Driver)
}

impl DecodeGraph {
    /// Captures the launches `record` makes on the device's stream (nothing may allocate
    /// or synchronize there), captured with `n_split` attention splits. `attention` and
    /// `combine` are the two attention kernels whose split count is rewritten later.
    pub fn capture(
        dev: &CudaDevice,
        n_split: usize,
        attention: &[CUfunction],
        combine: CUfunction,
        record: impl FnOnce() -> Result<(), CudaError>,
    ) -> Result<DecodeGraph, CudaError> {
        let s = &dev.stream;
        s.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
        let recorded = record();
        let graph = s.end_capture(sys::CUgraphInstantiate_flags(0));
        recorded?;
        let graph = graph?.ok_or_else(|| CudaError::Invalid("captured an empty graph".into()))?;
        // The kernel nodes in capture order: one stream records a chain, and the driver
        // lists a captured graph's nodes in the order they were added.
        let mut count = 0usize;
        // SAFETY: the graph is live; the first call asks for the count, the second fills.
        unsafe {
            check(sys::cuGraphGetNodes(
                graph.cu_graph(),
                std::ptr::null_mut(),
                &mut count,
            ))?
        };
        let mut nodes = vec![std::ptr::null_mut(); count];
        unsafe {
            check(sys::cuGraphGetNodes(
                graph.cu_graph(),
                nodes.as_mut_ptr(),
                &mut count,
            ))?
        };
        let mut mains = Vec::new();
        let mut combines = Vec::new();
        for node in nodes {
            let mut ty = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
            // SAFETY: node belongs to the live graph.
            unsafe { check(sys::cuGraphNodeGetType(node, &mut ty))? };
            if ty != sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL {
                continue;
            }
            // SAFETY: a kernel node; the params' argument array is owned by the graph.
            let mut params: CUDA_KERNEL_NODE_PARAMS = unsafe { std::mem::zeroed() };
            unsafe { check(sys::cuGraphKernelNodeGetParams_v2(node, &mut params))? };
            if attention.contains(&params.func) {
                mains.push(KernelNode { node, params });
            } else if params.func == combine {
                combines.push(KernelNode { node, params });
            }
        }
        if mains.len() != combines.len() || mains.is_empty() {
            return Err(CudaError::Invalid(format!(
                "the captured step has {} attention and {} combine kernels",
                mains.len(),
                combines.len()
            )));
        }
        Ok(DecodeGraph {
            graph,
            attention: mains.into_iter().zip(combines).collect(),
            n_split,
        })
    }

    /// Rewrites the attention nodes for `n_split` splits (nothing when unchanged).
    pub fn set_splits(&mut self, n_split: usize) -> Result<(), CudaError> {
        if n_split == self.n_split {
            return Ok(());
        }
        let exec = self.graph.cu_graph_exec();
        let mut value = n_split as i32;
        for (main, combine) in &self.attention {
            for (k, arity, at, grid_y) in [
                (main, DECODE_ARGS, DECODE_SPLIT_ARG, true),
                (combine, COMBINE_ARGS, COMBINE_SPLIT_ARG, false),
            ] {
                let mut params = k.params;
                // The node's own argument values, with `n_split` pointing at ours.
                // SAFETY: kernelParams holds `arity` pointers (the kernel's signature).
                let mut args: Vec<*mut c_void> = (0..arity)
                    .map(|i| unsafe { *params.kernelParams.add(i) })
                    .collect();
                args[at] = (&mut value) as *mut i32 as *mut c_void;
                params.kernelParams = args.as_mut_ptr();
                if grid_y {
                    params.gridDimY = n_split as u32;
                }
                // SAFETY: same kernel, same topology; the arguments are read during the call.
                unsafe {
                    check(sys::cuGraphExecKernelNodeSetParams_v2(
                        exec, k.node, &params,
                    ))?
                };
            }
        }
        self.n_split = n_split;
        Ok(())
    }

    pub fn launch(&self) -> Result<(), DriverError> {
        self.graph.launch()
    }
}
