//! The device: a context, a compute stream and a copy stream, the NVRTC-compiled kernels, and raw device
//! buffers. Buffers are plain `cuMemAlloc` allocations addressed by pointer; ordering between the two streams
//! is explicit (events), so cudarc's per-slice event tracking is not used.

use crate::devptr::DevPtr;
use crate::timeline::Timeline;
use anyhow::{anyhow, bail, Context, Result};
use cudarc::driver::result::{self as cu, DriverError};
use cudarc::driver::{
    sys, CudaContext, CudaEvent, CudaFunction, CudaStream, DevicePtr, LaunchConfig,
};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions, Ptx};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

/// A driver call's result as an error that says what was being done (the driver's code alone does not).
pub(crate) trait Doing<T> {
    fn doing(self, what: &str) -> Result<T>;
    /// As `doing`, the description formatted only on error (for calls on the hot path).
    fn doing_with(self, what: impl FnOnce() -> String) -> Result<T>;
}

impl<T> Doing<T> for std::result::Result<T, DriverError> {
    fn doing(self, what: &str) -> Result<T> {
        self.doing_with(|| what.to_string())
    }

    fn doing_with(self, what: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|e| anyhow!("CUDA driver error {}: {}", what(), explain(&e)))
    }
}

/// The driver's error code and its description, e.g. `CUDA_ERROR_OUT_OF_MEMORY (out of memory)`.
fn explain(e: &DriverError) -> String {
    match e.error_string() {
        Ok(s) => format!("{:?} ({})", e.0, s.to_string_lossy()),
        Err(_) => format!("{:?}", e.0),
    }
}

/// The kernels' CUDA C source, compiled at run time for the GPU in hand.
pub const KERNEL_SOURCE: &str = include_str!("kernels.cu");

/// Every kernel the backend launches (each must exist in the compiled module).
pub const KERNEL_NAMES: &[&str] = &[
    "matmul_bf16",
    "matmul_fp8",
    "act_rows",
    "mlp_up_act",
    "embed_rows",
    "rms_norm_rows",
    "attn_res_mix",
    "kda_recurrence",
    "mla_append",
    "mla_attend",
    "expert_up_mx",
    "expert_up_mx2",
    "expert_up_bf16",
    "expert_down_mx",
    "expert_down_mx2",
    "expert_down_bf16",
    "expert_up_fp8",
    "expert_up_int4",
    "expert_down_fp8",
    "expert_down_int4",
    "moe_combine",
    "moe_route",
    "moe_group",
    "mx_repack",
    "decode_pick",
    "timeline_mark",
    "gqa_append",
    "gqa_attend",
    "bias_rows",
    "add_rows",
    "moe_route_softmax",
    "expert_up_mxb",
    "expert_up_mxb2",
    "expert_down_mxb",
    "expert_down_mxb2",
];

/// The kernels whose dynamic shared memory can exceed the default 48 KB.
const DYNAMIC_SMEM: &[&str] = &[
    "matmul_bf16",
    "matmul_fp8",
    "expert_up_fp8",
    "expert_up_int4",
    "expert_down_fp8",
    "expert_down_int4",
    "mx_repack",
    "expert_up_mx",
    "expert_up_mx2",
    "expert_up_bf16",
    "expert_down_mx",
    "expert_down_mx2",
    "expert_down_bf16",
    "kda_recurrence",
    "expert_up_mxb",
    "expert_up_mxb2",
    "expert_down_mxb",
    "expert_down_mxb2",
];

