//! Records served in place from the page cache, through read-only mappings of their data files — the cache
//! when it holds every record (Linux).
//!
//! Why not the slab then: a direct read into a never-touched anonymous page makes the kernel fault it and
//! clear it inside the read, and a model that fits in memory fills the whole slab once. On the measured VM
//! (free pages handed back to the host, so a fresh page is also backed again by the host on first touch)
//! that clearing was 38–49% of a 30-token run's CPU samples (BENCHMARKS.md, "First touch"). The drive fills
//! page-cache pages by DMA with nothing to clear, and what is left is bookkeeping.

use crate::io::{Fault, ReadOp, ALIGN};
use std::fs::File;
use std::path::Path;

/// A read-only shared mapping of a whole file.
pub struct FileMap {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: read-only memory; nothing writes through the mapping.
unsafe impl Send for FileMap {}
unsafe impl Sync for FileMap {}

impl FileMap {
    /// Maps `path` read-only; `None` for an empty file or where the kernel refuses (callers keep the slab).
    pub fn open(path: &Path) -> Option<FileMap> {
        use std::os::unix::io::AsRawFd;
        let file = File::open(path).ok()?;
        let len = usize::try_from(file.metadata().ok()?.len()).ok()?;
        if len == 0 {
            return None;
        }
        // SAFETY: a shared read-only mapping of an open file with no address hint; it outlives the descriptor.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return None;
        }
        // Faults read ahead in 2 MiB steps into 2 MiB page-cache folios where the filesystem has them (ext4,
        // xfs), whatever the drive's read-ahead setting: ~25x less kernel time than 4 KiB pages (BENCHMARKS.md,
        // "First touch"). Advice only, whatever the transparent-huge-page mode.
        // SAFETY: advice on the mapping just made.
        #[cfg(target_os = "linux")]
        unsafe {
            libc::madvise(ptr, len, libc::MADV_HUGEPAGE)
        };
        Some(FileMap {
            ptr: ptr as *mut u8,
            len,
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: mapped for `len` bytes for the map's lifetime. A file truncated under a running model
        // would fault on access (SIGBUS), as any memory-mapped reader does.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl Drop for FileMap {
    fn drop(&mut self) {
        // SAFETY: mapped in `open` with this length.
        unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len) };
    }
}

/// Performs a read whose destination is `op.file`'s mapping at `op.offset` (`op.dst`): the pages are read
/// into the page cache and mapped, so the compute that follows takes no page fault. `MADV_POPULATE_READ`
/// (Linux 5.14) faults them in; an older kernel touches one byte a page instead. (Announcing the range
/// with `POSIX_FADV_WILLNEED` first read it into 4 KiB pages: 25x the kernel time.) The error text if it
/// failed.
pub fn bring_in(op: &ReadOp) -> Option<String> {
    let err = |e: String| {
        Some(format!(
            "{}: {} bytes at offset {}: {e}",
            op.file.path.display(),
            op.len,
            op.offset
        ))
    };
    match op
        .file
        .faults
        .as_ref()
        .and_then(|f| f.before_read(&op.file.path, op.offset, op.len))
    {
        Some(Fault::Os(errno)) => return err(std::io::Error::from_raw_os_error(errno).to_string()),
        Some(Fault::Short(n)) if n < op.need => {
            return err(format!(
                "short read: {n} of {} bytes (the file ends early)",
                op.need
            ))
        }
        _ => {}
    }
    let start = op.dst as usize / ALIGN * ALIGN;
    let len = op.dst as usize + op.len - start;
    #[cfg(target_os = "linux")]
    {
        // SAFETY: `start..start+len` lies in the file's live mapping (the store checked every record
        // against the file's length); populating only reads.
        let populated =
            unsafe { libc::madvise(start as *mut libc::c_void, len, libc::MADV_POPULATE_READ) };
        if populated == 0 {
            return None;
        }
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINVAL) {
            return err(e.to_string());
        }
    }
    for at in (start..start + len).step_by(ALIGN) {
        // SAFETY: inside the live mapping, as above; a volatile read so that the touch is not optimised out.
        unsafe { std::ptr::read_volatile(at as *const u8) };
    }
    None
}
