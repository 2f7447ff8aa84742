//! The description against checkpoints written in the released layouts (`deltafin-makemodel`): it names every
//! spine tensor and nothing else, every layer loads from it, and each family's choices are its contract's.

use deltafin_formats::checkpoint::Checkpoint;
use deltafin_formats::config::ModelConfig;
use deltafin_makemodel::{make_model, Arch, Preset};
use deltafin_models::describe::{
    ALogLayout, Attention, DecayGate, Description, FeedForward, OutputGate, QkNorm, QueryPath,
    Residual, Scoring,
};
use deltafin_models::ops::Act;
use deltafin_models::Model;
use deltafin_store::record::is_routed_expert;
use std::collections::BTreeSet;

fn described(arch: Arch) -> (Description, Checkpoint, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    make_model(arch, Preset::Tiny, 0, dir.path()).unwrap();
    let cfg = ModelConfig::from_dir(dir.path()).unwrap();
    let desc = Description::of(&cfg).unwrap();
    Model::load(dir.path()).expect("every described tensor loads with its described shape");
    (desc, Checkpoint::open(dir.path()).unwrap(), dir)
}

#[test]
fn the_description_names_every_spine_tensor_once() {
    for arch in [Arch::KimiK3, Arch::KimiLinear, Arch::GptOss, Arch::Qwen3Moe] {
        let (desc, ck, _dir) = described(arch);
        let mut names: Vec<&str> = desc.globals();
        names.extend(desc.layers.iter().flat_map(|l| l.tensors()));
        let listed: BTreeSet<&str> = names.iter().copied().collect();
        assert_eq!(
            listed.len(),
            names.len(),
            "{arch:?}: a tensor is described twice"
        );
        let spine: BTreeSet<&str> = ck
            .tensors()
            .map(|t| t.name.as_str())
            .filter(|n| !is_routed_expert(n))
            .collect();
        assert_eq!(listed, spine, "{arch:?}");
    }
}

#[test]
fn each_family_makes_its_contract_choices() {
    let (k3, _, _d1) = described(Arch::KimiK3);
    let (kl, _, _d2) = described(Arch::KimiLinear);
    assert!(matches!(k3.residual, Residual::AttnRes { .. }));
    assert_eq!(kl.residual, Residual::PreNorm);
    assert_eq!(k3.lm_head.name, "language_model.lm_head.weight");
    assert_eq!(kl.lm_head.name, "lm_head.weight");
    for (desc, k3) in [(&k3, true), (&kl, false)] {
        for l in &desc.layers {
            assert_eq!(l.res.is_some(), k3);
            match &l.attn {
                Attention::Kda(k) => {
                    assert_eq!(matches!(k.out_gate, OutputGate::FullRank(_)), k3);
                    let (decay, a_log, qk) = if k3 {
                        let lower = DecayGate::LowerBoundSigmoid { lower: -5.0 };
                        (lower, ALogLayout::PaddedToHeadDim, QkNorm::ClampedNorm)
                    } else {
                        (
                            DecayGate::Softplus,
                            ALogLayout::PerHead,
                            QkNorm::EpsInsideSqrt,
                        )
                    };
                    assert_eq!((k.decay, k.a_log_layout, k.qk_norm), (decay, a_log, qk));
                }
                Attention::Mla(m) => {
                    assert_eq!(m.gate.is_some(), k3);
                    assert_eq!(matches!(m.q, QueryPath::LowRank { .. }), k3);
                }
                Attention::Gqa(_) => panic!("the Kimi families have no GQA layers"),
            }
            let act = if k3 { Act::Situ } else { Act::SiluGlu };
            match &l.ffn {
                FeedForward::Dense(m) => assert_eq!(m.act, act),
                FeedForward::Moe(m) => {
                    assert_eq!((m.act, m.shared.as_ref().map(|s| s.act)), (act, Some(act)));
                    assert_eq!(m.latent.is_some(), k3);
                }
            }
        }
    }
}

