//! [`Collective`] over NCCL, for ranks on GPUs: all-reduce, all-gather and broadcast of f32
//! device buffers on each rank's stream. Not run in CI (no GPUs there, nor a second one
//! on the one-GPU machine); see `docs/parallel.md` for what is left to run.
//!
//! The library is loaded at run time like the rest of CUDA, but not through cudarc's
//! loader: cudarc 0.19 opens `libnccl.so` or `libnccl.so.<CUDA major>` by name, while
//! NCCL installs `libnccl.so.2` (distro packages, and the `nvidia-nccl-cu13` Python package
//! the GPU machines carry, which is on no library path). So this file finds the library
//! (`MEMRA_NCCL`, the library path, Python's package) and opens it by its path; the
//! types and constants come from cudarc's bindings of `nccl.h` (`cudarc::nccl::sys`).

use std::ffi::{c_char, c_int, c_void, CStr};
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use cudarc::nccl::sys::{cudaStream_t, ncclComm_t, ncclDataType_t, ncclRedOp_t, ncclUniqueId};

use super::collective::{Collective, CollectiveError};

/// The library names the dynamic loader is asked for (NCCL 2's soname first).
const NAMES: [&str; 2] = ["libnccl.so.2", "libnccl.so"];

type GetUniqueId = unsafe extern "C" fn(*mut ncclUniqueId) -> c_int;
type CommInitRank = unsafe extern "C" fn(*mut ncclComm_t, c_int, ncclUniqueId, c_int) -> c_int;
type CommInitAll = unsafe extern "C" fn(*mut ncclComm_t, c_int, *const c_int) -> c_int;
type CommDestroy = unsafe extern "C" fn(ncclComm_t) -> c_int;
type AllReduce = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    c_int,
    c_int,
    ncclComm_t,
    cudaStream_t,
) -> c_int;
type AllGather = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    c_int,
    ncclComm_t,
    cudaStream_t,
) -> c_int;
type Broadcast = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    c_int,
    c_int,
    ncclComm_t,
    cudaStream_t,
) -> c_int;
type GetErrorString = unsafe extern "C" fn(c_int) -> *const c_char;

/// The NCCL entry points this file calls.
struct Nccl {
    get_unique_id: GetUniqueId,
    comm_init_rank: CommInitRank,
    comm_init_all: CommInitAll,
    comm_destroy: CommDestroy,
    all_reduce: AllReduce,
    all_gather: AllGather,
    broadcast: Broadcast,
    get_error_string: GetErrorString,
    /// Keeps the symbols above valid.
    _lib: libloading::Library,
}

fn lib() -> Result<&'static Nccl, CollectiveError> {
    static LIB: OnceLock<Result<Nccl, String>> = OnceLock::new();
    LIB.get_or_init(|| load(std::env::var_os("MEMRA_NCCL").map(PathBuf::from)))
        .as_ref()
        .map_err(|e| CollectiveError::Nccl(e.clone()))
}

/// Opens NCCL: the file `explicit` names (`MEMRA_NCCL`) if given, else the loader's search
/// (`LD_LIBRARY_PATH`, the ldconfig cache: CUDA and distro installs), else the
/// `nvidia-nccl-cu13` Python package of `$VIRTUAL_ENV` or the `python3` on `PATH`.
fn load(explicit: Option<PathBuf>) -> Result<Nccl, String> {
    // SAFETY: NCCL's initializers have no preconditions beyond a working dynamic loader.
    let open = |p: &Path| unsafe { libloading::Library::new(p) };
    let lib = if let Some(path) = explicit {
        open(&path).map_err(|e| format!("MEMRA_NCCL={}: cannot load it: {e}", path.display()))?
    } else {
        let mut tried: Vec<String> = NAMES.iter().map(|n| n.to_string()).collect();
        let found = NAMES
            .iter()
            .find_map(|n| open(Path::new(n)).ok())
            .or_else(|| {
                let p = python_package_lib()?;
                tried.push(p.display().to_string());
                open(&p).ok()
            });
        found.ok_or_else(|| {
            format!(
                "NCCL cannot be loaded (tried {}): install it (`pip install nvidia-nccl-cu13`, \
                 or the distro's libnccl2) or set MEMRA_NCCL to the path of libnccl.so.2",
                tried.join(", ")
            )
        })?
    };
    // SAFETY: the types are those of nccl.h (NCCL 2.x, as cudarc binds it).
    unsafe {
        macro_rules! sym {
            ($name:literal) => {
                *lib.get(concat!($name, "\0").as_bytes())
                    .map_err(|e| format!("NCCL lacks {}: {e}", $name))?
            };
        }
        Ok(Nccl {
            get_unique_id: sym!("ncclGetUniqueId"),
            comm_init_rank: sym!("ncclCommInitRank"),
            comm_init_all: sym!("ncclCommInitAll"),
            comm_destroy: sym!("ncclCommDestroy"),
            all_reduce: sym!("ncclAllReduce"),
            all_gather: sym!("ncclAllGather"),
            broadcast: sym!("ncclBroadcast"),
            get_error_string: sym!("ncclGetErrorString"),
            _lib: lib,
        })
    }
}

