//! A tiny random K3 checkpoint, servers on loopback port 0, and a minimal HTTP/1.0 client (the response
//! body ends when the server closes, so no chunked decoding is needed).

#![allow(dead_code)]

use deltafin_makemodel::{make_model, make_padded_model, Arch, Preset};
use deltafin_models::Model;
use deltafin_server::{Running, ServerConfig};
use deltafin_tokenizer::Tokenizer;
use serde_json::Value;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

pub const MODEL: &str = "k3-tiny";

pub fn model_dir() -> PathBuf {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        make_model(Arch::KimiK3, Preset::Tiny, 0, dir.path()).unwrap();
        dir
    })
    .path()
    .to_path_buf()
}

/// Rows of the padded checkpoints' embedding tables past the tokenizer's ranks and specials.
pub const PADDING_ROWS: usize = 256;

/// A tiny random checkpoint of `arch` with [`PADDING_ROWS`] padding rows (made once per test binary).
pub fn padded_model_dir(arch: Arch) -> PathBuf {
    static DIRS: [OnceLock<tempfile::TempDir>; 2] = [OnceLock::new(), OnceLock::new()];
    DIRS[(arch == Arch::KimiLinear) as usize]
        .get_or_init(|| {
            let dir = tempfile::tempdir().unwrap();
            make_padded_model(arch, Preset::Tiny, 0, PADDING_ROWS, dir.path()).unwrap();
            dir
        })
        .path()
        .to_path_buf()
}

pub fn config() -> ServerConfig {
    ServerConfig {
        model_name: MODEL.into(),
        ..ServerConfig::default()
    }
}

pub fn start(cfg: ServerConfig) -> Running {
    start_on(&model_dir(), cfg)
}

/// A server of the checkpoint in `dir`.
pub fn start_on(dir: &Path, cfg: ServerConfig) -> Running {
    let model = Arc::new(Model::load(dir).unwrap());
    let tokenizer = Arc::new(Tokenizer::from_dir(dir).unwrap());
    Running::start("127.0.0.1:0".parse().unwrap(), model, tokenizer, cfg).unwrap()
}

pub fn send(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let mut req = format!(
        "{method} {path} HTTP/1.0\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes()).unwrap();
    s.write_all(body.as_bytes()).unwrap();
    s
}

pub struct Resp {
    pub status: u16,
    pub head: String,
    pub body: String,
}

impl Resp {
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }
    pub fn header(&self, name: &str) -> Option<String> {
        self.head.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case(name).then(|| v.trim().to_string())
        })
    }
}

pub fn call_with(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Resp {
    let mut s = send(addr, method, path, headers, body);
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let raw = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = raw.split_once("\r\n\r\n").expect("an HTTP response");
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    Resp {
        status,
        head: head.to_string(),
        body: body.to_string(),
    }
}

pub fn get(addr: SocketAddr, path: &str) -> Resp {
    call_with(addr, "GET", path, &[], "")
}

pub fn post(addr: SocketAddr, path: &str, body: &Value) -> Resp {
    call_with(addr, "POST", path, &[], &body.to_string())
}

/// An SSE response read line by line as it arrives.
pub struct Stream {
    pub status: u16,
    reader: BufReader<TcpStream>,
}

impl Stream {
    pub fn open(addr: SocketAddr, path: &str, body: &Value) -> Stream {
        let s = send(addr, "POST", path, &[], &body.to_string());
        let mut reader = BufReader::new(s);
        let mut status_line = String::new();
        reader.read_line(&mut status_line).unwrap();
        let status = status_line.split(' ').nth(1).unwrap().parse().unwrap();
        loop {
            let mut line = String::new();
            reader.read_line(&mut line).unwrap();
            if line.trim_end().is_empty() {
                break;
            }
        }
        Stream { status, reader }
    }

    /// The next non-empty line (`data: …` or `: comment`), or `None` at the end of the stream.
    pub fn line(&mut self) -> Option<String> {
        loop {
            let mut line = String::new();
            if self.reader.read_line(&mut line).unwrap() == 0 {
                return None;
            }
            let line = line.trim_end().to_string();
            if !line.is_empty() {
                return Some(line);
            }
        }
    }

    /// The next `data:` payload, skipping comments.
    pub fn data(&mut self) -> Option<String> {
        loop {
            let line = self.line()?;
            if let Some(d) = line.strip_prefix("data: ") {
                return Some(d.to_string());
            }
        }
    }

    /// Every remaining data payload.
    pub fn rest(&mut self) -> Vec<String> {
        std::iter::from_fn(|| self.data()).collect()
    }

    /// Every remaining typed event (Anthropic's and the Responses API's streams) as (name, data); each
    /// `event:` line must come with its data, whose `type` is the event's name.
    pub fn events(&mut self) -> Vec<(String, Value)> {
        let mut events = Vec::new();
        let mut name = None;
        while let Some(line) = self.line() {
            if let Some(n) = line.strip_prefix("event: ") {
                name = Some(n.to_string());
            } else if let Some(d) = line.strip_prefix("data: ") {
                let data: Value = serde_json::from_str(d).unwrap();
                let n = name.take().expect("every data line follows its event line");
                assert_eq!(
                    data["type"],
                    n.as_str(),
                    "the event name is the data's type"
                );
                events.push((n, data));
            }
        }
        events
    }
}

/// The value of an unlabelled metric (or one with the given labels).
pub fn metric(addr: SocketAddr, name: &str) -> f64 {
    let body = get(addr, "/metrics").body;
    body.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no metric {name} in:\n{body}"))
}

/// Polls `cond` every 10 ms for up to `secs` seconds.
pub fn eventually(secs: u64, what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// `base` with `extra`'s fields set (replacing any of the same name).
pub fn merged(mut base: Value, extra: &Value) -> Value {
    for (k, v) in extra.as_object().unwrap() {
        base[k] = v.clone();
    }
    base
}

/// `body` with each field at each depth (objects and arrays, down to `depth`) replaced, one at a time, by
/// values of every JSON type: what a careless or hostile client sends.
pub fn mutations(body: &Value, depth: usize) -> Vec<Value> {
    let kinds = [
        Value::Null,
        serde_json::json!(true),
        serde_json::json!(-1),
        serde_json::json!(1.5e300),
        serde_json::json!("x"),
        serde_json::json!([]),
        serde_json::json!([{}]),
        serde_json::json!({}),
        serde_json::json!({"type": "text"}),
    ];
    let mut out = Vec::new();
    if depth == 0 {
        return out;
    }
    // (the child, where it sits: a field name or an index)
    let children: Vec<(Value, Result<String, usize>)> = match body {
        Value::Object(o) => o.iter().map(|(k, v)| (v.clone(), Ok(k.clone()))).collect(),
        Value::Array(a) => a.iter().cloned().zip((0..).map(Err)).collect(),
        _ => Vec::new(),
    };
    let set = |b: &mut Value, at: &Result<String, usize>, x: Value| match at {
        Ok(k) => b[k.as_str()] = x,
        Err(i) => b[*i] = x,
    };
    for (child, at) in children {
        for m in kinds.iter().cloned().chain(mutations(&child, depth - 1)) {
            let mut b = body.clone();
            set(&mut b, &at, m);
            out.push(b);
        }
    }
    out
}
