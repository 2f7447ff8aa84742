//! Reading and writing `tiktoken.model` and `tokenizer_config.json`.

use anyhow::{bail, ensure, Context, Result};
use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine;
use serde_json::{json, Map, Value};
use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::path::Path;

pub(crate) const TIKTOKEN_FILE: &str = "tiktoken.model";
pub(crate) const CONFIG_FILE: &str = "tokenizer_config.json";
pub(crate) const GENERATION_FILE: &str = "generation_config.json";

/// Number of reserved special ids K3 places right after its ranks.
pub const K3_NUM_SPECIALS: u32 = 256;

/// Name of K3's special token `k` (id = number of ranks + k), for k in 0..256.
pub fn k3_special_name(k: u32) -> String {
    match k {
        0 => "[BOS]".into(),
        1 => "[EOS]".into(),
        2 => "<|end_of_msg|>".into(),
        3 => "<|open|>".into(),
        4 => "<|close|>".into(),
        5 => "<|sep|>".into(),
        6 => "<|header_start|>".into(),
        7 => "<|header_end|>".into(),
        9 => "[EOT]".into(),
        254 => "[UNK]".into(),
        255 => "[PAD]".into(),
        _ => format!("<|reserved_token_{k}|>"),
    }
}

/// Shows at most 60 characters of untrusted input in an error message.
fn excerpt(s: &str) -> String {
    let mut out: String = s.chars().take(60).collect();
    if out.len() < s.len() {
        out.push('…');
    }
    format!("{out:?}")
}

/// Parses a tiktoken file: one `base64(bytes) SPACE decimal-rank` per line, ranks exactly 0..n in any
/// order, token bytes distinct. Empty lines are skipped (tiktoken does the same). Returns tokens by rank.
pub(crate) fn parse_tiktoken(path: &Path, text: &str) -> Result<Vec<Vec<u8>>> {
    let shown = path.display();
    let lines: Vec<(usize, &str)> = text
        .split('\n')
        .enumerate()
        .map(|(i, l)| (i + 1, l.strip_suffix('\r').unwrap_or(l)))
        .filter(|(_, l)| !l.is_empty())
        .collect();
    let n = lines.len();
    let mut by_rank: Vec<Option<(Vec<u8>, usize)>> = vec![None; n];
    let mut seen: HashMap<Vec<u8>, usize> = HashMap::with_capacity(n);
    for &(line_no, line) in &lines {
        let at = || format!("{shown}:{line_no}");
        let mut fields = line.split(' ');
        let (Some(b64), Some(rank), None) = (fields.next(), fields.next(), fields.next()) else {
            bail!(
                "{}: expected `<base64 token> <rank>` separated by one space, found {}",
                at(),
                excerpt(line)
            );
        };
        let bytes = BASE64.decode(b64).with_context(|| {
            format!(
                "{}: expected base64 token bytes, found {}",
                at(),
                excerpt(b64)
            )
        })?;
        ensure!(
            !bytes.is_empty(),
            "{}: expected non-empty token bytes, found an empty token",
            at()
        );
        ensure!(
            !rank.is_empty() && rank.bytes().all(|b| b.is_ascii_digit()),
            "{}: expected a decimal rank, found {}",
            at(),
            excerpt(rank)
        );
        let rank: usize = match rank.parse() {
            Ok(r) if r < n => r,
            _ => bail!(
                "{}: rank {rank} is out of range: the file has {n} entries, so ranks must be 0..{n} with no gaps",
                at()
            ),
        };
        if let Some((_, first)) = &by_rank[rank] {
            bail!(
                "{}: duplicate rank {rank}, already given on line {first}",
                at()
            );
        }
        if let Some(first) = seen.insert(bytes.clone(), line_no) {
            bail!(
                "{}: duplicate token bytes {:?}, already given on line {first}",
                at(),
                bytes.escape_ascii().to_string()
            );
        }
        by_rank[rank] = Some((bytes, line_no));
    }
    // n entries, ranks < n and no duplicates, so every rank is present; collect without panicking anyway.
    let tokens: Vec<Vec<u8>> = by_rank.into_iter().flatten().map(|(b, _)| b).collect();
    ensure!(
        tokens.len() == n,
        "{shown}: ranks are not contiguous 0..{n}"
    );
    if let Some(b) = (0..=255u8).find(|&b| !seen.contains_key(&[b][..])) {
        bail!("{shown}: expected a rank for every single byte (byte-level BPE needs all 256), found none for byte 0x{b:02x}");
    }
    Ok(tokens)
}

