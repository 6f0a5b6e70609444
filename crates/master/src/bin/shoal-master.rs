//! `shoal-master --listen HOST:PORT [--http HOST:PORT] [--state-dir DIR] [--tls-cert PEM --tls-key PEM
//! --tls-ca PEM]`: runs a master in the foreground until killed.
//! The Python package's `shoal master` does the same; this binary needs no Python.

use shoal_master::{MasterOptions, MasterServer};
use std::time::Duration;

fn main() {
    let mut args = std::env::args().skip(1);
    let mut listen = "0.0.0.0:48148".to_string();
    let mut heartbeat: Option<f64> = None;
    let mut secret_file: Option<String> = None;
    let mut http: Option<String> = None;
    let mut state_dir: Option<std::path::PathBuf> = None;
    let mut tls: [Option<std::path::PathBuf>; 3] = [None, None, None];
    while let Some(a) = args.next() {
        match (a.as_str(), args.next()) {
            ("--listen", Some(v)) => listen = v,
            ("--heartbeat-timeout", Some(v)) => heartbeat = Some(v.parse().unwrap_or_else(|_| usage(&a))),
            ("--secret-file", Some(v)) => secret_file = Some(v),
            ("--http", Some(v)) => http = Some(v),
            ("--state-dir", Some(v)) => state_dir = Some(v.into()),
            ("--tls-cert", Some(v)) => tls[0] = Some(v.into()),
            ("--tls-key", Some(v)) => tls[1] = Some(v.into()),
            ("--tls-ca", Some(v)) => tls[2] = Some(v.into()),
            _ => usage(&a),
        }
    }
    let mut options = MasterOptions::from_env(&listen).unwrap_or_else(|e| fail(&e.to_string()));
    if let Some(s) = heartbeat {
        if !(s.is_finite() && s > 0.0) {
            usage("--heartbeat-timeout");
        }
        options.heartbeat_timeout = Some(Duration::from_secs_f64(s));
    }
    if let Some(path) = secret_file {
        let secret = std::fs::read(&path).unwrap_or_else(|e| fail(&format!("cannot read the secret file {path}: {e}")));
        // A trailing newline is an editor's, not the secret's.
        options.secret = Some(secret.strip_suffix(b"\n").unwrap_or(&secret).to_vec());
    }
    if http.is_some() {
        options.http = http;
    }
    options.state_dir = state_dir;
    if tls.iter().any(Option::is_some) {
        let [cert, key, ca] = tls;
        options.tls = shoal_transport::TlsFiles::from_parts(cert, key, ca).unwrap_or_else(|e| fail(&e.to_string()));
    }
    let server = MasterServer::start(options).unwrap_or_else(|e| fail(&format!("cannot listen on {listen}: {e}")));
    println!("shoal master listening on {}", server.local_addr());
    if let Some(a) = server.http_addr() {
        println!("status page on http://{a}/ (metrics: /metrics, JSON: /status)");
    }
    loop {
        std::thread::park();
    }
}

fn usage(at: &str) -> ! {
    fail(&format!("bad argument {at}\nusage: shoal-master [--listen HOST:PORT] [--heartbeat-timeout SECONDS] [--secret-file PATH] [--http HOST:PORT] [--state-dir DIR] [--tls-cert PEM --tls-key PEM --tls-ca PEM]"))
}

fn fail(message: &str) -> ! {
    eprintln!("shoal-master: {message}");
    std::process::exit(2)
}
