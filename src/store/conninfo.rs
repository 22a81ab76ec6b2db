//! Connection strings as libpq reads them: a `postgres://` URL or `key=value` pairs, the `PG*`
//! environment variables as defaults, the password file, and a redacted form for logs.
//!
//! tokio-postgres parses most of libpq's keys itself, but not the TLS ones (`sslmode` beyond
//! disable/prefer/require, `sslrootcert`, `sslcert`, `sslkey`) nor `passfile`: those are taken
//! out here, and the rest is handed to [`tokio_postgres::Config`].

use std::collections::HashMap;
use std::path::PathBuf;
use std::str::FromStr;

use super::passfile;
use super::tls::{SslMode, TlsFiles};

/// Keys tallyd reads itself; everything else goes to tokio-postgres.
const OWN_KEYS: [&str; 7] = [
    "sslmode",
    "sslrootcert",
    "sslcert",
    "sslkey",
    "passfile",
    "fallback_application_name",
    "sslsni",
];

/// libpq's environment variables for the keys tallyd reads itself.
const OWN_ENV: [(&str, &str); 6] = [
    ("sslmode", "PGSSLMODE"),
    ("sslrootcert", "PGSSLROOTCERT"),
    ("sslcert", "PGSSLCERT"),
    ("sslkey", "PGSSLKEY"),
    ("passfile", "PGPASSFILE"),
    ("sslsni", "PGSSLSNI"),
];

/// Where libpq looks when neither `host` nor `PGHOST` says (Debian's build).
const DEFAULT_SOCKET_DIR: &str = "/var/run/postgresql";

#[derive(Debug, thiserror::Error)]
pub enum ConninfoError {
    #[error("invalid connection string {redacted}: {reason}")]
    Syntax { redacted: String, reason: String },
    #[error("invalid connection string {redacted}: {reason}")]
    Driver { redacted: String, reason: String },
    #[error("environment variable {var} (for {redacted}): {reason}")]
    Env {
        var: &'static str,
        redacted: String,
        reason: String,
    },
    #[error("connection string {redacted}: {cause}")]
    Tls {
        redacted: String,
        cause: super::tls::TlsError,
    },
}

/// A parsed connection string: what tokio-postgres needs, the TLS settings, and how to name the
/// database in messages without its password.
#[derive(Clone, Debug)]
pub struct Conninfo {
    pub config: tokio_postgres::Config,
    pub sslmode: SslMode,
    pub files: TlsFiles,
    pub sni: bool,
    /// `host=... port=... dbname=... user=...`, never a password.
    pub redacted: String,
    /// Set by the string or `PGAPPNAME`: tallyd's default must not override it.
    pub application_name_set: bool,
    pub fallback_application_name: Option<String>,
}

