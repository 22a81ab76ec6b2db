//! The shape of the source tree, checked: no import cycle between the files of a crate, every
//! file of `src/` imports only from its own layer or the layers below it (docs/design.md,
//! "Layering"), every module file is in the module map of docs/design.md, and every path the docs
//! name exists in the repository (and every test they name, `tests/<file>::<test>`, in it).
//! Reads files only; no PostgreSQL.
//!
//! How imports are read (from the text, not from the compiler):
//! - Comments and the contents of string and char literals are stripped first, and a file is
//!   read only up to its `#[cfg(test)] mod ... {` block.
//! - Test-only files are skipped: `tests.rs`, and any module declared `#[cfg(test)] mod name;`.
//! - Every path a file names through `crate::` or `super::` counts: in `use` lines (nested
//!   groups such as `use crate::{a::B, c::{D, E}}` included) and in code
//!   (`crate::statsd::spawn(...)`). A path is tied to the file that defines its longest module
//!   prefix (`name.rs` or `name/mod.rs`; the crate root for none).
//! - A child naming an ancestor through `super::` is no edge: the ancestor declares the child,
//!   and a child using its parent's items is no cycle. Through `crate::` it is an edge. A
//!   parent's own `mod` and `pub use` of its children are not read.
//! - Each crate root is its own crate: when a folder holds both `lib.rs` and `main.rs`, the
//!   binary is `main.rs` and the modules it declares (`mod cli;`), the library the rest.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Component, Path, PathBuf};

/// A module's path in its crate: `["store", "lease"]`; the crate root is `[]`.
type ModPath = Vec<String>;

/// Per file, the files it imports and the names that tie it to each.
type Edges = BTreeMap<String, BTreeMap<String, BTreeSet<String>>>;

