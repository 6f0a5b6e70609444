//! The master's state directory (`--state-dir`): what a restarted master needs
//! ([`shoal_proto::master::Durable`]) in `run.json`, rewritten whenever it changes. A write goes
//! to a temporary file that is synced and then renamed over the old one, so a master killed at
//! any instant leaves either the old state or the new one, never a torn file. The file holds the
//! run's data key: it is created readable by its owner only.
//!
//! Another user on the host must neither read that key nor plant a run: the directory and the
//! file must be the master's own, reached through no symbolic link and writable by nobody else,
//! or the master refuses to start, saying which and why; the temporary file is created anew
//! and never followed through a link.

use serde_json::{json, Value};
use shoal_proto::master::{Durable, DurableGroup, DurablePeer, DurableRing};
use shoal_wire::{Epoch, GroupId, PeerId, SessionId};
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// The state file's format version: 2 keeps a ring per group, 3 each peer's reach and whether it
/// catches up.
const VERSION: u64 = 3;
const FILE: &str = "run.json";

/// A state directory.
#[derive(Debug, Clone)]
pub(crate) struct StateDir {
    dir: PathBuf,
}

impl StateDir {
    /// Opens `dir`, creating it (owner only) if it does not exist.
    ///
    /// # Errors
    /// If it cannot be created, or is not private ([`check_private`]).
    pub fn open(dir: &Path) -> io::Result<StateDir> {
        fs::DirBuilder::new().recursive(true).mode(0o700).create(dir)?;
        check_private(dir, true)?;
        Ok(StateDir { dir: dir.to_path_buf() })
    }

    /// The run kept here, if one is.
    ///
    /// # Errors
    /// If the file cannot be read or does not hold a run: the master must not silently start a
    /// new run over one it cannot read.
    pub fn load(&self) -> io::Result<Option<Durable>> {
        let path = self.dir.join(FILE);
        match check_private(&path, false) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            checked => checked?,
        }
        let mut text = String::new();
        io::Read::read_to_string(
            &mut OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW).open(&path)?,
            &mut text,
        )?;
        let bad = |why: String| io::Error::new(io::ErrorKind::InvalidData, format!("{}: {why}", path.display()));
        let value: Value = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
        decode(&value).map(Some).map_err(bad)
    }

    /// Keeps `durable`, replacing what was kept.
    pub fn save(&self, durable: &Durable) -> io::Result<()> {
        let tmp = self.dir.join(format!("{FILE}.tmp"));
        // Left by a master killed mid-write: made anew, so that nothing else is written through.
        match fs::remove_file(&tmp) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        let mut f =
            OpenOptions::new().write(true).create_new(true).custom_flags(libc::O_NOFOLLOW).mode(0o600).open(&tmp)?;
        f.write_all(encode(durable).to_string().as_bytes())?;
        f.sync_all()?;
        fs::rename(&tmp, self.dir.join(FILE))?;
        // The rename itself must reach the disk.
        File::open(&self.dir)?.sync_all()
    }
}

/// Refuses a state directory (`dir`) or file another user planted or can change: it must be a
/// directory (a regular file), not a symbolic link, ours, and writable by nobody else.
fn check_private(path: &Path, dir: bool) -> io::Result<()> {
    let meta = fs::symlink_metadata(path)?;
    let refuse = |why: String| {
        let what = format!("{}: {why}: another user could read the run's data key or plant a run", path.display());
        Err(io::Error::new(io::ErrorKind::PermissionDenied, what))
    };
    let (kind, expected) = (meta.file_type(), if dir { "a directory" } else { "a regular file" });
    if kind.is_symlink() {
        return refuse(format!("a symbolic link, not {expected}"));
    }
    if (dir && !kind.is_dir()) || (!dir && !kind.is_file()) {
        return refuse(format!("not {expected}"));
    }
    let me = shoal_transport::shm::effective_uid();
    if meta.uid() != me {
        return refuse(format!("owned by uid {}, not by this master's ({me})", meta.uid()));
    }
    if meta.mode() & 0o022 != 0 {
        return refuse(format!("writable by others (mode {:o})", meta.mode() & 0o777));
    }
    Ok(())
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex32(s: &str) -> Result<[u8; 32], String> {
    if s.len() != 64 || !s.is_ascii() {
        return Err(format!("{s:?} is not 32 bytes in hex"));
    }
    let mut out = [0u8; 32];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).map_err(|e| format!("{s:?}: {e}"))?;
    }
    Ok(out)
}