/// Parses `conninfo` with `env` for the `PG*` defaults (std::env::var in production; tests pass
/// their own so that they do not race on the process environment).
pub fn parse(
    conninfo: &str,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Conninfo, ConninfoError> {
    let redacted = redact(conninfo);
    let syntax = |reason: String| ConninfoError::Syntax {
        redacted: redacted.clone(),
        reason,
    };
    let (rest, mut own) = split_own(conninfo).map_err(syntax)?;
    // Which of tallyd's own keys came from the environment, so that an error names the variable.
    let mut from_env: HashMap<&str, &'static str> = HashMap::new();
    for (key, var) in OWN_ENV {
        if !own.contains_key(key) {
            if let Some(v) = env(var).filter(|v| !v.is_empty()) {
                own.insert(key.to_string(), v);
                from_env.insert(key, var);
            }
        }
    }
    let mut config =
        tokio_postgres::Config::from_str(&rest).map_err(|err| ConninfoError::Driver {
            redacted: redacted.clone(),
            reason: innermost(&err),
        })?;
    let application_name_set = apply_env(&mut config, env);
    let home = env("HOME").map(PathBuf::from);
    if config.get_password().is_none() {
        let file = own
            .get("passfile")
            .map(PathBuf::from)
            .or_else(|| home.as_ref().map(|h| h.join(".pgpass")));
        if let Some(password) =
            file.and_then(|f| passfile::lookup(&f, &passfile::Entry::of(&config, env)))
        {
            config.password(password);
        }
    }
    let sslmode = match own.get("sslmode") {
        Some(v) => v.parse().map_err(|reason| match from_env.get("sslmode") {
            Some(var) => ConninfoError::Env {
                var,
                redacted: describe(&config),
                reason,
            },
            None => syntax(reason),
        })?,
        None => SslMode::Prefer,
    };
    let files = TlsFiles::new(&own, home.as_deref());
    let sni = own.get("sslsni").is_none_or(|v| v != "0");
    Ok(Conninfo {
        redacted: describe(&config),
        config,
        sslmode,
        files,
        sni,
        application_name_set,
        fallback_application_name: own.get("fallback_application_name").cloned(),
    })
}

/// The deepest cause of a parse error: tokio-postgres wraps it in two "invalid connection
/// string" layers.
fn innermost(err: &tokio_postgres::Error) -> String {
    let mut text = err.to_string();
    let mut cause = std::error::Error::source(err);
    while let Some(c) = cause {
        text = c.to_string();
        cause = c.source();
    }
    text.trim_start_matches("invalid connection string: ")
        .to_string()
}

/// Fills what the string left unset from libpq's environment variables, as libpq does.
/// Returns whether `application_name` is set.
fn apply_env(config: &mut tokio_postgres::Config, env: &dyn Fn(&str) -> Option<String>) -> bool {
    let var = |name: &str| env(name).filter(|v| !v.is_empty());
    if config.get_hosts().is_empty() && config.get_hostaddrs().is_empty() {
        if let Some(addrs) = var("PGHOSTADDR") {
            for a in addrs.split(',').filter_map(|a| a.trim().parse().ok()) {
                config.hostaddr(a);
            }
        }
        match var("PGHOST") {
            Some(hosts) => hosts.split(',').for_each(|h| {
                config.host(h.trim());
            }),
            None if config.get_hostaddrs().is_empty() => {
                config.host(DEFAULT_SOCKET_DIR);
            }
            None => {}
        }
    }
    if config.get_ports().is_empty() {
        if let Some(ports) = var("PGPORT") {
            for p in ports.split(',').filter_map(|p| p.trim().parse().ok()) {
                config.port(p);
            }
        }
    }
    if config.get_user().is_none() {
        if let Some(user) = var("PGUSER") {
            config.user(user);
        }
    }
    if config.get_dbname().is_none() {
        if let Some(db) = var("PGDATABASE") {
            config.dbname(db);
        }
    }
    if config.get_password().is_none() {
        if let Some(p) = var("PGPASSWORD") {
            config.password(p);
        }
    }
    if config.get_options().is_none() {
        if let Some(o) = var("PGOPTIONS") {
            config.options(o);
        }
    }
    if config.get_application_name().is_none() {
        if let Some(a) = var("PGAPPNAME") {
            config.application_name(a);
        }
    }
    config.get_application_name().is_some()
}

/// Splits tallyd's own keys out of `conninfo`, returning the rest for tokio-postgres.
fn split_own(conninfo: &str) -> Result<(String, HashMap<String, String>), String> {
    let mut own = HashMap::new();
    if let Some(url) = Url::split(conninfo) {
        let mut kept = Vec::new();
        for pair in url.query.split('&').filter(|p| !p.is_empty()) {
            let (k, v) = pair
                .split_once('=')
                .ok_or("a query parameter has no \"=value\"")?;
            let key = percent_decode(k)?;
            if OWN_KEYS.contains(&key.as_str()) {
                own.insert(key, percent_decode(v)?);
            } else {
                kept.push(pair);
            }
        }
        // The driver takes the user information up to the first `@`: characters that should
        // have been percent-encoded in it are encoded, so that it splits where redact() does.
        let userinfo = url.userinfo.map(|u| {
            u.replace('@', "%40")
                .replace('/', "%2F")
                .replace('?', "%3F")
                + "@"
        });
        let mut rest = format!(
            "{}{}{}{}",
            url.scheme,
            userinfo.unwrap_or_default(),
            url.hosts,
            url.path
        );
        if !kept.is_empty() {
            rest = format!("{rest}?{}", kept.join("&"));
        }
        return Ok((rest, own));
    }
    let mut kept = Vec::new();
    for (key, value) in key_values(conninfo)? {
        if OWN_KEYS.contains(&key.as_str()) {
            own.insert(key, value);
        } else {
            kept.push(format!("{key}={}", quote(&value)));
        }
    }
    Ok((kept.join(" "), own))
}

/// A `postgres://` URL cut into its parts, without decoding anything.
struct Url<'a> {
    /// `postgresql://`
    scheme: &'a str,
    /// `user:password`, without the `@`.
    userinfo: Option<&'a str>,
    hosts: &'a str,
    /// `/dbname`, or empty.
    path: &'a str,
    /// After the `?`, or empty.
    query: &'a str,
}