/// The crate folders of the workspace, each read as one or two crates.
const CRATE_DIRS: [&str; 4] = ["src", "bench/src", "testkit/src", "clients/rust/src"];

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Every `.rs` file under `dir` (relative to it, with `/`) and its text.
fn read_tree(dir: &Path) -> BTreeMap<String, String> {
    fn walk(root: &Path, dir: &Path, out: &mut BTreeMap<String, String>) {
        let entries =
            fs::read_dir(dir).unwrap_or_else(|e| panic!("read_dir {}: {e}", dir.display()));
        for entry in entries {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(root, &path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let rel = path.strip_prefix(root).unwrap();
                let rel = rel.components().map(|c| c.as_os_str().to_str().unwrap());
                let text = fs::read_to_string(&path)
                    .unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
                out.insert(rel.collect::<Vec<_>>().join("/"), text);
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(dir, dir, &mut out);
    out
}

// ---------------------------------------------------------------------------------------------
// Reading a file's imports.

fn is_word(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

fn is_ident_start(c: char) -> bool {
    c.is_ascii_alphabetic() || c == '_'
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// Whether `pat` occurs in `s` at `i`.
fn at(s: &[char], i: usize, pat: &str) -> bool {
    (i..).zip(pat.chars()).all(|(k, c)| s.get(k) == Some(&c))
}

/// The identifier starting at `i` (ASCII), and where it ends.
fn ident(s: &[char], i: usize) -> Option<(String, usize)> {
    if !s.get(i).copied().is_some_and(is_ident_start) {
        return None;
    }
    let end = (i..s.len()).find(|&k| !is_ident(s[k])).unwrap_or(s.len());
    Some((s[i..end].iter().collect(), end))
}

/// The text without comments, and with every string or char literal emptied (`""`, `' '`), so
/// that neither a `"/*"` in a string nor a `'"'` char can hide code or fake it.
fn strip_comments(text: &str) -> String {
    let s: Vec<char> = text.chars().collect();
    let n = s.len();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < n {
        if at(&s, i, "//") {
            i = (i..n).find(|&k| s[k] == '\n').unwrap_or(n);
        } else if at(&s, i, "/*") {
            let mut depth = 1;
            i += 2;
            while i < n && depth > 0 {
                if at(&s, i, "/*") {
                    depth += 1;
                    i += 2;
                } else if at(&s, i, "*/") {
                    depth -= 1;
                    i += 2;
                } else {
                    i += 1;
                }
            }
        } else if let Some((hashes, body)) = raw_string_start(&s, i) {
            let close: String = std::iter::once('"')
                .chain("#".repeat(hashes).chars())
                .collect();
            out.push_str("\"\"");
            i = (body..n)
                .find(|&k| at(&s, k, &close))
                .map_or(n, |end| end + 1 + hashes);
        } else if s[i] == '"' {
            i += 1;
            while i < n && s[i] != '"' {
                i += if s[i] == '\\' { 2 } else { 1 };
            }
            out.push_str("\"\"");
            i += 1;
        } else if s[i] == '\'' {
            match char_literal_end(&s, i) {
                Some(end) => {
                    out.push_str("' '");
                    i = end;
                }
                None => {
                    out.push('\''); // a lifetime
                    i += 1;
                }
            }
        } else {
            out.push(s[i]);
            i += 1;
        }
    }
    out
}

/// `r"`, `r#"`, `br##"`, ... at `i` (not inside a word): the number of `#`s and where the
/// contents start.
fn raw_string_start(s: &[char], i: usize) -> Option<(usize, usize)> {
    if i > 0 && is_word(s[i - 1]) {
        return None;
    }
    let mut k = i;
    if s.get(k) == Some(&'b') {
        k += 1;
    }
    if s.get(k) != Some(&'r') {
        return None;
    }
    k += 1;
    let hashes = (k..s.len()).take_while(|&j| s[j] == '#').count();
    k += hashes;
    (s.get(k) == Some(&'"')).then_some((hashes, k + 1))
}

/// The end of the char literal at `i` (`'x'`, `'\n'`, `'\u{1F600}'`), or `None` for a lifetime.
fn char_literal_end(s: &[char], i: usize) -> Option<usize> {
    match (s.get(i + 1), s.get(i + 2)) {
        (Some('\\'), Some(&c)) if c != '\n' => {
            let close = (i + 3..s.len()).find(|&k| s[k] == '\'')?;
            Some(close + 1)
        }
        (Some(&c), Some('\'')) if c != '\\' && c != '\'' => Some(i + 3),
        _ => None,
    }
}

/// Where the file's `#[cfg(test)] mod name {` block starts (the end of the text if none).
fn test_module_start(text: &str) -> usize {
    text.match_indices("#[cfg(test)]")
        .map(|(at, m)| (at, at + m.len()))
        .find(|&(_, after)| {
            let rest = text[after..].trim_start();
            let Some(rest) = rest.strip_prefix("mod") else {
                return false;
            };
            if !rest.starts_with(char::is_whitespace) {
                return false;
            }
            let rest = rest.trim_start();
            let name_len = rest.find(|c: char| !is_ident(c)).unwrap_or(rest.len());
            name_len > 0
                && rest.starts_with(is_ident_start)
                && rest[name_len..].trim_start().starts_with('{')
        })
        .map_or(text.len(), |(at, _)| at)
}

/// The modules a file declares as its test-only children: `#[cfg(test)] mod name;`.
fn test_only_children(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for (at, m) in text.match_indices("#[cfg(test)]") {
        let rest = text[at + m.len()..].trim_start();
        let Some(rest) = rest.strip_prefix("mod") else {
            continue;
        };
        let rest = rest.trim_start();
        let name_len = rest.find(|c: char| !is_ident(c)).unwrap_or(rest.len());
        if name_len > 0 && rest[name_len..].trim_start().starts_with(';') {
            out.insert(rest[..name_len].to_string());
        }
    }
    out
}

/// The modules a crate root declares from files: `mod name;` (any visibility).
fn declared_modules(text: &str) -> BTreeSet<String> {
    let s: Vec<char> = text.chars().collect();
    let mut out = BTreeSet::new();
    for i in 0..s.len() {
        if !at(&s, i, "mod") || (i > 0 && is_word(s[i - 1])) {
            continue;
        }
        let mut k = i + 3;
        if !s.get(k).copied().is_some_and(char::is_whitespace) {
            continue;
        }
        while s.get(k).copied().is_some_and(char::is_whitespace) {
            k += 1;
        }
        if let Some((name, mut end)) = ident(&s, k) {
            while s.get(end).copied().is_some_and(char::is_whitespace) {
                end += 1;
            }
            if s.get(end) == Some(&';') {
                out.insert(name);
            }
        }
    }
    out
}

/// What a path is relative to.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Base {
    Crate,
    /// `super::` this many times.
    Super(usize),
}

/// Every path the (stripped) text names through `crate::` or `super::`, as segments after the
/// base: `crate::a::{b, c::D}` gives `a::b`, `a::c::D` and `a` itself.
fn referenced_paths(text: &str) -> Vec<(Base, Vec<String>)> {
    let s: Vec<char> = text.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < s.len() {
        let Some((base, mut j)) = path_base(&s, i) else {
            i += 1;
            continue;
        };
        let mut segs: Vec<String> = Vec::new();
        loop {
            if s.get(j) == Some(&'{') {
                let end = matching_brace(&s, j + 1);
                let body: String = s[j + 1..end].iter().collect();
                out.extend(expand(&segs, &body).into_iter().map(|p| (base, p)));
                if !segs.is_empty() {
                    out.push((base, segs));
                }
                i = j + 1; // a group may itself hold `crate::` paths
                break;
            }
            match ident(&s, j) {
                Some((name, end)) => {
                    segs.push(name);
                    if at(&s, end, "::") {
                        j = end + 2;
                        continue;
                    }
                    out.push((base, segs));
                    i = end;
                }
                None => {
                    if !segs.is_empty() {
                        out.push((base, segs));
                    }
                    i = j.max(i + 1);
                }
            }
            break;
        }
    }
    out
}

/// `crate::` or `super::super::` (not inside a word) at `i`: the base and where the path after
/// it starts.
fn path_base(s: &[char], i: usize) -> Option<(Base, usize)> {
    if i > 0 && is_word(s[i - 1]) {
        return None;
    }
    let (word, mut end) = ident(s, i)?;
    let base = match word.as_str() {
        "crate" => Base::Crate,
        "super" => {
            let mut k = 1;
            // Another `::super` counts only when a path goes on after it.
            while at(s, end, "::super::") {
                k += 1;
                end += "::super".len();
            }
            Base::Super(k)
        }
        _ => return None,
    };
    at(s, end, "::").then_some((base, end + 2))
}

/// The index of the `}` closing the group whose contents start at `start` (or the end).
fn matching_brace(s: &[char], start: usize) -> usize {
    let mut depth = 1;
    for (k, &c) in s.iter().enumerate().skip(start) {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return k;
                }
            }
            _ => {}
        }
    }
    s.len()
}

/// The paths of a `use` group's contents: `prefix::{b, c::{d, E}, self}` gives `prefix::b`,
/// `prefix::c::d`, `prefix::c::E` and `prefix`.
fn expand(prefix: &[String], body: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let mut depth = 0;
    let mut item = String::new();
    for c in body.chars().chain(std::iter::once(',')) {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            _ => {}
        }
        if c != ',' || depth != 0 {
            item.push(c);
            continue;
        }
        let it = std::mem::take(&mut item);
        let it = it.trim();
        if it.is_empty() {
            continue;
        }
        if it == "self" {
            if !prefix.is_empty() {
                out.push(prefix.to_vec());
            }
            continue;
        }
        if let Some((head, inner)) = group_item(it) {
            let mut p = prefix.to_vec();
            p.extend(head);
            out.extend(expand(&p, &inner));
            continue;
        }
        let name = it.split(" as ").next().unwrap().trim();
        let mut p = prefix.to_vec();
        p.extend(name.split("::").filter(|s| !s.is_empty()).map(String::from));
        if !p.is_empty() {
            out.push(p);
        }
    }
    out
}