/// `libnccl.so.2` of the `nvidia-nccl-cu13` (or -cu12) Python package, if a Python has it.
fn python_package_lib() -> Option<PathBuf> {
    const ASK: &str =
        "import os, nvidia.nccl as m; print(os.path.join(list(m.__path__)[0], 'lib'))";
    let venv = std::env::var_os("VIRTUAL_ENV").map(|v| PathBuf::from(v).join("bin/python3"));
    let pythons = venv.into_iter().chain([PathBuf::from("python3")]);
    pythons.into_iter().find_map(|py| {
        let out = std::process::Command::new(py)
            .args(["-c", ASK])
            .output()
            .ok()?;
        let dir = String::from_utf8(out.stdout).ok()?;
        let path = Path::new(dir.trim()).join("libnccl.so.2");
        (out.status.success() && path.is_file()).then_some(path)
    })
}

fn check(nccl: &Nccl, call: &str, code: c_int) -> Result<(), CollectiveError> {
    if code == 0 {
        return Ok(());
    }
    // SAFETY: NCCL returns a static string for every code.
    let msg = unsafe { CStr::from_ptr((nccl.get_error_string)(code)) };
    Err(CollectiveError::Nccl(format!(
        "{call} failed: {} (NCCL error {code}; NCCL_DEBUG=INFO says more)",
        msg.to_string_lossy()
    )))
}

/// Multicast (NVLink SHARP) stays off on the machines we use: unless the user chose,
/// set `NCCL_NVLS_ENABLE=0` before NCCL reads its environment (at the first communicator).
fn nvls_off() {
    if std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
        // Set from the thread making the communicators, before NCCL first reads its
        // environment; no other thread of memra reads or writes the environment.
        std::env::set_var("NCCL_NVLS_ENABLE", "0");
    }
}

/// The id every rank of a group passes to [`NcclComm::init_rank`]: made by one rank and
/// shared out of band (over TCP, a file, the launcher), the way NCCL spans hosts.
#[derive(Clone)]
pub struct UniqueId(ncclUniqueId);

impl UniqueId {
    pub fn new() -> Result<UniqueId, CollectiveError> {
        let nccl = lib()?;
        let mut id = ncclUniqueId { internal: [0; 128] };
        // SAFETY: `id` is a valid out-pointer.
        check(nccl, "ncclGetUniqueId", unsafe {
            (nccl.get_unique_id)(&mut id)
        })?;
        Ok(UniqueId(id))
    }

    pub fn to_bytes(&self) -> [u8; 128] {
        self.0.internal.map(|c| c as u8)
    }

    pub fn from_bytes(bytes: [u8; 128]) -> UniqueId {
        UniqueId(ncclUniqueId {
            internal: bytes.map(|b| b as c_char),
        })
    }
}

/// One rank's NCCL communicator, issuing its calls on `stream` (the rank's GPU).
pub struct NcclComm {
    comm: ncclComm_t,
    stream: Arc<CudaStream>,
    rank: usize,
    world: usize,
}

// SAFETY: a communicator may be used from any one thread at a time; `Collective` takes
// `&self` but is only `Send`, so one thread owns each rank.
unsafe impl Send for NcclComm {}

impl NcclComm {
    /// One communicator per stream (rank `i` on `streams[i]`'s GPU), made together by this
    /// thread: the one-process, one-thread-per-GPU layout.
    pub fn init_all(streams: &[Arc<CudaStream>]) -> Result<Vec<NcclComm>, CollectiveError> {
        let nccl = lib()?;
        nvls_off();
        let n = streams.len();
        let devices: Vec<c_int> = streams
            .iter()
            .map(|s| s.context().ordinal() as c_int)
            .collect();
        let mut comms = vec![std::ptr::null_mut(); n];
        // SAFETY: `comms` and `devices` hold `n` entries each.
        check(nccl, "ncclCommInitAll", unsafe {
            (nccl.comm_init_all)(comms.as_mut_ptr(), n as c_int, devices.as_ptr())
        })?;
        Ok(comms
            .into_iter()
            .zip(streams)
            .enumerate()
            .map(|(rank, (comm, stream))| NcclComm {
                comm,
                stream: stream.clone(),
                rank,
                world: n,
            })
            .collect())
    }

