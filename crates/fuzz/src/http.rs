//! HTTP responses as a range client meets them: a loopback server answers each request with the fuzz input,
//! verbatim, and closes; the first input byte picks the request (a range GET, a HEAD, a whole GET).

use deltafin_remote::{HttpOptions, Source};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

/// The server's address and where to send the next answer.
struct Server {
    url: String,
    answers: Mutex<Sender<Vec<u8>>>,
}

fn server() -> &'static Server {
    static SERVER: OnceLock<Server> = OnceLock::new();
    SERVER.get_or_init(|| {
        let listener = TcpListener::bind("127.0.0.1:0").expect("binding a loopback port");
        let url = format!("http://{}/repo", listener.local_addr().unwrap());
        let (tx, rx) = channel::<Vec<u8>>();
        std::thread::spawn(move || {
            for answer in rx {
                let Ok((conn, _)) = listener.accept() else {
                    continue;
                };
                answer_once(conn, &answer);
            }
        });
        Server {
            url,
            answers: Mutex::new(tx),
        }
    })
}

/// Reads the request head, writes `answer`, closes.
fn answer_once(mut conn: TcpStream, answer: &[u8]) {
    let _ = conn.set_read_timeout(Some(Duration::from_secs(2)));
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        match conn.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => head.extend_from_slice(&buf[..n]),
        }
    }
    let _ = conn.write_all(answer);
}

pub fn response(data: &[u8]) {
    let Some((&op, answer)) = data.split_first() else {
        return;
    };
    // A redirect would send the client elsewhere (only this machine's loopback server may be asked); see
    // `has_colonless_header` for the other answers left out.
    if answer
        .to_ascii_lowercase()
        .windows(8)
        .any(|w| w == b"location")
        || has_colonless_header(answer)
    {
        return;
    }
    let s = server();
    let opts = HttpOptions {
        retries: 0,
        backoff: Duration::from_millis(1),
        timeout: Duration::from_secs(2),
        connections: 1,
    };
    let source = Source::new(&s.url, opts).expect("a loopback URL");
    s.answers.lock().unwrap().send(answer.to_vec()).unwrap();
    match op % 3 {
        0 => {
            if let Ok(body) = source.range("model.safetensors", 8, 16, 64, &|_| Ok(())) {
                assert_eq!(
                    body.len(),
                    16,
                    "a range answer of the wrong length was accepted"
                );
            }
        }
        1 => {
            let _ = source.head("model.safetensors");
        }
        _ => {
            let _ = source.get("config.json");
        }
    }
}

/// ureq 2 panics on a header line without a colon; deltafin catches that panic (`remote::http`, with its
/// regression test), but libFuzzer aborts on any panic, caught or not, so such answers are left out here.
fn has_colonless_header(answer: &[u8]) -> bool {
    answer
        .split(|&b| b == b'\n')
        .skip(1)
        .map(|l| l.strip_suffix(b"\r").unwrap_or(l))
        .take_while(|l| !l.is_empty())
        .any(|l| !l.contains(&b':'))
}