/// `a::b::{...}` as an item of a group: its head segments and the contents of its braces.
fn group_item(item: &str) -> Option<(Vec<String>, String)> {
    let s: Vec<char> = item.chars().collect();
    let mut head = Vec::new();
    let mut k = 0;
    while let Some((name, end)) = ident(&s, k) {
        if !at(&s, end, "::") {
            return None;
        }
        head.push(name);
        k = end + 2;
    }
    if s.get(k) != Some(&'{') || s.last() != Some(&'}') || s.len() < k + 2 {
        return None;
    }
    Some((head, s[k + 1..s.len() - 1].iter().collect()))
}

// ---------------------------------------------------------------------------------------------
// Crates, their import graphs and cycles.

/// One crate of a crate folder.
struct Crate {
    /// How messages name the crate's folder: `src/`.
    dir: String,
    /// Whether this is the binary beside a library (its root file is then `main.rs`).
    binary: bool,
    /// Module path → file, relative to `dir`.
    modules: BTreeMap<ModPath, String>,
    /// File → its text.
    texts: BTreeMap<String, String>,
}

impl Crate {
    /// Where messages say a file is: `src/store/lease.rs`.
    fn shown(&self, file: &str) -> String {
        format!("{}{file}", self.dir)
    }

    /// Test-only files: `tests.rs`, and modules declared `#[cfg(test)] mod name;`.
    fn test_only(&self) -> BTreeSet<String> {
        let mut out = BTreeSet::new();
        for (path, file) in &self.modules {
            if file == "tests.rs" || file.ends_with("/tests.rs") {
                out.insert(file.clone());
            }
            let children = test_only_children(&strip_comments(&self.texts[file]));
            for child in children {
                let mut p = path.clone();
                p.push(child);
                if let Some(f) = self.modules.get(&p) {
                    out.insert(f.clone());
                }
            }
        }
        out
    }

