//! Configuration from `SHOAL_*` environment variables, and the logger behind `SHOAL_LOG`.
//!
//! An explicit argument wins over the environment, the environment over the default: callers
//! pass their argument (if any) and the fallback to the helpers here. Unknown `SHOAL_*` names are
//! warned about once, never silently ignored. This crate reads the environment and writes to
//! stderr; it knows nothing of the protocol.
#![warn(missing_docs)]
#![deny(unsafe_code)]

use std::io::Write;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Every `SHOAL_*` variable shoal reads, with what it means. Anything else is warned about.
pub const KNOWN_VARS: &[(&str, &str)] = &[
    ("SHOAL_LOG", "log filter: a level (error, warn, info, debug, trace) or target=level list"),
    ("SHOAL_HEARTBEAT_TIMEOUT", "seconds a silent peer or master is tolerated (float)"),
    ("SHOAL_CONNECTIONS", "TCP connections per peer pair (fixed: optimize_topology does not size pools)"),
    ("SHOAL_CONNECTIONS_MAX", "most TCP connections optimize_topology grows a pool to (default 16)"),
    ("SHOAL_PROBE_BYTES", "most bytes one exchange of optimize_topology's measurement sends (default 64 MiB)"),
    ("SHOAL_CHUNK_BYTES", "pipeline chunk size in bytes (default 256 KiB)"),
    ("SHOAL_MAX_IN_FLIGHT", "most collectives in flight at once per communicator (default 64)"),
    (
        "SHOAL_ALGO",
        "all-reduce algorithm of calls that name none: auto (default), ring, oneshot, twoshot or hierarchical",
    ),
    ("SHOAL_ONESHOT_MAX_BYTES", "largest all-reduce in bytes that auto runs one-shot (default 65536)"),
    ("SHOAL_TWOSHOT_MAX_BYTES", "largest all-reduce in bytes that auto runs two-shot between hosts (default 4194304)"),
    ("SHOAL_TRANSPORT", "streams to peers on the same host: auto (shared memory, default) or tcp"),
    ("SHOAL_ADVERTISE_ADDR", "host[:port] other peers should dial to reach this peer"),
    ("SHOAL_SECRET", "run credentials"),
    ("SHOAL_TLS_CERT", "TLS: this process's certificate (PEM); with SHOAL_TLS_KEY and SHOAL_TLS_CA"),
    ("SHOAL_TLS_KEY", "TLS: this process's private key (PEM)"),
    ("SHOAL_TLS_CA", "TLS: the run's CA certificate (PEM) that every other end's certificate must chain to"),
    ("SHOAL_HTTP_ADDR", "where the master serves /metrics, /status and its status page"),
    ("SHOAL_TIMEOUT", "bound in seconds on any blocking call (float)"),
    ("SHOAL_MASTER", "torch backend: the master's host:port (default: rank 0 hosts one)"),
    ("SHOAL_MIN_WORLD_SIZE", "torch backend: members the run must have before init_process_group returns"),
    ("SHOAL_TORCH_COMPILED", "torch backend: 0 keeps it in Python alone (default: its compiled part, built once)"),
    (
        "SHOAL_CATCHUP_RATE",
        "most bytes per second a peer serves newcomers catching up, all together (default: no bound)",
    ),
    ("SHOAL_CATCHUP_MEMORY", "most bytes of shared state a peer copies to serve newcomers catching up (default 8 GiB)"),
    (
        "SHOAL_FAILPOINT",
        "tests: a protocol step at which the peer dies (all_reduce.before_confirm, all_reduce.after_commit)",
    ),
    ("SHOAL_VENV", "scripts: where the cached Python environment lives"),
    ("SHOAL_SKIP_BUILD", "scripts: 1 to skip rebuilding the native module"),
    ("SHOAL_LAB_REQUIRED", "tests: 1 to fail, not skip, the lab's tests where no lab can be built"),
    ("SHOAL_BLESS", "tests: 1 to rewrite generated files (crates/ffi/include/shoal.h) instead of checking them"),
    ("SHOAL_BROWSER_REQUIRED", "tests: 1 to fail, not skip, the status page's test where there is no chromium"),
];

/// A `SHOAL_*` variable holds a value that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{name}={value:?} is invalid: expected {expected}")]
pub struct ConfigError {
    /// The variable.
    pub name: &'static str,
    /// Its value.
    pub value: String,
    /// What was expected.
    pub expected: &'static str,
}

/// Reads a positive duration in float seconds from `name`.
///
/// # Errors
/// [`ConfigError`] if the variable is set but is not a positive, finite number.
pub fn env_seconds(name: &'static str) -> Result<Option<Duration>, ConfigError> {
    let Some(value) = env_value(name) else {
        return Ok(None);
    };
    match value.trim().parse::<f64>() {
        Ok(s) if s.is_finite() && s > 0.0 && s < 1e9 => Ok(Some(Duration::from_secs_f64(s))),
        _ => Err(ConfigError { name, value, expected: "a positive number of seconds" }),
    }
}

