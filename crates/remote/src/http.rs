//! The HTTP side: whole-file GETs for the small files, and range GETs held to the letter — a 206 with exactly
//! the Content-Range asked for and exactly that many body bytes, or the attempt failed. Transient failures
//! (timeouts, resets, 5xx, 429) and lies (wrong range, wrong length, cut-off or corrupted bodies) are retried
//! with exponential backoff; what each failed attempt saw is reported.

use anyhow::{bail, Result};
use std::io::Read;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

#[derive(Clone, Debug)]
pub struct HttpOptions {
    /// Attempts per request after the first.
    pub retries: u32,
    /// Wait before the first retry; doubles each time, up to 16 times this.
    pub backoff: Duration,
    /// Connect and per-read timeout.
    pub timeout: Duration,
    /// Requests in flight at once.
    pub connections: usize,
}

impl Default for HttpOptions {
    fn default() -> Self {
        HttpOptions {
            retries: 5,
            backoff: Duration::from_millis(250),
            timeout: Duration::from_secs(30),
            connections: 8,
        }
    }
}

/// What the remote source did, for the stats line.
#[derive(Default, Debug)]
pub struct HttpCounters {
    pub requests: AtomicU64,
    pub bytes: AtomicU64,
    pub retries: AtomicU64,
    /// Responses that broke the protocol or carried wrong bytes.
    pub bad_responses: AtomicU64,
}

/// What the server says about a whole file.
#[derive(Clone, Debug)]
pub struct FileInfo {
    pub size: u64,
    /// SHA-256 the server states (Hugging Face's `X-Linked-Etag` for LFS files, or a SHA-256 ETag).
    pub sha256: Option<String>,
    /// A strong ETag of the file itself (not of a redirect), sent back as `If-Match` with every range request
    /// so a file that changes on the server is caught instead of mixed.
    pub etag: Option<String>,
    /// The commit a Hugging Face repository served the file from (`X-Repo-Commit`).
    pub commit: Option<String>,
}

/// One failed attempt.
enum Failure {
    /// Worth another attempt.
    Retry(String),
    /// Another attempt cannot help (404, ranges unsupported, …).
    Fatal(String),
}

/// An agent builder with the platform's TLS: rustls everywhere but macOS, where its `ring` crypto would
/// need Apple's SDK to compile its C code; there the system's own TLS (Security.framework, through
/// native-tls) serves instead, with the system's certificate store.
fn agent_builder() -> Result<ureq::AgentBuilder> {
    let builder = ureq::AgentBuilder::new();
    #[cfg(target_os = "macos")]
    let builder = builder.tls_connector(std::sync::Arc::new(
        ureq::native_tls::TlsConnector::new()
            .map_err(|e| anyhow::anyhow!("setting up the system TLS (Security.framework): {e}"))?,
    ));
    Ok(builder)
}

/// A remote repository: `{base}/{file name}`.
#[derive(Debug)]
pub struct Source {
    base: String,
    /// `If-Match` values per file name.
    etags: std::collections::HashMap<String, String>,
    agent: ureq::Agent,
    /// For HEAD: Hugging Face states an LFS file's SHA-256 on the redirect, not on the CDN's answer.
    head_agent: ureq::Agent,
    token: Option<String>,
    pub opts: HttpOptions,
    pub counters: HttpCounters,
}

impl Source {
    /// `url`: the repository's base URL. `https://huggingface.co/ORG/NAME` is read as
    /// `…/ORG/NAME/resolve/main`. `HF_TOKEN` in the environment is sent as a bearer token.
    pub fn new(url: &str, opts: HttpOptions) -> Result<Source> {
        if !(url.starts_with("http://") || url.starts_with("https://")) {
            bail!("--remote/--from {url:?} is not an http:// or https:// URL");
        }
        let mut base = url.trim_end_matches('/').to_string();
        if let Some(path) = base.strip_prefix("https://huggingface.co/") {
            if path.split('/').count() == 2 {
                base.push_str("/resolve/main");
            }
        }
        let build = |redirects| -> Result<ureq::Agent> {
            Ok(agent_builder()?
                .timeout_connect(opts.timeout)
                .timeout_read(opts.timeout)
                .redirects(redirects)
                .max_idle_connections_per_host(opts.connections.max(1))
                .user_agent(concat!("deltafin/", env!("CARGO_PKG_VERSION")))
                .build())
        };
        Ok(Source {
            base,
            etags: Default::default(),
            agent: build(8)?,
            head_agent: build(0)?,
            token: std::env::var("HF_TOKEN").ok().filter(|t| !t.is_empty()),
            opts,
            counters: HttpCounters::default(),
        })
    }