    /// Each file (test-only ones left out) and the files it imports, with the names that tie
    /// them.
    fn imports(&self) -> Edges {
        let test_only = self.test_only();
        let mut edges = Edges::new();
        for (module, file) in &self.modules {
            if test_only.contains(file) {
                continue;
            }
            let text = strip_comments(&self.texts[file]);
            let text = &text[..test_module_start(&text)];
            let targets = edges.entry(file.clone()).or_default();
            for (base, segs) in referenced_paths(text) {
                let mut full: ModPath = match base {
                    Base::Crate => Vec::new(),
                    Base::Super(up) => module[..module.len().saturating_sub(up)].to_vec(),
                };
                full.extend(segs);
                let Some((n, target)) = (0..=full.len())
                    .rev()
                    .find_map(|n| self.modules.get(&full[..n]).map(|t| (n, t)))
                else {
                    continue;
                };
                if target == file || test_only.contains(target) {
                    continue;
                }
                if matches!(base, Base::Super(_)) && module.starts_with(&full[..n]) {
                    continue; // a child naming its ancestor
                }
                let name = full
                    .get(n)
                    .or(full.last())
                    .map_or("self".to_string(), String::clone);
                targets.entry(target.clone()).or_default().insert(name);
            }
        }
        edges
    }
}

/// `store/lease.rs` → `["store", "lease"]`, `config/mod.rs` → `["config"]`, `lib.rs` → `[]`.
fn module_path(file: &str) -> ModPath {
    let stem = file.strip_suffix(".rs").expect("a .rs file");
    let mut segs: ModPath = stem.split('/').map(String::from).collect();
    if segs.len() == 1 && (segs[0] == "lib" || segs[0] == "main") {
        return Vec::new();
    }
    if segs.last().is_some_and(|s| s == "mod") {
        segs.pop();
    }
    segs
}

/// The crates of one folder's files: one per root (`lib.rs`, `main.rs`). With both, the binary
/// is `main.rs` and the top-level modules it declares; the library is the rest.
fn crates(dir: &str, files: BTreeMap<String, String>) -> Vec<Crate> {
    let both = files.contains_key("lib.rs") && files.contains_key("main.rs");
    let bin_modules = if both {
        declared_modules(&strip_comments(&files["main.rs"]))
    } else {
        BTreeSet::new()
    };
    let mut lib = Crate {
        dir: dir.to_string(),
        binary: false,
        modules: BTreeMap::new(),
        texts: BTreeMap::new(),
    };
    let mut bin = Crate {
        dir: dir.to_string(),
        binary: true,
        modules: BTreeMap::new(),
        texts: BTreeMap::new(),
    };
    for (file, text) in files {
        let path = module_path(&file);
        let in_bin = both
            && (file == "main.rs" || path.first().is_some_and(|top| bin_modules.contains(top)));
        let krate = if in_bin { &mut bin } else { &mut lib };
        if let Some(other) = krate.modules.insert(path.clone(), file.clone()) {
            panic!("{dir}{file} and {dir}{other} both define module {path:?}");
        }
        krate.texts.insert(file, text);
    }
    [lib, bin]
        .into_iter()
        .filter(|c| !c.modules.is_empty())
        .collect()
}

/// The groups of files that import each other in a loop (each sorted, in file order).
fn cycles(edges: &Edges) -> Vec<Vec<String>> {
    let reach: BTreeMap<&str, BTreeSet<&str>> = edges
        .keys()
        .map(|from| {
            let mut seen = BTreeSet::new();
            let mut todo: Vec<&str> = vec![from];
            while let Some(f) = todo.pop() {
                for to in edges.get(f).into_iter().flat_map(|t| t.keys()) {
                    if seen.insert(to.as_str()) {
                        todo.push(to);
                    }
                }
            }
            (from.as_str(), seen)
        })
        .collect();
    let mut placed = BTreeSet::new();
    let mut out = Vec::new();
    for (&f, from_f) in &reach {
        if placed.contains(f) || !from_f.contains(f) {
            continue;
        }
        let group: Vec<String> = from_f
            .iter()
            .filter(|&&g| reach.get(g).is_some_and(|r| r.contains(f)))
            .map(|g| g.to_string())
            .collect();
        placed.extend(group.iter().cloned());
        out.push(group);
    }
    out
}

/// Every cycle of a crate, one line per import inside it: `src/a.rs -> src/b.rs: B, c`.
fn describe_cycles(krate: &Crate, edges: &Edges) -> Vec<String> {
    cycles(edges)
        .iter()
        .map(|group| {
            let mut text = format!("cycle of {} files:", group.len());
            for a in group {
                for (b, names) in &edges[a] {
                    if group.contains(b) {
                        let names: Vec<&str> = names.iter().map(String::as_str).collect();
                        text += &format!(
                            "\n  {} -> {}: {}",
                            krate.shown(a),
                            krate.shown(b),
                            names.join(", ")
                        );
                    }
                }
            }
            text
        })
        .collect()
}

/// The crates of the workspace's crate folders.
fn workspace_crates() -> Vec<Crate> {
    CRATE_DIRS
        .iter()
        .flat_map(|dir| crates(&format!("{dir}/"), read_tree(&repo().join(dir))))
        .collect()
}

