//! `deltafin tokenize`: a checkpoint's token ids for some text, as JSON.

use anyhow::Result;
use clap::Args;
use std::path::PathBuf;

#[derive(Args)]
pub struct TokenizeArgs {
    /// Checkpoint directory holding tiktoken.model (or tokenizer.json) and tokenizer_config.json.
    #[arg(long)]
    model: PathBuf,
    /// The text to tokenize.
    #[arg(long)]
    text: String,
    /// Treat special-token names in the text (e.g. <|open|>) as special ids, as template text would be
    /// (default: off; they are ordinary text, as user text always is).
    #[arg(long)]
    specials: bool,
}

pub fn tokenize(a: TokenizeArgs) -> Result<()> {
    let tok = crate::chat::load_tokenizer(&a.model)?;
    let ids = if a.specials {
        tok.encode_with_specials(&a.text)
    } else {
        tok.encode(&a.text)
    };
    println!("{}", serde_json::to_string(&ids)?);
    Ok(())
}