    pub fn base(&self) -> &str {
        &self.base
    }

    pub fn url(&self, name: &str) -> String {
        format!("{}/{name}", self.base)
    }

    /// Reads every later file at `commit` when the URL names a Hugging Face revision (`…/resolve/REV`), so a
    /// repository that moves on while the mirror fills cannot mix two versions.
    pub fn pin(&mut self, commit: &str) {
        if let Some(at) = self.base.rfind("/resolve/") {
            self.base = format!("{}/resolve/{commit}", &self.base[..at]);
        }
    }

    /// Requires each named file to still have this ETag (`If-Match`) in every range request.
    pub fn require_etags(&mut self, etags: impl IntoIterator<Item = (String, String)>) {
        self.etags.extend(etags);
    }

    fn request(&self, agent: &ureq::Agent, method: &str, name: &str) -> ureq::Request {
        let r = agent.request(method, &self.url(name));
        match &self.token {
            Some(t) => r.set("Authorization", &format!("Bearer {t}")),
            None => r,
        }
    }

    /// Runs `attempt` until it succeeds, retrying what is worth retrying with exponential backoff.
    fn with_retries<T>(
        &self,
        what: &str,
        mut attempt: impl FnMut() -> Result<T, Failure>,
    ) -> Result<T> {
        let mut wait = self.opts.backoff;
        for n in 0..=self.opts.retries {
            self.counters.requests.fetch_add(1, Ordering::Relaxed);
            match attempt() {
                Ok(v) => return Ok(v),
                Err(Failure::Fatal(msg)) => bail!("{what}: {msg}"),
                Err(Failure::Retry(msg)) if n == self.opts.retries => bail!(
                    "{what}: {msg} (gave up after {} attempts)",
                    self.opts.retries + 1
                ),
                Err(Failure::Retry(msg)) => {
                    eprintln!("warning: {what}: {msg}; retrying in {wait:?}");
                    self.counters.retries.fetch_add(1, Ordering::Relaxed);
                    std::thread::sleep(wait);
                    wait = (wait * 2).min(self.opts.backoff * 16);
                }
            }
        }
        unreachable!("the loop returns on its last attempt")
    }