impl<'a> Url<'a> {
    /// The user information ends at the last `@` before the query's first `=` (a password may
    /// hold `/`, `?` and `@` that should have been percent-encoded; a host never holds `@`).
    fn split(s: &'a str) -> Option<Url<'a>> {
        let scheme_len = ["postgres://", "postgresql://"]
            .into_iter()
            .find(|p| s.starts_with(p))?
            .len();
        let (scheme, rest) = s.split_at(scheme_len);
        let before_value = rest.find('=').unwrap_or(rest.len());
        let (userinfo, after) = match rest[..before_value].rfind('@') {
            Some(at) => (Some(&rest[..at]), &rest[at + 1..]),
            None => (None, rest),
        };
        let host_end = after.find(['/', '?']).unwrap_or(after.len());
        let (hosts, tail) = after.split_at(host_end);
        let (path, query) = tail.split_once('?').unwrap_or((tail, ""));
        Some(Url {
            scheme,
            userinfo,
            hosts,
            path,
            query,
        })
    }
}

/// libpq's `key = value` pairs: values bare (backslash escapes) or single-quoted (`\'`, `\\`).
fn key_values(s: &str) -> Result<Vec<(String, String)>, String> {
    let mut out = Vec::new();
    let mut chars = s.chars().peekable();
    loop {
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        if chars.peek().is_none() {
            return Ok(out);
        }
        let mut key = String::new();
        while let Some(c) = chars.next_if(|c| *c != '=' && !c.is_whitespace()) {
            key.push(c);
        }
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        if chars.next() != Some('=') {
            // Not the word itself: it may be part of a password with an unquoted space.
            return Err(match out.last() {
                Some((previous, _)) => format!(
                    "a word without \"=\" follows the value of \"{previous}\" \
                     (quote a value that holds spaces: key='a b')"
                ),
                None => "expected key=value pairs".to_string(),
            });
        }
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        let mut value = String::new();
        if chars.next_if_eq(&'\'').is_some() {
            loop {
                match chars.next() {
                    None => return Err(format!("unterminated quoted value for \"{key}\"")),
                    Some('\'') => break,
                    Some('\\') => value.extend(chars.next()),
                    Some(c) => value.push(c),
                }
            }
        } else {
            while let Some(c) = chars.next_if(|c| !c.is_whitespace()) {
                if c == '\\' {
                    value.extend(chars.next());
                } else {
                    value.push(c);
                }
            }
        }
        out.push((key, value));
    }
}

/// A value quoted for a key/value string when it needs to be.
pub fn quote(v: &str) -> String {
    if !v.is_empty()
        && !v
            .chars()
            .any(|c| c.is_whitespace() || c == '\'' || c == '\\')
    {
        return v.to_string();
    }
    let mut s = String::with_capacity(v.len() + 2);
    s.push('\'');
    for c in v.chars() {
        if c == '\'' || c == '\\' {
            s.push('\\');
        }
        s.push(c);
    }
    s.push('\'');
    s
}

fn percent_decode(s: &str) -> Result<String, String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            // The text is not shown: it may be a password.
            let bad = || "bad percent-encoding in a query parameter".to_string();
            let hex = s.get(i + 1..i + 3).ok_or_else(bad)?;
            out.push(u8::from_str_radix(hex, 16).map_err(|_| bad())?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| "a percent-encoded query parameter is not UTF-8".to_string())
}

/// Keys whose values are never secret: [`redact`] shows these and hides every other value.
const SHOWN_KEYS: [&str; 22] = [
    "host",
    "hostaddr",
    "port",
    "dbname",
    "user",
    "sslmode",
    "sslrootcert",
    "sslcert",
    "sslkey",
    "sslsni",
    "passfile",
    "application_name",
    "fallback_application_name",
    "connect_timeout",
    "target_session_attrs",
    "load_balance_hosts",
    "channel_binding",
    "gssencmode",
    "keepalives",
    "keepalives_idle",
    "keepalives_interval",
    "keepalives_count",
];

/// One `key=value` as [`redact`] shows it: the value only for a key in [`SHOWN_KEYS`].
fn redact_pair(key: &str, value: &str) -> String {
    if SHOWN_KEYS.contains(&key) {
        format!("{key}={}", quote(value))
    } else {
        format!("{key}=***")
    }
}