    /// Rank `rank` of `world` joining the group of `id`, on `stream`'s GPU: every rank
    /// calls this at once (from its own thread or process, on any host).
    pub fn init_rank(
        stream: Arc<CudaStream>,
        rank: usize,
        world: usize,
        id: &UniqueId,
    ) -> Result<NcclComm, CollectiveError> {
        let nccl = lib()?;
        nvls_off();
        // ncclCommInitRank takes the calling thread's current device.
        stream
            .context()
            .bind_to_thread()
            .map_err(|e| CollectiveError::Nccl(format!("cannot select the GPU: {e}")))?;
        let mut comm = std::ptr::null_mut();
        // SAFETY: `comm` is a valid out-pointer; the id is passed by value as nccl.h says.
        check(nccl, "ncclCommInitRank", unsafe {
            (nccl.comm_init_rank)(&mut comm, world as c_int, id.0, rank as c_int)
        })?;
        Ok(NcclComm {
            comm,
            stream,
            rank,
            world,
        })
    }

    fn raw_stream(&self) -> cudaStream_t {
        self.stream.cu_stream() as cudaStream_t
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        if let Ok(nccl) = lib() {
            // SAFETY: the communicator was made by NCCL and is destroyed once.
            unsafe { (nccl.comm_destroy)(self.comm) };
        }
    }
}

const F32: c_int = ncclDataType_t::ncclFloat32 as c_int;
const SUM: c_int = ncclRedOp_t::ncclSum as c_int;

impl Collective for NcclComm {
    type Buf = CudaSlice<f32>;

    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn all_reduce_sum(&self, buf: &mut CudaSlice<f32>) -> Result<(), CollectiveError> {
        let nccl = lib()?;
        let n = buf.len();
        let (ptr, _sync) = buf.device_ptr_mut(&self.stream);
        let p = ptr as *mut c_void;
        // SAFETY: in place over the buffer's `n` floats, on the rank's stream.
        check(nccl, "ncclAllReduce", unsafe {
            (nccl.all_reduce)(p, p, n, F32, SUM, self.comm, self.raw_stream())
        })
    }

    fn all_gather(
        &self,
        part: &CudaSlice<f32>,
        all: &mut CudaSlice<f32>,
    ) -> Result<(), CollectiveError> {
        if all.len() != part.len() * self.world {
            return Err(CollectiveError::Shape(format!(
                "gathering {} parts of {} into {}",
                self.world,
                part.len(),
                all.len()
            )));
        }
        let nccl = lib()?;
        let (src, _s) = part.device_ptr(&self.stream);
        let (dst, _d) = all.device_ptr_mut(&self.stream);
        // SAFETY: `all` holds `world` parts of `part.len()` floats.
        check(nccl, "ncclAllGather", unsafe {
            (nccl.all_gather)(
                src as *const c_void,
                dst as *mut c_void,
                part.len(),
                F32,
                self.comm,
                self.raw_stream(),
            )
        })
    }

    fn broadcast(&self, buf: &mut CudaSlice<f32>, root: usize) -> Result<(), CollectiveError> {
        if root >= self.world {
            return Err(CollectiveError::Root {
                root,
                world: self.world,
            });
        }
        let nccl = lib()?;
        let n = buf.len();
        let (ptr, _sync) = buf.device_ptr_mut(&self.stream);
        let p = ptr as *mut c_void;
        // SAFETY: in place over the buffer's `n` floats, on the rank's stream.
        check(nccl, "ncclBroadcast", unsafe {
            (nccl.broadcast)(p, p, n, F32, root as c_int, self.comm, self.raw_stream())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_is_a_clear_error() {
        let e = load(Some(PathBuf::from("/nonexistent/libnccl.so.2")))
            .err()
            .expect("no such file");
        assert!(e.contains("MEMRA_NCCL=/nonexistent/libnccl.so.2"), "{e}");
    }

    #[test]
    fn unique_ids_round_trip_through_bytes() {
        let bytes: [u8; 128] = std::array::from_fn(|i| (i * 7) as u8);
        assert_eq!(UniqueId::from_bytes(bytes).to_bytes(), bytes);
    }
}