    /// Runs `f`, which reads a response through ureq. ureq 2 panics on a header line without a colon (its
    /// `Header::value` slices past the line's end), in `call` as in `header`: from a server that sends one,
    /// that is a broken response like any other, never the end of the process.
    fn unpanic<T>(&self, f: impl FnOnce() -> T) -> Result<T, Failure> {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))
            .map_err(|_| self.lie("the response has a malformed header line (no colon)".into()))
    }

    /// Sends a request under [`Self::unpanic`].
    fn call(
        &self,
        req: impl FnOnce() -> ureq::Request,
    ) -> Result<Result<ureq::Response, ureq::Error>, Failure> {
        // Boxed inside the closure only: ureq's error is large.
        Ok(self
            .unpanic(|| req().call().map_err(Box::new))?
            .map_err(|e| *e))
    }

    fn lie(&self, msg: String) -> Failure {
        self.counters.bad_responses.fetch_add(1, Ordering::Relaxed);
        Failure::Retry(msg)
    }

    /// A whole small file, or `None` when the server has no such file (404).
    pub fn get(&self, name: &str) -> Result<Option<Vec<u8>>> {
        let what = format!("GET {}", self.url(name));
        self.with_retries(&what, || {
            let resp = match self.call(|| self.request(&self.agent, "GET", name))? {
                Ok(r) => r,
                Err(ureq::Error::Status(404, _)) => return Ok(None),
                Err(e) => return Err(classify(e)),
            };
            let want = self
                .unpanic(|| resp.header("Content-Length"))?
                .and_then(|v| v.trim().parse::<u64>().ok());
            let mut body = Vec::new();
            if let Err(e) = resp.into_reader().read_to_end(&mut body) {
                return Err(self.lie(format!(
                    "the body broke off after {} bytes: {e}",
                    body.len()
                )));
            }
            if want.is_some_and(|w| w != body.len() as u64) {
                return Err(self.lie(format!(
                    "Content-Length said {} bytes but the body had {}",
                    want.unwrap_or(0),
                    body.len()
                )));
            }
            self.counters
                .bytes
                .fetch_add(body.len() as u64, Ordering::Relaxed);
            Ok(Some(body))
        })
    }

    /// Size and stated SHA-256 of a file, from a HEAD that does not follow redirects.
    pub fn head(&self, name: &str) -> Result<FileInfo> {
        let what = format!("HEAD {}", self.url(name));
        self.with_retries(&what, || {
            let resp = match self.call(|| self.request(&self.head_agent, "HEAD", name))? {
                Ok(r) => r,
                Err(ureq::Error::Status(404, _)) => {
                    return Err(Failure::Fatal(
                        "the server has no such file (404), though the model's index lists it"
                            .into(),
                    ))
                }
                Err(e) => return Err(classify(e)),
            };
            let redirected = (300..400).contains(&resp.status());
            let header = |h| self.unpanic(|| resp.header(h));
            let size = if redirected {
                header("X-Linked-Size")?
            } else {
                header("Content-Length")?
            };
            let Some(size) = size.and_then(|v| v.trim().parse::<u64>().ok()) else {
                return Err(Failure::Fatal(format!(
                    "answered {} without the file's size ({})",
                    resp.status(),
                    if redirected {
                        "X-Linked-Size"
                    } else {
                        "Content-Length"
                    }
                )));
            };
            let etag = header("ETag")?;
            let sha256 = header("X-Linked-Etag")?.or(etag).and_then(sha256_etag);
            // A redirect's ETag describes the redirect; a weak one cannot be matched byte for byte.
            let etag = etag
                .filter(|e| !redirected && !e.trim().starts_with("W/"))
                .map(|e| e.trim().to_string());
            let commit = header("X-Repo-Commit")?.map(|c| c.trim().to_string());
            Ok(FileInfo {
                size,
                sha256,
                etag,
                commit,
            })
        })
    }

    /// Bytes `[offset, offset + len)` of `name`, a file of `total` bytes; `check` may reject the bytes (a
    /// checksum mismatch), which counts as a bad response and is retried like one.
    pub fn range(
        &self,
        name: &str,
        offset: u64,
        len: u64,
        total: u64,
        check: &dyn Fn(&[u8]) -> std::result::Result<(), String>,
    ) -> Result<Vec<u8>> {
        let end = offset + len - 1;
        let what = format!("GET {} bytes {offset}-{end}", self.url(name));
        let want_range = format!("bytes {offset}-{end}/{total}");
        self.with_retries(&what, || {
            let mut req = self
                .request(&self.agent, "GET", name)
                .set("Range", &format!("bytes={offset}-{end}"));
            if let Some(tag) = self.etags.get(name) {
                req = req.set("If-Match", tag);
            }
            let resp = match self.call(|| req)? {
                Ok(r) => r,
                Err(ureq::Error::Status(412, _)) => {
                    return Err(Failure::Fatal(format!(
                        "the file changed on the server since this mirror was started (it no longer has ETag {}); start a new mirror in an empty directory",
                        self.etags.get(name).map_or("?", |t| t.as_str())
                    )))
                }
                Err(ureq::Error::Status(416, _)) => {
                    return Err(Failure::Fatal(format!(
                        "416 Range Not Satisfiable: the file on the server is not the {total} bytes its header promised"
                    )))
                }
                Err(e) => return Err(classify(e)),
            };
            if resp.status() == 200 {
                return Err(Failure::Fatal(
                    "the server ignored the Range header (200 with the whole file); deltafin needs HTTP range requests"
                        .into(),
                ));
            }
            if resp.status() != 206 {
                return Err(self.lie(format!("answered {} instead of 206", resp.status())));
            }
            let got_range = self
                .unpanic(|| resp.header("Content-Range"))?
                .unwrap_or("")
                .trim()
                .to_string();
            if got_range != want_range {
                return Err(self.lie(format!(
                    "Content-Range is {got_range:?}, expected {want_range:?}"
                )));
            }
            let clen = self
                .unpanic(|| resp.header("Content-Length"))?
                .and_then(|v| v.trim().parse::<u64>().ok());
            if clen.is_some_and(|c| c != len) {
                return Err(self.lie(format!(
                    "Content-Length is {}, expected {len}",
                    clen.unwrap_or(0)
                )));
            }
            let mut body = Vec::with_capacity(len as usize);
            let read = resp.into_reader().take(len + 1).read_to_end(&mut body);
            self.counters
                .bytes
                .fetch_add(body.len() as u64, Ordering::Relaxed);
            if let Err(e) = read {
                return Err(self.lie(format!(
                    "the body broke off after {} of {len} bytes: {e}",
                    body.len()
                )));
            }
            if body.len() as u64 != len {
                return Err(self.lie(format!(
                    "the body had {} bytes, expected {len}",
                    body.len()
                )));
            }
            check(&body).map_err(|m| self.lie(m))?;
            Ok(body)
        })
    }
}

