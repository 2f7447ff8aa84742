//! Tests only: serves a directory over HTTP/1.1 on loopback with range requests, like a Hugging Face
//! repository (HEAD states a safetensors file's SHA-256 in `X-Linked-Etag`), and injects faults on request:
//! errors, resets, hangs, and every way a server can lie about a range.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

#[derive(Clone, Debug, PartialEq)]
pub enum Fault {
    /// Answer with this status and no body.
    Status(u16),
    /// Close the connection without answering.
    Reset,
    /// Say nothing for this long, then close.
    Hang(Duration),
    /// Correct headers, then half the body, then close.
    Truncate,
    /// A Content-Length one byte short, and that many bytes.
    WrongLength,
    /// A Content-Range one byte off, with the bytes it names.
    WrongRange,
    /// The right headers with one byte of the body flipped.
    Corrupt,
    /// 200 with the whole file, as a server without range support does.
    IgnoreRange,
}

/// Lets the first `skip` range requests whose path contains `path` through, then applies `fault` to the next
/// `times` of them (`usize::MAX`: all).
#[derive(Clone, Debug)]
struct Rule {
    path: String,
    fault: Fault,
    skip: usize,
    times: usize,
}

/// One request the server saw.
#[derive(Clone, Debug, PartialEq)]
pub struct Seen {
    pub method: String,
    pub path: String,
    pub range: Option<(u64, u64)>,
    /// A fault was injected into the answer.
    pub faulted: bool,
}

#[derive(Default)]
struct State {
    rules: Vec<Rule>,
    seen: Vec<Seen>,
}

pub struct Server {
    url: String,
    state: Arc<Mutex<State>>,
}

impl Server {
    /// Serves `root` on 127.0.0.1 (an ephemeral port) until the process ends.
    pub fn start(root: &Path) -> Server {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind loopback");
        let url = format!("http://{}", listener.local_addr().unwrap());
        let state = Arc::new(Mutex::new(State::default()));
        let (root, st) = (root.to_path_buf(), state.clone());
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let (root, st) = (root.clone(), st.clone());
                std::thread::spawn(move || {
                    let _ = handle(conn, &root, &st);
                });
            }
        });
        Server { url, state }
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    pub fn inject(&self, path: &str, fault: Fault, times: usize) {
        self.inject_after(path, fault, 0, times);
    }

    pub fn inject_after(&self, path: &str, fault: Fault, skip: usize, times: usize) {
        self.state.lock().unwrap().rules.push(Rule {
            path: path.into(),
            fault,
            skip,
            times,
        });
    }

    pub fn clear_faults(&self) {
        self.state.lock().unwrap().rules.clear();
    }

    /// Requests seen since the last call (and forgets them).
    pub fn take_seen(&self) -> Vec<Seen> {
        std::mem::take(&mut self.state.lock().unwrap().seen)
    }
}