fn encode(d: &Durable) -> Value {
    json!({
        "version": VERSION,
        "session": d.session.0,
        "data_key": hex(&d.data_key),
        "next_peer": d.next_peer,
        "epoch": d.epoch.0,
        "rings": d.rings.iter().map(|r| json!({
            "group": r.group.0, "epoch": r.epoch.0, "issued": r.issued.0,
            "members": r.members.iter().map(|p| p.0).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
        "peers": d.peers.iter().map(|p| json!({
            "id": p.peer.0, "group": p.group.0, "addr": p.addr, "accepted": p.accepted,
            "catching_up": p.catching_up,
            "dialable": p.dialable, "seen": p.seen.map(|ip| ip.to_string()),
        })).collect::<Vec<_>>(),
        "groups": d.groups.iter().map(|g| json!({
            "group": g.group.0,
            "revision": g.revision,
            "hashes": g.hashes.iter().map(|(n, h)| (n.clone(), json!(hex(h)))).collect::<serde_json::Map<_, _>>(),
            "synced": g.synced.iter().map(|p| p.0).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
    })
}

fn decode(v: &Value) -> Result<Durable, String> {
    let field = |v: &'_ Value, name: &str| v.get(name).cloned().ok_or_else(|| format!("no {name:?}"));
    let u64_of = |v: &Value, name: &str| field(v, name)?.as_u64().ok_or_else(|| format!("{name:?} is not a number"));
    let u32_of = |v: &Value, name: &str| {
        u64_of(v, name).and_then(|n| u32::try_from(n).map_err(|_| format!("{name:?} is out of range")))
    };
    let list = |v: &Value, name: &str| match field(v, name)? {
        Value::Array(a) => Ok(a),
        _ => Err(format!("{name:?} is not a list")),
    };
    let ids = |v: &Value, name: &str| {
        list(v, name)?
            .iter()
            .map(|p| p.as_u64().and_then(|n| u32::try_from(n).ok()).map(PeerId).ok_or(format!("a bad id in {name:?}")))
            .collect::<Result<Vec<_>, String>>()
    };
    let version = u64_of(v, "version")?;
    if version != VERSION {
        return Err(format!("state format {version}, this master reads {VERSION}"));
    }
    let peers = list(v, "peers")?
        .iter()
        .map(|p| {
            Ok(DurablePeer {
                peer: PeerId(u32_of(p, "id")?),
                group: GroupId(u32_of(p, "group")?),
                addr: field(p, "addr")?.as_str().ok_or("\"addr\" is not a string")?.to_string(),
                accepted: field(p, "accepted")?.as_bool().ok_or("\"accepted\" is not a bool")?,
                catching_up: field(p, "catching_up")?.as_bool().ok_or("\"catching_up\" is not a bool")?,
                dialable: match field(p, "dialable")? {
                    Value::Null => None,
                    v => Some(v.as_bool().ok_or("\"dialable\" is not a bool")?),
                },
                seen: match field(p, "seen")? {
                    Value::Null => None,
                    v => Some(v.as_str().and_then(|s| s.parse().ok()).ok_or("\"seen\" is not an IP address")?),
                },
            })
        })
        .collect::<Result<Vec<_>, String>>()?;
    let rings = list(v, "rings")?
        .iter()
        .map(|r| {
            Ok(DurableRing {
                group: GroupId(u32_of(r, "group")?),
                epoch: Epoch(u64_of(r, "epoch")?),
                issued: Epoch(u64_of(r, "issued")?),
                members: ids(r, "members")?,
            })
        })
        .collect::<Result<Vec<_>, String>>()?;
    let groups = list(v, "groups")?
        .iter()
        .map(|g| {
            let hashes = match field(g, "hashes")? {
                Value::Object(m) => m
                    .iter()
                    .map(|(n, h)| Ok((n.clone(), unhex32(h.as_str().ok_or("a hash is not a string")?)?)))
                    .collect::<Result<_, String>>()?,
                _ => return Err("\"hashes\" is not an object".to_string()),
            };
            Ok(DurableGroup {
                group: GroupId(u32_of(g, "group")?),
                revision: u64_of(g, "revision")?,
                hashes,
                synced: ids(g, "synced")?.into_iter().collect(),
            })
        })
        .collect::<Result<Vec<_>, String>>()?;
    Ok(Durable {
        session: SessionId(u64_of(v, "session")?),
        data_key: unhex32(field(v, "data_key")?.as_str().ok_or("\"data_key\" is not a string")?)?,
        next_peer: u32_of(v, "next_peer")?,
        epoch: Epoch(u64_of(v, "epoch")?),
        rings,
        peers,
        groups,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::{BTreeMap, BTreeSet};

    fn run() -> Durable {
        Durable {
            session: SessionId(u64::MAX - 3),
            data_key: [7; 32],
            next_peer: 5,
            epoch: Epoch(9),
            rings: vec![
                DurableRing {
                    group: GroupId(0),
                    epoch: Epoch(8),
                    issued: Epoch(8),
                    members: vec![PeerId(3), PeerId(1)],
                },
                DurableRing { group: GroupId(2), epoch: Epoch(0), issued: Epoch(9), members: vec![] },
            ],
            peers: vec![
                DurablePeer {
                    peer: PeerId(1),
                    group: GroupId(0),
                    addr: "10.0.0.1:4000".into(),
                    accepted: true,
                    catching_up: false,
                    dialable: Some(true),
                    seen: Some("10.0.0.1".parse().unwrap()),
                },
                DurablePeer {
                    peer: PeerId(3),
                    group: GroupId(0),
                    addr: "[::1]:4001".into(),
                    accepted: true,
                    catching_up: false,
                    dialable: Some(false),
                    seen: Some("::1".parse().unwrap()),
                },
                DurablePeer {
                    peer: PeerId(4),
                    group: GroupId(2),
                    addr: "h:1".into(),
                    accepted: false,
                    catching_up: true,
                    dialable: None,
                    seen: None,
                },
            ],
            groups: vec![DurableGroup {
                group: GroupId(0),
                revision: 12,
                hashes: BTreeMap::from([("w".to_string(), [0xab; 32]), ("b".to_string(), [0; 32])]),
                synced: BTreeSet::from([PeerId(1), PeerId(3)]),
            }],
        }
    }

    #[test]
    fn what_is_saved_is_loaded() {
        let dir = std::env::temp_dir().join(format!("shoal-state-{}", std::process::id()));
        let state = StateDir::open(&dir).unwrap();
        assert_eq!(state.load().unwrap(), None);
        state.save(&run()).unwrap();
        assert_eq!(state.load().unwrap(), Some(run()));
        let mode = fs::metadata(dir.join(FILE)).unwrap().permissions();
        assert_eq!(std::os::unix::fs::PermissionsExt::mode(&mode) & 0o777, 0o600, "it holds the data key");
        // What cannot be read is an error naming the file and the problem, never a new run.
        for (text, problem) in [
            ("{\"version\": 3, \"session\": 3}", "no \"peers\""),
            ("{\"version\": 2}", "state format 2, this master reads 3"),
            ("{\"version\": 3, \"sess", "EOF while parsing"),
        ] {
            fs::write(dir.join(FILE), text).unwrap();
            let e = state.load().unwrap_err().to_string();
            assert!(e.contains("run.json: ") && e.contains(problem), "{e}");
        }
        fs::remove_dir_all(&dir).unwrap();
    }

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("shoal-state-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        dir
    }

    /// Another user's directory or file, or one they can change or reach through a link, is
    /// refused with a reason: the master never writes the data key where others read it, nor
    /// adopts a run they planted.
    #[test]
    fn a_state_another_user_could_touch_is_refused() {
        use std::os::unix::fs::{symlink, PermissionsExt};
        let dir = scratch("open");
        fs::create_dir(&dir).unwrap();
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o777)).unwrap();
        let e = StateDir::open(&dir).unwrap_err().to_string();
        assert!(e.contains("writable by others (mode 777)") && e.contains("data key"), "{e}");
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o700)).unwrap();
        let link = scratch("link");
        symlink(&dir, &link).unwrap();
        let e = StateDir::open(&link).unwrap_err().to_string();
        assert!(e.contains("a symbolic link, not a directory"), "{e}");

        let state = StateDir::open(&dir).unwrap();
        let planted = scratch("planted");
        fs::write(&planted, "{}").unwrap();
        symlink(&planted, dir.join(FILE)).unwrap();
        let e = state.load().unwrap_err().to_string();
        assert!(e.contains("run.json: a symbolic link, not a regular file"), "{e}");
        fs::remove_file(dir.join(FILE)).unwrap();
        fs::write(dir.join(FILE), "{}").unwrap();
        fs::set_permissions(dir.join(FILE), fs::Permissions::from_mode(0o666)).unwrap();
        assert!(state.load().unwrap_err().to_string().contains("writable by others (mode 666)"));
        fs::remove_file(dir.join(FILE)).unwrap();

        // A temporary file planted as a link is replaced, never written through.
        symlink(&planted, dir.join(format!("{FILE}.tmp"))).unwrap();
        state.save(&run()).unwrap();
        assert_eq!(fs::read_to_string(&planted).unwrap(), "{}");
        assert_eq!(state.load().unwrap(), Some(run()));

        if shoal_transport::shm::effective_uid() == 0 {
            // As root, a directory of another user's.
            let theirs = scratch("theirs");
            fs::create_dir(&theirs).unwrap();
            std::os::unix::fs::chown(&theirs, Some(65534), None).unwrap();
            let e = StateDir::open(&theirs).unwrap_err().to_string();
            assert!(e.contains("owned by uid 65534, not by this master's (0)"), "{e}");
            fs::remove_dir_all(&theirs).unwrap();
        }
        for p in [&dir, &link, &planted] {
            let _ = fs::remove_file(p).or_else(|_| fs::remove_dir_all(p));
        }
    }
}