fn classify(e: ureq::Error) -> Failure {
    match e {
        ureq::Error::Status(code, _) if code >= 500 || code == 429 || code == 408 => {
            Failure::Retry(format!("server error {code}"))
        }
        ureq::Error::Status(code, r) => Failure::Fatal(format!(
            "HTTP {code} {}{}",
            r.status_text(),
            if code == 401 || code == 403 {
                " (a gated or private repository needs HF_TOKEN in the environment)"
            } else {
                ""
            }
        )),
        ureq::Error::Transport(t) => Failure::Retry(format!("transport error: {t}")),
    }
}

/// A SHA-256 stated as an ETag: 64 hex digits, possibly quoted or weak.
fn sha256_etag(v: &str) -> Option<String> {
    let t = v.trim().trim_start_matches("W/").trim_matches('"');
    (t.len() == 64 && t.bytes().all(|b| b.is_ascii_hexdigit())).then(|| t.to_ascii_lowercase())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Found by fuzzing: ureq 2 panics on a header line without a colon, inside `call` (for the headers it
    /// reads itself) and in `header`; each request must turn that into an error instead.
    #[test]
    fn a_header_line_without_a_colon_is_an_error_not_a_panic() {
        use std::io::Write;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}/repo", listener.local_addr().unwrap());
        let answers = [
            "HTTP/1.1 206 Partial Content\r\nContent-Length\r\n\r\n",
            "HTTP/1.1 206 Partial Content\r\nContent-Length\r\n\r\n",
            "HTTP/1.1 206 Partial Content\r\nContent-Length\r\n\r\n",
            "HTTP/1.1 200 OK\r\nContent-Length: 0\r\nETag\r\n\r\n",
        ];
        let server = std::thread::spawn(move || {
            for answer in answers {
                let (mut conn, _) = listener.accept().unwrap();
                let mut head = Vec::new();
                let mut buf = [0u8; 1024];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    let n = conn.read(&mut buf).unwrap();
                    head.extend_from_slice(&buf[..n]);
                }
                conn.write_all(answer.as_bytes()).unwrap();
            }
        });
        let opts = HttpOptions {
            retries: 0,
            ..HttpOptions::default()
        };
        let s = Source::new(&url, opts).unwrap();
        let errors = [
            s.head("f").unwrap_err(),
            s.get("f").unwrap_err(),
            s.range("f", 0, 4, 8, &|_| Ok(())).unwrap_err(),
            s.head("f").unwrap_err(),
        ];
        for e in errors {
            let e = format!("{e:#}");
            assert!(e.contains("malformed header line"), "{e}");
        }
        server.join().unwrap();
        assert_eq!(s.counters.bad_responses.load(Ordering::Relaxed), 4);
    }

    #[test]
    fn etags_count_as_sha256_only_when_they_are_one() {
        let h = "a".repeat(64);
        assert_eq!(sha256_etag(&format!("\"{h}\"")), Some(h.clone()));
        assert_eq!(sha256_etag(&format!("W/\"{}\"", h.to_uppercase())), Some(h));
        assert_eq!(sha256_etag("\"5d41402abc4b2a76b9719d911017c592\""), None);
        assert_eq!(sha256_etag(&"g".repeat(64)), None);
    }

    #[test]
    fn a_hugging_face_revision_is_pinned_to_a_commit() {
        let mut s = Source::new("https://huggingface.co/org/name", HttpOptions::default()).unwrap();
        s.pin("0123abcd");
        assert_eq!(
            s.url("config.json"),
            "https://huggingface.co/org/name/resolve/0123abcd/config.json"
        );
        let mut s = Source::new("http://mirror.lan/k3", HttpOptions::default()).unwrap();
        s.pin("0123abcd");
        assert_eq!(s.url("config.json"), "http://mirror.lan/k3/config.json");
    }

    #[test]
    fn hugging_face_repository_urls_resolve_main() {
        let s = Source::new("https://huggingface.co/org/name", HttpOptions::default()).unwrap();
        assert_eq!(
            s.url("config.json"),
            "https://huggingface.co/org/name/resolve/main/config.json"
        );
        let s = Source::new("http://10.0.0.2:8000/k3/", HttpOptions::default()).unwrap();
        assert_eq!(s.url("config.json"), "http://10.0.0.2:8000/k3/config.json");
        assert!(Source::new("ftp://x/y", HttpOptions::default()).is_err());
    }
}
