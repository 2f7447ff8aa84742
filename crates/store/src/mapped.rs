//! Records served in place from the page cache, through read-only mappings of their data files — the cache
//! when it holds every record and [`crate::StoreOptions::map_files`] asks for it (Linux).
//!
//! Why not the slab then: a direct read into a never-touched anonymous page makes the kernel fault it and
//! clear it inside the read, and a model that fits in memory fills the whole slab once: that clearing was
//! 22–49% of a 30-token run's CPU samples (BENCHMARKS.md, "First touch"). The drive fills page-cache pages
//! with nothing to clear, and the next process finds them still cached. (On a VM whose host takes back the
//! guest's free memory, backing a fresh page again still costs the host the same; see [`bring_in`].)

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

/// The smallest page size: the stride of the touch below.
const PAGE: usize = 4096;

/// Brings the pages of the mapping under `start..start+len` (`start` page-aligned) into the page cache and
/// maps them, so the compute that follows takes no page fault: `MADV_POPULATE_READ` (Linux 5.14; an older
/// kernel only gets the touch). (Announcing the range with `POSIX_FADV_WILLNEED` first read it into 4 KiB
/// pages: 25x the kernel time.) Then one byte a page is read: on a VM whose host takes back the guest's free
/// memory, the first access to a page the drive filled still exits to the host (~9 µs a page measured here,
/// BENCHMARKS.md), and this keeps that off the compute threads; elsewhere it costs a cache miss a page.
pub fn bring_in(start: usize, len: usize) -> std::io::Result<()> {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: `start..start+len` lies in a live mapping of a file (the store checked every record
        // against its file's length); populating only reads.
        let populated =
            unsafe { libc::madvise(start as *mut libc::c_void, len, libc::MADV_POPULATE_READ) };
        if populated != 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EINVAL) {
                return Err(e);
            }
        }
    }
    for at in (start..start + len).step_by(PAGE) {
        // SAFETY: inside the live mapping, as above; volatile, so that the read is not optimised out.
        unsafe { std::ptr::read_volatile(at as *const u8) };
    }
    Ok(())
}