fn handle(mut conn: TcpStream, root: &Path, st: &Mutex<State>) -> std::io::Result<()> {
    let mut reader = BufReader::new(conn.try_clone()?);
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let mut parts = line.split_whitespace();
    let (method, target) = (
        parts.next().unwrap_or("").to_string(),
        parts.next().unwrap_or("/").to_string(),
    );
    let (mut range, mut if_match) = (None, None);
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h)? == 0 || h == "\r\n" || h == "\n" {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            if k.eq_ignore_ascii_case("range") {
                range = parse_range(v.trim());
            } else if k.eq_ignore_ascii_case("if-match") {
                if_match = Some(v.trim().to_string());
            }
        }
    }
    let rel = target.trim_start_matches('/').to_string();
    let fault = {
        let mut s = st.lock().unwrap();
        let rule = s
            .rules
            .iter_mut()
            .find(|r| r.times > 0 && range.is_some() && method == "GET" && rel.contains(&r.path));
        let fault = rule.and_then(|r| {
            if r.skip > 0 {
                r.skip -= 1;
                return None;
            }
            r.times = r.times.saturating_sub(1);
            Some(r.fault.clone())
        });
        s.seen.push(Seen {
            method: method.clone(),
            path: rel.clone(),
            range,
            faulted: fault.is_some(),
        });
        fault
    };
    let path: PathBuf = root.join(&rel);
    let data = if rel.split('/').any(|c| c == ".." || c.is_empty()) {
        None
    } else {
        std::fs::read(&path).ok()
    };
    let Some(data) = data else {
        return respond(&mut conn, "404 Not Found", &[], b"", method == "HEAD");
    };
    let total = data.len() as u64;
    // Content-derived, so a file rewritten between requests gets a new one.
    let etag = format!(
        "\"{total}-{}\"",
        deltafin_formats::checksums::xxh3_hex(&data)
    );
    if if_match.is_some_and(|m| m != etag) {
        return respond(&mut conn, "412 Precondition Failed", &[], b"", false);
    }
    if method == "HEAD" {
        let mut headers = vec![
            ("Content-Length".into(), total.to_string()),
            ("ETag".into(), etag),
        ];
        if rel.ends_with(".safetensors") {
            let sum = deltafin_formats::checksums::sha256_hex(&data);
            headers.push(("X-Linked-Etag".into(), format!("\"{sum}\"")));
        }
        return respond(&mut conn, "200 OK", &headers, &data, true);
    }
    let Some((a, b)) = range else {
        return respond(&mut conn, "200 OK", &[], &data, false);
    };
    if a > b || b >= total {
        return respond(
            &mut conn,
            "416 Range Not Satisfiable",
            &[("Content-Range".into(), format!("bytes */{total}"))],
            b"",
            false,
        );
    }
    let mut body = data[a as usize..=b as usize].to_vec();
    let mut content_range = format!("bytes {a}-{b}/{total}");
    match fault {
        None => {}
        Some(Fault::Status(code)) => {
            return respond(&mut conn, &format!("{code} Injected"), &[], b"", false)
        }
        Some(Fault::Reset) => return Ok(()),
        Some(Fault::Hang(d)) => {
            std::thread::sleep(d);
            return Ok(());
        }
        Some(Fault::Truncate) => {
            let head = format!(
                "HTTP/1.1 206 Partial Content\r\nContent-Range: {content_range}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                body.len()
            );
            conn.write_all(head.as_bytes())?;
            conn.write_all(&body[..body.len() / 2])?;
            return conn.flush();
        }
        Some(Fault::WrongLength) => {
            body.pop();
        }
        Some(Fault::WrongRange) => {
            let (a, b) = (a + 1, (b + 1).min(total - 1));
            body = data[a as usize..=b as usize].to_vec();
            content_range = format!("bytes {a}-{b}/{total}");
        }
        Some(Fault::Corrupt) => {
            let mid = body.len() / 2;
            body[mid] ^= 0x5a;
        }
        Some(Fault::IgnoreRange) => return respond(&mut conn, "200 OK", &[], &data, false),
    }
    respond(
        &mut conn,
        "206 Partial Content",
        &[("Content-Range".into(), content_range)],
        &body,
        false,
    )
}

fn parse_range(v: &str) -> Option<(u64, u64)> {
    let (a, b) = v.strip_prefix("bytes=")?.split_once('-')?;
    Some((a.trim().parse().ok()?, b.trim().parse().ok()?))
}

fn respond(
    conn: &mut TcpStream,
    status: &str,
    headers: &[(String, String)],
    body: &[u8],
    head_only: bool,
) -> std::io::Result<()> {
    let mut out = format!("HTTP/1.1 {status}\r\nConnection: close\r\n");
    if !headers.iter().any(|(k, _)| k == "Content-Length") {
        out += &format!("Content-Length: {}\r\n", body.len());
    }
    for (k, v) in headers {
        out += &format!("{k}: {v}\r\n");
    }
    out += "\r\n";
    conn.write_all(out.as_bytes())?;
    if !head_only {
        conn.write_all(body)?;
    }
    conn.flush()?;
    // Let the client read everything before the socket closes.
    let _ = conn.shutdown(std::net::Shutdown::Write);
    let mut sink = [0u8; 64];
    let _ = conn.set_read_timeout(Some(Duration::from_millis(200)));
    let _ = conn.read(&mut sink);
    Ok(())
}
