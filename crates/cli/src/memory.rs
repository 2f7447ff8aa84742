//! How many bytes this process may still take, and what sets that number: the machine's available memory, or
//! a memory cgroup (v2 `memory.max`, v1 `memory.limit_in_bytes`) of this process or one of its parents when
//! that leaves less. Every automatic budget starts from here; [`allowance`] is the one platform query.

#[cfg(any(target_os = "linux", test))]
use std::path::{Path, PathBuf};

const GIB: f64 = (1u64 << 30) as f64;

/// Room this process may still fill, with the limit that sets it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Allowance {
    /// Bytes that may still be allocated (the limit less what is already in use and cannot be reclaimed).
    pub bytes: u64,
    /// The limit itself.
    pub limit: u64,
    /// Where `limit` comes from, e.g. "cgroup /sys/fs/cgroup/memory/job/memory.limit_in_bytes".
    pub source: String,
}

impl std::fmt::Display for Allowance {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:.1} GiB may be used ({} = {:.1} GiB)",
            self.bytes as f64 / GIB,
            self.source,
            self.limit as f64 / GIB
        )
    }
}

/// The machine's memory: MemTotal from /proc/meminfo.
#[cfg(not(target_os = "macos"))]
pub fn physical_memory() -> Option<u64> {
    meminfo_field(&std::fs::read_to_string("/proc/meminfo").ok()?, "MemTotal:")
}

/// The machine's memory: `hw.memsize`.
#[cfg(target_os = "macos")]
pub fn physical_memory() -> Option<u64> {
    Some(crate::host::memory()?.total)
}

/// What this process may still take: the smallest room among the machine and every memory cgroup above it.
/// `None` where the platform gives no answer.
#[cfg(target_os = "linux")]
pub fn allowance() -> Option<Allowance> {
    let read = |p: &Path| std::fs::read_to_string(p).ok();
    let meminfo = read(Path::new("/proc/meminfo"))?;
    let mut best = Allowance {
        bytes: meminfo_field(&meminfo, "MemAvailable:")?,
        limit: meminfo_field(&meminfo, "MemAvailable:")?,
        source: "/proc/meminfo MemAvailable".into(),
    };
    let (own, mounts) = (
        read(Path::new("/proc/self/cgroup"))?,
        read(Path::new("/proc/self/mountinfo"))?,
    );
    for version in [Version::V2, Version::V1] {
        let Some(dir) = cgroup_dir(&own, &mounts, version) else {
            continue;
        };
        for level in levels(&dir, version) {
            let Some(limit) = read(&level.join(version.limit_file())).and_then(|t| parse_limit(&t))
            else {
                continue;
            };
            let usage = read(&level.join(version.usage_file()))
                .and_then(|t| t.trim().parse::<u64>().ok())
                .unwrap_or(0);
            let cache = read(&level.join("memory.stat")).map_or(0, |t| reclaimable(&t, version));
            let bytes = limit.saturating_sub(usage.saturating_sub(cache));
            if bytes < best.bytes {
                best = Allowance {
                    bytes,
                    limit,
                    source: format!("cgroup {}", level.join(version.limit_file()).display()),
                };
            }
        }
    }
    Some(best)
}

/// macOS has no memory cgroups: what the system could hand out without swapping (free and inactive pages).
#[cfg(target_os = "macos")]
pub fn allowance() -> Option<Allowance> {
    let available = crate::host::memory()?.available?;
    Some(Allowance {
        bytes: available,
        limit: available,
        source: "the Mach VM statistics' free and inactive pages".into(),
    })
}

#[cfg(not(any(target_os = "linux", target_os = "macos")))]
pub fn allowance() -> Option<Allowance> {
    None
}

#[cfg(any(target_os = "linux", test))]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Version {
    V1,
    V2,
}

#[cfg(target_os = "linux")]
impl Version {
    fn limit_file(self) -> &'static str {
        match self {
            Version::V1 => "memory.limit_in_bytes",
            Version::V2 => "memory.max",
        }
    }

    fn usage_file(self) -> &'static str {
        match self {
            Version::V1 => "memory.usage_in_bytes",
            Version::V2 => "memory.current",
        }
    }
}

/// A /proc/meminfo field in bytes.
#[cfg(any(not(target_os = "macos"), test))]
fn meminfo_field(text: &str, field: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with(field))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

