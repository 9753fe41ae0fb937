//! Steps as CUDA graphs: captured once, replayed for every token. [`StepGraph`] is one
//! captured step; [`DecodeGraph`] is a decode step through the mat-vec kernels (one per
//! row count), whose attention splits are rewritten in place as contexts grow. (The
//! decoder keeps a `StepGraph` per row count and split count for the steps of many decodes
//! through the GEMMs.)
//!
//! What changes from token to token is read on the device (the token id and its position
//! live in a small buffer the host writes before each replay), except the split count of
//! the decode attention: it sets the attention kernels' grid and their `n_split` argument.
//! When it changes (every `KEYS_PER_SPLIT` positions), the attention and combine nodes of
//! the instantiated graph are rewritten in place with `cuGraphExecKernelNodeSetParams`
//! instead of capturing again.
//!
//! On sm_90 and later the edges into our kernels are made programmatic before the graph is
//! instantiated (programmatic dependent launch): a kernel is launched while its
//! predecessor's last blocks still run, and waits for it on the device (`PDL_WAIT` at the
//! start of every kernel), which hides most of the launch gap between the step's ~450
//! kernels. An edge into a cuBLAS kernel stays a full dependency: those do not wait.

use std::collections::HashSet;
use std::ffi::c_void;

use cudarc::driver::sys::{
    self, CUfunction, CUgraph, CUgraphExec, CUgraphNode, CUDA_KERNEL_NODE_PARAMS,
};
use cudarc::driver::CudaStream;

use super::CudaError;

/// Arguments of `attn_decode_d*` and `attn_combine` (cu/attention.cu): their count and the
/// index of `n_split`.
const DECODE_ARGS: usize = 14;
const DECODE_SPLIT_ARG: usize = 13;
/// The decode kernel's `n_head` and `n_head_kv` (its grid.x follows the split count).
const DECODE_HEADS_ARGS: [usize; 2] = [9, 10];
const COMBINE_ARGS: usize = 10;
const COMBINE_SPLIT_ARG: usize = 9;

struct KernelNode {
    node: CUgraphNode,
    params: CUDA_KERNEL_NODE_PARAMS,
}

/// A captured and instantiated step.
pub struct StepGraph {
    graph: CUgraph,
    exec: CUgraphExec,
    stream: std::sync::Arc<CudaStream>,
}

pub struct DecodeGraph {
    step: StepGraph,
    /// Each layer's decode attention node and its combine node, in capture order.
    attention: Vec<(KernelNode, KernelNode)>,
    kernels: DecodeKernels,
    n_split: usize,
}

/// A model's two decode attention kernels: a block per KV head's group, or per query head.
#[derive(Clone, Copy)]
pub struct DecodeKernels {
    pub group: CUfunction,
    pub one_head: CUfunction,
}

// SAFETY: the graph's handles belong to the driver and may be used from any thread whose
// current context is the decoder's (the engine thread binds it before its first step); the
// node parameters point at the driver's copies of the captured arguments, which live as
// long as the graph. A graph has one owner at a time (it is not Sync).
unsafe impl Send for StepGraph {}
unsafe impl Send for DecodeGraph {}

fn check(r: sys::CUresult) -> Result<(), CudaError> {
    r.result().map_err(CudaError::Driver)
}

impl StepGraph {
    /// Captures the launches `record` makes on `stream` (nothing may allocate or
    /// synchronize there). `ours`: the kernels that wait for their predecessor on the
    /// device (`PDL_WAIT`), whose incoming edges may be programmatic.
    pub fn capture(
        stream: &std::sync::Arc<CudaStream>,
        compute_capability: (i32, i32),
        ours: &HashSet<CUfunction>,
        record: impl FnOnce() -> Result<(), CudaError>,
    ) -> Result<StepGraph, CudaError> {
        let s = stream;
        s.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
        let recorded = record();
        let mut graph: CUgraph = std::ptr::null_mut();
        // SAFETY: ends the capture begun above on this stream.
        let ended = unsafe { check(sys::cuStreamEndCapture(s.cu_stream(), &mut graph)) };
        let destroy = |g: CUgraph| {
            if !g.is_null() {
                // SAFETY: a graph this function created and no one else holds.
                unsafe { sys::cuGraphDestroy(g) };
            }
        };
        if let Err(e) = recorded.and(ended) {
            destroy(graph);
            return Err(e);
        }
        if graph.is_null() {
            return Err(CudaError::Invalid("captured an empty graph".into()));
        }
        let built = (|| {
            if compute_capability.0 >= 9 {
                make_edges_programmatic(graph, ours)?;
            }
            let mut exec: CUgraphExec = std::ptr::null_mut();
            // SAFETY: a complete graph; the exec is destroyed with it (Drop).
            unsafe { check(sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0))? };
            Ok(exec)
        })();
        match built {
            Ok(exec) => Ok(StepGraph {
                graph,
                exec,
                stream: s.clone(),
            }),
            Err(e) => {
                destroy(graph);
                Err(e)
            }
        }
    }

    pub fn launch(&self) -> Result<(), CudaError> {
        // SAFETY: the exec is live; the stream is the one the graph was captured on.
        unsafe { check(sys::cuGraphLaunch(self.exec, self.stream.cu_stream())) }
    }

    /// The kernel nodes in capture order: one stream records a chain, and the driver
    /// lists a captured graph's nodes in the order they were added.
    fn kernel_nodes(&self) -> Result<Vec<KernelNode>, CudaError> {
        let mut count = 0usize;
        // SAFETY: the graph is live; the first call asks for the count, the second fills.
        unsafe {
            check(sys::cuGraphGetNodes(
                self.graph,
                std::ptr::null_mut(),
                &mut count,
            ))?
        };
        let mut nodes = vec![std::ptr::null_mut(); count];
        unsafe {
            check(sys::cuGraphGetNodes(
                self.graph,
                nodes.as_mut_ptr(),
                &mut count,
            ))?
        };
        let mut kernels = Vec::new();
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
            kernels.push(KernelNode { node, params });
        }
        Ok(kernels)
    }
}

