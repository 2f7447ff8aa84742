//! `run` and `demo`: tokenize, generate with the engine, stream the text, report where the time went.

use crate::GenArgs;
use anyhow::{bail, Context, Result};
use deltafin_engine::{generate, Flow, Request, SamplingParams};
use deltafin_formats::npy;
use deltafin_models::{LoadOptions, Model, Stats};
use deltafin_tokenizer::Tokenizer;
use std::io::Write;
use std::path::Path;
use std::time::Instant;

pub fn run(dir: &Path, args: &GenArgs, load: &LoadOptions) -> Result<()> {
    let t_load = Instant::now();
    let model = Model::load_with(dir, load)?;
    let cfg = model.config();
    let vocab = cfg.vocab_size;
    let tokenizer = if dir.join("tiktoken.model").exists() {
        Some(Tokenizer::from_dir(dir)?)
    } else {
        None
    };
    let prompt: Vec<u32> = match (&args.prompt, &args.prompt_ids) {
        (Some(text), _) => {
            let tok = tokenizer.as_ref().with_context(|| {
                format!(
                    "{} has no tiktoken.model; pass --prompt-ids instead of --prompt",
                    dir.display()
                )
            })?;
            tok.encode(text)
        }
        (None, Some(ids)) => ids.clone(),
        (None, None) => bail!("pass --prompt TEXT or --prompt-ids 1,2,3"),
    };
    let load_secs = t_load.elapsed().as_secs_f64();

    let req = Request {
        prompt,
        max_new: args.max_new,
        stop_ids: if args.ignore_eos {
            vec![]
        } else {
            cfg.eos_token_id.into_iter().collect()
        },
        sampling: SamplingParams::default(),
        prompt_logits: args.dump_logits.is_some(),
    };
    let stats = Stats::default();
    let mut out = std::io::stdout().lock();
    let mut chosen_logits: Vec<f32> = Vec::new();
    let mut bytes: Vec<u8> = Vec::new();
    let mut printed = 0usize;
    let mut io_error = None;
    let output = generate(&model, &req, &stats, |token, logits| {
        if args.dump_logits.is_some() {
            chosen_logits.extend_from_slice(logits);
        }
        if let Some(tok) = &tokenizer {
            // Print only whole UTF-8 characters; a split character waits for its next token.
            match tok.decode_bytes(&[token]) {
                Ok(b) => bytes.extend_from_slice(&b),
                Err(e) => {
                    io_error = Some(e);
                    return Flow::Stop;
                }
            }
            let valid = match std::str::from_utf8(&bytes[printed..]) {
                Ok(s) => s.len(),
                Err(e) => e.valid_up_to(),
            };
            if let Err(e) = out
                .write_all(&bytes[printed..printed + valid])
                .and_then(|_| out.flush())
            {
                io_error = Some(e.into());
                return Flow::Stop;
            }
            printed += valid;
        }
        Flow::Continue
    })?;
    if let Some(e) = io_error {
        return Err(e);
    }
    if tokenizer.is_some() {
        out.write_all(&bytes[printed..])?;
        writeln!(out)?;
    }
    if args.print_ids || tokenizer.is_none() {
        writeln!(out, "{}", serde_json::to_string(&output.tokens)?)?;
    }
    if let Some(path) = &args.dump_logits {
        // Prompt rows, then row P+j = the logits that chose generated[j] (row P repeats the last prompt row).
        let mut rows = output.prompt_logits.clone().unwrap_or_default();
        rows.extend_from_slice(&chosen_logits);
        npy::write_f32(path, rows.len() / vocab, vocab, &rows)?;
    }
    eprintln!("{}", crate::report::stats_line(&model, &stats, req.prompt.len(), &output, load_secs));
    Ok(())
}