#[test]
fn no_file_imports_a_file_that_imports_it_back() {
    let mut problems = Vec::new();
    for krate in workspace_crates() {
        let edges = krate.imports();
        let imports: usize = edges.values().map(BTreeMap::len).sum();
        let root = if krate.binary { "main.rs" } else { "" };
        println!(
            "{}{root}: {} files, {} imports between files",
            krate.dir,
            edges.len(),
            imports
        );
        // A reader that silently finds nothing would pass: the library's files import plenty.
        if krate.dir == "src/" && !krate.binary {
            assert!(
                imports > 50,
                "src/: only {imports} imports read: is the reader broken?"
            );
        }
        problems.extend(describe_cycles(&krate, &edges));
    }
    assert!(
        problems.is_empty(),
        "import cycles: the files of each group import each other in a loop, so none can be \
         read, tested or moved alone. Move what ties them into a file below both (see \
         \"Layering\" in docs/design.md):\n{}",
        problems.join("\n")
    );
}

/// A crate from `(file, text)` pairs, as `src/` files.
fn tree(files: &[(&str, &str)]) -> Crate {
    let files = files
        .iter()
        .map(|(f, t)| (f.to_string(), t.to_string()))
        .collect();
    let mut all = crates("src/", files);
    assert_eq!(all.len(), 1, "one crate");
    all.pop().unwrap()
}

fn edge_list(krate: &Crate) -> Vec<String> {
    let mut out = Vec::new();
    for (a, targets) in krate.imports() {
        for (b, names) in targets {
            let names: Vec<&str> = names.iter().map(String::as_str).collect();
            out.push(format!("{a} -> {b}: {}", names.join(",")));
        }
    }
    out
}

#[test]
fn the_reader_finds_a_cycle_through_a_use_group_and_a_call_in_code() {
    let krate = tree(&[
        ("lib.rs", "pub mod a;\npub mod b;\npub mod c;\n"),
        ("a.rs", "use crate::{b::{Bee, self}, c};\npub struct A;\n"),
        ("b.rs", "pub struct Bee;\npub fn f() { crate::c::see(); }\n"),
        ("c.rs", "pub fn see() -> crate::a::A { crate::a::A }\n"),
    ]);
    assert_eq!(
        edge_list(&krate),
        [
            "a.rs -> b.rs: Bee,b",
            "a.rs -> c.rs: c",
            "b.rs -> c.rs: see",
            "c.rs -> a.rs: A"
        ]
    );
    assert_eq!(
        describe_cycles(&krate, &krate.imports()),
        [
            "cycle of 3 files:\n  src/a.rs -> src/b.rs: Bee, b\n  src/a.rs -> src/c.rs: c\n  \
          src/b.rs -> src/c.rs: see\n  src/c.rs -> src/a.rs: A"
        ]
    );
}

#[test]
fn the_reader_maps_paths_to_the_file_of_their_longest_module() {
    let krate = tree(&[
        ("lib.rs", "pub mod a;\npub mod store;\nfn root() {}\n"),
        (
            "a.rs",
            "use crate::store::lease::{Lease, renew as r};\nuse crate::store::Db;\n\
             fn f() { crate::root(); super::root(); }\n",
        ),
        ("store/mod.rs", "pub mod lease;\npub struct Db;\n"),
        ("store/lease.rs", "pub struct Lease;\npub fn renew() {}\n"),
    ]);
    assert_eq!(
        edge_list(&krate),
        [
            "a.rs -> lib.rs: root",
            "a.rs -> store/lease.rs: Lease,lease,renew",
            "a.rs -> store/mod.rs: Db"
        ]
    );
}

#[test]
fn a_child_using_its_parent_through_super_is_no_cycle_but_through_crate_it_is() {
    let parent = "pub mod child;\npub struct P;\npub fn f() { child::g() }\n\
                  fn h() -> crate::p::child::C { todo!() }\n";
    let krate = tree(&[
        ("lib.rs", "pub mod p;\n"),
        ("p/mod.rs", parent),
        (
            "p/child.rs",
            "use super::P;\npub struct C;\npub fn g() {}\n",
        ),
    ]);
    assert_eq!(edge_list(&krate), ["p/mod.rs -> p/child.rs: C"]);
    assert!(describe_cycles(&krate, &krate.imports()).is_empty());

    let krate = tree(&[
        ("lib.rs", "pub mod p;\n"),
        ("p/mod.rs", parent),
        (
            "p/child.rs",
            "use crate::p::P;\npub struct C;\npub fn g() {}\n",
        ),
    ]);
    assert_eq!(cycles(&krate.imports()).len(), 1);
}