/// The parts of `tokenizer_config.json` the tokenizer uses.
pub(crate) struct Config {
    /// Added tokens by id (all of them, whether or not flagged `special`).
    pub specials: BTreeMap<u32, String>,
    /// `bos_token`, `eos_token`, `pad_token`, `unk_token` resolved to ids, in that order.
    pub roles: [Option<u32>; 4],
}

pub(crate) const ROLE_FIELDS: [&str; 4] = ["bos_token", "eos_token", "pad_token", "unk_token"];

/// Parses the HF-style config and checks added tokens against the `num_ranks` ranks.
pub(crate) fn parse_config(path: &Path, text: &str, num_ranks: usize) -> Result<Config> {
    let shown = path.display();
    let root: Value =
        serde_json::from_str(text).with_context(|| format!("{shown}: expected JSON"))?;
    let Some(root) = root.as_object() else {
        bail!(
            "{shown}: expected a JSON object at the top level, found {}",
            kind(&root)
        );
    };
    let mut specials = BTreeMap::new();
    let mut by_name: HashMap<String, u32> = HashMap::new();
    match root.get("added_tokens_decoder") {
        None | Some(Value::Null) => {}
        Some(Value::Object(added)) => {
            for (key, entry) in added {
                let field = format!("{shown}: added_tokens_decoder[{key:?}]");
                let id: u32 = match key.parse() {
                    Ok(id) if key.bytes().all(|b| b.is_ascii_digit()) => id,
                    _ => bail!(
                        "{field}: expected a decimal token id below 2^32 as the key, found {key:?}"
                    ),
                };
                let content = match entry.get("content") {
                    Some(Value::String(s)) if !s.is_empty() => s.clone(),
                    Some(other) => {
                        bail!("{field}.content: expected a non-empty string, found {other}")
                    }
                    None => bail!(
                        "{field}: expected an object with a \"content\" string, found {}",
                        excerpt(&entry.to_string())
                    ),
                };
                ensure!(
                    (id as usize) >= num_ranks,
                    "{field} ({content:?}): id {id} collides with rank {id} of tiktoken.model (ranks are 0..{num_ranks})"
                );
                if let Some(other) = by_name.insert(content.clone(), id) {
                    bail!("{field}: content {content:?} is already the name of id {other}");
                }
                specials.insert(id, content);
            }
        }
        Some(other) => bail!(
            "{shown}: added_tokens_decoder: expected an object, found {}",
            kind(other)
        ),
    }
    let mut roles = [None; 4];
    for (role, field) in roles.iter_mut().zip(ROLE_FIELDS) {
        let Some(name) = role_name(root.get(field), field, &shown)? else {
            continue;
        };
        let Some(&id) = by_name.get(name) else {
            bail!("{shown}: {field}: expected the name of a token in added_tokens_decoder, found {name:?}");
        };
        *role = Some(id);
    }
    Ok(Config { specials, roles })
}

/// The token name a `tokenizer_config.json` role field (`bos_token`, …) gives, if any. HF writes these either as
/// a plain string or as an AddedToken object with "content".
pub(crate) fn role_name<'a>(
    value: Option<&'a Value>,
    field: &str,
    shown: &impl std::fmt::Display,
) -> Result<Option<&'a str>> {
    match value {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(Value::Object(o)) => match o.get("content") {
            Some(Value::String(s)) => Ok(Some(s)),
            _ => bail!("{shown}: {field}: expected an object with a \"content\" string"),
        },
        Some(other) => bail!("{shown}: {field}: expected a string, found {}", kind(other)),
    }
}