/// DeepSeek-V3 / Kimi K2 as transformers writes them (tests/fixtures; BF16 spine in both): the description
/// names every spine tensor once, every layer MLA with YaRN RoPE, the MoE layers with the config's groups.
#[test]
fn deepseek_v3_description_matches_the_released_layout() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures");
    for (fixture, groups) in [
        ("deepseek_v3_tiny_bf16", (4, 2)),
        ("kimi_k2_tiny_int4", (1, 1)),
    ] {
        let dir = root.join(fixture);
        let cfg = ModelConfig::from_dir(&dir).unwrap();
        let desc = Description::of(&cfg).unwrap();
        let ck = Checkpoint::open(&dir).unwrap();
        let mut names: Vec<&str> = desc.globals();
        names.extend(desc.layers.iter().flat_map(|l| l.tensors()));
        let listed: BTreeSet<&str> = names.iter().copied().collect();
        assert_eq!(
            listed.len(),
            names.len(),
            "{fixture}: a tensor is described twice"
        );
        let spine: BTreeSet<&str> = ck
            .tensors()
            .map(|t| t.name.as_str())
            .filter(|n| !is_routed_expert(n))
            .collect();
        assert_eq!(listed, spine, "{fixture}");
        assert_eq!(desc.residual, Residual::PreNorm);
        for (l, layer) in desc.layers.iter().enumerate() {
            let Attention::Mla(m) = &layer.attn else {
                panic!("{fixture}: layer {l} is not MLA")
            };
            assert!(m.rotary.as_ref().is_some_and(|r| r.yarn.is_some()));
            assert!(m.gate.is_none() && matches!(m.q, QueryPath::LowRank { .. }));
            match &layer.ffn {
                FeedForward::Dense(_) => assert_eq!(l, 0, "{fixture}: first_k_dense_replace is 1"),
                FeedForward::Moe(m) => {
                    assert_eq!((m.router.groups, m.router.topk_group), groups);
                    assert_eq!(m.act, Act::SiluGlu);
                }
            }
        }
    }
}

/// Qwen3-MoE: GQA without biases or sinks but with per-head q/k norms, a bias-free softmax router, the dense
/// layer of `mlp_only_layers`; with `tie_word_embeddings` the head is the embedding table, described once.
#[test]
fn qwen3_moe_description_is_the_released_models() {
    let (desc, _, dir) = described(Arch::Qwen3Moe);
    for (l, layer) in desc.layers.iter().enumerate() {
        let Attention::Gqa(g) = &layer.attn else {
            panic!("layer {l} is not GQA")
        };
        assert!(g.sinks.is_none() && g.window.is_none());
        assert!([&g.q, &g.k, &g.v, &g.o].iter().all(|a| a.bias.is_none()));
        let n = g.head_norm.as_ref().expect("q_norm and k_norm");
        assert_eq!((n.q.shape.clone(), n.eps), (vec![g.dim], 1e-6));
        match &layer.ffn {
            FeedForward::Dense(m) => assert_eq!((l, m.gate.rows), (1, 96)),
            FeedForward::Moe(m) => {
                assert_eq!(
                    (m.router.scoring, m.router.bias.clone()),
                    (Scoring::Softmax, None)
                );
                assert!(m.router.renormalize && m.shared.is_none());
            }
        }
    }
    assert_eq!(desc.lm_head.name, "lm_head.weight");
    let path = dir.path().join("config.json");
    let config = std::fs::read_to_string(&path).unwrap();
    let tie = config.replace(
        "\"tie_word_embeddings\": false",
        "\"tie_word_embeddings\": true",
    );
    assert_ne!(tie, config);
    std::fs::write(&path, tie).unwrap();
    let tied = Description::of(&ModelConfig::from_dir(dir.path()).unwrap()).unwrap();
    assert_eq!(tied.lm_head, tied.embed);
    assert_eq!(
        tied.globals(),
        ["model.embed_tokens.weight", "model.norm.weight"]
    );
}