#[test]
fn comments_strings_and_tests_name_nothing() {
    let krate = tree(&[
        ("lib.rs", "pub mod a;\npub mod b;\nmod tests;\n"),
        (
            "a.rs",
            "// use crate::b::B;\n/* crate::b::B /* nested */ crate::b::B */\n\
             /// [`crate::b::B`]\nconst S: &str = \"crate::b::B /*\";\n\
             const R: &str = r#\"crate::b::B\"#;\nconst Q: char = '\"';\n\
             fn f<'a>(x: &'a str) -> &'a str { x }\n\
             #[cfg(test)]\nmod tests {\n    use crate::b::B;\n}\n",
        ),
        ("b.rs", "pub struct B;\nfn g() { crate::a::f(\"x\"); }\n"),
        ("tests.rs", "use crate::b::B;\nuse crate::a::f;\n"),
    ]);
    assert_eq!(edge_list(&krate), ["b.rs -> a.rs: f"]);
}

#[test]
fn a_char_literal_does_not_hide_the_code_after_it() {
    let krate = tree(&[
        ("lib.rs", "pub mod a;\npub mod b;\n"),
        (
            "a.rs",
            "fn f() -> char { let q = '\"'; crate::b::g(); q }\n",
        ),
        ("b.rs", "pub fn g() {}\n"),
    ]);
    assert_eq!(edge_list(&krate), ["a.rs -> b.rs: g"]);
}

#[test]
fn a_library_and_a_binary_in_one_folder_are_two_crates() {
    let files = [
        ("lib.rs", "pub mod a;\n"),
        ("a.rs", "pub fn f() {}\n"),
        ("main.rs", "mod cli;\nfn main() { cli::run() }\n"),
        (
            "cli/mod.rs",
            "mod get;\npub fn run() { crate::cli::get::get() }\n",
        ),
        ("cli/get.rs", "pub fn get() { tallyd::a::f() }\n"),
    ];
    let files = files
        .iter()
        .map(|(f, t)| (f.to_string(), t.to_string()))
        .collect();
    let all = crates("src/", files);
    let shape: Vec<(bool, Vec<&String>)> = all
        .iter()
        .map(|c| (c.binary, c.modules.values().collect()))
        .collect();
    assert_eq!(
        format!("{shape:?}"),
        r#"[(false, ["lib.rs", "a.rs"]), (true, ["main.rs", "cli/mod.rs", "cli/get.rs"])]"#
    );
    assert_eq!(edge_list(&all[1]), ["cli/mod.rs -> cli/get.rs: get"]);
}

// ---------------------------------------------------------------------------------------------
// The docs.

fn read(rel: &str) -> String {
    let path = repo().join(rel);
    fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

/// The lines of the section of `doc` under `heading` (a whole heading line), up to the next
/// heading.
fn section<'a>(doc: &'a str, heading: &str) -> Vec<&'a str> {
    let mut lines = doc.lines().skip_while(|l| l.trim() != heading);
    assert!(
        lines.next().is_some(),
        "docs/design.md has no section \"{heading}\""
    );
    lines.take_while(|l| !l.starts_with('#')).collect()
}

/// The cells of a Markdown table row, without the header separator row.
fn table_rows<'a>(lines: &[&'a str]) -> Vec<Vec<&'a str>> {
    lines
        .iter()
        .filter(|l| l.starts_with('|'))
        .map(|l| {
            l.trim()
                .trim_matches('|')
                .split(" | ")
                .map(str::trim)
                .collect::<Vec<_>>()
        })
        .filter(|cells| {
            !cells
                .iter()
                .all(|c| c.chars().all(|ch| ch == '-' || ch == ' '))
        })
        .collect()
}

/// The `code spans` of a cell.
fn code_spans(cell: &str) -> Vec<&str> {
    cell.split('`').skip(1).step_by(2).collect()
}

/// The module files of `src/` that the module map must list: all but test-only ones.
fn src_module_files() -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for krate in crates("src/", read_tree(&repo().join("src"))) {
        let test_only = krate.test_only();
        out.extend(
            krate
                .modules
                .values()
                .filter(|f| !test_only.contains(*f))
                .map(|f| krate.shown(f)),
        );
    }
    out
}

#[test]
fn the_module_map_lists_every_module_file() {
    let design = read("docs/design.md");
    let rows = table_rows(&section(&design, "### Module map"));
    let mapped: BTreeSet<String> = rows
        .iter()
        .skip(1) // the header
        .flat_map(|cells| code_spans(cells[0]))
        .filter(|p| p.starts_with("src/"))
        .map(String::from)
        .collect();
    let files = src_module_files();
    let missing: Vec<&String> = files.difference(&mapped).collect();
    let stale: Vec<&String> = mapped.difference(&files).collect();
    assert!(
        missing.is_empty() && stale.is_empty(),
        "the module map of docs/design.md (\"### Module map\": one row per module file, its path \
         in the first column) does not match src/:\n  not in the map: {missing:?}\n  in the map \
         but no module file: {stale:?}"
    );
}

