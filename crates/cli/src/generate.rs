//! Greedy generation for `run` and `demo`: prefill the prompt in one pass, then one token per pass.

use crate::GenArgs;
use anyhow::{bail, Context, Result};
use deltafin_formats::npy;
use deltafin_models::{LogitRows, Model, Stats};
use deltafin_tokenizer::Tokenizer;
use std::io::Write;
use std::path::Path;
use std::time::Instant;

pub fn run(dir: &Path, args: &GenArgs) -> Result<()> {
    let t_load = Instant::now();
    let model = Model::load(dir)?;
    let cfg = model.config();
    let vocab = cfg.vocab_size;
    let tokenizer = if dir.join("tiktoken.model").exists() { Some(Tokenizer::from_dir(dir)?) } else { None };
    let prompt: Vec<u32> = match (&args.prompt, &args.prompt_ids) {
        (Some(text), _) => {
            let tok = tokenizer
                .as_ref()
                .with_context(|| format!("{} has no tiktoken.model; pass --prompt-ids instead of --prompt", dir.display()))?;
            tok.encode(text)
        }
        (None, Some(ids)) => ids.clone(),
        (None, None) => bail!("pass --prompt TEXT or --prompt-ids 1,2,3"),
    };
    if prompt.is_empty() {
        bail!("the prompt is empty; give at least one token");
    }
    if let Some(&bad) = prompt.iter().find(|&&t| t as usize >= vocab) {
        bail!("prompt token id {bad} is outside the vocabulary (size {vocab})");
    }
    let load_secs = t_load.elapsed().as_secs_f64();

    let stats = Stats::default();
    let mut session = model.new_session();
    let rows = if args.dump_logits.is_some() { LogitRows::All } else { LogitRows::Last };
    let t0 = Instant::now();
    let logits = model.forward(&mut session, &prompt, rows, &stats)?;
    let prefill_secs = t0.elapsed().as_secs_f64();
    let mut dumped: Vec<f32> = if args.dump_logits.is_some() { logits.clone() } else { Vec::new() };
    let mut last = logits[logits.len() - vocab..].to_vec();

    let mut out = std::io::stdout().lock();
    let mut generated: Vec<u32> = Vec::new();
    let mut printed = 0usize;
    let t1 = Instant::now();
    while generated.len() < args.max_new {
        if args.dump_logits.is_some() {
            dumped.extend_from_slice(&last);
        }
        let next = argmax(&last);
        generated.push(next);
        if let Some(tok) = &tokenizer {
            // Print only whole UTF-8 characters; a split character waits for its next token.
            let bytes = tok.decode_bytes(&generated)?;
            let valid = match std::str::from_utf8(&bytes[printed..]) {
                Ok(s) => s.len(),
                Err(e) => e.valid_up_to(),
            };
            out.write_all(&bytes[printed..printed + valid])?;
            out.flush()?;
            printed += valid;
        }
        if generated.len() == args.max_new || (!args.ignore_eos && Some(next) == cfg.eos_token_id) {
            break;
        }
        last = model.forward(&mut session, &[next], LogitRows::Last, &stats)?;
    }
    let decode_secs = t1.elapsed().as_secs_f64();
    if let Some(tok) = &tokenizer {
        let bytes = tok.decode_bytes(&generated)?;
        out.write_all(&bytes[printed..])?;
        writeln!(out)?;
    }
    if args.print_ids || tokenizer.is_none() {
        writeln!(out, "{}", serde_json::to_string(&generated)?)?;
    }
    if let Some(path) = &args.dump_logits {
        // Row P+j holds the logits that chose generated[j] (so row P repeats the last prompt row).
        npy::write_f32(path, dumped.len() / vocab, vocab, &dumped)?;
    }
    // Decode passes: one per generated token after the first (the first comes from the prefill's logits).
    let steps = generated.len().saturating_sub(1).max(1);
    eprintln!(
        "[stats] load {:.2}s | prefill {} tok in {:.3}s ({:.1} tok/s) | decode {} tok in {:.3}s ({:.2} tok/s) | expert reads {} ({:.1} MB, {:.3}s in reads) | kernels {}",
        load_secs,
        prompt.len(),
        prefill_secs,
        prompt.len() as f64 / prefill_secs,
        generated.len(),
        decode_secs,
        steps as f64 / decode_secs.max(1e-9),
        stats.reads(),
        stats.bytes() as f64 / 1e6,
        stats.read_secs(),
        deltafin_kernels::isa(),
    );
    Ok(())
}

/// The highest logit; ties go to the lowest id, like the router.
pub fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best as u32
}