/// Reads a positive integer from `name`.
///
/// # Errors
/// [`ConfigError`] if the variable is set but is not a positive integer.
pub fn env_count(name: &'static str) -> Result<Option<usize>, ConfigError> {
    let Some(value) = env_value(name) else {
        return Ok(None);
    };
    match value.trim().parse::<usize>() {
        Ok(n) if n > 0 => Ok(Some(n)),
        _ => Err(ConfigError { name, value, expected: "a positive integer" }),
    }
}

/// Reads a string from `name`; an empty value counts as unset.
pub fn env_value(name: &'static str) -> Option<String> {
    debug_assert!(KNOWN_VARS.iter().any(|(n, _)| *n == name), "{name} missing from KNOWN_VARS");
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

/// Installs the stderr logger filtered by `SHOAL_LOG` (default `warn`), once per process, and
/// warns about unknown `SHOAL_*` variables. Later calls do nothing.
pub fn init_logging() {
    static LOGGER: OnceLock<Logger> = OnceLock::new();
    let mut first = false;
    let logger = LOGGER.get_or_init(|| {
        first = true;
        Logger::new(&std::env::var("SHOAL_LOG").unwrap_or_default())
    });
    if first && log::set_logger(logger).is_ok() {
        log::set_max_level(logger.max_level());
        for name in unknown_vars() {
            log::warn!("unknown environment variable {name} ignored (known: see KNOWN_VARS)");
        }
    }
}

/// `SHOAL_*` variables in the environment that shoal does not know.
pub fn unknown_vars() -> Vec<String> {
    std::env::vars()
        .map(|(k, _)| k)
        .filter(|k| k.starts_with("SHOAL_") && !KNOWN_VARS.iter().any(|(n, _)| n == k))
        .collect()
}

/// A filter of `SHOAL_LOG` syntax: comma-separated `level` or `target=level`; the longest
/// matching target prefix wins.
struct Logger {
    default: log::LevelFilter,
    targets: Vec<(String, log::LevelFilter)>,
    start: Instant,
}

impl Logger {
    fn new(spec: &str) -> Self {
        let mut logger = Logger { default: log::LevelFilter::Warn, targets: Vec::new(), start: Instant::now() };
        for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            match part.split_once('=') {
                Some((target, level)) => {
                    if let Ok(level) = level.parse() {
                        logger.targets.push((target.replace('-', "_"), level));
                    }
                }
                None => {
                    if let Ok(level) = part.parse() {
                        logger.default = level;
                    }
                }
            }
        }
        logger.targets.sort_by_key(|(t, _)| std::cmp::Reverse(t.len()));
        logger
    }

    fn max_level(&self) -> log::LevelFilter {
        self.targets.iter().map(|(_, l)| *l).fold(self.default, std::cmp::max)
    }

    fn level_for(&self, target: &str) -> log::LevelFilter {
        self.targets.iter().find(|(t, _)| target.starts_with(t.as_str())).map_or(self.default, |x| x.1)
    }
}

impl log::Log for Logger {
    fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
        metadata.level() <= self.level_for(metadata.target())
    }

    fn log(&self, record: &log::Record<'_>) {
        if self.enabled(record.metadata()) {
            let t = self.start.elapsed().as_secs_f64();
            let line = format!(
                "shoal {t:9.3} {:5} [{}] {}: {}\n",
                record.level(),
                std::process::id(),
                record.target(),
                record.args()
            );
            // One write per line keeps lines of concurrent threads whole; a failed write to
            // stderr has nowhere better to go.
            let _ = std::io::stderr().lock().write_all(line.as_bytes());
        }
    }

    fn flush(&self) {}
}

/// Dies abruptly if `SHOAL_FAILPOINT` names `point`: a test makes the process abort at that
/// step of the protocol, which no signal sent from outside can hit reliably (the points are
/// listed in `docs/glossary.md`). Read at every pass (well under a microsecond), so a test
/// process can arm it once it is where it wants to be.
pub fn failpoint(point: &str) {
    if env_value("SHOAL_FAILPOINT").as_deref() == Some(point) {
        log::warn!("failpoint {point}: dying");
        std::process::abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_filter_picks_the_longest_matching_target() {
        let l = Logger::new("info, shoal_peer=debug, shoal_peer::ring=trace, bogus=nonsense");
        assert_eq!(l.level_for("shoal_master"), log::LevelFilter::Info);
        assert_eq!(l.level_for("shoal_peer::conn"), log::LevelFilter::Debug);
        assert_eq!(l.level_for("shoal_peer::ring"), log::LevelFilter::Trace);
        assert_eq!(l.max_level(), log::LevelFilter::Trace);
        assert_eq!(Logger::new("").level_for("x"), log::LevelFilter::Warn);
    }
}
