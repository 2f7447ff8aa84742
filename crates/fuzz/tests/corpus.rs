//! Every committed corpus input, each a regression test of a finding or a seed of the fuzzer, runs through
//! its target without a panic; every target has a corpus.

use std::path::Path;

#[test]
fn every_corpus_input_runs_clean() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tools/fuzz/corpus");
    for t in deltafin_fuzz::TARGETS {
        let dir = root.join(t.name);
        let mut inputs: Vec<_> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .map(|e| e.unwrap().path())
            .collect();
        inputs.sort();
        assert!(!inputs.is_empty(), "{} has no corpus", t.name);
        for input in inputs {
            let data = std::fs::read(&input).unwrap();
            let run = std::panic::catch_unwind(|| (t.run)(&data));
            assert!(run.is_ok(), "{} panicked on {}", t.name, input.display());
        }
    }
}
