//! What the read engine asks of the operating system, per OS. Linux: `O_DIRECT` and `posix_fadvise`
//! (io_uring lives in io.rs). macOS has neither: `fcntl(F_NOCACHE)` turns off caching for a descriptor,
//! and `fcntl(F_RDADVISE)` asks for a range to be read ahead (Apple's fcntl(2) man page).

use std::fs::File;
use std::path::Path;

/// Opens `path` for reads that bypass the page cache: `O_DIRECT` on Linux (aligned requests only), and
/// on macOS a plain open followed by `F_NOCACHE` ("turns data caching off", any alignment, though
/// page-aligned requests avoid copies). An error means the filesystem refused; callers read buffered.
pub fn open_uncached(path: &Path) -> std::io::Result<File> {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::fs::OpenOptionsExt;
        std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(path)
    }
    #[cfg(target_os = "macos")]
    {
        let file = File::open(path)?;
        set_nocache(&file)?;
        Ok(file)
    }
    #[cfg(not(any(target_os = "linux", target_os = "macos")))]
    {
        let _ = path;
        Err(std::io::ErrorKind::Unsupported.into())
    }
}

/// macOS: stop caching this descriptor's reads and writes (`fcntl(fd, F_NOCACHE, 1)`).
#[cfg(target_os = "macos")]
fn set_nocache(file: &File) -> std::io::Result<()> {
    use std::os::unix::io::AsRawFd;
    // SAFETY: a valid descriptor; F_NOCACHE takes an int argument.
    if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_NOCACHE, 1) } == -1 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Keeps what is written through `file` out of the page cache where the OS can only do that up front
/// (macOS: F_NOCACHE on the writer), so a probe file just written is read from the drive. Linux needs
/// nothing here: [`drop_cached_pages`] evicts afterwards. Advice only: a refusal changes speed, not data.
pub fn write_uncached(file: &File) {
    #[cfg(target_os = "macos")]
    let _ = set_nocache(file);
    #[cfg(not(target_os = "macos"))]
    let _ = file;
}

/// Asks the kernel to forget `file`'s cached pages (Linux `POSIX_FADV_DONTNEED`). macOS has no such
/// call; files meant to be read cold there are written with [`write_uncached`]. Advice only.
pub fn drop_cached_pages(file: &File) {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::io::AsRawFd;
        // SAFETY: a valid descriptor; advice only.
        unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    }
    #[cfg(not(target_os = "linux"))]
    let _ = file;
}

/// Announces that `len` bytes at `offset` will be read soon (macOS `F_RDADVISE`: the kernel starts
/// reading them into its cache). Linux: nothing; its readahead is left as measured. Advice only.
pub fn advise_read(file: &File, offset: u64, len: usize) {
    #[cfg(target_os = "macos")]
    {
        use std::os::unix::io::AsRawFd;
        for (offset, count) in advisory_pieces(offset, len) {
            let advice = libc::radvisory {
                ra_offset: offset as libc::off_t,
                ra_count: count,
            };
            // SAFETY: a valid descriptor and a radvisory that lives across the call.
            unsafe { libc::fcntl(file.as_raw_fd(), libc::F_RDADVISE, &advice) };
        }
    }
    #[cfg(not(target_os = "macos"))]
    let _ = (file, offset, len);
}

/// `F_RDADVISE` takes an `int` byte count: a longer range goes as consecutive pieces of at most
/// `i32::MAX` bytes.
#[cfg_attr(not(target_os = "macos"), allow(dead_code))]
fn advisory_pieces(offset: u64, len: usize) -> impl Iterator<Item = (u64, i32)> {
    let len = len as u64;
    let step = i32::MAX as u64;
    (0..len)
        .step_by(step as usize)
        .map(move |at| (offset + at, (len - at).min(step) as i32))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn advice_is_split_into_int_sized_pieces() {
        let max = i32::MAX as u64;
        assert_eq!(advisory_pieces(7, 0).count(), 0);
        assert_eq!(
            advisory_pieces(4096, 1 << 20).collect::<Vec<_>>(),
            [(4096, 1 << 20)]
        );
        let long = 2 * max as usize + 5;
        assert_eq!(
            advisory_pieces(10, long).collect::<Vec<_>>(),
            [(10, i32::MAX), (10 + max, i32::MAX), (10 + 2 * max, 5)]
        );
    }
}
