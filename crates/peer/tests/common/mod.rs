//! What the peer crate's end-to-end tests share: a real master on loopback, and communicators'
//! settings for it. Each test file uses what it needs.
#![allow(dead_code)]

use shoal_master::{MasterOptions, MasterServer};
use shoal_peer::{Communicator, CommunicatorConfig};
use shoal_transport::TlsFiles;
use std::time::Duration;

/// A master on an ephemeral loopback port, declaring a peer dead after `heartbeat_timeout`.
pub fn master_with(heartbeat_timeout: Duration, tls: Option<TlsFiles>) -> MasterServer {
    let options = MasterOptions {
        listen: "127.0.0.1:0".into(),
        heartbeat_timeout: Some(heartbeat_timeout),
        secret: None,
        http: None,
        state_dir: None,
        tls,
    };
    MasterServer::start(options).unwrap()
}

/// A master on an ephemeral loopback port, with a 5 s heartbeat timeout and no TLS.
pub fn master() -> MasterServer {
    master_with(Duration::from_secs(5), None)
}

/// A communicator's settings for `master`: listening on loopback, calls bound to 20 s.
pub fn config(master: &MasterServer) -> CommunicatorConfig {
    let mut c = CommunicatorConfig::from_env(&master.local_addr().to_string()).unwrap();
    c.listen_addr = "127.0.0.1:0".into();
    c.timeout = Duration::from_secs(20);
    c
}

/// `v`'s bytes, as a buffer of f32 elements.
pub fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Peer `index` of `world` joins with `config`, `index` × 100 ms after the first (so that they
/// join in order), and admits the later ones until all are in.
pub fn join(config: CommunicatorConfig, index: usize, world: usize) -> Communicator {
    std::thread::sleep(Duration::from_millis(100 * index as u64));
    let comm = Communicator::new(config).unwrap();
    comm.connect(None).unwrap();
    while comm.group_world_size() != Some(world) {
        if comm.peers_pending().unwrap() {
            comm.update_topology().unwrap();
        }
    }
    comm
}
