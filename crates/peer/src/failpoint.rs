//! Fail points: `SHOAL_FAILPOINT=<point>` makes the process abort at that step of the protocol,
//! which no signal sent from outside can hit reliably. For tests; the points are listed in
//! `docs/glossary.md`.

/// Dies abruptly if `SHOAL_FAILPOINT` names `point`. Read at every pass (well under a
/// microsecond), so a test process can arm it once it is where it wants to be.
pub(crate) fn failpoint(point: &str) {
    if shoal_config::env_value("SHOAL_FAILPOINT").as_deref() == Some(point) {
        log::warn!("failpoint {point}: dying");
        std::process::abort();
    }
}
