//! Rebuilds the library when a migration is added, changed or removed: `refinery`'s
//! `embed_migrations!` (src/store/mod.rs) reads `migrations/` at compile time, but Cargo tracks
//! only the files a build already read, so a new `V<n>__*.sql` would otherwise not be embedded.
fn main() {
    println!("cargo:rerun-if-changed=migrations");
}
