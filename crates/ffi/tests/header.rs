//! `include/shoal.h` is what cbindgen makes of `src/lib.rs` today: a stale header fails CI.

#[test]
fn the_header_is_up_to_date() {
    let dir = env!("CARGO_MANIFEST_DIR");
    let config = cbindgen::Config::from_file(format!("{dir}/cbindgen.toml")).unwrap();
    let bindings = cbindgen::Builder::new().with_crate(dir).with_config(config).generate().unwrap();
    let mut fresh = Vec::new();
    bindings.write(&mut fresh);
    let path = format!("{dir}/include/shoal.h");
    if std::env::var_os("SHOAL_BLESS").is_some_and(|v| v == "1") {
        std::fs::write(&path, &fresh).unwrap();
        return;
    }
    let kept = std::fs::read(&path).unwrap_or_default();
    assert!(
        kept == fresh,
        "{path} is not what cbindgen makes of src/lib.rs: run SHOAL_BLESS=1 cargo test -p shoal-ffi --test header"
    );
}