/// Why CUDA cannot be used here, or `Ok` with the device count: checks the driver library, the NVRTC
/// library and the devices, without panicking (cudarc panics on a missing library when first used).
pub fn availability() -> Result<usize> {
    // SAFETY: only tries to dlopen the libraries by their usual names.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        bail!("CUDA is unavailable: the NVIDIA driver library (libcuda.so.1) was not found — is this a machine with an NVIDIA GPU and its driver installed? (LD_LIBRARY_PATH is searched)");
    }
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        bail!("CUDA is unavailable: the NVRTC library (libnvrtc.so.13 or .12) was not found; install the CUDA toolkit or `pip install nvidia-cuda-nvrtc` and add its lib directory to LD_LIBRARY_PATH");
    }
    let n = CudaContext::device_count().map_err(|e| {
        anyhow!(
            "CUDA is unavailable: the driver reports {} (no usable GPU?)",
            explain(&e)
        )
    })?;
    if n <= 0 {
        bail!("CUDA is unavailable: the driver sees no GPU");
    }
    Ok(n as usize)
}

/// Whether the kernels run on a GPU of compute capability `sm`: they use the tensor cores' m16n8k16 MMA and
/// cp.async, so Ampere (sm_80) and later.
pub fn check_capability(name: &str, sm: (i32, i32)) -> Result<()> {
    if sm.0 < 8 {
        bail!(
            "{name} (sm_{}{}) is older than the kernels support: --device cuda needs compute capability 8.0 \
             (Ampere) or newer; run on the CPU instead",
            sm.0,
            sm.1
        );
    }
    Ok(())
}

/// One line per GPU (`cuda:N name (sm_XY), memory`, and why it cannot be used if so), or why CUDA cannot be
/// used here: what `doctor` reports.
pub fn describe() -> Result<Vec<String>> {
    let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
    (0..availability()?)
        .map(|i| {
            let ctx = CudaContext::new(i).doing_with(|| format!("opening GPU cuda:{i}"))?;
            let name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
            let (major, minor) = ctx
                .compute_capability()
                .doing("reading a GPU's compute capability")?;
            let (free, total) = ctx.mem_get_info().doing("reading a GPU's free memory")?;
            let usable = match check_capability(&name, (major, minor)) {
                Ok(()) => String::new(),
                Err(e) => format!(" — not usable: {e}"),
            };
            Ok(format!(
                "cuda:{i} {name} (sm_{major}{minor}), {:.1} GiB, {:.1} GiB free{usable}",
                gib(total),
                gib(free)
            ))
        })
        .collect()
}

/// NVRTC options shared by tests and the device: no contraction of a*b+c (the CPU rounds twice there),
/// IEEE division and square root, no flush-to-zero.
pub fn compile_options(arch: Option<&'static str>, timeline: bool) -> CompileOptions {
    CompileOptions {
        options: if timeline {
            vec!["-DDELTAFIN_TIMELINE".into()]
        } else {
            Vec::new()
        },
        fmad: Some(false),
        ftz: Some(false),
        prec_div: Some(true),
        prec_sqrt: Some(true),
        use_fast_math: Some(false),
        arch,
        name: Some("deltafin_kernels.cu".into()),
        ..Default::default()
    }
}

/// Compiles the kernels to PTX for `arch` (e.g. "compute_90"); `None` lets NVRTC pick its default. `timeline`:
/// with the notes of `run --timeline` (timeline.rs).
pub fn compile(arch: Option<&'static str>, timeline: bool) -> Result<Ptx> {
    compile_ptx_with_opts(KERNEL_SOURCE, compile_options(arch, timeline)).map_err(|e| match e {
        cudarc::nvrtc::CompileError::CompileError { log, .. } => {
            anyhow!("NVRTC rejected the kernels:\n{}", log.to_string_lossy())
        }
        other => anyhow!("NVRTC failed to compile the kernels: {other}"),
    })
}

pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub copy: Arc<CudaStream>,
    /// Readies copied experts (rearranges their weights) after each copy, so the copy stream never waits on a
    /// kernel between copies.
    pub prep: Arc<CudaStream>,
    /// A second compute stream for work of a pass that is independent of the compute stream's for a while (the
    /// MoE's shared expert beside the routed ones), forked and joined by events.
    pub side: Arc<CudaStream>,
    funcs: HashMap<&'static str, CudaFunction>,
    /// Page-locked landing buffer of `dtoh`, grown on demand.
    readback: Mutex<Option<Pinned>>,
    pub name: String,
    pub sm: (i32, i32),
    /// The dynamic shared memory each kernel of DYNAMIC_SMEM may take: the block's opted-in limit less the
    /// kernel's static shared memory.
    dynamic_smem: HashMap<&'static str, usize>,
    /// Kernels on the compute stream are launched as programmatic dependents (Hopper and later).
    pub pdl: bool,
    /// `run --timeline`: the kernels note when each block is past its wait.
    pub timeline: Option<Timeline>,
}

