//! DeepSeek-V3 / Kimi K2 tiny checkpoints against the transformers-made fixtures of the same shape
//! (tests/fixtures/{deepseek_v3_tiny_fp8,kimi_k2_tiny_int4,deepseek_v3_tiny_bf16}): the same tensor names,
//! dtypes and shapes, the same config.json (quantization_config included), and quantized values a decoder
//! accepts, read back with the `safetensors` crate. A Kimi K2 checkpoint chats in K2's format.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use deltafin_makemodel::{make_deepseek_model, make_model, Arch, Preset, Quant};
use deltafin_tokenizer::chat::{ChatMessage, ChatTemplate};
use deltafin_tokenizer::{Piece, Tokenizer};
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;

/// name -> (dtype, shape, bytes)
type Tensors = BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)>;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

fn read_json(path: &Path) -> Value {
    serde_json::from_slice(&fs::read(path).unwrap()).unwrap()
}

/// Every tensor of the checkpoint at `dir`, through its index.
fn tensors(dir: &Path) -> Tensors {
    let index = read_json(&dir.join("model.safetensors.index.json"));
    let mut files: Vec<&str> = index["weight_map"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_str().unwrap())
        .collect();
    files.sort();
    files.dedup();
    let mut out = Tensors::new();
    for file in files {
        let bytes = fs::read(dir.join(file)).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        for (name, view) in st.tensors() {
            assert_eq!(index["weight_map"][&name], file, "{name}");
            let t = (view.dtype(), view.shape().to_vec(), view.data().to_vec());
            assert!(out.insert(name, t).is_none());
        }
    }
    out
}

fn made(arch: Arch, quant: Quant, seed: u64) -> (tempfile::TempDir, Tensors) {
    let dir = tempfile::tempdir().unwrap();
    make_deepseek_model(arch, Preset::Tiny, seed, quant, dir.path()).unwrap();
    let t = tensors(dir.path());
    (dir, t)
}

const VARIANTS: [(Arch, Quant, &str); 3] = [
    (Arch::DeepseekV3, Quant::Fp8, "deepseek_v3_tiny_fp8"),
    (Arch::KimiK2, Quant::Int4, "kimi_k2_tiny_int4"),
    (Arch::DeepseekV3, Quant::Bf16, "deepseek_v3_tiny_bf16"),
];

#[test]
fn tiny_has_the_released_roster_of_each_variant() {
    for (arch, quant, name) in VARIANTS {
        let (_dir, ours) = made(arch, quant, 0);
        let released = tensors(&fixture(name));
        let shape = |t: &Tensors| -> BTreeMap<String, (Dtype, Vec<usize>)> {
            t.iter()
                .map(|(n, (d, s, _))| (n.clone(), (*d, s.clone())))
                .collect()
        };
        assert_eq!(shape(&ours), shape(&released), "{name}");
    }
}

#[test]
fn tiny_config_is_the_released_form() {
    for (arch, quant, name) in VARIANTS {
        let dir = tempfile::tempdir().unwrap();
        make_deepseek_model(arch, Preset::Tiny, 0, quant, dir.path()).unwrap();
        let mut ours = read_json(&dir.path().join("config.json"));
        let mut released = read_json(&fixture(name).join("config.json"));
        // Our ids follow the tokenizer written beside the weights ([BOS] and [EOS] after its 256 ranks);
        // the fixture's DeepSeek-V3 ids are transformers' defaults.
        assert_eq!(
            (&ours["bos_token_id"], &ours["eos_token_id"]),
            (&256.into(), &257.into())
        );
        // Kimi K2's generation ends a turn at <|im_end|>, the special after [EOS].
        let generation = read_json(&dir.path().join("generation_config.json"));
        let eos = if arch == Arch::KimiK2 { 258 } else { 257 };
        assert_eq!(generation["eos_token_id"], eos, "{name}");
        for key in ["bos_token_id", "eos_token_id"] {
            ours.as_object_mut().unwrap().remove(key);
            released.as_object_mut().unwrap().remove(key);
        }
        assert_eq!(ours, released, "{name}");
        let vocab = deltafin_tokenizer::Tokenizer::from_dir(dir.path())
            .unwrap()
            .vocab_size();
        assert_eq!(
            vocab, 512,
            "{name}: the tokenizer covers the embedding rows"
        );
    }
}