/// The connection string for messages about a string that did not parse: only what is certainly
/// not secret. A URL keeps its user (the rest of its user information is `***`), hosts and
/// path; a parameter keeps its value only when its (decoded) key is in [`SHOWN_KEYS`].
pub fn redact(conninfo: &str) -> String {
    if let Some(url) = Url::split(conninfo) {
        // Over-redacting is safe: the user information runs to the last `@` anywhere.
        let (userinfo, after) = match conninfo[url.scheme.len()..].rsplit_once('@') {
            Some((u, a)) => (Some(u), a),
            None => (None, &conninfo[url.scheme.len()..]),
        };
        let userinfo = userinfo.map(|u| {
            let user = &u[..u.find([':', '/', '?', '@', '&', '=']).unwrap_or(u.len())];
            if user.len() == u.len() {
                format!("{user}@")
            } else {
                format!("{user}:***@")
            }
        });
        let host_end = after.find(['/', '?']).unwrap_or(after.len());
        let (hosts, tail) = after.split_at(host_end);
        let (path, query) = tail.split_once('?').unwrap_or((tail, ""));
        let mut out = format!(
            "{}{}{hosts}{path}",
            url.scheme,
            userinfo.unwrap_or_default()
        );
        if !query.is_empty() {
            let pairs: Vec<String> = query
                .split('&')
                .map(|p| match p.split_once('=') {
                    Some((k, v)) => match percent_decode(k) {
                        Ok(key) => redact_pair(&key, &percent_decode(v).unwrap_or_default()),
                        Err(_) => "***".into(),
                    },
                    None => "***".into(),
                })
                .collect();
            out = format!("{out}?{}", pairs.join("&"));
        }
        return out;
    }
    match key_values(conninfo) {
        Ok(pairs) => pairs
            .iter()
            .map(|(k, v)| redact_pair(k, v))
            .collect::<Vec<_>>()
            .join(" "),
        Err(_) => "(an unparsable key=value string, not shown)".into(),
    }
}