impl DecodeGraph {
    /// Captures the decode step `record` launches (as [`StepGraph::capture`]), with
    /// `n_split` attention splits. `attention` (the model's group and one-head kernels,
    /// either captured: [`super::ops::decode_one_head`] picks) and `combine` are the
    /// attention kernels whose split count is rewritten later.
    pub fn capture(
        stream: &std::sync::Arc<CudaStream>,
        compute_capability: (i32, i32),
        ours: &HashSet<CUfunction>,
        n_split: usize,
        attention: DecodeKernels,
        combine: CUfunction,
        record: impl FnOnce() -> Result<(), CudaError>,
    ) -> Result<DecodeGraph, CudaError> {
        let step = StepGraph::capture(stream, compute_capability, ours, record)?;
        let (mut mains, mut combines) = (Vec::new(), Vec::new());
        for k in step.kernel_nodes()? {
            if [attention.group, attention.one_head].contains(&k.params.func) {
                mains.push(k);
            } else if k.params.func == combine {
                combines.push(k);
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
            step,
            attention: mains.into_iter().zip(combines).collect(),
            kernels: attention,
            n_split,
        })
    }

    /// Rewrites the attention nodes for `n_split` splits (nothing when unchanged).
    pub fn set_splits(&mut self, n_split: usize) -> Result<(), CudaError> {
        if n_split == self.n_split {
            return Ok(());
        }
        let exec = self.step.exec;
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
                    // SAFETY: the captured arguments at these indices are the i32 head counts.
                    let [nh, nkv] = DECODE_HEADS_ARGS.map(|i| unsafe { *(args[i] as *const i32) });
                    let (nh, nkv, seqs) = (nh as usize, nkv as usize, params.gridDimZ as usize);
                    params.gridDimX = super::ops::decode_grid_x(nh, nkv, n_split, seqs) as u32;
                    params.func = match super::ops::decode_one_head(nkv, n_split, seqs) {
                        true => self.kernels.one_head,
                        false => self.kernels.group,
                    };
                }
                // SAFETY: the captured kernel or its one-head twin (the same signature), same
                // topology; the arguments are read during the call.
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

    pub fn launch(&self) -> Result<(), CudaError> {
        self.step.launch()
    }
}

impl Drop for StepGraph {
    fn drop(&mut self) {
        // SAFETY: both were created for this graph alone; nothing runs after the stream
        // is synchronized.
        unsafe {
            let _ = self.stream.synchronize();
            sys::cuGraphExecDestroy(self.exec);
            sys::cuGraphDestroy(self.graph);
        }
    }
}

/// Turns every kernel-to-kernel edge of `graph` whose successor is one of `ours` into a
/// programmatic one (the successor may launch as its predecessor's blocks finish; it waits
/// on the device before reading).
fn make_edges_programmatic(graph: CUgraph, ours: &HashSet<CUfunction>) -> Result<(), CudaError> {
    let mut n = 0usize;
    // SAFETY: the graph is live and not instantiated yet; the first call counts the edges.
    unsafe {
        check(sys::cuGraphGetEdges_v2(
            graph,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            &mut n,
        ))?
    };
    let mut from = vec![std::ptr::null_mut(); n];
    let mut to = vec![std::ptr::null_mut(); n];
    let mut data: Vec<sys::CUgraphEdgeData> = vec![unsafe { std::mem::zeroed() }; n];
    unsafe {
        check(sys::cuGraphGetEdges_v2(
            graph,
            from.as_mut_ptr(),
            to.as_mut_ptr(),
            data.as_mut_ptr(),
            &mut n,
        ))?
    };
    let is_kernel = |node: CUgraphNode| -> Result<bool, CudaError> {
        let mut ty = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
        // SAFETY: a node of the live graph.
        unsafe { check(sys::cuGraphNodeGetType(node, &mut ty))? };
        Ok(ty == sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL)
    };
    let waits = |node: CUgraphNode| -> Result<bool, CudaError> {
        // SAFETY: a kernel node of the live graph.
        let mut params: CUDA_KERNEL_NODE_PARAMS = unsafe { std::mem::zeroed() };
        unsafe { check(sys::cuGraphKernelNodeGetParams_v2(node, &mut params))? };
        Ok(ours.contains(&params.func))
    };
    for i in 0..n {
        if !(is_kernel(from[i])? && is_kernel(to[i])? && waits(to[i])?) {
            continue;
        }
        let mut programmatic = data[i];
        programmatic.type_ =
            sys::CUgraphDependencyType::CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC as u8;
        programmatic.from_port = sys::CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC as u8;
        // SAFETY: replaces an existing edge of the live graph by its programmatic form.
        unsafe {
            check(sys::cuGraphRemoveDependencies_v2(
                graph, &from[i], &to[i], &data[i], 1,
            ))?;
            check(sys::cuGraphAddDependencies_v2(
                graph,
                &from[i],
                &to[i],
                &programmatic,
                1,
            ))?;
        }
    }
    Ok(())
}