/// FP8 e4m3fn as a float (no infinities; 0x7f / 0xff are NaN).
fn e4m3(b: u8) -> f32 {
    let (sign, exp, mant) = (b >> 7, (b >> 3) & 15, (b & 7) as f32);
    let mag = if exp == 0 {
        mant / 8.0 * 2f32.powi(-6)
    } else {
        (1.0 + mant / 8.0) * 2f32.powi(exp as i32 - 7)
    };
    if exp == 15 && mant == 7.0 {
        f32::NAN
    } else if sign == 1 {
        -mag
    } else {
        mag
    }
}

fn f32s(data: &[u8]) -> Vec<f32> {
    data.chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

fn bf16s(data: &[u8]) -> Vec<f32> {
    data.chunks_exact(2)
        .map(|b| f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16))
        .collect()
}

fn rms(xs: &[f32]) -> f32 {
    (xs.iter().map(|x| x * x).sum::<f32>() / xs.len() as f32).sqrt()
}

/// Every FP8 linear decodes (no NaN, scales positive with 4 significant bits, so weight × scale is a BF16
/// value), and its decoded std is near 1/sqrt(fan_in).
#[test]
fn fp8_weights_decode_to_scaled_bf16_values() {
    let (_dir, t) = made(Arch::DeepseekV3, Quant::Fp8, 3);
    let mut checked = 0;
    for (name, (dtype, shape, data)) in &t {
        let Some(base) = name.strip_suffix(".weight_scale_inv") else {
            continue;
        };
        let scales = f32s(data);
        let (_, wshape, wdata) = &t[&format!("{base}.weight")];
        let (rows, cols) = (wshape[0], wshape[1]);
        assert_eq!(
            (*dtype, shape.clone()),
            (Dtype::F32, vec![rows.div_ceil(128), cols.div_ceil(128)])
        );
        let decoded: Vec<f32> = wdata
            .iter()
            .enumerate()
            .map(|(i, &b)| {
                let s = scales[(i / cols / 128) * shape[1] + (i % cols) / 128];
                assert!(
                    s > 0.0 && s.to_bits() & 0x000f_ffff == 0,
                    "{name}: scale {s}"
                );
                let w = e4m3(b) * s;
                assert!(
                    w.is_finite() && w.to_bits() & 0xffff == 0,
                    "{base}: {w} is not BF16"
                );
                w
            })
            .collect();
        let want = 1.0 / (cols as f32).sqrt();
        let got = rms(&decoded);
        assert!(
            (0.5 * want..2.0 * want).contains(&got),
            "{base}: rms {got}, want ~{want}"
        );
        checked += 1;
    }
    // 8 spine linears in layer 0, 5 attention + 3 shared + 16 × 3 routed in layers 1 and 2.
    assert_eq!(checked, 8 + 2 * (5 + 3 + 48));
}

/// Each INT4 expert: `weight_shape` holds its [rows, cols], scales are positive, and the decoded std
/// ((nibble - 8) × group scale) is near 1/sqrt(cols); every nibble value occurs.
#[test]
fn int4_experts_decode() {
    let (_dir, t) = made(Arch::KimiK2, Quant::Int4, 3);
    let mut checked = 0;
    for (name, (_, _, data)) in &t {
        let Some(base) = name.strip_suffix(".weight_shape") else {
            continue;
        };
        let dims: Vec<i64> = data
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
            .collect();
        let (rows, cols) = (dims[0] as usize, dims[1] as usize);
        let (_, pshape, packed) = &t[&format!("{base}.weight_packed")];
        assert_eq!(pshape, &vec![rows, cols / 8], "{base}");
        let scales = bf16s(&t[&format!("{base}.weight_scale")].2);
        assert_eq!(scales.len(), rows * cols / 32, "{base}");
        assert!(scales.iter().all(|&s| s > 0.0), "{base}");
        let mut seen = [false; 16];
        let decoded: Vec<f32> = f32s(packed)
            .iter()
            .flat_map(|w| (0..8).map(move |k| (w.to_bits() >> (4 * k)) & 15))
            .enumerate()
            .map(|(i, q)| {
                seen[q as usize] = true;
                (q as f32 - 8.0) * scales[i / 32]
            })
            .collect();
        assert!(seen.iter().all(|&s| s), "{base}: nibbles {seen:?}");
        let want = 1.0 / (cols as f32).sqrt();
        let got = rms(&decoded);
        assert!(
            (0.5 * want..2.0 * want).contains(&got),
            "{base}: rms {got}, want ~{want}"
        );
        checked += 1;
    }
    assert_eq!(
        checked,
        2 * 16 * 3,
        "every routed expert linear of layers 1 and 2"
    );
}

