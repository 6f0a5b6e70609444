//! `examples/c/allreduce.c`, compiled against the static library, run as 4 peer processes of a
//! real master.

use shoal_master::{MasterOptions, MasterServer};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

/// The directory cargo put this build's `libshoal.a` in.
fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().and_then(|deps| deps.parent()).expect("target/PROFILE/deps/TEST").to_path_buf()
}

#[test]
fn four_peers_in_c_all_reduce_gather_and_broadcast() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    // `cargo test` builds the library as Rust needs it, not the C archive: build that, with
    // this build's profile, so that it shares what is compiled already.
    let built = Command::new(env!("CARGO"))
        .args(["build", "--quiet", "--profile", "test", "-p", "shoal-ffi", "--lib"])
        .current_dir(&root)
        .status()
        .expect("cargo");
    assert!(built.success(), "building libshoal.a failed");
    let lib = target_dir().join("libshoal.a");
    assert!(lib.exists(), "{} was not built", lib.display());
    let exe = target_dir().join("shoal-c-allreduce");
    let compiled = Command::new("cc")
        .arg(root.join("../../examples/c/allreduce.c"))
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-I"])
        .arg(root.join("include"))
        .arg(&lib)
        .args(["-lpthread", "-ldl", "-lm", "-o"])
        .arg(&exe)
        .output()
        .expect("a C compiler (cc)");
    assert!(compiled.status.success(), "{}", String::from_utf8_lossy(&compiled.stderr));

    let options = MasterOptions {
        listen: "127.0.0.1:0".into(),
        heartbeat_timeout: Some(Duration::from_secs(5)),
        secret: None,
        http: None,
        state_dir: None,
        tls: None,
    };
    let master = MasterServer::start(options).unwrap();
    let peers = 4;
    let children: Vec<_> = (0..peers)
        .map(|_| {
            let child = Command::new(&exe)
                .args([master.local_addr().to_string(), peers.to_string()])
                .env("SHOAL_TIMEOUT", "60")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap();
            std::thread::sleep(Duration::from_millis(100));
            child
        })
        .collect();
    let mut ranks = Vec::new();
    for child in children {
        let out = child.wait_with_output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
        ranks.push(stdout.trim().strip_prefix("ok ").expect("ok RANK").parse::<usize>().unwrap());
    }
    ranks.sort_unstable();
    assert_eq!(ranks, (0..peers).collect::<Vec<_>>());
}