impl Gpu {
    pub fn open(ordinal: usize, timeline: bool) -> Result<Gpu> {
        let count = availability()?;
        if ordinal >= count {
            bail!(
                "--device cuda:{ordinal}: this machine has {count} GPU(s) (cuda:0 … cuda:{})",
                count - 1
            );
        }
        let ctx = CudaContext::new(ordinal).doing_with(|| format!("opening GPU cuda:{ordinal}"))?;
        // Ordering between the compute and copy streams is explicit (events), and buffers are raw pointers.
        // SAFETY: no CudaSlice is shared between streams in this crate.
        unsafe { ctx.disable_event_tracking() };
        let sm = ctx
            .compute_capability()
            .doing("reading the GPU's compute capability")?;
        let name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
        check_capability(&name, sm)?;
        let arch: &'static str = Box::leak(format!("compute_{}{}", sm.0, sm.1).into_boxed_str());
        let ptx = compile(Some(arch), timeline).context("compiling the CUDA kernels")?;
        let module = ctx.load_module(ptx).doing("loading the compiled kernels")?;
        let stream = ctx.new_stream().doing("creating the compute stream")?;
        let timeline = if timeline {
            let global = |name: &str| -> Result<(u64, usize)> {
                let v = module
                    .get_global(name, &stream)
                    .doing_with(|| format!("finding the timeline's {name} in the kernels"))?;
                let (ptr, _read) = v.device_ptr(&stream);
                Ok((ptr, v.len()))
            };
            let (notes, bytes) = global("timeline")?;
            Some(Timeline::new(notes, global("timeline_n")?.0, bytes / 8))
        } else {
            None
        };
        // Kernels that stage rows in dynamic shared memory may take all the block can have (beyond 48 KB only
        // on request).
        let smem_max = ctx
            .attribute(
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            )
            .doing("reading the GPU's shared memory per block")?;
        let mut funcs = HashMap::new();
        let mut dynamic_smem = HashMap::new();
        for &k in KERNEL_NAMES {
            let f = module
                .load_function(k)
                .doing_with(|| format!("loading kernel {k}"))?;
            if DYNAMIC_SMEM.contains(&k) {
                // Static and dynamic shared memory together stay within the block's limit.
                let fixed = f
                    .get_attribute(sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)
                    .doing_with(|| format!("reading kernel {k}'s static shared memory"))?;
                f.set_attribute(
                    sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    smem_max - fixed,
                )
                .doing_with(|| format!("raising kernel {k}'s dynamic shared memory limit"))?;
                dynamic_smem.insert(k, (smem_max - fixed) as usize);
            }
            funcs.insert(k, f);
        }
        let copy = ctx.new_stream().doing("creating the copy stream")?;
        let prep = ctx.new_stream().doing("creating the prep stream")?;
        let side = ctx.new_stream().doing("creating the side stream")?;
        Ok(Gpu {
            ctx,
            stream,
            copy,
            prep,
            side,
            funcs,
            readback: Mutex::new(None),
            name,
            sm,
            dynamic_smem,
            pdl: sm.0 >= 9,
            timeline,
        })
    }

    /// Orders the compute stream after `ev`.
    pub fn wait(&self, ev: &CudaEvent) -> Result<()> {
        self.stream
            .wait(ev)
            .doing("ordering the compute stream after an event")
    }

    /// Records `ev` on the compute stream (after everything issued so far).
    pub fn record(&self, ev: &CudaEvent) -> Result<()> {
        ev.record(&self.stream)
            .doing("recording an event on the compute stream")
    }

