//! The scalar fallback and the AVX2 path follow one reduction order, so whole-model logits agree bit for bit.
//! (Its own test binary: forcing the scalar path is process-wide.)

mod common;
use common::*;
use deltafin_makemodel::Arch;
use deltafin_models::{Backend, LogitRows, Model, Stats};

#[test]
fn scalar_and_simd_kernels_give_identical_logits() {
    for arch in [Arch::KimiK3, Arch::KimiLinear] {
        let t = tiny(arch, 6);
        let model = Model::load(&model_dir(&t)).unwrap();
        let run = || {
            let mut s = model.new_session();
            model
                .forward(
                    &mut s,
                    &[1, 2, 3, 400, 5],
                    LogitRows::All,
                    &Stats::default(),
                )
                .unwrap()
        };
        deltafin_kernels::set_force_scalar(false);
        let simd = run();
        deltafin_kernels::set_force_scalar(true);
        let scalar = run();
        deltafin_kernels::set_force_scalar(false);
        assert!(
            simd == scalar,
            "{arch:?}: {} and scalar kernels differ",
            deltafin_kernels::isa()
        );
    }
}
