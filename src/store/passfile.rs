//! libpq's password file (`~/.pgpass`, `passfile`, `PGPASSFILE`): lines of
//! `hostname:port:database:username:password`, `*` matching anything, `\` escaping `:` and `\`.

use std::os::unix::fs::MetadataExt;
use std::path::Path;

use tokio_postgres::config::Host;
use tracing::warn;

/// libpq treats the default socket directory as `localhost` in the password file.
const DEFAULT_SOCKET_DIR: &str = "/var/run/postgresql";

/// What a password file line is matched against.
#[derive(Debug, PartialEq)]
pub struct Entry {
    pub host: String,
    pub port: String,
    pub database: String,
    pub user: String,
}

impl Entry {
    /// The first host of `config`, as libpq matches it: a socket directory other than the default
    /// one by its path.
    pub fn of(config: &tokio_postgres::Config, env: &dyn Fn(&str) -> Option<String>) -> Entry {
        let host = match config.get_hosts().first() {
            Some(Host::Tcp(h)) => h.clone(),
            Some(Host::Unix(p)) if p.as_os_str() != DEFAULT_SOCKET_DIR => p.display().to_string(),
            Some(Host::Unix(_)) => "localhost".into(),
            None => config
                .get_hostaddrs()
                .first()
                .map_or("localhost".into(), |a| a.to_string()),
        };
        let user = config
            .get_user()
            .map(str::to_string)
            .or_else(|| env("USER"))
            .unwrap_or_default();
        Entry {
            host,
            port: config
                .get_ports()
                .first()
                .copied()
                .unwrap_or(5432)
                .to_string(),
            database: config
                .get_dbname()
                .map_or_else(|| user.clone(), str::to_string),
            user,
        }
    }
}

/// The password of the first line of `file` matching `entry`. A missing file is no password; a
/// file readable by group or others is ignored with a warning, as libpq does.
pub fn lookup(file: &Path, entry: &Entry) -> Option<String> {
    let meta = std::fs::metadata(file).ok()?;
    if !meta.is_file() {
        return None;
    }
    if meta.mode() & 0o077 != 0 {
        warn!(file = %file.display(), "password file has group or world access; permissions should be u=rw (0600) or less; ignored");
        return None;
    }
    let text = match std::fs::read_to_string(file) {
        Ok(t) => t,
        Err(e) => {
            warn!(file = %file.display(), cause = %e, "cannot read the password file");
            return None;
        }
    };
    text.lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .find_map(|line| matches(line, entry))
}

fn matches(line: &str, entry: &Entry) -> Option<String> {
    let fields = split(line);
    if fields.len() < 5 {
        return None;
    }
    let wanted = [&entry.host, &entry.port, &entry.database, &entry.user];
    let all = fields.iter().zip(wanted).all(|(f, w)| f == "*" || f == w);
    // The password is everything after the fourth separator, colons included.
    all.then(|| fields[4..].join(":"))
}

/// Fields separated by unescaped `:`, with `\:` and `\\` unescaped.
fn split(line: &str) -> Vec<String> {
    let mut fields = vec![String::new()];
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => fields.last_mut().expect("one field").extend(chars.next()),
            ':' => fields.push(String::new()),
            c => fields.last_mut().expect("one field").push(c),
        }
    }
    fields
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn entry(host: &str, db: &str) -> Entry {
        Entry {
            host: host.into(),
            port: "5432".into(),
            database: db.into(),
            user: "app".into(),
        }
    }

    #[test]
    fn first_matching_line_wins_with_wildcards_and_escapes() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("pgpass");
        std::fs::write(
            &file,
            "# comment\nother:5432:*:app:no\ndb.example:*:counts:app:pa\\:ss\\\\word\n*:*:*:*:fallback\n",
        )
        .unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(
            lookup(&file, &entry("db.example", "counts")).as_deref(),
            Some("pa:ss\\word")
        );
        assert_eq!(
            lookup(&file, &entry("db.example", "x")).as_deref(),
            Some("fallback")
        );
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert_eq!(lookup(&file, &entry("db.example", "counts")), None);
        assert_eq!(lookup(&dir.path().join("missing"), &entry("h", "d")), None);
    }

    #[test]
    fn default_socket_directory_is_localhost() {
        let mut c = tokio_postgres::Config::new();
        c.host("/var/run/postgresql").user("app");
        let e = Entry::of(&c, &|_| None);
        assert_eq!(
            e,
            Entry {
                host: "localhost".into(),
                port: "5432".into(),
                database: "app".into(),
                user: "app".into()
            }
        );
        let mut c = tokio_postgres::Config::new();
        c.host("/tmp/sock").port(6000).dbname("d").user("app");
        assert_eq!(Entry::of(&c, &|_| None).host, "/tmp/sock");
    }
}