    /// A new event recorded on the compute stream.
    pub fn mark(&self) -> Result<CudaEvent> {
        self.stream
            .record_event(None)
            .doing("recording an event on the compute stream")
    }

    /// The dynamic shared memory a block of `kernel` (one of DYNAMIC_SMEM) may take.
    pub fn dynamic_smem(&self, kernel: &str) -> usize {
        *self
            .dynamic_smem
            .get(kernel)
            .expect("asked only for kernels in DYNAMIC_SMEM")
    }

    pub fn func(&self, name: &str) -> &CudaFunction {
        self.funcs
            .get(name)
            .expect("every launched kernel is in KERNEL_NAMES")
    }

    pub fn alloc(&self, bytes: usize) -> Result<DevBuf> {
        self.ctx
            .bind_to_thread()
            .doing("binding the GPU context to this thread")?;
        // SAFETY: a plain allocation, freed in Drop.
        let ptr = unsafe { cu::malloc_sync(bytes.max(256)) }
            .doing_with(|| format!("allocating {bytes} bytes of GPU memory"))?;
        Ok(DevBuf {
            ptr,
            bytes,
            ctx: self.ctx.clone(),
        })
    }

    pub fn upload<T: Copy>(&self, data: &[T]) -> Result<DevBuf> {
        let b = self.alloc(std::mem::size_of_val(data))?;
        self.htod_sync(b.ptr, data)?;
        Ok(b)
    }

    pub fn htod_sync<T: Copy>(&self, dst: u64, src: &[T]) -> Result<()> {
        if src.is_empty() {
            return Ok(());
        }
        self.ctx
            .bind_to_thread()
            .doing("binding the GPU context to this thread")?;
        // SAFETY: dst holds at least size_of_val(src) bytes (callers allocate it so).
        unsafe { cu::memcpy_htod_sync(dst, src) }.doing("copying host memory to the GPU")
    }

    /// Copies on the compute stream (ordered after the kernels before it) and waits for it, through a
    /// page-locked buffer (a copy into pageable memory is slower to set up and may be staged).
    pub fn dtoh<T: Copy + Default>(&self, src: u64, len: usize) -> Result<Vec<T>> {
        let bytes = len * std::mem::size_of::<T>();
        let mut rb = self.readback.lock().unwrap();
        if rb.as_ref().is_none_or(|p| p.bytes < bytes) {
            *rb = None;
            *rb = Some(Pinned::new(self, bytes.next_power_of_two(), false)?);
        }
        let pinned = rb.as_mut().expect("sized above");
        // SAFETY: src holds `bytes`; the buffer is synchronised before it is read.
        unsafe {
            cu::memcpy_dtoh_async(
                &mut pinned.as_mut_slice()[..bytes],
                src,
                self.stream.cu_stream(),
            )
        }
        .doing("copying GPU memory to the host")?;
        self.stream
            .synchronize()
            .doing("waiting for the GPU's kernels and copy back (a failed kernel shows here)")?;
        let mut out = vec![T::default(); len];
        // SAFETY: `bytes` bytes of plain values of T, copied byte for byte.
        unsafe {
            std::ptr::copy_nonoverlapping(pinned.ptr, out.as_mut_ptr() as *mut u8, bytes);
        }
        Ok(out)
    }

    /// Host data into device memory, ordered on the compute stream. `src` must stay alive and unchanged until
    /// the stream has passed this point (callers keep it until their next synchronisation).
    pub fn htod_async<T: Copy>(&self, dst: u64, src: &[T]) -> Result<()> {
        if src.is_empty() {
            return Ok(());
        }
        // SAFETY: see above.
        unsafe { cu::memcpy_htod_async(dst, src, self.stream.cu_stream()) }
            .doing("copying host memory to the GPU")
    }

    pub fn dtod(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        // SAFETY: both ranges are device allocations of at least `bytes`.
        unsafe { cu::memcpy_dtod_async(dst, src, bytes, self.stream.cu_stream()) }
            .doing("copying GPU memory on the GPU")
    }

