//! deltafin inside a memory cgroup made for it, with a limit far below the machine's memory: defaults fit
//! (no out-of-memory kill, the same logits as without the limit), `doctor` shows the limit, and flags that
//! cannot fit are refused naming it. Needs root and a writable memory controller (CI has both); without
//! them the test says loudly that it did not run.

mod common;
use common::*;
use deltafin_makemodel::{make_model, Arch, Preset};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// Above what the `small` preset needs with a small cache (~125 MiB), below what it takes with every expert
/// cached: main before this test was OOM-killed here by its default (a quarter of the machine's RAM).
const LIMIT: u64 = 160 << 20;

/// A child memory cgroup of this process's own (v1 `memory.limit_in_bytes`, or v2 `memory.max` where the
/// controller is enabled for children), removed on drop.
struct Cgroup {
    dir: PathBuf,
    limit_file: &'static str,
}

impl Cgroup {
    fn create(limit: u64) -> Result<Cgroup, String> {
        let own = std::fs::read_to_string("/proc/self/cgroup").map_err(|e| e.to_string())?;
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").map_err(|e| e.to_string())?;
        let name = format!("deltafin-test-{}", std::process::id());
        for v1 in [true, false] {
            let Some(parent) = own_dir(&own, &mounts, v1) else {
                continue;
            };
            let limit_file = if v1 {
                "memory.limit_in_bytes"
            } else {
                "memory.max"
            };
            let controls = std::fs::read_to_string(parent.join("cgroup.subtree_control"));
            if !v1 && !controls.is_ok_and(|c| c.split_whitespace().any(|c| c == "memory")) {
                continue;
            }
            let dir = parent.join(&name);
            if std::fs::create_dir(&dir).is_err() {
                continue;
            }
            let cg = Cgroup { dir, limit_file };
            std::fs::write(cg.dir.join(limit_file), limit.to_string())
                .map_err(|e| format!("{}: {e}", cg.dir.join(limit_file).display()))?;
            return Ok(cg);
        }
        Err("no writable memory cgroup controller (v1 or v2) for this process".into())
    }

    /// Runs `deltafin ARGS` inside the cgroup.
    fn run(&self, args: &[&str]) -> Output {
        Command::new("sh")
            .arg("-c")
            .arg(r#"echo $$ > "$0/cgroup.procs" && exec "$@""#)
            .arg(&self.dir)
            .arg(env!("CARGO_BIN_EXE_deltafin"))
            .args(args)
            .output()
            .unwrap()
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// This process's cgroup directory in the v1 memory hierarchy or the v2 one.
fn own_dir(own: &str, mounts: &str, v1: bool) -> Option<PathBuf> {
    let path = own.lines().find_map(|l| {
        let mut f = l.splitn(3, ':');
        let (id, controllers, path) = (f.next()?, f.next()?, f.next()?);
        let ours = if v1 {
            controllers.split(',').any(|c| c == "memory")
        } else {
            id == "0"
        };
        ours.then_some(path)
    })?;
    mounts.lines().find_map(|l| {
        let (left, right) = l.split_once(" - ")?;
        let left: Vec<&str> = left.split(' ').collect();
        let right: Vec<&str> = right.split(' ').collect();
        let fits = if v1 {
            right[0] == "cgroup" && right.get(2)?.split(',').any(|o| o == "memory")
        } else {
            right[0] == "cgroup2"
        };
        let inside = path.strip_prefix(left[3].trim_end_matches('/'))?;
        fits.then(|| Path::new(left[4]).join(inside.trim_start_matches('/')))
    })
}

fn dump_args<'a>(model: &'a str, npy: &'a str) -> Vec<&'a str> {
    vec![
        "run",
        "--model",
        model,
        "--prompt-ids",
        "17,400,9",
        "--max-new",
        "6",
        "--ignore-eos",
        "--dump-logits",
        npy,
    ]
}

#[test]
fn defaults_fit_in_a_memory_cgroup_and_flags_that_cannot_are_refused() {
    let is_root = std::fs::read_to_string("/proc/self/status").is_ok_and(|s| {
        s.lines()
            .any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(1) == Some("0"))
    });
    let cg = match (is_root, Cgroup::create(LIMIT)) {
        (true, Ok(cg)) => cg,
        (root, e) => {
            eprintln!(
                "\n*** SKIPPED defaults_fit_in_a_memory_cgroup: {} ***\n",
                if root {
                    e.err().unwrap_or_default()
                } else {
                    "not root (making a memory cgroup needs root)".into()
                }
            );
            return;
        }
    };
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    make_model(Arch::KimiK3, Preset::Small, 0, &model).unwrap();
    let (m, free, limited) = (
        model.to_str().unwrap(),
        tmp.path().join("free.npy"),
        tmp.path().join("limited.npy"),
    );

    let out = bin()
        .args(dump_args(m, free.to_str().unwrap()))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = cg.run(&dump_args(m, limited.to_str().unwrap()));
    assert!(
        out.status.success(),
        "under a {} MiB limit: {:?} {}",
        LIMIT >> 20,
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        std::fs::read(&free).unwrap(),
        std::fs::read(&limited).unwrap(),
        "the logits under the limit differ from those without it"
    );

    let limit_path = cg.dir.join(cg.limit_file).display().to_string();
    let doctor = cg.run(&["doctor", "--disk-mib", "0"]);
    let text = String::from_utf8_lossy(&doctor.stdout);
    assert!(
        text.contains(&format!("cgroup {limit_path} = 0.2 GiB")),
        "{text}"
    );

    let refused = cg.run(&[
        "run",
        "--model",
        m,
        "--prompt-ids",
        "1",
        "--memory-budget",
        "1G",
    ]);
    let err = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(1), "{err}");
    assert!(
        err.contains("--memory-budget 1.0 GiB cannot fit") && err.contains(&limit_path),
        "{err}"
    );
}