#[test]
fn same_seed_same_bytes_and_released_defaults() {
    for (arch, quant, _) in VARIANTS {
        let (_a, a) = made(arch, quant, 9);
        let (_b, b) = made(arch, quant, 9);
        let (_c, c) = made(arch, quant, 10);
        assert_eq!(a, b, "{arch:?} {quant:?}");
        assert_ne!(
            a["lm_head.weight"], c["lm_head.weight"],
            "{arch:?} {quant:?}"
        );
    }
    // make_model writes each architecture's release: FP8 DeepSeek-V3, INT4 Kimi K2.
    for (arch, quant) in [(Arch::DeepseekV3, Quant::Fp8), (Arch::KimiK2, Quant::Int4)] {
        let dir = tempfile::tempdir().unwrap();
        make_model(arch, Preset::Tiny, 9, dir.path()).unwrap();
        assert_eq!(tensors(dir.path()), made(arch, quant, 9).1, "{arch:?}");
    }
}

#[test]
fn quant_and_preset_errors_name_the_choices() {
    let e = "fp4".parse::<Quant>().unwrap_err().to_string();
    assert!(
        e.contains("bf16") && e.contains("fp8") && e.contains("int4"),
        "{e}"
    );
    let dir = tempfile::tempdir().unwrap();
    let e = make_deepseek_model(Arch::GptOss, Preset::Tiny, 0, Quant::Fp8, dir.path())
        .unwrap_err()
        .to_string();
    assert!(e.contains("deepseek_v3") && e.contains("kimi_k2"), "{e}");
    let e = make_deepseek_model(Arch::KimiK2, Preset::Wide, 0, Quant::Int4, dir.path())
        .unwrap_err()
        .to_string();
    assert!(e.contains("kimi_k3"), "{e}");
}

/// The prompt text of Kimi-K2-Instruct's released chat template for `messages` (a default system turn
/// when there is none), and each markup name a single special id, `<|im_end|>` the generation's EOS.
#[test]
fn kimi_k2_chats_in_its_released_format() {
    let dir = tempfile::tempdir().unwrap();
    make_model(Arch::KimiK2, Preset::Tiny, 0, dir.path()).unwrap();
    let template = ChatTemplate::from_dir(dir.path()).unwrap().unwrap();
    let conversation = [
        ChatMessage::user("Weather in Paris?"),
        ChatMessage::assistant("Let me look."),
        ChatMessage::tool("call_1", "18 C, sunny"),
        ChatMessage::user("Thanks <|im_end|>"),
    ];
    let text = |messages: &[ChatMessage]| -> String {
        let pieces = template.render(messages, true, None).unwrap();
        pieces.iter().map(Piece::as_str).collect()
    };
    let turns = "<|im_user|>user<|im_middle|>Weather in Paris?<|im_end|>\
                 <|im_assistant|>assistant<|im_middle|>Let me look.<|im_end|>\
                 <|im_system|>tool<|im_middle|>18 C, sunny<|im_end|>\
                 <|im_user|>user<|im_middle|>Thanks <|im_end|><|im_end|>\
                 <|im_assistant|>assistant<|im_middle|>";
    assert_eq!(
        text(&conversation),
        format!("<|im_system|>system<|im_middle|>You are a helpful assistant<|im_end|>{turns}")
    );
    let mut with_system = vec![ChatMessage::system("Be brief.")];
    with_system.extend(conversation.iter().cloned());
    assert_eq!(
        text(&with_system),
        format!("<|im_system|>system<|im_middle|>Be brief.<|im_end|>{turns}")
    );

    let tok = Tokenizer::from_dir(dir.path()).unwrap();
    let im_end = tok.special_id("<|im_end|>").unwrap();
    assert_eq!(
        tok.eos_ids(),
        [257, im_end],
        "[EOS] and <|im_end|> end a generation"
    );
    let ids = tok.encode_pieces(&template.render(&conversation, true, None).unwrap());
    let markup = [
        "<|im_system|>",
        "<|im_user|>",
        "<|im_assistant|>",
        "<|im_middle|>",
        "<|im_end|>",
    ];
    let count = |name: &str| {
        let id = tok.special_id(name).unwrap();
        ids.iter().filter(|&&i| i == id).count()
    };
    // Five turns: each opens, names its role and ends once; the user's typed "<|im_end|>" stays text.
    assert_eq!(markup.map(count), [2, 2, 2, 6, 5]);
}