/// Each layer's number (from 1, in table order) and the modules it lists, as `a::b` names.
fn layers(design: &str) -> Vec<(usize, String, Vec<String>)> {
    table_rows(&section(design, "### Layering"))
        .iter()
        .skip(1)
        .enumerate()
        .map(|(i, cells)| {
            let modules = code_spans(cells[1]).into_iter().map(String::from).collect();
            (i + 1, cells[0].to_string(), modules)
        })
        .collect()
}

/// The name the layering table gives a file's module: `store::lease`; the binary's root is
/// `main`, its modules are named from it (`cli`, `cli::get`).
fn layer_name(krate: &Crate, file: &str) -> String {
    let path = module_path(file);
    if path.is_empty() && krate.binary {
        return "main".to_string();
    }
    path.join("::")
}

#[test]
fn every_file_imports_only_from_its_own_layer_or_below() {
    let design = read("docs/design.md");
    let layers = layers(&design);
    let mut listed: BTreeMap<String, (usize, String)> = BTreeMap::new();
    for (n, layer, modules) in &layers {
        for m in modules {
            if let Some((other, _)) = listed.insert(m.clone(), (*n, layer.clone())) {
                panic!("docs/design.md, Layering: `{m}` is in layers {other} and {n}");
            }
        }
    }
    // The layer of a module: that of its longest listed prefix.
    let layer_of = |name: &str| -> Option<(usize, String, String)> {
        let segs: Vec<&str> = name.split("::").collect();
        (1..=segs.len()).rev().find_map(|n| {
            let prefix = segs[..n].join("::");
            listed
                .get(&prefix)
                .map(|(l, layer)| (*l, layer.clone(), prefix))
        })
    };
    let mut problems = Vec::new();
    let mut names = BTreeSet::new();
    for krate in crates("src/", read_tree(&repo().join("src"))) {
        let edges = krate.imports();
        for (file, targets) in &edges {
            let name = layer_name(&krate, file);
            names.insert(name.clone());
            if name.is_empty() {
                continue; // the library's root only declares modules
            }
            let Some((from, from_layer, _)) = layer_of(&name) else {
                problems.push(format!(
                    "{} (`{name}`) is in no layer: add it to the Layering table",
                    krate.shown(file)
                ));
                continue;
            };
            for (target, why) in targets {
                let target_name = layer_name(&krate, target);
                let Some((to, to_layer, _)) = layer_of(&target_name) else {
                    continue; // reported as a file of its own, or the crate root
                };
                if to > from {
                    let why: Vec<&str> = why.iter().map(String::as_str).collect();
                    problems.push(format!(
                        "{} (layer {from_layer}) imports {} (layer {to_layer}): {}",
                        krate.shown(file),
                        krate.shown(target),
                        why.join(", ")
                    ));
                }
            }
        }
    }
    for m in listed.keys() {
        let is_module = names
            .iter()
            .any(|n| n == m || n.starts_with(&format!("{m}::")));
        if !is_module {
            problems.push(format!(
                "the Layering table names `{m}`, which is no module of src/"
            ));
        }
    }
    assert!(
        problems.is_empty(),
        "the layering of docs/design.md (\"### Layering\", lowest layer first: a file may import \
         only from its own layer and the layers listed before it) does not hold:\n  {}",
        problems.join("\n  ")
    );
}

/// The Markdown files whose paths must exist.
fn docs() -> Vec<String> {
    let mut out = vec!["README.md".to_string()];
    let mut entries: Vec<String> = fs::read_dir(repo().join("docs"))
        .expect("read docs/")
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.ends_with(".md"))
        .map(|n| format!("docs/{n}"))
        .collect();
    entries.sort();
    out.extend(entries);
    out
}

/// `a/../b/./c` → `b/c`; `None` when it climbs above its start.
fn normalise(path: &Path) -> Option<PathBuf> {
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            Component::ParentDir => {
                if !out.pop() {
                    return None;
                }
            }
            Component::CurDir => {}
            other => out.push(other),
        }
    }
    Some(out)
}

/// What is wrong with a path a doc names (`rel` is it relative to the repository root), or
/// `None` when it exists in the repository.
fn check_path(named: &str, rel: &Path) -> Option<String> {
    match normalise(rel) {
        None => Some(format!(
            "{named} is outside the repository (summarise what the reader needs in docs/)"
        )),
        Some(p) if !repo().join(&p).exists() => Some(format!(
            "{named} does not exist ({} in the repository)",
            p.display()
        )),
        Some(_) => None,
    }
}