    pub fn event(&self) -> Result<CudaEvent> {
        self.ctx
            .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
            .doing("creating an event")
    }
}

/// Grid sizes and the kernel launch, with every argument a plain value (device pointers as u64), on the compute
/// stream, the side stream or the prep stream: the untyped mechanism under the typed wrappers of kernels.rs,
/// which alone build launches.
pub(crate) struct Launch<'a> {
    gpu: &'a Gpu,
    name: &'static str,
    /// A matmul's (rows, cols), which the timeline tells apart.
    shape: Option<(usize, usize)>,
    cfg: LaunchConfig,
    on: On,
    args: Vec<Arg>,
}

/// The stream a launch goes to.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum On {
    Compute,
    Side,
    Prep,
}

enum Arg {
    Ptr(u64),
    I(i32),
    F(f32),
    Parts([u64; 6]),
}

impl<'a> Launch<'a> {
    pub fn new(
        gpu: &'a Gpu,
        name: &'static str,
        grid: (u32, u32),
        block: u32,
        shared: u32,
    ) -> Self {
        Launch {
            gpu,
            name,
            shape: None,
            cfg: LaunchConfig {
                grid_dim: (grid.0.max(1), grid.1.max(1), 1),
                block_dim: (block, 1, 1),
                shared_mem_bytes: shared,
            },
            on: On::Compute,
            args: Vec::new(),
        }
    }
    /// Runs on the given stream (the compute stream by default).
    pub fn on(mut self, on: On) -> Self {
        self.on = on;
        self
    }
    /// A matmul's (rows, cols), which the timeline tells apart.
    pub fn shape(mut self, rows: usize, cols: usize) -> Self {
        self.shape = Some((rows, cols));
        self
    }
    pub fn p(mut self, v: u64) -> Self {
        self.args.push(Arg::Ptr(v));
        self
    }
    pub fn i(mut self, v: usize) -> Self {
        self.args
            .push(Arg::I(i32::try_from(v).expect("kernel sizes fit in i32")));
        self
    }
    pub fn f(mut self, v: f32) -> Self {
        self.args.push(Arg::F(v));
        self
    }
    pub fn parts(mut self, v: [u64; 6]) -> Self {
        self.args.push(Arg::Parts(v));
        self
    }
    pub fn go(self) -> Result<()> {
        let f = self.gpu.func(self.name);
        // With the timeline on, the side stream's kernels run on the compute stream: the notes are then one chain.
        let stream = match (self.on, &self.gpu.timeline) {
            (On::Compute, _) | (On::Side, Some(_)) => &self.gpu.stream,
            (On::Side, None) => &self.gpu.side,
            (On::Prep, _) => &self.gpu.prep,
        };
        if let Some(t) = self.gpu.timeline.as_ref().filter(|_| self.on != On::Prep) {
            let label = match self.shape {
                Some((r, c)) => format!("{} {r}x{c}", self.name),
                None => self.name.to_string(),
            };
            t.launched(label, self.cfg.grid_dim.0 * self.cfg.grid_dim.1);
        }
        // The kernel's parameters: a pointer to each argument's value, as the kernel declares it (a Parts is
        // six u64, laid out as the kernels' struct).
        let mut params: Vec<*mut c_void> = self
            .args
            .iter()
            .map(|a| match a {
                Arg::Ptr(v) => v as *const u64 as *mut c_void,
                Arg::I(v) => v as *const i32 as *mut c_void,
                Arg::F(v) => v as *const f32 as *mut c_void,
                Arg::Parts(v) => v as *const [u64; 6] as *mut c_void,
            })
            .collect();
        // Programmatic dependent launch on the compute streams (sm_90+): the kernel may start while the one
        // before it finishes; each kernel waits (griddepcontrol.wait) before it touches anything but weights.
        let mut pdl = sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            value: sys::CUlaunchAttributeValue {
                programmaticStreamSerializationAllowed: 1,
            },
        };
        let (grid, block) = (self.cfg.grid_dim, self.cfg.block_dim);
        let config = sys::CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: grid.2,
            blockDimX: block.0,
            blockDimY: block.1,
            blockDimZ: block.2,
            sharedMemBytes: self.cfg.shared_mem_bytes,
            hStream: stream.cu_stream(),
            attrs: &mut pdl,
            numAttrs: (self.gpu.pdl && self.on != On::Prep) as u32,
        };
        self.gpu
            .ctx
            .bind_to_thread()
            .doing("binding the GPU context to this thread before a kernel launch")?;
        // SAFETY: the argument lists match the kernels' signatures (each wrapper of kernels.rs mirrors its kernel,
        // checked against kernels.cu by its test), and
        // `params` points into `self.args`, alive until the call returns (the driver copies the values).
        unsafe {
            sys::cuLaunchKernelEx(
                &config,
                f.cu_function(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
        .doing_with(|| format!("launching kernel {}", self.name))
    }
}

/// A device allocation.
pub struct DevBuf {
    pub ptr: u64,
    pub bytes: usize,
    ctx: Arc<CudaContext>,
}

impl DevBuf {
    /// The buffer as elements of `T`.
    pub fn typed<T>(&self) -> DevPtr<T> {
        DevPtr::new(self.ptr)
    }

    /// Pointer to element `i` of an f32 buffer.
    pub fn f(&self, i: usize) -> u64 {
        self.ptr + 4 * i as u64
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: allocated by malloc_sync, freed once; cuMemFree synchronises with pending work.
        unsafe {
            let _ = cu::free_sync(self.ptr);
        }
    }
}

/// Page-locked host memory (the staging buffers of host-to-device copies).
pub struct Pinned {
    pub ptr: *mut u8,
    pub bytes: usize,
    ctx: Arc<CudaContext>,
}

// SAFETY: plain memory; access is coordinated by the staging ring's events.
unsafe impl Send for Pinned {}
unsafe impl Sync for Pinned {}

impl Pinned {
    /// `write_combined`: for memory the CPU only writes and the DMA engine reads (CPU reads of it are slow).
    pub fn new(gpu: &Gpu, bytes: usize, write_combined: bool) -> Result<Pinned> {
        gpu.ctx
            .bind_to_thread()
            .doing("binding the GPU context to this thread")?;
        let flags = if write_combined {
            sys::CU_MEMHOSTALLOC_WRITECOMBINED
        } else {
            0
        };
        // SAFETY: allocation; freed in Drop.
        let ptr = unsafe { cu::malloc_host(bytes.max(1), flags) }
            .doing_with(|| format!("page-locking {bytes} bytes of host memory"))?;
        Ok(Pinned {
            ptr: ptr as *mut u8,
            bytes,
            ctx: gpu.ctx.clone(),
        })
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `bytes` bytes were allocated at ptr.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.bytes) }
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: as above.
        unsafe { std::slice::from_raw_parts(self.ptr, self.bytes) }
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: allocated by malloc_host.
        unsafe {
            let _ = cu::free_host(self.ptr as *mut _);
        }
    }
}

/// Copies `src` into `dst` with several threads (one core's copy rate is below PCIe's).
pub fn par_copy(dst: &mut [u8], src: &[u8]) {
    use rayon::prelude::*;
    const CHUNK: usize = 1 << 20;
    if src.len() < 2 * CHUNK {
        dst[..src.len()].copy_from_slice(src);
        return;
    }
    dst[..src.len()]
        .par_chunks_mut(CHUNK)
        .zip(src.par_chunks(CHUNK))
        .for_each(|(d, s)| d.copy_from_slice(s));
}

#[cfg(test)]
mod tests {
    #[test]
    fn gpus_older_than_ampere_are_refused_with_the_reason() {
        let e = super::check_capability("Tesla T4", (7, 5))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("Tesla T4 (sm_75)") && e.contains("8.0 (Ampere)"),
            "{e}"
        );
        assert!(super::check_capability("A100", (8, 0)).is_ok());
        assert!(super::check_capability("H200", (9, 0)).is_ok());
    }
}