#[cfg(any(target_os = "linux", test))]
/// The directory of this process's memory cgroup: its path in /proc/self/cgroup (v1: the hierarchy listing
/// "memory"; v2: hierarchy 0) under the mount of that hierarchy in /proc/self/mountinfo, whose root within
/// the hierarchy need not be "/".
fn cgroup_dir(own: &str, mountinfo: &str, version: Version) -> Option<PathBuf> {
    let path = own.lines().find_map(|l| {
        let mut f = l.splitn(3, ':');
        let (id, controllers, path) = (f.next()?, f.next()?, f.next()?);
        let ours = match version {
            Version::V2 => id == "0" && controllers.is_empty(),
            Version::V1 => controllers.split(',').any(|c| c == "memory"),
        };
        ours.then_some(path)
    })?;
    mountinfo.lines().find_map(|l| {
        // "id parent major:minor root mountpoint options [optional...] - fstype source superoptions"
        let (left, right) = l.split_once(" - ")?;
        let left: Vec<&str> = left.split(' ').collect();
        let right: Vec<&str> = right.split(' ').collect();
        let (root, point) = (*left.get(3)?, *left.get(4)?);
        let fits = match version {
            Version::V2 => right.first() == Some(&"cgroup2"),
            Version::V1 => {
                right.first() == Some(&"cgroup") && right.get(2)?.split(',').any(|o| o == "memory")
            }
        };
        let inside = if root == "/" {
            path
        } else {
            path.strip_prefix(root)?
        };
        fits.then(|| Path::new(point).join(inside.trim_start_matches('/')))
    })
}

#[cfg(target_os = "linux")]
/// `dir` and each parent up to the hierarchy's mount (the first without a limit file ends the walk).
fn levels(dir: &Path, version: Version) -> Vec<PathBuf> {
    dir.ancestors()
        .take_while(|d| d.join(version.limit_file()).exists())
        .map(Path::to_path_buf)
        .collect()
}

#[cfg(any(target_os = "linux", test))]
/// A limit file's value; `None` for no limit ("max", or v1's page-counter maximum).
fn parse_limit(text: &str) -> Option<u64> {
    let v: u64 = text.trim().parse().ok()?;
    // v1 writes "no limit" as the largest page count times the page size, just under 2^63.
    (v < 1 << 62).then_some(v)
}

#[cfg(any(target_os = "linux", test))]
/// Page-cache bytes of the cgroup's usage (file pages the kernel reclaims under the limit rather than kill).
fn reclaimable(stat: &str, version: Version) -> u64 {
    let fields: &[&str] = match version {
        Version::V1 => &["total_inactive_file", "total_active_file"],
        Version::V2 => &["inactive_file", "active_file"],
    };
    stat.lines()
        .filter_map(|l| l.split_once(' '))
        .filter(|(k, _)| fields.contains(k))
        .filter_map(|(_, v)| v.trim().parse::<u64>().ok())
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    const MOUNTS: &str = "\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
35 31 0:32 /process_api /sys/fs/cgroup/memory rw,relatime shared:7 - cgroup cgroup rw,memory
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw,nsdelegate
";

    #[test]
    fn the_own_cgroup_maps_under_its_mount() {
        let own = "9:name=systemd:/\n4:memory:/process_api/abc\n1:cpu:/\n0::/user.slice/job\n";
        assert_eq!(
            cgroup_dir(own, MOUNTS, Version::V1),
            Some(PathBuf::from("/sys/fs/cgroup/memory/abc"))
        );
        assert_eq!(
            cgroup_dir(own, MOUNTS, Version::V2),
            Some(PathBuf::from("/sys/fs/cgroup/unified/user.slice/job"))
        );
        // A process outside the mount's root cannot see its cgroup there.
        assert_eq!(
            cgroup_dir("4:memory:/elsewhere\n", MOUNTS, Version::V1),
            None
        );
        assert_eq!(cgroup_dir("4:cpu:/x\n", MOUNTS, Version::V1), None);
    }

    #[test]
    fn limits_parse_and_no_limit_is_none() {
        assert_eq!(parse_limit("3221225472\n"), Some(3 << 30));
        assert_eq!(parse_limit("max\n"), None);
        assert_eq!(parse_limit("9223372036854771712\n"), None);
        assert_eq!(parse_limit("garbage"), None);
    }

    #[test]
    fn page_cache_counts_as_reclaimable() {
        let v1 =
            "cache 100\nrss 5\ntotal_cache 900\ntotal_inactive_file 300\ntotal_active_file 200\n";
        assert_eq!(reclaimable(v1, Version::V1), 500);
        let v2 = "anon 1000\nfile 700\nactive_file 400\ninactive_file 250\n";
        assert_eq!(reclaimable(v2, Version::V2), 650);
    }

    #[test]
    fn meminfo_fields_are_bytes() {
        let text = "MemTotal:       24576000 kB\nMemAvailable:   20000000 kB\n";
        assert_eq!(meminfo_field(text, "MemTotal:"), Some(24576000 * 1024));
        assert_eq!(meminfo_field(text, "MemAvailable:"), Some(20000000 * 1024));
        assert_eq!(meminfo_field(text, "SwapTotal:"), None);
    }
}