/// `eos_token_id` of `dir`'s `generation_config.json`: none when the file or the field is absent (or null),
/// else one id or a list of ids, each one the tokenizer has text for (`is_token`).
pub(crate) fn generation_eos(
    dir: &Path,
    is_token: impl Fn(u32) -> bool,
    vocab_size: usize,
) -> Result<Vec<u32>> {
    let path = dir.join(GENERATION_FILE);
    if !path.exists() {
        return Ok(Vec::new());
    }
    let shown = path.display();
    let text = std::fs::read_to_string(&path).with_context(|| format!("reading {shown}"))?;
    let root: Value =
        serde_json::from_str(&text).with_context(|| format!("{shown}: expected JSON"))?;
    let Some(root) = root.as_object() else {
        bail!(
            "{shown}: expected a JSON object at the top level, found {}",
            kind(&root)
        );
    };
    let values = match root.get("eos_token_id") {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(list)) => list.iter().collect(),
        Some(one) => vec![one],
    };
    values
        .into_iter()
        .map(|v| {
            let Some(id) = v.as_u64().and_then(|id| u32::try_from(id).ok()) else {
                bail!("{shown}: eos_token_id: expected a token id or a list of token ids, found {v}");
            };
            ensure!(
                is_token(id),
                "{shown}: eos_token_id: {id} is not a token of the tokenizer (vocab size {vocab_size}); \
                 correct the id or remove it"
            );
            Ok(id)
        })
        .collect()
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Writes `tiktoken.model` (rank i = `ranks[i]`) and a `tokenizer_config.json` with K3's 256 special
/// ids right after the ranks, each file via a temporary file and a rename so readers never see a torn one.
pub fn write_tiktoken_files(dir: &Path, ranks: &[Vec<u8>]) -> Result<()> {
    write_tiktoken_files_named(dir, ranks, k3_special_name)
}

/// [`write_tiktoken_files`] with special `k` (of the 256) called `name(k)`: a family whose specials sit
/// where K3's do under other names (Kimi K2's `<|im_end|>` is K3's `<|end_of_msg|>`).
pub fn write_tiktoken_files_named(
    dir: &Path,
    ranks: &[Vec<u8>],
    name: impl Fn(u32) -> String,
) -> Result<()> {
    let mut seen = HashMap::with_capacity(ranks.len());
    for (rank, token) in ranks.iter().enumerate() {
        ensure!(
            !token.is_empty(),
            "rank {rank}: expected non-empty token bytes, found an empty token"
        );
        if let Some(first) = seen.insert(&token[..], rank) {
            bail!("rank {rank}: duplicate token bytes, already rank {first}");
        }
    }
    let mut model = String::new();
    for (rank, token) in ranks.iter().enumerate() {
        writeln!(model, "{} {rank}", BASE64.encode(token))?;
    }

    let base = u32::try_from(ranks.len())
        .ok()
        .filter(|n| n.checked_add(K3_NUM_SPECIALS).is_some());
    let Some(base) = base else {
        bail!(
            "{} ranks leave no room for 256 special ids below 2^32",
            ranks.len()
        )
    };
    let mut added = Map::new();
    for k in 0..K3_NUM_SPECIALS {
        let entry = json!({
            "content": name(k),
            "lstrip": false,
            "normalized": false,
            "rstrip": false,
            "single_word": false,
            "special": true,
        });
        added.insert((base + k).to_string(), entry);
    }
    let config = json!({
        "added_tokens_decoder": added,
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
    });
    let config = serde_json::to_string_pretty(&config)? + "\n";

    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    deltafin_formats::write_atomically(&dir.join(TIKTOKEN_FILE), model.as_bytes())?;
    deltafin_formats::write_atomically(&dir.join(CONFIG_FILE), config.as_bytes())
}