/// `migrations/<name>`, where a bare `V<n>` names the file `V<n>__*.sql` (the docs say
/// `migrations/V12` for `migrations/V12__counter_kinds.sql`).
fn migration_path(name: &str) -> PathBuf {
    let folder = Path::new("migrations");
    let is_version = name
        .strip_prefix('V')
        .is_some_and(|n| !n.is_empty() && n.chars().all(|c| c.is_ascii_digit()));
    if is_version {
        let prefix = format!("{name}__");
        let file = fs::read_dir(repo().join(folder))
            .expect("read migrations/")
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .find(|f| f.starts_with(&prefix));
        if let Some(file) = file {
            return folder.join(file);
        }
    }
    folder.join(name)
}

#[test]
fn every_path_the_docs_name_exists_in_the_repository() {
    let mut problems = Vec::new();
    for doc in docs() {
        let text = read(&doc);
        let base = Path::new(&doc).parent().unwrap().to_path_buf();
        for (n, line) in text.lines().enumerate() {
            // Each path named, and where it leads from the repository root.
            let mut named: BTreeMap<String, PathBuf> = BTreeMap::new();
            // Links, relative to the doc's folder: `[text](target)`, but for web addresses and
            // anchors.
            for (at, _) in line.match_indices("](") {
                let rest = &line[at + 2..];
                let target = &rest[..rest.find(')').unwrap_or(rest.len())];
                let target = target.split('#').next().unwrap();
                if !target.is_empty() && !target.contains("://") && !target.starts_with("mailto:") {
                    named.insert(target.to_string(), base.join(target));
                }
            }
            // Paths into the crates' sources, linked or not: `src/...`, `bench/src/...` from the
            // repository root, `../src/...` from the doc's folder; and into the schema:
            // `sql/...`, `migrations/...`, where `migrations/V12` stands for its file.
            let path_char = |c: char| c.is_ascii_alphanumeric() || "_./-".contains(c);
            for token in line.split(|c: char| !path_char(c)) {
                let token = token.trim_end_matches('.');
                if token.starts_with('.') && token.contains("src/") {
                    named.insert(token.to_string(), base.join(token));
                } else if token.starts_with("src/")
                    || token.contains("/src/") && !token.starts_with('/')
                    || token.starts_with("sql/")
                {
                    named.insert(token.to_string(), PathBuf::from(token));
                } else if let Some(name) = token.strip_prefix("migrations/") {
                    named.insert(token.to_string(), migration_path(name));
                }
            }
            for (path, rel) in named {
                if let Some(problem) = check_path(&path, &rel) {
                    problems.push(format!("{doc}:{}: {problem}", n + 1));
                }
            }
            // Tests, from the repository root: `tests/...`, and the test a `::name` after it
            // names (a prefix of a function's name, for `full_disk_fsync_{always,off}`).
            for (at, _) in line.match_indices("tests/") {
                if line[..at].ends_with(path_char) {
                    continue;
                }
                let rest = &line[at..];
                let path = rest[..rest.find(|c| !path_char(c)).unwrap_or(rest.len())]
                    .trim_end_matches('.');
                if let Some(problem) = check_path(path, Path::new(path)) {
                    problems.push(format!("{doc}:{}: {problem}", n + 1));
                    continue;
                }
                let Some(after) = rest[path.len()..].strip_prefix("::") else {
                    continue;
                };
                let name = &after[..after.find(|c: char| !is_ident(c)).unwrap_or(after.len())];
                let full = repo().join(path);
                let texts: Vec<String> = if full.is_dir() {
                    read_tree(&full).into_values().collect()
                } else {
                    vec![read(path)]
                };
                let defined = texts.iter().any(|t| t.contains(&format!("fn {name}")));
                if !defined {
                    problems.push(format!("{doc}:{}: {path} has no test named {name}", n + 1));
                }
            }
        }
    }
    assert!(
        problems.is_empty(),
        "the docs name paths that are not in the repository:\n  {}",
        problems.join("\n  ")
    );
}

#[test]
fn the_library_layout_names_every_module() {
    let lib = read("src/lib.rs");
    let layout: String = lib
        .lines()
        .skip_while(|l| l.trim() != "//! # Layout")
        .skip(1)
        .take_while(|l| l.starts_with("//!") && !l.starts_with("//! #"))
        .collect::<Vec<_>>()
        .join("\n");
    let declared = declared_modules(&strip_comments(&lib));
    let missing: Vec<&String> = declared
        .iter()
        .filter(|m| !layout.contains(&format!("[`{m}`]")))
        .collect();
    assert!(
        !declared.is_empty() && missing.is_empty(),
        "the `//! # Layout` comment of src/lib.rs does not name (as [`module`]) every module \
         src/lib.rs declares: missing {missing:?}"
    );
}