/// How messages name a parsed database: its hosts, ports, database and user, never a password.
fn describe(config: &tokio_postgres::Config) -> String {
    use tokio_postgres::config::Host;
    let hosts: Vec<String> = config
        .get_hosts()
        .iter()
        .map(|h| match h {
            Host::Tcp(name) => name.clone(),
            Host::Unix(path) => path.display().to_string(),
        })
        .chain(config.get_hostaddrs().iter().map(|a| a.to_string()))
        .collect();
    let ports: Vec<String> = config.get_ports().iter().map(|p| p.to_string()).collect();
    let mut s = format!("host={}", quote(&hosts.join(",")));
    if !ports.is_empty() {
        s.push_str(&format!(" port={}", ports.join(",")));
    }
    if let Some(db) = config.get_dbname() {
        s.push_str(&format!(" dbname={}", quote(db)));
    }
    if let Some(user) = config.get_user() {
        s.push_str(&format!(" user={}", quote(user)));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |name| {
            vars.iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn url_with_tls_parameters() {
        let c = parse(
            "postgresql://app:s3cr%40t@db.example:6432/counts?sslmode=verify-full&sslrootcert=/ca.crt&application_name=x",
            &env(&[]),
        )
        .unwrap();
        assert_eq!(c.sslmode, SslMode::VerifyFull);
        assert_eq!(c.files.rootcert, Some(PathBuf::from("/ca.crt")));
        assert_eq!(c.config.get_password(), Some(&b"s3cr@t"[..]));
        assert_eq!(c.config.get_application_name(), Some("x"));
        assert!(c.application_name_set);
        assert_eq!(
            c.redacted,
            "host=db.example port=6432 dbname=counts user=app"
        );
    }

    #[test]
    fn key_values_quoted_and_escaped() {
        let c = parse(
            r"host=/tmp/my\ sock dbname='it\'s' sslmode = require sslkey='/k ey' password=p",
            &env(&[]),
        )
        .unwrap();
        assert_eq!(c.config.get_dbname(), Some("it's"));
        assert_eq!(c.sslmode, SslMode::Require);
        assert_eq!(c.files.key, Some(PathBuf::from("/k ey")));
        assert!(!c.redacted.contains("password"), "{}", c.redacted);
    }

    #[test]
    fn environment_fills_only_what_is_missing() {
        let vars = [
            ("PGSSLMODE", "verify-ca"),
            ("PGHOST", "h1,h2"),
            ("PGPORT", "5433"),
            ("PGUSER", "u"),
            ("PGPASSWORD", "envpw"),
            ("PGAPPNAME", "fromenv"),
        ];
        let c = parse("dbname=d", &env(&vars)).unwrap();
        assert_eq!(c.sslmode, SslMode::VerifyCa);
        assert_eq!(c.config.get_hosts().len(), 2);
        assert_eq!(c.config.get_ports(), &[5433]);
        assert_eq!(c.config.get_password(), Some(&b"envpw"[..]));
        assert!(c.application_name_set);
        let c = parse("host=h sslmode=disable password=mine", &env(&vars)).unwrap();
        assert_eq!(c.sslmode, SslMode::Disable);
        assert_eq!(c.config.get_hosts().len(), 1);
        assert_eq!(c.config.get_password(), Some(&b"mine"[..]));
    }

    #[test]
    fn default_host_is_the_socket_directory() {
        let c = parse("dbname=d", &env(&[])).unwrap();
        assert_eq!(c.redacted, "host=/var/run/postgresql dbname=d");
        assert_eq!(c.sslmode, SslMode::Prefer);
    }

    #[test]
    fn bad_sslmode_is_named() {
        let err = parse("postgres://u:hunter2@h/d?sslmode=verify-some", &env(&[])).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("verify-some"), "{msg}");
        assert!(!msg.contains("hunter2"), "{msg}");
    }

    #[test]
    fn redaction_hides_passwords() {
        assert_eq!(
            redact("postgres://u:hunter2@h:5/d?password=x&sslmode=require"),
            "postgres://u:***@h:5/d?password=***&sslmode=require"
        );
        assert_eq!(redact("postgres://u@h/d"), "postgres://u@h/d");
        assert_eq!(
            redact("host=h password='a b' user=u"),
            "host=h password=*** user=u"
        );
        let err = parse("host=h password=hunter2 bogus=1", &env(&[])).unwrap_err();
        assert!(!err.to_string().contains("hunter2"), "{err}");
    }

    /// Passwords that should have been percent-encoded, and keywords that are: never shown,
    /// whether the string parses or not.
    #[test]
    fn redaction_finds_the_password_wherever_it_is() {
        for (url, shown) in [
            (
                "postgresql://app:se/cretpw@h:1/db?sslmode=bogus",
                "postgresql://app:***@h:1/db?sslmode=bogus",
            ),
            (
                "postgresql://app:se?cretpw@h:1/db",
                "postgresql://app:***@h:1/db",
            ),
            (
                "postgresql://app:p@ss@cretpw@h:1/db",
                "postgresql://app:***@h:1/db",
            ),
            (
                "postgresql://app@h:1/db?pass%77ord=cretpw&sslmode=bogus",
                "postgresql://app@h:1/db?password=***&sslmode=bogus",
            ),
            (
                "postgresql://app@h:1/db?cretpw&options=-c%20x%3Dcretpw&application_name=a%20b",
                "postgresql://app@h:1/db?***&options=***&application_name='a b'",
            ),
            (
                "host=h password=se cretpw user=u",
                "(an unparsable key=value string, not shown)",
            ),
            (
                "host=h sslpassword=cretpw user=u",
                "host=h sslpassword=*** user=u",
            ),
        ] {
            assert_eq!(redact(url), shown, "{url}");
            if let Err(err) = parse(url, &env(&[])) {
                assert!(!err.to_string().contains("cretpw"), "{url}: {err}");
            }
        }
    }

    /// The driver splits the user information where redaction does: at the last `@`.
    #[test]
    fn unencoded_characters_in_a_url_password() {
        for (url, password) in [
            ("postgresql://app:se?cretpw@h:1/db", "se?cretpw"),
            ("postgresql://app:se/cretpw@h:1/db", "se/cretpw"),
            ("postgresql://app:p@ss@h:1/db?sslmode=require", "p@ss"),
            ("postgresql://app:a=b@h:1/db?application_name=x@y", "a=b"),
        ] {
            let c = parse(url, &env(&[])).unwrap();
            assert_eq!(c.config.get_password(), Some(password.as_bytes()), "{url}");
            assert_eq!(c.redacted, "host=h port=1 dbname=db user=app", "{url}");
        }
        let c = parse(
            "postgres://u@h/d?application_name=a@b&sslmode=require",
            &env(&[]),
        )
        .unwrap();
        assert_eq!(c.config.get_application_name(), Some("a@b"));
        assert_eq!(c.sslmode, SslMode::Require);
    }

    #[test]
    fn a_bad_sslmode_from_the_environment_names_the_variable() {
        let err = parse("postgres://u:pw@h/d", &env(&[("PGSSLMODE", "bogus")])).unwrap_err();
        assert_eq!(
            err.to_string(),
            "environment variable PGSSLMODE (for host=h port=5432 dbname=d user=u): invalid sslmode \
             value \"bogus\" (expected disable, allow, prefer, require, verify-ca or verify-full)"
        );
    }
}
